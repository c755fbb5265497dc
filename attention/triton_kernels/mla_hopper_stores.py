"""What the Hopper MLA decode kernels (:mod:`.mla_decode_hopper`, :mod:`.mla_decode_hopper_ring`,
:mod:`.mla_decode_hopper_split`, :mod:`.mla_decode_hopper_fp8`, :mod:`.mla_decode_hopper_fp8_ws`)
share besides the loop: a tile's
TMA load, its online softmax with its row sums kept per thread, zeroing a latent tile's rows past
a token's length in shared memory, and storing a segment's result, its output held transposed
([channels, heads]) in two channel halves."""

from __future__ import annotations

from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.decode_hopper import _col_max
    from attention.triton_kernels.prefill_hopper import _partition_barrier, _tma_load, gl, gluon, mbarrier

__all__ = [
    "finish_segment",
    "load_tile",
    "load_tile_at",
    "merge_split_tokens",
    "store_half",
    "store_segment",
    "store_slot_halves",
    "table_page",
    "tile_softmax",
    "zero_latents_from",
    "zero_unseen_tokens",
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
    def tile_softmax(  # type: ignore[no-untyped-def]
        s, page, n0, end, m_i, l_part, offs_n, num_blocks, scale_log2, max_buf=0, ONE_BARRIER: gl.constexpr = False
    ):  # fmt: skip
        """The online softmax of a tile's scores ``s`` [BLOCK_N latents, heads] (latents ``n0 ..``;
        those at or past ``end``, and all of them when the tile's block id ``page`` is outside
        ``[0, num_blocks)``, masked). Returns (p, alpha, the new running max, the per-thread row
        sums ``l_part`` rescaled and grown by p, the tile's latents inside the row).
        ``ONE_BARRIER``: the maxima over the latents through ``max_buf`` behind one barrier
        (:func:`.decode_hopper._col_max`; the buffer from ``_allocate_max_buf(heads)``, free
        again once every warp has passed the tile's next barrier) instead of ``gl.max``'s two."""
        page_ok = (page >= 0) & (page < num_blocks)
        valid = gl.where(page_ok, end - n0, 0)
        s = gl.where((offs_n < valid)[:, None], s * scale_log2, float("-inf"))
        if ONE_BARRIER:  # noqa: SIM108 (a compile-time branch)
            m_new = gl.maximum(m_i, _col_max(s, max_buf))
        else:
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

    @gluon.jit
    def finish_segment(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot, stride_oh, tail, offs_h,
        head_ok, o_a, o_b, m_i, l_i, out_layout: gl.constexpr, HALF: gl.constexpr, BLOCK_H: gl.constexpr,
        BLOCK_TAIL: gl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s segment's result with the merge in the kernel (``FUSED``): a token of
        one segment normalized into its row of ``out`` with its ``tail`` channels after the
        first ``2 * HALF`` zeroed; else the partial output into slot ``slot_id``, which
        :func:`merge_split_tokens` counts after the program's loop."""
        if gl.load(token_slots + 2 * t + 1) == 1:
            inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
            out_row = out_ptr + t.to(gl.int64) * stride_ot + offs_h.to(gl.int64) * stride_oh
            store_half(o_a * inv[None, :], out_row, head_ok, 0, out_layout, HALF)
            store_half(o_b * inv[None, :], out_row, head_ok, HALF, out_layout, HALF)
            store_tails(out_ptr, t, num_heads, stride_ot, stride_oh, tail, 2 * HALF, BLOCK_H, BLOCK_TAIL)
        else:
            store_slot_halves(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_a, o_b, m_i, l_i,
                              out_layout, HALF)  # fmt: skip

    @gluon.jit
    def merge_split_tokens(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, out_ptr, token_slots, t0, t_stop, num_slots, num_tokens, num_heads, stride_ot, stride_oh,
        tail, BLOCK_H: gl.constexpr, R: gl.constexpr, BLOCK_TAIL: gl.constexpr,
    ):  # fmt: skip
        """After a program's loop (``FUSED``): only its first and last tokens (``t0``,
        ``t_stop - 1``) can be split across programs. For each that is, each head's row counts
        the program's segment on a counter of its own (``token_slots + 2 * num_tokens +
        BLOCK_H * t + head``, zero before the launch), and where the count is the token's last
        the row merges the token's slots for that head into ``out`` and sets its counter back
        to zero for the next launch. Per head, as a head's row lies in one warp, so that no
        value crosses warps: a count shared through shared memory made ptxas spill 172-184
        bytes in the tile loop (Triton 3.6). A barrier first orders every warp's partial stores
        (and the maxima and sums, which one warp may store for all) before any count."""
        _partition_barrier()
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # a head's row in one warp
        CHUNK: gl.constexpr = 256
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        first_of_row = (offs_c == 0)[None, :] & (offs_h >= 0)[:, None]  # one element a row
        for k in gl.static_range(2):
            t = t0 if k == 0 else t_stop - 1
            if (t_stop > t0) and (k == 0 or t_stop - 1 > t0):
                count = gl.load(token_slots + 2 * t + 1)
                if count >= 2:
                    counters = token_slots + 2 * num_tokens + BLOCK_H * t + offs_h  # [BLOCK_H]
                    old = row_count(counters[:, None] + offs_c[None, :] * 0, first_of_row)
                    last = gl.max(old, 1) == count - 1  # the row's count, in each of its lanes
                    gl.store(counters, gl.zeros_like(offs_h), mask=last)
                    last = last & (offs_h < num_heads)
                    merge_slots(acc_ptr, ml_ptr, out_ptr, gl.load(token_slots + 2 * t), count, num_slots, num_heads,
                                t, stride_ot, stride_oh, tail, last, offs_h, offs_c, layout, BLOCK_H, R, CHUNK,
                                BLOCK_TAIL)  # fmt: skip

    @gluon.jit
    def row_count(counters, first_of_row):  # type: ignore[no-untyped-def]
        """``atomicAdd(counter, 1)`` (acquire-release, GPU scope) where ``first_of_row`` is set
        (one element a row), between syncs of the warp's lanes; other elements give 0, so a
        maximum over a row's elements gives its lanes the count's old value."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 0; bar.warp.sync -1; "
            "@p atom.global.gpu.acq_rel.add.u32 $0, [$1], 1; bar.warp.sync -1; }",
            "=r,l,r", [counters, first_of_row.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def merge_slots(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, out_ptr, first, count, num_slots, num_heads, t, stride_ot, stride_oh, tail, rows_ok,
        offs_h, offs_c, layout: gl.constexpr, BLOCK_H: gl.constexpr, R: gl.constexpr, CHUNK: gl.constexpr,
        BLOCK_TAIL: gl.constexpr,
    ):  # fmt: skip
        """The log-sum-exp merge of token ``t``'s slots ``[first, first + count)`` (clamped to
        the buffer; loaded past L1: other programs stored them) for the heads where ``rows_ok``,
        ``CHUNK`` channels at a time, into its row of ``out`` with its tail zeroed: what
        :func:`.mla_balanced._mla_balanced_merge_kernel` does per (token, head)."""
        first = gl.minimum(gl.maximum(first, 0), num_slots)
        stop = gl.minimum(first + gl.maximum(count, 0), num_slots)
        rows = out_ptr + t.to(gl.int64) * stride_ot + offs_h.to(gl.int64) * stride_oh
        for c0 in gl.static_range(0, R, CHUNK):
            m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, layout))
            l_run = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, layout))
            acc = gl.zeros([BLOCK_H, CHUNK], gl.float32, layout)
            for s in range(first, stop):
                base = (s + 0 * first).to(gl.int64) * num_heads + offs_h.to(gl.int64)  # (a tensor, as typed)
                m_s = gl.load(ml_ptr + base * 2, mask=rows_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = gl.load(ml_ptr + base * 2 + 1, mask=rows_ok, other=0.0, cache_modifier=".cg")
                a_s = gl.load(acc_ptr + base[:, None] * R + (c0 + offs_c)[None, :], mask=rows_ok[:, None], other=0.0,
                              cache_modifier=".cg").to(gl.float32)  # fmt: skip
                m_new = gl.maximum(m_run, m_s)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                w_run = gl.exp2(m_run - m_safe)
                w_s = gl.exp2(m_s - m_safe)
                l_run = l_run * w_run + l_s * w_s
                acc = acc * w_run[:, None] + a_s * w_s[:, None]
                m_run = m_new
            acc = acc / gl.where(l_run > 0, l_run, 1.0)[:, None]
            gl.store(rows[:, None] + (c0 + offs_c)[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])
        if BLOCK_TAIL > 0:
            tail_c = gl.arange(0, BLOCK_TAIL, layout=gl.SliceLayout(0, layout))
            zeros = gl.zeros([BLOCK_H, BLOCK_TAIL], gl.float32, layout).to(out_ptr.dtype.element_ty)
            gl.store(rows[:, None] + R + tail_c[None, :], zeros, mask=rows_ok[:, None] & (tail_c < tail)[None, :])

    @gluon.jit
    def store_tails(  # type: ignore[no-untyped-def]
        out_ptr, t, num_heads, stride_ot, stride_oh, tail, R: gl.constexpr, BLOCK_H: gl.constexpr,
        BLOCK_TAIL: gl.constexpr,
    ):  # fmt: skip
        """Zeros into token ``t``'s ``tail`` channels after the first ``R`` of every head
        (``BLOCK_TAIL``: a power of two >= tail, 0 for none)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])
        if BLOCK_TAIL > 0:
            offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
            offs_c = gl.arange(0, BLOCK_TAIL, layout=gl.SliceLayout(0, layout))
            rows = out_ptr + t.to(gl.int64) * stride_ot + offs_h.to(gl.int64) * stride_oh + R
            zeros = gl.zeros([BLOCK_H, BLOCK_TAIL], gl.float32, layout)
            keep = (offs_h < num_heads)[:, None] & (offs_c < tail)[None, :]
            gl.store(rows[:, None] + offs_c[None, :], zeros.to(out_ptr.dtype.element_ty), mask=keep)

    @gluon.jit
    def zero_unseen_tokens(  # type: ignore[no-untyped-def]
        out_ptr, token_slots, num_tokens, num_heads, stride_ot, stride_oh, tail, pid, num_programs,
        BLOCK_H: gl.constexpr, R: gl.constexpr, BLOCK_TAIL: gl.constexpr,
    ):  # fmt: skip
        """Zeros into the rows of the tokens without latents (segment count 0: padding, or no
        visible latent), every ``num_programs``-th from ``pid``: with the merge in the kernel
        no other program writes them."""
        CHUNK: gl.constexpr = 128
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        zeros = gl.zeros([BLOCK_H, CHUNK], gl.float32, layout).to(out_ptr.dtype.element_ty)
        for t in range(pid, num_tokens, num_programs):
            if gl.load(token_slots + 2 * t + 1) <= 0:
                rows = out_ptr + (t + 0 * pid).to(gl.int64) * stride_ot + offs_h.to(gl.int64) * stride_oh
                for c0 in gl.static_range(0, R, CHUNK):
                    gl.store(rows[:, None] + (c0 + offs_c)[None, :], zeros, mask=(offs_h < num_heads)[:, None])
                store_tails(out_ptr, t, num_heads, stride_ot, stride_oh, tail, R, BLOCK_H, BLOCK_TAIL)
