"""Stable block digests (``kvcache.blocks.digest``): the same in every process, over the salt
in every block, refused for salts without a stable encoding; and the index's own hash keyed
per process, so crafted prompts cannot collide in it."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache import ArgumentTypeError, BlockManager
from kvcache.blocks.digest import DIGEST_SIZE, ROOT_DIGEST, block_digests, encode_salt
from kvcache.blocks.prefix_cache import BlockKey
from tests.child_env import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]
BS = 4


def spec_digest(parent: bytes, ids: list[int], salt: bytes) -> bytes:
    """The documented layout, written out independently of the module."""
    return hashlib.blake2b(parent + salt + struct.pack(f"<{len(ids)}q", *ids), digest_size=16).digest()


def test_digests_follow_the_documented_layout() -> None:
    ids = [5, -1, 2**63 - 1, 0, 7, 7, 7, 7, 9]
    assert hashlib.blake2b(b"paged-kvcache block digest v1", digest_size=16).digest() == ROOT_DIGEST
    first = spec_digest(ROOT_DIGEST, ids[:4], b"n")
    second = spec_digest(first, ids[4:8], b"n")
    assert block_digests(ids, BS) == [first, second]  # the partial last block has no digest
    assert len(first) == DIGEST_SIZE


def test_the_salt_enters_every_block() -> None:
    ids = list(range(12))
    plain, salted = block_digests(ids, BS), block_digests(ids, BS, "tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    other = block_digests(ids, BS, "tenant-b")
    assert all(a != b for a, b in zip(salted, other, strict=True))
    # Salt encodings are self-delimiting: a salt cannot pass for token bytes or another salt.
    assert len({encode_salt(s) for s in ("1", 1, b"1", ("1",), (1,), None, "", ())}) == 8


def test_manager_keys_carry_the_same_digests() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    ids = list(range(100, 113))
    m.allocate("a", token_ids=ids, extra_key=("lora", 3))
    m.mark_computed("a", len(ids))
    assert [k.digest for k in m.sequence("a").keys] == block_digests(ids, BS, ("lora", 3))


def test_a_long_chain_digests_without_recursion() -> None:
    key = None
    for i in range(5000):
        key = BlockKey(key, (i, i, i, i), None)
    assert key is not None and key.digest == block_digests([i for i in range(5000) for _ in range(4)], BS)[-1]


@pytest.mark.parametrize(
    "salt", [1.5, True, object(), frozenset({1}), ((((((((((1,),),),),),),),),),), ("lora", True), (1.0,)]
)
def test_salts_without_a_stable_encoding_are_refused_naming_extra_key(salt: object) -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    encode_salt(("lora", 1))  # an equal salt just before must not stand in for it
    encode_salt((1,))
    with pytest.raises(ArgumentTypeError, match="extra_key"):
        m.allocate("a", token_ids=list(range(9)), extra_key=salt)
    with pytest.raises(ArgumentTypeError, match="extra_key"):
        m.can_allocate(token_ids=list(range(9)), extra_key=salt)
    assert m.num_sequences == 0
    BlockManager(8, BS).allocate("b", token_ids=list(range(9)), extra_key=salt)  # no caching: unused


CHILD = """
import sys
from kvcache.blocks.digest import block_digests
from kvcache.blocks.prefix_cache import BlockKey
print(block_digests(list(range(64)), 16, ("tenant", 7))[-1].hex())
print(hash(BlockKey(None, (1, 2, 3, 4), "s")))
"""


def test_digests_are_equal_across_processes_and_index_hashes_are_not() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": child_pythonpath(ROOT)}
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.split())
    (digest_1, hash_1), (digest_2, hash_2) = outputs
    assert digest_1 == digest_2 == block_digests(list(range(64)), 16, ("tenant", 7))[-1].hex()
    assert hash_1 != hash_2  # the index's hash is keyed per process: not predictable from outside
