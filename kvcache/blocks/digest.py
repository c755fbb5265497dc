"""Stable content digests of full blocks: the names a block's K/V has outside this process.

A block's digest is BLAKE2b (16 bytes) over its parent's digest, the request's salt (the
``extra_key``, in every block, not only the first; its encoding is self-delimiting) and the
block's token ids as little-endian int64, so it names the whole prefix up to the block, as
vLLM's and TensorRT-LLM's block hashes do. It is the same in every process and on every
machine (Python's ``hash()`` is not: str and bytes are hashed with a per-process seed), so a
disk tier, an event consumer or another engine can name a block.

Salts are encoded canonically: ``None``, ``str``, ``bytes``, ``int`` and (nested) tuples of
them. Other objects have no stable encoding and are refused as ``extra_key``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Sequence
from hashlib import blake2b

from attention.errors import ArgumentTypeError

__all__ = ["DIGEST_SIZE", "ROOT_DIGEST", "block_digest", "block_digests", "encode_salt", "pack_ids"]

#: Bytes per digest.
DIGEST_SIZE = 16
#: The parent digest of a sequence's first block (names the scheme, so a future change of
#: encoding cannot be mistaken for this one).
ROOT_DIGEST = blake2b(b"paged-kvcache block digest v1", digest_size=DIGEST_SIZE).digest()

_last_salt: tuple[object, bytes] = (None, b"n")


def encode_salt(extra_key: Hashable) -> bytes:
    """The canonical bytes of a salt. Raises ArgumentTypeError for a type without a stable
    encoding (name the salt with a str, bytes, int, or a tuple of them)."""
    global _last_salt
    if extra_key is None:
        return b"n"
    last, encoded = _last_salt
    # A request's blocks share one salt. Only a str, bytes or int equal to the last salt (and of
    # its type) is surely the same salt: tuples compare equal across types, (1,) == (True,).
    if type(extra_key) is type(last) and type(extra_key) in (str, bytes, int) and extra_key == last:
        return encoded
    encoded = bytes(_encode(extra_key, depth=0))
    _last_salt = (extra_key, encoded)
    return encoded


def _encode(value: object, depth: int) -> bytearray:
    out = bytearray()
    if value is None:
        out += b"n"
    elif type(value) is str:
        data = value.encode("utf-8", "surrogatepass")
        out += b"s" + len(data).to_bytes(8, "little") + data
    elif type(value) is bytes:
        out += b"b" + len(value).to_bytes(8, "little") + value
    elif type(value) is int:
        text = str(value).encode()
        out += b"i" + len(text).to_bytes(8, "little") + text
    elif type(value) is tuple and depth < 8:
        out += b"t" + len(value).to_bytes(8, "little")
        for item in value:
            out += _encode(item, depth + 1)
    else:
        raise ArgumentTypeError(
            f"extra_key: a salt must have a stable encoding (None, str, bytes, int, or a tuple of them, "
            f"nested at most 8 deep), got {type(value).__name__}; name it with a str, e.g. str(adapter_id)"
        )
    return out


_packers: dict[int, Callable[..., bytes]] = {}


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` (checked ints, within int64) as little-endian int64 bytes."""
    n = len(token_ids)
    pack = _packers.get(n)
    if pack is None:
        pack = _packers[n] = struct.Struct(f"<{n}q").pack
    return pack(*token_ids)


def block_digest(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The digest of one full block whose ids are ``token_ids``, after the block whose digest
    is ``parent`` (``ROOT_DIGEST`` for a first block), salted with ``encode_salt(extra_key)``."""
    return blake2b(parent + salt + pack_ids(token_ids), digest_size=DIGEST_SIZE).digest()


def block_digests(token_ids: Sequence[int], block_size: int, extra_key: Hashable = None) -> list[bytes]:
    """The digests of every full block of a prompt: what a router computes to ask which
    engine holds the longest prefix (compare with the digests of
    :class:`kvcache.blocks.events.BlockStored` events)."""
    salt = encode_salt(extra_key)
    out: list[bytes] = []
    parent = ROOT_DIGEST
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_digest(parent, token_ids[start : start + block_size], salt)
        out.append(parent)
    return out
