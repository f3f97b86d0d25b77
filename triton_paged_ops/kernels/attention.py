"""Unified paged attention: prefill, decode and mixed rows of a ragged batch in one launch.

Computes, for every new query token t of sequence b and query head h,

    out[t, h] = softmax(scale * q[t, h] . K_b^T  (+ masks, softcap, alibi, sink)) @ V_b

where K_b, V_b are gathered from a paged cache through ``block_table[b]``.

Program ids
-----------
* axis 0: (query block, KV segment), segment fastest. A query block is ``BLOCK_Q`` consecutive new tokens of one
  sequence. Sequence ``b`` owns the blocks ``cu_seqlens_q[b] // BLOCK_Q + b`` onwards, so ``T // BLOCK_Q + B``
  blocks bound them all using shapes only (static under CUDA graphs); programs past a sequence's last block exit at
  once. When every sequence fits one block (decode), block ``b`` is simply sequence ``b``.
  Segment ``s`` (split-KV, short queries) covers keys ``[s * segment_len, (s + 1) * segment_len)`` and writes a
  partial (out, lse) to a workspace that ``_reduce_splits_kernel`` merges exactly; with one segment the kernel
  writes the final output directly.
  (Shared with the warp-specialized kernel: ``schedule.py``; the tile maths: ``attention_tile.py``; host planning:
  ``plan.py``; launches: ``prepared.py``.)
* axis 1: a KV head. The tile's ``BLOCK_M`` rows are ``BLOCK_Q`` tokens x the ``GROUP`` query heads that share
  this KV head (GQA packing), so each K/V tile is loaded once for the whole group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_paged_ops.kernels.attention_tile import (
    LN2,
    LOG2E,
    _attend_segment,
    _attend_segment_chunks,
)
from triton_paged_ops.kernels.launch import Launcher
from triton_paged_ops.kernels.merge import _fold_out, _fold_result, _fold_step, gdc_launch_dependents, gdc_wait
from triton_paged_ops.kernels.schedule import (
    _find_seq,
    _find_seq_with_tail,
    _interleave_one_token_rows,
    _one_token_tail,
    _query_block,
    _sequence_keys,
)


@triton.jit
def _attend_block(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, alibi_slopes_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    bt_row_ptr, sm_scale, softcap, window_left, num_pages, q_start, q_len, q_block, kv_head, kv_len, split,
    segment_len, stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot,
    stride_v_head, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
    WRITE_LSE: tl.constexpr, SPLIT_KV: tl.constexpr, FOLD_SEGMENTS: tl.constexpr, LEAVES: tl.constexpr,
    FP8_VIA_FP16: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_RESCALE: tl.constexpr, IDS_AHEAD: tl.constexpr,
    PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr, CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    """Query block ``q_block`` (``BLOCK_Q`` tokens x ``GROUP`` heads in ``BLOCK_M`` rows) of one sequence against
    its keys (one segment of them under split-KV): load q, run the online softmax, store out (and lse).
    ``CHUNKS`` > 0 (one-token rows only): each KV tile in that many runs, one per warp (``_attend_segment_chunks``)."""
    context_len = kv_len - q_len  # bottom-right alignment: new tokens are the last q_len keys

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = context_len + q_tok
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)

    q_row = (q_start + q_tok).to(tl.int64) * stride_q_t + q_head * stride_q_h
    q = tl.load(
        q_ptr + q_row[:, None] + offs_d[None, :],
        mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )

    # Float arguments arrive as fp64 when Inductor launches the kernel (triton_op): keep the softmax in fp32.
    qk_scale = tl.cast(sm_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    if HAS_K_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * LOG2E
    if not HAS_SOFTCAP and not HAS_ALIBI:
        # The scale is folded into the exponent (_attend_tile), which needs it > 0: scale > 0 is checked on the host,
        # and a k_scale of 0 becomes the smallest normal float (scores ~0: uniform weights) instead of NaNs.
        qk_scale = tl.maximum(qk_scale, 1.1754943508222875e-38)
    if FP8_VIA_FP16:
        # fp8 -> fp16 is one native conversion per two values, fp8 -> bf16 several: a bf16 query meets an fp8
        # cache in fp16 (P too), with the score scale folded into q first so that it fits fp16's range.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    alibi_slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        alibi_slope = tl.load(alibi_slopes_ptr + q_head, mask=row_valid, other=0.0) * LOG2E

    # Key range this block can see: causal stops at the last row's position, a window starts at the first's.
    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = kv_len
    if IS_CAUSAL:
        kv_hi = tl.minimum(kv_len, context_len + last_tok + 1)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(0, context_len + q_block * BLOCK_Q - window_left)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT_KV:
        # segment_len is a multiple of BLOCK_N, so segment edges are tile edges.
        kv_lo = tl.maximum(kv_lo, split * segment_len)
        kv_hi = tl.minimum(kv_hi, (split + 1) * segment_len)

    # Tiles every row of the block sees whole (no mask needed): inside the sequence, at or below the first row's
    # causal diagonal, at or after the last row's window start.
    full_hi = (kv_len // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, ((context_len + q_block * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N)
    full_lo = 0
    if HAS_WINDOW:
        full_lo = tl.cdiv(tl.maximum(0, context_len + last_tok - window_left), BLOCK_N) * BLOCK_N

    if FOLD_SEGMENTS:
        # Batch-invariant mode in one program: fixed segments of segment_len keys, each the in-order fold of its
        # LEAVES leaves (each its own online softmax), folded in order: the arithmetic of split programs + the
        # sequential reduce, so a row's bits do not depend on whether (or how) its keys were split, nor on the
        # other rows of its tile.
        out = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
        m_fold = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Segment 0 holds the sink even when a window skips its keys.
        first_seg = 0 if HAS_SINKS else (kv_lo // segment_len) * segment_len
        for seg_lo in range(first_seg, kv_hi, segment_len):
            o_seg, lse_seg = _attend_segment(
                q, seg_lo, tl.maximum(seg_lo, kv_lo), tl.minimum(seg_lo + segment_len, kv_hi), segment_len, full_lo,
                full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages, q_pos, q_head, row_valid,
                qk_scale, softcap, window_left, alibi_slope, sinks_ptr, v_scale_ptr,
                stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
                HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N,
                IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_V_SCALE, DOT_PRECISION, ACC_RESCALE,
                IDS_AHEAD, PAGE_IDS, DIAG_LOOP, CLAMP_PAGES, NARROW_OFFSETS, LEAVES,
            )  # fmt: skip
            m_fold, total, alpha, beta = _fold_step(m_fold, total, lse_seg)
            out = _fold_out(out, o_seg, alpha[:, None], beta[:, None])
        total_safe, lse2 = _fold_result(m_fold, total)
        out = out / total_safe[:, None]
    elif CHUNKS > 0:
        out, lse2 = _attend_segment_chunks(
            q, split * segment_len, kv_lo, kv_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages,
            q_head, row_valid, qk_scale, sinks_ptr, stride_k_page, stride_k_slot, stride_k_head, stride_v_page,
            stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_M,
            BLOCK_N, CHUNKS, HAS_SINKS, DOT_PRECISION, CLAMP_PAGES, NARROW_OFFSETS,
        )  # fmt: skip
    else:
        # One segment (all keys when nothing splits); sinks count in the one starting at key 0.
        out, lse2 = _attend_segment(
            q, split * segment_len, kv_lo, kv_hi, segment_len, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr,
            kv_head, kv_len, num_pages, q_pos, q_head, row_valid, qk_scale, softcap, window_left, alibi_slope,
            sinks_ptr, v_scale_ptr, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot,
            stride_v_head, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N,
            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_V_SCALE, DOT_PRECISION, ACC_RESCALE,
            IDS_AHEAD, PAGE_IDS, DIAG_LOOP, CLAMP_PAGES, NARROW_OFFSETS, LEAVES,
        )  # fmt: skip

    # A segment's partial result (base-2 lse, as the reduce wants it) goes to its workspace slice; empty segments
    # write out = 0, lse = -inf.
    o_row = (q_start + q_tok).to(tl.int64) * stride_o_t + q_head * stride_o_h
    tl.store(
        out_ptr + o_row[:, None] + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
    )
    lse_off = (q_start + q_tok).to(tl.int64) * stride_lse_t + q_head * stride_lse_h
    if WRITE_LSE:
        tl.store(lse_ptr + lse_off, lse2 if SPLIT_KV else lse2 * LN2, mask=row_valid)


# Arguments whose values change from batch to batch: Triton must not specialise on them (value 1, multiple of 16),
# or a serving loop would compile new variants as batches change. They only feed scalar address arithmetic.
# (segment_len stays specialised: it is 0 or a multiple of BLOCK_N, always "divisible by 16", and that lets the
# compiler keep KV tiles aligned; num_splits is 1 exactly when SPLIT_KV is off, where the kernel ignores it.)
_PER_BATCH_ARGS = ("num_seqs", "tail_seq", "num_tokens", "max_pages", "num_bt_rows", "num_pages", "window_left",
                   "stride_o_split", "stride_lse_split", "stride_bt_b", "num_splits")  # fmt: skip


@triton.jit(do_not_specialize=_PER_BATCH_ARGS)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    block_table_ptr,
    block_table_rows_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    alibi_slopes_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale,
    softcap,
    window_left,
    num_seqs,
    tail_seq,
    num_tokens,
    max_pages,
    num_bt_rows,
    num_pages,
    stride_q_t,
    stride_q_h,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_o_split,
    stride_o_t,
    stride_o_h,
    stride_lse_split,
    stride_lse_t,
    stride_lse_h,
    stride_bt_b,
    segment_len,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMALL_M: tl.constexpr,
    SMALL_N: tl.constexpr,
    SMALL_CHUNKS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    HAS_BT_ROWS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    FOLD_SEGMENTS: tl.constexpr,
    LEAVES: tl.constexpr,
    FP8_VIA_FP16: tl.constexpr,
    ONE_BLOCK_PER_SEQ: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_RESCALE: tl.constexpr,
    DECODE_ORDER: tl.constexpr,
    CLAMP_PAGES: tl.constexpr,
    NARROW_OFFSETS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    SKIP_EMPTY_SEGMENTS: tl.constexpr,
    MIXED_ORDER: tl.constexpr,
    PAGE_IDS: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M, "a query tile must hold at least one token's packed heads")
    if WAIT_PRIOR:
        # Launched as a programmatic dependent of whatever kernel precedes it on the stream: the programs become
        # resident as that kernel drains, and wait here for its end (and its writes) before touching memory.
        gdc_wait()
    if LAUNCH_DEPENDENTS:
        # The reduce kernel (a dependent launch) may be scheduled once every program here has started; it waits for
        # this kernel's end before reading, so this only moves its launch off the critical path.
        gdc_launch_dependents()
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs N >= 16")
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = 0
    tail = 0
    tail_first = 0
    if ONE_BLOCK_PER_SEQ and DECODE_ORDER != "sequences":
        # KV heads fastest in dispatch order (x, then y): a page's heads are read at about the same time.
        linear = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        kv_head = linear % tl.num_programs(1)
        rest = linear // tl.num_programs(1)
        if DECODE_ORDER == "heads":
            block_id = rest // num_splits
            if SPLIT_KV:
                split = rest % num_splits
        else:
            # Segments slowest: every sequence's first segment (the longest work in a ragged batch) comes first,
            # the empty segments of short sequences last (remapped below once the length is known).
            num_blocks = tl.num_programs(0) // num_splits
            block_id = rest % num_blocks
            if SPLIT_KV:
                split = rest // num_blocks
    elif SPLIT_KV:  # noqa: SIM102 (a compile-time if around a run-time one)
        # Segments of one query block are adjacent program ids, so a long sequence's segments run side by side
        # instead of trailing after every other sequence's first segment.
        block_id = tl.program_id(0) // num_splits
        split = tl.program_id(0) % num_splits
    elif not ONE_BLOCK_PER_SEQ:
        # KV heads vary fastest in dispatch order (x, then y), so the first wave holds every head's first blocks.
        linear = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        block_id = linear // tl.num_programs(1)
        kv_head = linear % tl.num_programs(1)
        if MIXED_ORDER:
            tail, tail_first, used = _one_token_tail(cu_seqlens_q_ptr, num_seqs, tail_seq, tl.num_programs(0), BLOCK_Q)
            block_id = _interleave_one_token_rows(block_id, tail_first, used)

    if ONE_BLOCK_PER_SEQ:
        # Every sequence fits one query block (decode): block b is sequence b, no search needed.
        seq = block_id
        q_block = 0
    elif MIXED_ORDER:
        seq = _find_seq_with_tail(cu_seqlens_q_ptr, num_seqs, block_id, tail, tail_first, BLOCK_Q)
    else:
        seq = _find_seq(cu_seqlens_q_ptr, num_seqs, block_id, BLOCK_Q)
    q_start, q_len, q_rank = _query_block(cu_seqlens_q_ptr, seq, block_id, num_tokens, BLOCK_Q)
    if not ONE_BLOCK_PER_SEQ:
        q_block = q_rank
        if q_block < 0:
            return
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len, bt_row = _sequence_keys(seq_lens_ptr, block_table_rows_ptr, seq, max_pages, num_bt_rows, PAGE_SIZE,
                                    HAS_BT_ROWS)  # fmt: skip
    bt_row_ptr = block_table_ptr + bt_row * stride_bt_b
    if ONE_BLOCK_PER_SEQ and DECODE_ORDER == "tails_last" and SPLIT_KV:
        # A sequence's segments fill the last dispatch groups: a group holds the segments of the sequences that
        # still have one that far from their end, so the first waves run the longest sequences' full segments and
        # every sequence's last (partial, often short) segment comes last, where short work evens out the tail.
        # Its empty segments take the groups before (they exit at once). Any bijection onto [0, num_splits) is
        # exact: each partial is stored at its segment's index and merged in index order.
        n_seg = tl.minimum(tl.maximum(tl.cdiv(kv_len, segment_len), 1), num_splits)
        lead = num_splits - n_seg
        split = tl.where(split >= lead, split - lead, n_seg + split)
    if SPLIT_KV:
        out_ptr += split.to(tl.int64) * stride_o_split
        lse_ptr += split.to(tl.int64) * stride_lse_split
    if SKIP_EMPTY_SEGMENTS > 0:  # noqa: SIM102 (a compile-time if around a run-time one)
        # A segment that starts past the sequence's keys (a short sequence in a batch split for long ones) holds
        # nothing: its partial is lse = -inf (1: alone, the parallel reduce drops the output where the lse is -inf;
        # 2: with zero outputs, for the sequential reduce of batch-invariant mode, whose output loads must not wait
        # for the lse: +5% on B1x32k when they did), stored without loading q. Segment 0 still runs with sinks (it
        # carries the sink's logit).
        if split * segment_len >= kv_len and (split > 0 or not HAS_SINKS):
            offs_m = tl.arange(0, BLOCK_M)
            q_tok = q_block * BLOCK_Q + offs_m // GROUP
            row_valid = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
            q_head = kv_head * GROUP + offs_m % GROUP
            lse_off = (q_start + q_tok).to(tl.int64) * stride_lse_t + q_head * stride_lse_h
            tl.store(lse_ptr + lse_off, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_valid)
            if SKIP_EMPTY_SEGMENTS == 2:
                offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
                o_row = (q_start + q_tok).to(tl.int64) * stride_o_t + q_head * stride_o_h
                tl.store(out_ptr + o_row[:, None] + offs_dv[None, :], tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32),
                         mask=row_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V))  # fmt: skip
            return

    if SMALL_M > 0:  # noqa: SIM102 (a compile-time if around a run-time one: no code without SMALL_M)
        # Tall tiles (prefill) meet one-token sequences (a mixed batch of prefill chunks and decodes): those run
        # the decode tile instead, so a decode row does not pay a 128-row tile's tensor-core work for its heads.
        if q_len == 1:
            _attend_block(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, alibi_slopes_ptr, sinks_ptr, k_scale_ptr,
                v_scale_ptr, bt_row_ptr, sm_scale, softcap, window_left, num_pages, q_start, q_len, 0, kv_head,
                kv_len, split, segment_len, stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_k_head,
                stride_v_page, stride_v_slot, stride_v_head, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
                GROUP, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, SMALL_M, 1, SMALL_N,
                IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_K_SCALE, HAS_V_SCALE,
                WRITE_LSE, SPLIT_KV, FOLD_SEGMENTS, LEAVES, FP8_VIA_FP16, DOT_PRECISION, ACC_RESCALE, False,
                "per_key", "separate", CLAMP_PAGES, NARROW_OFFSETS, SMALL_CHUNKS,
            )  # fmt: skip
            return
    _attend_block(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, alibi_slopes_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
        bt_row_ptr, sm_scale, softcap, window_left, num_pages, q_start, q_len, q_block, kv_head, kv_len, split,
        segment_len, stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_k_head, stride_v_page,
        stride_v_slot, stride_v_head, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        GROUP, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_K_SCALE, HAS_V_SCALE, WRITE_LSE, SPLIT_KV,
        FOLD_SEGMENTS, LEAVES, FP8_VIA_FP16, DOT_PRECISION, ACC_RESCALE, IDS_AHEAD or BLOCK_Q == 1, PAGE_IDS,
        DIAG_LOOP, CLAMP_PAGES, NARROW_OFFSETS, 0,
    )  # fmt: skip


_launch_attention = Launcher(_paged_attention_kernel, num_tensors=13, num_floats=2)
