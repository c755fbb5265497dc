"""What the Hopper MLA decode kernels (:mod:`.mla_decode_hopper`, :mod:`.mla_decode_hopper_ring`,
:mod:`.mla_decode_hopper_split`, :mod:`.mla_decode_hopper_fp8`, :mod:`.mla_decode_hopper_fp8_ws`)
share besides the loop: a tile's
TMA load, its online softmax with its row sums kept per thread, zeroing a latent tile's rows past
a token's length in shared memory, and storing a segment's result, its output held transposed
([channels, heads]) in two channel halves."""

from __future__ import annotations

from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.prefill_hopper import _tma_load, gl, gluon, mbarrier

__all__ = [
    "load_tile",
    "load_tile_at",
    "store_half",
    "store_segment",
    "store_slot_halves",
    "table_page",
    "tile_softmax",
    "zero_latents_from",
]


if _GLUON:

    @gluon.jit
    def load_tile(  # type: ignore[no-untyped-def]
        c_desc, e_desc, c_bufs, e_bufs, ready, pos, table_row, n0, table_width, num_blocks,
        HALF: gl.constexpr, STAGES: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """TMA of the 64 latents from ``n0`` of a token's row into ring position ``pos``: the
        two channel halves and the rotary part (an id outside the cache reads block 0)."""
        page = table_page(table_row, n0, table_width, BLOCK_SIZE)
        load_tile_at(c_desc, e_desc, c_bufs, e_bufs, ready, pos, page, n0, num_blocks, HALF, STAGES, BLOCK_SIZE)

    @gluon.jit
    def table_page(table_row, n0, table_width, BLOCK_SIZE: gl.constexpr):  # type: ignore[no-untyped-def]
        """The block id of latent ``n0`` of a row (the row's last entry past its table), as stored."""
        return gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))

    @gluon.jit
    def load_tile_at(  # type: ignore[no-untyped-def]
        c_desc, e_desc, c_bufs, e_bufs, ready, pos, page, n0, num_blocks,
        HALF: gl.constexpr, STAGES: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """:func:`load_tile` with the tile's block id ``page`` already read (:func:`table_page`)."""
        slot = pos % STAGES
        page = gl.where((page >= 0) & (page < num_blocks), page, 0)
        first = page * BLOCK_SIZE + n0 % BLOCK_SIZE
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * c_desc.block_type.nbytes + e_desc.block_type.nbytes)
        _tma_load(c_desc, [first, 0], bar, c_bufs.index(2 * slot))
        _tma_load(c_desc, [first, HALF], bar, c_bufs.index(2 * slot + 1))
        _tma_load(e_desc, [first, 2 * HALF], bar, e_bufs.index(slot))

    @gluon.jit
    def tile_softmax(s, page, n0, end, m_i, l_part, offs_n, num_blocks, scale_log2):  # type: ignore[no-untyped-def]
        """The online softmax of a tile's scores ``s`` [BLOCK_N latents, heads] (latents ``n0 ..``;
        those at or past ``end``, and all of them when the tile's block id ``page`` is outside
        ``[0, num_blocks)``, masked). Returns (p, alpha, the new running max, the per-thread row
        sums ``l_part`` rescaled and grown by p, the tile's latents inside the row)."""
        page_ok = (page >= 0) & (page < num_blocks)
        valid = gl.where(page_ok, end - n0, 0)
        s = gl.where((offs_n < valid)[:, None], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        return p, alpha, m_new, l_part * alpha[None, :] + p, valid

    @gluon.jit
    def zero_latents_from(buf, first_bad, BLOCK_N: gl.constexpr, HALF: gl.constexpr):  # type: ignore[no-untyped-def]
        """Zero rows ``first_bad ..`` of a [BLOCK_N, HALF] latent tile in shared memory."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        v = buf.load(layout)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        buf.store(gl.where((rows < first_bad)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def store_slot_halves(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_a, o_b, m_i, l_i,
        out_layout: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """A segment's partial output (O^T halves, max and sum per head) into slot ``slot_id``
        (nothing for a slot outside the buffer). Into a float16 ``acc_ptr`` each head's output
        and sum are scaled by ``2**-k`` and its max raised by ``k`` (log2 domain), ``k`` the
        least integer putting the head's largest channel within 1: the merge's sums are the
        same, and the channels keep fp16's 11 significant bits whatever their size."""
        if acc_ptr.dtype.element_ty == gl.float16:
            most = gl.maximum(gl.max(gl.abs(o_a), 0), gl.max(gl.abs(o_b), 0))
            k = gl.where(most > 0, gl.ceil(gl.log2(most)), 0.0)
            scale = gl.exp2(-k)
            o_a = o_a * scale[None, :]
            o_b = o_b * scale[None, :]
            m_i = m_i + k
            l_i = l_i * scale
        slot_ok = (slot_id >= 0) & (slot_id < num_slots)
        keep = head_ok & slot_ok
        idx = gl.where(slot_ok, slot_id, 0).to(gl.int64) * num_heads + offs_h.to(gl.int64)
        acc_row = acc_ptr + idx * (2 * HALF)
        store_half(o_a, acc_row, keep, 0, out_layout, HALF)
        store_half(o_b, acc_row, keep, HALF, out_layout, HALF)
        gl.store(ml_ptr + idx * 2, m_i, mask=keep)
        gl.store(ml_ptr + idx * 2 + 1, l_i, mask=keep)

    @gluon.jit
    def store_half(  # type: ignore[no-untyped-def]
        o, base, keep, col0, out_layout: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """Channels ``col0 ..`` of an output in [HALF, heads] (O^T) to ``base + head * stride +
        channel`` (``base``: [heads] pointers in ``out_layout``'s column slice) where ``keep``."""
        o = gl.convert_layout(o, out_layout)
        r = gl.arange(0, HALF, layout=gl.SliceLayout(1, out_layout))
        h_ok = gl.convert_layout(keep, gl.SliceLayout(0, out_layout))
        ptrs = gl.convert_layout(base, gl.SliceLayout(0, out_layout))[None, :] + (col0 + r)[:, None]
        gl.store(ptrs, o.to(ptrs.dtype.element_ty), mask=h_ok[None, :] & (r < HALF)[:, None])

    @gluon.jit
    def store_segment(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot, stride_oh, offs_h,
        head_ok, o_a, o_b, m_i, l_i, out_layout: gl.constexpr, HALF: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s segment's result: under ``DIRECT``, a token of one segment (its count
        in ``token_slots``) normalized into its row of ``out``; else the partial output into
        slot ``slot_id``."""
        if DIRECT:
            if gl.load(token_slots + 2 * t + 1) == 1:
                inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
                out_row = out_ptr + t.to(gl.int64) * stride_ot + offs_h.to(gl.int64) * stride_oh
                store_half(o_a * inv[None, :], out_row, head_ok, 0, out_layout, HALF)
                store_half(o_b * inv[None, :], out_row, head_ok, HALF, out_layout, HALF)
            else:
                store_slot_halves(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_a, o_b, m_i,
                                  l_i, out_layout, HALF)  # fmt: skip
        else:
            store_slot_halves(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_a, o_b, m_i, l_i,
                              out_layout, HALF)  # fmt: skip
