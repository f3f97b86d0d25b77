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
* axis 1: a KV head. The tile's ``BLOCK_M`` rows are ``BLOCK_Q`` tokens x the ``GROUP`` query heads that share
  this KV head (GQA packing), so each K/V tile is loaded once for the whole group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from triton_paged_ops import configs
from triton_paged_ops.kernels.launch import Launcher
from triton_paged_ops.kernels.merge import (
    ReducePlan,
    _fold_out,
    _fold_result,
    _fold_step,
    _launch_reduce,
    dependent_launch_supported,
    gdc_launch_dependents,
    launch_reduce,
    reduce_plan,
)
from triton_paged_ops.plan import (
    INVARIANT_LEAVES,
    INVARIANT_SEGMENT,
    MAX_SPLIT_Q_LEN,
    SplitPlan,
    forced_split_plan,
    invariant_split_plan,
    num_sms_at,
    plan_splits,
)
from triton_paged_ops.prepared import PreparedLaunches

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1/ln 2: softmax runs in base 2 (exp2 is native)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # turns the base-2 log-sum-exp back into natural log
RESCALE_SLACK: tl.constexpr = tl.constexpr(8.0)  # base-2 headroom of the lazy running max (p <= 256)
# Fixed when the kernels are defined, as @triton.jit reads TRITON_INTERPRET then.
INTERPRETED: tl.constexpr = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``a @ b (+ acc)`` in fp32. Triton's interpreter multiplies bf16 operands as if they were other numbers (it
    returns garbage), so there they are widened to fp32 first: exact (a product of two bf16 values fits fp32's
    mantissa), and the sum in fp32 is what the tensor cores do with them."""
    if INTERPRETED and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, block_id, BLOCK_Q: tl.constexpr):
    """Largest b < num_seqs with cu_seqlens_q[b] // BLOCK_Q + b <= block_id (binary search over B + 1 entries)."""
    # (lo as a run-time int: a constant would be a constexpr argument, which the search loop may not reassign)
    return _find_seq_between(cu_seqlens_q_ptr, num_seqs * 0, num_seqs - 1, block_id, BLOCK_Q)


@triton.jit
def _find_seq_between(cu_seqlens_q_ptr, lo, hi, block_id, BLOCK_Q: tl.constexpr):
    """``_find_seq`` where the answer is known to lie in [lo, hi] (lo if none there qualifies)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= block_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _one_token_tail(cu_seqlens_q_ptr, num_seqs, tail_seq, num_blocks, BLOCK_Q: tl.constexpr):
    """Where a batch said to end in one-token sequences from sequence ``tail_seq`` on (the caller's ``decode_tail``
    hint) has them: (that sequence, clamped to [0, B]; its first query block; the blocks real sequences use)."""
    total = tl.load(cu_seqlens_q_ptr + num_seqs)
    lo = tl.minimum(tl.maximum(tail_seq, 0), num_seqs)
    # Blocks of real sequences: [0, used); the tail's: [first, used). (Clamped: a bijection even for bad input.)
    used = tl.minimum(total // BLOCK_Q + num_seqs, num_blocks)
    first = tl.minimum(tl.load(cu_seqlens_q_ptr + lo) // BLOCK_Q + lo, used)
    return lo, first, used


@triton.jit
def _interleave_one_token_rows(block_id, first, used):
    """The query block that dispatch position ``block_id`` runs in a batch that ends in one-token sequences from
    block ``first`` on (a mixed batch: prompts' chunks, then decodes; see ``_one_token_tail``): those blocks
    alternate with the others' (each kept in its own order, the longest first) until one kind runs out, so decode
    rows stream while the chunks compute instead of all at once at the end. A bijection of the grid whatever
    ``first`` and the batch hold (so a wrong hint costs time, never results)."""
    pairs = tl.minimum(first, used - first)
    if block_id < 2 * pairs:
        mapped = tl.where(block_id % 2 == 0, block_id // 2, first + block_id // 2)
    elif block_id < used:
        mapped = tl.where(first > used - first, block_id - pairs, first + block_id - pairs)
    else:
        mapped = block_id
    return mapped


@triton.jit
def _find_seq_with_tail(cu_seqlens_q_ptr, num_seqs, block_id, tail, first, BLOCK_Q: tl.constexpr):
    """``_find_seq``'s answer where sequence ``tail`` starts at block ``first`` and the sequences from it on are said
    to hold one token each: blocks before ``first`` search the sequences before ``tail`` only (for one prompt: no
    load at all), a tail block computes its sequence as if the hint held and checks it against the two offsets it
    loads anyway, searching the tail's sequences only where it does not hold. The same answer whatever the hint."""
    if block_id < first:
        seq = _find_seq_between(cu_seqlens_q_ptr, tail * 0, tail - 1, block_id, BLOCK_Q)
    else:
        lo = tl.minimum(tail, num_seqs - 1)
        c0 = tl.load(cu_seqlens_q_ptr + lo)
        # Sequence lo + i of a one-token tail starts at block (c0 + i) // BLOCK_Q + lo + i: the largest x = c0 + i
        # with x + x // BLOCK_Q <= block_id - lo + c0.
        r = block_id - lo + c0
        x = r - r // (BLOCK_Q + 1) - (r % (BLOCK_Q + 1) == BLOCK_Q).to(tl.int32)
        guess = tl.minimum(tl.maximum(x - c0 + lo, lo), num_seqs - 1)
        starts_by = tl.load(cu_seqlens_q_ptr + guess) // BLOCK_Q + guess <= block_id
        next_after = tl.load(cu_seqlens_q_ptr + guess + 1) // BLOCK_Q + guess + 1 > block_id
        if starts_by & (next_after | (guess == num_seqs - 1)):
            seq = guess
        else:
            seq = _find_seq_between(cu_seqlens_q_ptr, lo, num_seqs - 1, block_id, BLOCK_Q)
    return seq


@triton.jit
def _query_block(cu_seqlens_q_ptr, seq, block_id, num_tokens, BLOCK_Q: tl.constexpr):
    """(first token, new tokens, query block) of dispatch block ``block_id`` in sequence ``seq`` (which owns the
    blocks from ``cu_seqlens_q[seq] // BLOCK_Q + seq`` on). A sequence's blocks run last one first: under a causal
    mask it sees the most keys, and the longest programs should start early rather than trail at the end of the
    launch. A negative block: the sequence holds fewer blocks than that (the program has nothing to do)."""
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.minimum(tl.load(cu_seqlens_q_ptr + seq + 1), num_tokens)
    owned = q_end // BLOCK_Q - q_start // BLOCK_Q + 1
    return q_start, q_end - q_start, owned - 1 - (block_id - (q_start // BLOCK_Q + seq))


@triton.jit
def _sequence_keys(seq_lens_ptr, block_table_rows_ptr, seq, max_pages, num_bt_rows, PAGE_SIZE: tl.constexpr,
                   HAS_BT_ROWS: tl.constexpr):  # fmt: skip
    """Sequence ``seq``'s key count and block table row: never past the row's end whatever ``seq_lens`` says; with
    ``HAS_BT_ROWS`` the row is picked by index (a request pool's table, used in place), and a row outside the table
    (an illegal access otherwise) gives the sequence no keys."""
    kv_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_pages * PAGE_SIZE)
    if HAS_BT_ROWS:
        bt_row = tl.load(block_table_rows_ptr + seq).to(tl.int64)
        row_ok = (bt_row >= 0) & (bt_row < num_bt_rows)
        kv_len = tl.where(row_ok, kv_len, 0)
        bt_row = tl.where(row_ok, bt_row, 0)
    else:
        bt_row = seq.to(tl.int64)
    return kv_len, bt_row


@triton.jit
def _tanh(x):
    # Written with exp so the same source runs on every backend and in the interpreter; exp(-2|x|) underflows to 0
    # for large |x| (saturating to +-1) instead of overflowing. Near 0, 1 - exp(-2|x|) cancels (a cap of 1e7 lost
    # a tenth of each logit): below 1/8 the odd series to x^7 instead (its next term is under 2e-9 of x there).
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)
    y = (1.0 - t) / (1.0 + t)
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(a < 0.125, series, tl.where(x < 0.0, -y, y))


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    start_n,
    page,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    kv_len,
    num_pages,
    q_pos,
    row_valid,
    qk_scale,
    softcap,
    window_left,
    alibi_slope,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_RESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    CLAMP_PAGES: tl.constexpr,
    NARROW_OFFSETS: tl.constexpr,
    KV_DESC: tl.constexpr,
    diag_lo=0,
):
    """One KV tile [start_n, start_n + BLOCK_N): gather it from its pages, score, mask, online-softmax step.

    ``MASKED=False`` for tiles that every row of the block sees whole (inside the sequence, below the causal
    diagonal, inside the window): the per-element row/causal/window mask is skipped, only the per-key guard
    remains. Visible scores get the same operations either way (a select of the score or -inf before the
    softmax), so a row's bits do not depend on the tile kind. ``MASKED=2``: a tile of keys all below ``kv_len``
    whose page ids are clamped (``CLAMP_PAGES``): no guard at all (no load masks, no select), same bits.
    ``MASKED=3``: unguarded as 2, and the causal mask applied only where the tile ends past ``diag_lo`` (a
    tile edge at or below the block's first row's diagonal), a branch per tile.
    ``KV_DESC``: the tile lies in one page (``page`` is its id) and ``k_cache_ptr``/``v_cache_ptr`` are tensor
    descriptors of the KV head's rows (``_kv_descriptors``): each tile arrives as one block copy (TMA on NVIDIA).
    """
    s, key_valid, v_loc = _tile_scores(
        q, start_n, page, k_cache_ptr, kv_head, kv_len, num_pages, stride_k_page, stride_k_slot, stride_k_head,
        stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
        MASKED, CLAMP_PAGES, NARROW_OFFSETS, KV_DESC,
    )  # fmt: skip
    return _tile_update(
        acc, m_i, l_i, s, key_valid, v_loc, q, start_n, v_cache_ptr, q_pos, row_valid, qk_scale, softcap,
        window_left, alibi_slope, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
        DOT_PRECISION, ACC_RESCALE, MASKED, KV_DESC, diag_lo,
    )  # fmt: skip


@triton.jit
def _kv_rows(page, slot, kv_head, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot,
             stride_v_head, NARROW_OFFSETS: tl.constexpr):  # fmt: skip
    """Element offsets of the K and V rows of keys at ``slot`` of ``page`` (broadcast together), KV head ``kv_head``."""
    if NARROW_OFFSETS:
        # Every element of the caches lies below 2^31 (the host checks), and so does any clamped or in-range
        # page's offset: 32-bit arithmetic, about 9% fewer instructions per page-16 prefill tile than 64-bit.
        k_row = page * stride_k_page + (slot * stride_k_slot + kv_head * stride_k_head)
        v_row = page * stride_v_page + (slot * stride_v_slot + kv_head * stride_v_head)
    else:
        # int64: page * stride overflows int32 for caches past 2 G elements.
        k_row = page.to(tl.int64) * stride_k_page + (slot.to(tl.int64) * stride_k_slot + kv_head * stride_k_head)
        v_row = page.to(tl.int64) * stride_v_page + (slot.to(tl.int64) * stride_v_slot + kv_head * stride_v_head)
    return k_row, v_row


@triton.jit
def _tile_scores(
    q, start_n, page, k_cache_ptr, kv_head, kv_len, num_pages, stride_k_page, stride_k_slot, stride_k_head,
    stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr, KV_DESC: tl.constexpr,
):  # fmt: skip
    """The first half of ``_attend_tile``: the tile's raw scores q @ K^T, its key mask, and where its V rows are."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    key_valid = offs_n < kv_len
    # A page id outside the cache would be an illegal access (debug mode reports them). Such keys are dropped, or
    # with CLAMP_PAGES read page 0 instead: the key mask then depends on the key index alone, and no tile converts
    # it from the page ids' register layout to the K and score layouts through shared memory (NOTES v19).
    if CLAMP_PAGES:
        # (One unsigned compare: a negative id reads as a huge one.)
        page = tl.where(page.to(tl.uint32, bitcast=True) < num_pages, page, 0)
    else:
        key_valid = key_valid & (page >= 0) & (page < num_pages)
    if KV_DESC:
        # A bad page's rows are asked for just past the cache's last row: the copy fills them with zeros (and its
        # keys are dropped), where the product page * PAGE_SIZE could wrap around into another page.
        page_ok = (page >= 0) & (page < num_pages)
        desc_row = tl.where(page_ok, page * PAGE_SIZE + start_n % PAGE_SIZE, num_pages * PAGE_SIZE)
        k = tl.trans(k_cache_ptr.load([desc_row, 0]))
    else:
        # Tiles start at multiples of BLOCK_N (_attend_range): where pages divide the tile a key's slot is fixed by
        # its place in the tile, and where the tile lies in one page (``page`` then is one id) it is the tile's
        # offset in the page plus its place, so the per-key part of the offset is loop-invariant.
        if BLOCK_N % PAGE_SIZE == 0:
            slot = tl.arange(0, BLOCK_N) % PAGE_SIZE
        elif PAGE_SIZE % BLOCK_N == 0:
            slot = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
        else:
            slot = offs_n % PAGE_SIZE
        k_row, v_row = _kv_rows(page, slot, kv_head, stride_k_page, stride_k_slot, stride_k_head, stride_v_page,
                                stride_v_slot, stride_v_head, NARROW_OFFSETS)  # fmt: skip
        if MASKED >= 2 and HEAD_DIM == HEAD_DIM_PAD:
            k = tl.load(k_cache_ptr + k_row[None, :] + offs_d[:, None])
        else:
            k = tl.load(
                k_cache_ptr + k_row[None, :] + offs_d[:, None],
                mask=key_valid[None, :] & (offs_d[:, None] < HEAD_DIM),
                other=0.0,
            )
    s = _mma(q, k.to(q.dtype), None, DOT_PRECISION)
    # Where the tile's V rows are: the descriptor's first row, or each key's offset.
    v_loc = desc_row if KV_DESC else v_row
    return s, key_valid, v_loc


@triton.jit
def _tile_update(
    acc, m_i, l_i, s, key_valid, v_loc, q, start_n, v_cache_ptr, q_pos, row_valid, qk_scale, softcap, window_left,
    alibi_slope, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC_RESCALE: tl.constexpr, MASKED: tl.constexpr, KV_DESC: tl.constexpr,
    diag_lo=0,
):  # fmt: skip
    """The second half of ``_attend_tile``: scale, cap, masks and the online-softmax step on the tile's scores ``s``,
    then its V rows (at ``v_loc``) into the accumulator."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    # Without a cap or ALiBi the scale is applied inside the exponent's fma (one instruction per score instead of a
    # multiply and a subtraction); it is positive there (_attend_block), so the row max scales with it exactly.
    FOLD_SCALE: tl.constexpr = not HAS_SOFTCAP and not HAS_ALIBI
    if not FOLD_SCALE:
        s = s * qk_scale
    # Scores are in base 2 (the factor LOG2E sits in qk_scale, or in the cap, and in the ALiBi slopes): no separate
    # multiply feeds the softmax's subtraction, which the compiler could fuse differently per kernel variant.
    if HAS_SOFTCAP:
        s = (softcap * LOG2E) * _tanh(s / softcap)
    if HAS_ALIBI:
        # An explicit fma for the same reason: with two products in one sum the contraction choice is free.
        s = tl.fma(alibi_slope[:, None], (offs_n[None, :] - q_pos[:, None]).to(tl.float32), s)

    if MASKED == 2:
        pass
    elif MASKED == 3:
        if start_n + BLOCK_N > diag_lo:
            s = tl.where(row_valid[:, None] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    elif MASKED:
        visible = row_valid[:, None] & key_valid[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))
    else:
        # (Padding rows score keys too; their q is 0 and their output is never stored.)
        s = tl.where(key_valid[None, :], s, float("-inf"))

    m_cand = tl.maximum(m_i, tl.max(s, 1) * qk_scale) if FOLD_SCALE else tl.maximum(m_i, tl.max(s, 1))
    # Lazy rescaling: a row's running max moves only when its scores pass it by more than RESCALE_SLACK (base 2),
    # so p <= 2^RESCALE_SLACK and most tiles rescale nothing; the result is exact either way (out and lse use the
    # same max as the sums), and a row's choices depend on its own scores only.
    m_new = tl.where(m_cand > m_i + RESCALE_SLACK, m_cand, m_i)
    # Rows that have seen no key yet keep m = -inf; subtracting 0 instead avoids (-inf) - (-inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None])) if FOLD_SCALE else tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    if ACC_RESCALE == 3:
        # The row sums of the rounded P that P @ V multiplies, as P @ 1 on the tensor cores (every column the same
        # sum: the max picks one exactly). P's fp32 values then die at the rounding instead of staying live for
        # 64 adds per row beside P and the accumulator (sm_90: the every-tile form's spills, NOTES v34).
        p = p.to(q.dtype)
        row_sums = _mma(p, tl.full([BLOCK_N, 16], 1.0, q.dtype), None, DOT_PRECISION)
        l_i = l_i * alpha + tl.max(row_sums, 1)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    if ACC_RESCALE == 1:
        # alpha is exactly 1 where the max stayed: skip the tile's accumulator multiply when no row moved.
        if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
            acc = acc * alpha[:, None]
    else:
        # Every tile (the same bits: x * 1 is x), no CTA-wide test. (With Triton 3.7 the skip's branch between the
        # MMAs made ptxas serialize every wgmma of the kernel at 128x128 tiles on sm_90: C7515, NOTES v29.)
        acc = acc * alpha[:, None]

    if KV_DESC:
        v = v_cache_ptr.load([v_loc, 0])
        if MASKED == 1:
            # A page's slots past the sequence hold whatever was there (NaN bits too): 0 * NaN would poison the
            # product, so those rows are zeroed (only masked tiles reach past kv_len).
            v = tl.where(key_valid[:, None], v, 0.0)
    elif MASKED >= 2 and HEAD_DIM_V == HEAD_DIM_V_PAD:
        v = tl.load(v_cache_ptr + v_loc[:, None] + offs_dv[None, :])
    else:
        v = tl.load(
            v_cache_ptr + v_loc[:, None] + offs_dv[None, :],
            mask=key_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )
    acc = _mma(p.to(q.dtype), v.to(q.dtype), acc, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, lo, hi, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages,
    q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope,
    stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACC_RESCALE: tl.constexpr,
    PAGES_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr, KV_DESC: tl.constexpr,
):  # fmt: skip
    """Keys [lo, hi) (lo a tile edge) tile by tile: masked tiles before ``full_lo``, unmasked ones in
    [full_lo, full_hi) (tile edges; every row of the block sees those tiles whole), masked ones after.
    ``KV_DESC``: each tile lies in one page; tall tiles then copy K and V through tensor descriptors."""
    acc, m_i, l_i, _, _, _, _ = _attend_tiles(
        acc, m_i, l_i, acc, m_i, l_i, 0, 1, None, q, lo, hi, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr,
        kv_head, kv_len, num_pages, q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope,
        stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
        HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_N, IS_CAUSAL,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, PAGES_AHEAD, PAGE_IDS, DIAG_LOOP,
        CLAMP_PAGES, NARROW_OFFSETS,
        KV_DESC,
        False, 1,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _close_leaf(acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE: tl.constexpr):
    """Fold a finished leaf's normalised result into its segment's running fold; an empty softmax state after."""
    o_leaf, lse_leaf = _normalize(acc, m_i, l_i, v_scale_ptr, HAS_V_SCALE)
    m_f, t_f, alpha, beta = _fold_step(m_f, t_f, lse_leaf)
    out_f = _fold_out(out_f, o_leaf, alpha[:, None], beta[:, None])
    return (tl.zeros_like(acc), tl.full(m_i.shape, float("-inf"), dtype=tl.float32), tl.zeros_like(l_i), out_f, m_f,
            t_f)  # fmt: skip


@triton.jit
def _enter_leaf(leaf, cur_leaf, acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE: tl.constexpr):
    """Before a tile of leaf ``leaf``: if the softmax state holds another leaf, fold it (``_close_leaf``)."""
    if leaf != cur_leaf:
        acc, m_i, l_i, out_f, m_f, t_f = _close_leaf(acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE)
    return acc, m_i, l_i, out_f, m_f, t_f, leaf


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, out_f, m_f, t_f, cur_leaf, leaf_len, v_scale_ptr, q, lo, hi, full_lo, full_hi, k_cache_ptr,
    v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages, q_pos, row_valid, qk_scale, softcap, window_left,
    alibi_slope, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACC_RESCALE: tl.constexpr,
    PAGES_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr, KV_DESC: tl.constexpr,
    HAS_V_SCALE: tl.constexpr, LEAVES: tl.constexpr,
):  # fmt: skip
    """``_attend_range``; with ``LEAVES`` > 1 the softmax state (acc, m_i, l_i) is that of leaf ``cur_leaf`` (keys
    [cur_leaf * leaf_len, ...)), and a tile of a later leaf first folds it into (out_f, m_f, t_f) (``_close_leaf``)
    and starts afresh: leaves inside one pipelined loop."""
    # A tile of one query position (a decode step, or one token of a longer query when a GQA group fills the tile)
    # without a window sees exactly the keys [lo, hi): hi already ends at that position's causal limit (and at the
    # segment's end). So the key guard is hi, not kv_len, and it is all the masking those rows need: one unmasked
    # range, one pipelined loop (lean code). (Guarding with kv_len let a prefill token see its successors.)
    one_token = BLOCK_Q == 1 and not HAS_WINDOW
    if one_token:
        kv_len = hi
    # Page ids once per page for taller tiles (``page_ids`` 2; one-token rows keep one load per key).
    per_page: tl.constexpr = PAGE_IDS == 2 and BLOCK_Q > 1
    # (One-token rows keep the gathers: their last tile reaches past kv_len unmasked, which a block copy would read.)
    use_desc: tl.constexpr = KV_DESC and BLOCK_Q > 1
    k_src = k_cache_ptr
    v_src = v_cache_ptr
    if use_desc:
        k_src, v_src = _kv_descriptors(
            k_cache_ptr, v_cache_ptr, kv_head, num_pages, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
            HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, BLOCK_N,
        )  # fmt: skip
    # With clamped page ids a one-token row's whole tiles need no key guard at all: they run unguarded (MASKED 2)
    # and the last, partial tile alone after them (NOTES v19).
    lean = one_token and CLAMP_PAGES
    # Taller tiles' unmasked range holds whole tiles below kv_len by construction (full_hi): with clamped page ids
    # they need no key guard either.
    unguarded = CLAMP_PAGES and (lean or not one_token)
    if lean:
        mid_lo, mid_hi = lo, lo + (hi - lo) // BLOCK_N * BLOCK_N
    elif one_token:
        mid_lo, mid_hi = lo, hi
    else:
        mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    # Causal taller tiles whose diagonal tiles run in the unmasked loop (``DIAG_LOOP`` 2): one pipeline fill per
    # block instead of two, the diagonal tiles' mask applied at run time (MASKED 3). The tile that crosses kv_len
    # stays in the masked loop after it: its V rows past the sequence must be zeroed, which the unguarded loads of
    # the unmasked loop do not do.
    merged: tl.constexpr = (DIAG_LOOP == 2 and IS_CAUSAL and not HAS_WINDOW and BLOCK_Q > 1 and CLAMP_PAGES
                            and LEAVES == 1 and not use_desc and PAGES_AHEAD != 2)  # fmt: skip
    # (Where the merged loop ends: the last whole tile below kv_len, or the unmasked range's end.)
    merged_hi = tl.maximum(mid_hi, tl.minimum(hi, kv_len // BLOCK_N * BLOCK_N)) if merged else mid_hi
    for phase in tl.static_range(3):  # masked, unmasked, masked: ascending tile order
        if phase == 0:
            start, stop = lo, mid_lo
        elif phase == 1:
            start, stop = mid_lo, merged_hi
        else:
            start, stop = merged_hi, hi
        # No code for ranges that are always empty: before full_lo (0) without a window, after hi for one token.
        if (phase == 0 and HAS_WINDOW) or phase == 1 or (phase == 2 and not one_token):
            # Decode launches load each tile's page ids one tile ahead (PAGES_AHEAD 1, or 2 where taller tiles also
            # score ahead, below): the tile's K/V addresses are then known when its loads are issued, not after a
            # block-table load (fp8 decode +4-7%, NOTES v19).
            # Taller tiles keep the plain order (there the pipeliner would stage more buffers than the shared memory
            # holds, D256), and so do the one-token rows of a prefill launch (0: with the launch's stages they cost
            # its tall tiles shared memory and speed; held to two stages, they still cost whole prompts 6%, NOTES v20).
            page = _tile_pages(bt_row_ptr, start, kv_len, PAGE_SIZE, BLOCK_N, per_page)
            if PAGES_AHEAD == 2 and phase == 1 and not one_token and LEAVES == 1:
                # Taller tiles, scores one tile ahead: the next tile's q @ K^T is issued before this tile's softmax
                # and P @ V, so the tensor cores have work while the softmax runs. The last step scores a tile past
                # the range, never used (its page id is 0 past kv_len, so its loads stay inside the cache). Page ids
                # arrive two tiles ahead: the next tile's K load then waits for no block-table load.
                s, key_valid, v_loc = _tile_scores(
                    q, start, page, k_src, kv_head, kv_len, num_pages, stride_k_page, stride_k_slot,
                    stride_k_head, stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                    BLOCK_N, DOT_PRECISION, 2 if unguarded else 0, CLAMP_PAGES, NARROW_OFFSETS, use_desc,
                )  # fmt: skip
                page = _tile_pages(bt_row_ptr, start + BLOCK_N, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                for start_n in tl.range(start, stop, BLOCK_N):
                    s_next, key_valid_next, v_loc_next = _tile_scores(
                        q, start_n + BLOCK_N, page, k_src, kv_head, kv_len, num_pages, stride_k_page, stride_k_slot,
                        stride_k_head, stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                        BLOCK_N, DOT_PRECISION, 2 if unguarded else 0, CLAMP_PAGES, NARROW_OFFSETS, use_desc,
                    )  # fmt: skip
                    page = _tile_pages(bt_row_ptr, start_n + 2 * BLOCK_N, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                    acc, m_i, l_i = _tile_update(
                        acc, m_i, l_i, s, key_valid, v_loc, q, start_n, v_src, q_pos, row_valid, qk_scale, softcap,
                        window_left, alibi_slope, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                        HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, 2 if unguarded else 0, use_desc,
                    )  # fmt: skip
                    s, key_valid, v_loc = s_next, key_valid_next, v_loc_next
            else:
                for start_n in tl.range(start, stop, BLOCK_N):
                    if (one_token and PAGES_AHEAD) or (phase == 1 and (use_desc or PAGES_AHEAD == 3)):
                        # (Block copies: a copy whose coordinates come from a load of the same iteration is not
                        # pipelined; with the id a tile ahead the copies get the launch's stages. Gathers of taller
                        # tiles with PAGES_AHEAD 3 (``ids_ahead`` 2): the ids' copies then take no pipeline stage.)
                        tile_page = page
                        page = _tile_pages(bt_row_ptr, start_n + BLOCK_N, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                    else:
                        tile_page = _tile_pages(bt_row_ptr, start_n, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                    if LEAVES > 1:
                        acc, m_i, l_i, out_f, m_f, t_f, cur_leaf = _enter_leaf(
                            start_n // leaf_len, cur_leaf, acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE
                        )
                    acc, m_i, l_i = _attend_tile(
                        acc, m_i, l_i, q, start_n, tile_page, k_src, v_src, kv_head, kv_len, num_pages,
                        q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope, stride_k_page, stride_k_slot,
                        stride_k_head, stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                        HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                        DOT_PRECISION, ACC_RESCALE,
                        (3 if merged else 2) if unguarded and phase == 1 else 0 if phase == 1 else 1,
                        CLAMP_PAGES, NARROW_OFFSETS, use_desc, mid_hi,
                    )  # fmt: skip
    if lean:
        # At most one partial tile: no pipeline to fill. (A separate loop: num_stages must be a constant per loop.)
        for start_n in tl.range(mid_hi, hi, BLOCK_N, num_stages=1):
            if LEAVES > 1:
                acc, m_i, l_i, out_f, m_f, t_f, cur_leaf = _enter_leaf(
                    start_n // leaf_len, cur_leaf, acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE
                )
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, start_n, _tile_pages(bt_row_ptr, start_n, kv_len, PAGE_SIZE, BLOCK_N), k_cache_ptr,
                v_cache_ptr, kv_head, kv_len, num_pages, q_pos, row_valid, qk_scale, softcap, window_left,
                alibi_slope, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
                HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, 0, CLAMP_PAGES, NARROW_OFFSETS, False,
            )  # fmt: skip
    return acc, m_i, l_i, out_f, m_f, t_f, cur_leaf


@triton.jit
def _kv_descriptors(k_cache_ptr, v_cache_ptr, kv_head, num_pages, stride_k_slot, stride_k_head, stride_v_slot,
                    stride_v_head, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """Tensor descriptors of one KV head's K and V rows: [num_pages * PAGE_SIZE, head dim] (slots of consecutive
    pages adjacent: the host checks stride_page == PAGE_SIZE * stride_slot, 16-byte strides and bases)."""
    rows = num_pages * PAGE_SIZE
    k_desc = tl.make_tensor_descriptor(k_cache_ptr + kv_head * stride_k_head, shape=[rows, HEAD_DIM],
                                       strides=[stride_k_slot, 1], block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    v_desc = tl.make_tensor_descriptor(v_cache_ptr + kv_head * stride_v_head, shape=[rows, HEAD_DIM_V],
                                       strides=[stride_v_slot, 1], block_shape=[BLOCK_N, HEAD_DIM_V])  # fmt: skip
    return k_desc, v_desc


@triton.jit
def _tile_pages(bt_row_ptr, start_n, kv_len, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                PER_PAGE: tl.constexpr = False):  # fmt: skip
    """Page ids of the keys [start_n, start_n + BLOCK_N) of a sequence (0 past ``kv_len``: never read); one id
    where the tile lies in one page (tiles start at multiples of BLOCK_N). ``PER_PAGE`` (pages of 16+ keys that
    divide the tile): one load per page, each id repeated over its page's keys, instead of one load per key."""
    if PAGE_SIZE % BLOCK_N == 0:
        # A scalar id: the tile's addresses are then one base plus loop-invariant offsets (a vector of equal ids
        # kept a 64-bit address per key live, and the D128 prefill loop spilled at page 64).
        pages = tl.load(bt_row_ptr + start_n // PAGE_SIZE, mask=start_n < kv_len, other=0)
    elif PER_PAGE and BLOCK_N % PAGE_SIZE == 0 and PAGE_SIZE >= 16:
        NUM: tl.constexpr = BLOCK_N // PAGE_SIZE
        first = start_n + tl.arange(0, NUM) * PAGE_SIZE
        ids = tl.load(bt_row_ptr + first // PAGE_SIZE, mask=first < kv_len, other=0)
        pages = tl.reshape(tl.broadcast_to(ids[:, None], (NUM, PAGE_SIZE)), (BLOCK_N,))
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pages = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=offs_n < kv_len, other=0)
    return pages


@triton.jit
def _softmax_start(sinks_ptr, q_head, row_valid, first, BLOCK_M: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                   HAS_SINKS: tl.constexpr):  # fmt: skip
    """Empty online-softmax state (acc, running max, denominator) for a run of keys; ``first`` marks key 0's run."""
    if HAS_SINKS:
        # The sink is a logit with no value: start the running max at it with a denominator of exp(0) = 1.
        # Only the run that starts at key 0 counts it, so a merge of runs sees it once.
        sink = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E
        m_i = tl.where(first, sink, float("-inf"))
        l_i = tl.where(first, 1.0, tl.zeros([BLOCK_M], dtype=tl.float32))
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32), m_i, l_i


@triton.jit
def _normalize(acc, m_i, l_i, v_scale_ptr, HAS_V_SCALE: tl.constexpr):
    """Output and base-2 log-sum-exp of a run of keys; a row that saw no key (and no sink) gets 0 and -inf."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    # One reciprocal per row and a product per element: an fp32 division per element costs a dozen instructions.
    out = acc * (1.0 / l_safe)[:, None]
    if HAS_V_SCALE:
        out = out * tl.load(v_scale_ptr)
    return out, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))


_config_override: dict[str, int] = {}
# Prepared launches by call metadata (ops.py fills it): cleared whenever what a plan depends on may change (a config
# override entered or left, the tables reloaded).
PREPARED = PreparedLaunches()


@contextlib.contextmanager
def attention_config_override(**cfg: int) -> Iterator[None]:
    """Force launch options in a block: tiles (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``), the split
    policy (``programs_per_sm``, ``min_segment``, ``max_segment``, ``fill_segment``: the shortest segment of a grid that
    would leave SMs idle, ``fill_percent``: the share of program slots a grid must fill unsplit) or a fixed split count
    (``num_splits``), the batch-invariant segment (``invariant_segment``), the decode dispatch order (``decode_order``:
    1 sequences outermost, 2 KV heads fastest, 3 KV heads fastest and segments slowest, 4 like 3 with each sequence's
    segments in the last groups) and who merges split-KV partials (``split_merge``: 1 a second kernel, 2 the last
    segment program of each tile; ``reduce_launch``: 1 that second kernel is a plain launch, 2 a programmatic dependent
    one where the device has it), and the KV tile width of one-token rows in a launch of taller tiles that splits
    nothing (``small_block_n``, a mixed batch's decode rows), what a key whose page id lies outside the cache does
    (``page_guard``: 1 it is dropped, 2 it reads page 0), and how tall tiles read K/V when a page holds whole tiles
    (``kv_loads``: 1 gathers, 2 tensor-descriptor copies), and whether the online softmax skips the accumulator's
    multiply in tiles where no row's max moved (``acc_rescale``: 1 skips, 2 multiplies every tile, 3 also sums the rows
    of the rounded P on the tensor cores), and how a mixed launch's one-token rows cut a KV tile (``small_chunks``: 1
    one tile shared by all warps, 2 one run of keys per warp where the launch allows it), and the dispatch order of a
    launch whose caller says its batch ends in one-token sequences (``decode_tail`` > 0; ``mixed_order``: 1 the batch's
    order, 2 their blocks alternating with the others'), and how taller tiles load page ids where pages of 16+ keys
    divide the tile (``page_ids``: 1 one per key, 2 one per page), and when taller tiles' unmasked gathers over pages
    of 16+ keys load a tile's page ids (``ids_ahead``: 1 in its own iteration, 2 a tile ahead), and where causal
    taller tiles run their diagonal tiles (``diag_loop``: 1 a masked loop of their own, 2 the unmasked loop), and
    whether sm_90 prefill launches that fit it run the warp-specialized kernel (``ws_prefill``: 1 no, 2 yes; its
    KV tile width ``ws_block_n``, pipeline stages ``ws_stages`` and mixed-batch order ``ws_mixed_order``).

    For tuning and for tests that must reach tile boundaries with small shapes; unset keys keep their default.
    """
    global _config_override
    unknown = set(cfg) - {*configs.CONFIG_KEYS, "num_splits"}
    if unknown:
        raise ValueError(f"unknown attention config keys: {sorted(unknown)}")
    # The table entries' rules (positive integers, power-of-two tiles, ...): a zero segment would divide by zero.
    table_keys = {k: v for k, v in cfg.items() if k != "num_splits"}
    problem = configs.validate_config(table_keys) if table_keys else None
    splits = cfg.get("num_splits", 1)
    if problem is None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        problem = f"num_splits must be a positive integer, got {splits!r}"
    if problem is not None:
        raise ValueError(f"attention config override: {problem}")
    previous, _config_override = _config_override, dict(sorted(cfg.items()))
    PREPARED.clear()
    try:
        yield
    finally:
        _config_override = previous
        PREPARED.clear()


def select_attention_config(
    head_dim_pad: int,
    group: int,
    dtype: torch.dtype,
    max_seqlen_q: int,
    interpret: bool,
    device_index: int | None = None,
    cache_dtype: torch.dtype | None = None,
    pairs: int = 0,
    regime: str | None = None,
    no_decodes: bool = False,
) -> dict[str, int]:
    """Tile sizes, launch options and split policy for one call: the single place that chooses them.

    A tuned table entry for this GPU (``configs.lookup``) wins over the built-in heuristic, and an active
    ``attention_config_override`` over both. Keys only on values fixed per model (head dim, GQA group, dtype) plus
    the regime: from the host-side bound ``max_seqlen_q`` (with the group: whether a short launch's packed rows
    fit one decode-style tile, ``short_narrow``) and, for one-token queries, whether the launch's
    ``pairs`` (sequences x KV heads, a shape) reach one per SM (``decode_large``; a table without that entry gives
    its ``decode`` one) and ``no_decodes`` (the caller says the batch holds no one-token sequence: a prefill launch
    is then ``prompts``). ``regime`` forces one. So a serving loop compiles a bounded set of variants.
    """
    group_pad = triton.next_power_of_2(group)
    if interpret:
        # The interpreter pays per operation, not per element: few large tiles are fastest.
        cfg = {"BLOCK_M": max(128, group_pad), "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}
    else:
        if max_seqlen_q * group <= configs.NARROW_ROWS:
            # Decode (and short queries with as few packed rows): one tile of packed rows. Memory-bound, so wide KV
            # tiles keep more bytes in flight.
            block_m, block_n = max(16, group_pad), 64 if head_dim_pad > 128 else 128
        elif max_seqlen_q <= MAX_SPLIT_Q_LEN:
            block_m, block_n = max(64, group_pad), 64  # short queries (speculative verification)
        else:
            block_m, block_n = max(64 if head_dim_pad > 128 else 128, group_pad), 32 if head_dim_pad > 128 else 64
        num_warps = 4 if block_m <= 64 else 8
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 2}
    if regime is None:
        num_sms = 0
        if max_seqlen_q <= 1 and pairs > 0:
            num_sms = num_sms_at(None if interpret else device_index)
        regime = configs.regime_of(max_seqlen_q, MAX_SPLIT_Q_LEN, pairs, num_sms, no_decodes, group)
    table_device, name = None if interpret else device_index, configs.dtype_name(dtype, cache_dtype)
    tuned = configs.lookup(table_device, name, head_dim_pad, regime)
    if tuned:
        cfg.update(tuned)
        # A table's tile height is per regime; a wider GQA group still needs its heads in one tile.
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], group_pad)
    elif not interpret and device_index is not None:
        cfg = _fit_shared_memory(cfg, head_dim_pad, dtype.itemsize, max(16, group_pad),
                                 max_shared_memory(device_index), device_is_amd(device_index))  # fmt: skip
    # Decode programs with KV heads fastest read a page's heads at about the same time: +2% on the large bf16
    # decode cases (H200), within noise on the small ones, -1-2% with fp8 caches (NOTES v14). Order 4 adds the
    # longest-work-first segment order: +2.7% on a ragged batch, the same elsewhere (NOTES v16); with fp8 caches'
    # longer segments (below) it keeps the ragged batch within 2% (NOTES v27).
    byte_cache = cache_dtype is not None and cache_dtype.itemsize == 1
    cfg.setdefault("decode_order", 1 if byte_cache and max_seqlen_q > 1 else 4)
    if byte_cache and max_seqlen_q <= 1:
        # fp8 decode: a program of one 2048-key segment costs relatively more to start (two programs per SM), so
        # segments are bounded in bytes, as 16-bit caches' are (4096 one-byte keys), and a grid within 10% of the
        # program slots is not doubled to fill the rest (B32 x 8 KV heads: 256 programs of 264). H200, fp8 copies
        # of the decode suite: B32x4k 89.8 -> 84.3 µs, B64x8k 333.5 -> 318.9, the ragged batch (longest first,
        # order 4) 151.9 -> 154.6, the suite's total 2.1% less (NOTES v27).
        cfg.setdefault("max_segment", 4096)
        cfg.setdefault("fill_percent", 90)
    # Split-KV partials merged by a second kernel (1) or by the last segment program of each tile (2): on the H200
    # the in-kernel merge gained nothing in the default mode and lost on B1x32k (32 arrivals per tile; NOTES v14).
    cfg.setdefault("split_merge", 1)
    # The reduce kernel as a plain launch (1) or a programmatic dependent one (2) where the device has it.
    cfg.setdefault("reduce_launch", 2)
    # Keys whose page id is outside the cache: dropped (1) or read from page 0 (2; a cheaper key mask, and whole
    # tiles below the sequence length unguarded). On the H200, 2 made fp8-cache decode 16% faster, short queries
    # 18-23% and bf16 prefill 6-24% (page 16: 1x8k 1924 -> 1574 µs, the mixed batch 1016 -> 825); 16-bit decode won
    # on B256x2k (+4.6%) but lost on the ragged batch (-4%) and D64 (-25%: 168 registers instead of 94), NOTES v21.
    bf16_decode = max_seqlen_q <= 1 and (cache_dtype is None or cache_dtype.itemsize > 1)
    cfg.setdefault("page_guard", 1 if bf16_decode else 2)
    # Tall tiles within one page: per-row gathers (1) or one block copy per tile through tensor descriptors (2,
    # where the device has them). Copies won 15-23% on H200 prefill against key-guarded gathers (NOTES v20); once the
    # gathers ran unguarded and took one page id per tile, the gathers won everywhere measured: prefill pages of 64
    # and 128 keys 12-15%, the mixed batch 8%, short queries on 64-key pages 3% (NOTES v22).
    cfg.setdefault("kv_loads", 1)
    # 32-bit K/V offsets where the caches allow them (2): ~9% fewer instructions per page-16 prefill tile (NOTES v22).
    cfg.setdefault("kv_offsets", 2)
    # Taller tiles' unmasked loop scores the next tile before the current one's softmax (2; off until measured).
    cfg.setdefault("qk_ahead", 1)
    # Online softmax: the accumulator's multiply skipped where no row's running max moved (1: a CTA-wide test and a
    # branch per tile) or done every tile (2). On the H200 skipping wins on D128/D256 prefill and decode (the
    # multiply costs 128 FMULs per thread per 256-row tile), multiplying wins on D64 prefill (+6%; NOTES v22, v29).
    # 3: every tile, the row sums taken from the rounded P on the tensor cores (fewer instructions, no spills, but
    # H200 prompts +10-12%: the sums' MMA round trip sits on each tile's serial path; NOTES v34, v36).
    cfg.setdefault("acc_rescale", 1)
    # One-token rows of a launch of taller tiles: each KV tile shared by all warps (1: ~9 CTA barriers per tile, the
    # row reductions cross the warps, and one tile in flight), or cut into one run of keys per warp (2), each run
    # its own online softmax, merged at the end (2 barriers per tile, pipelined). H200: the mixed batch 730 -> 705
    # µs, and whole prompts ~2% faster (the tall tiles' register allocation changes with it; NOTES v30).
    cfg.setdefault("small_chunks", 2)
    # Launches whose caller says the batch ends in one-token sequences (``decode_tail`` > 0): query blocks in the
    # batch's order (1), or the tail's blocks alternating with the others', each program finding its sequence
    # from the hint without a search (2). H200: the mixed batch -3.2% (NOTES v32). Without the hint every launch
    # keeps the batch's order: finding the tail in the kernel cost launches of several prompts 0.5-2.5% (v31).
    cfg.setdefault("mixed_order", 2)
    # Taller tiles over pages of 16+ keys that divide the tile: one page-id load per key (1) or per page (2). H200,
    # page 16: prefill 1x8k / 4x2k -2%, D256 -10%, short queries -3%, but D64 +4% (its loop grows: sm_90 SASS per
    # tile 945 -> 1025 instructions where D128's falls 760 -> 735; NOTES v31).
    cfg.setdefault("page_ids", 2 if head_dim_pad >= 128 else 1)
    # Taller tiles' unmasked gathers over pages of 16+ keys: a tile's page ids loaded in its own iteration (1), or a
    # tile ahead (2: the pipeliner then gives the ids' loads no stage of their own, so K/V copies run two tiles ahead
    # instead of one). H200 (its table takes 2 at D64/D128): prompts and the mixed batch -2..-7% (NOTES v36). Off in
    # the heuristic: the third K/V stage it brings is what pays, and other GPUs' shared memory and pipelines were
    # not measured.
    cfg.setdefault("ids_ahead", 1)
    # Causal taller tiles' diagonal tiles in a masked loop of their own (1), or in the unmasked loop, masked from
    # the first tile that reaches the block's first row's diagonal (2): one pipeline fill per block instead of two,
    # a branch per tile (sm_90 SASS, D128 prompts: 410 instructions per tile on the common path against 409, but
    # K and V waited for apart, with a third CTA barrier). H200: D64 prompts (two 8-warp programs per SM) -4.4%,
    # D128 +3-8%, page 1 +9%, D64's 4-warp prefill entry +4.6% (NOTES v43): only the D64 prompts entry takes it.
    cfg.setdefault("diag_loop", 1)
    # Prefill on sm_90 through the warp-specialized kernel (``kernels.hopper``; 2), or the unified one (1): only
    # where a table entry measured it. H200, bf16: 128-key tiles in two stages beat 64-key tiles in three (D128 1x8k
    # 1059 vs 1156 µs); D256 takes 64-key tiles (128 would not fit). Its mixed batches run in the batch's order:
    # interleaving the decodes cost 580 -> 592 µs there (each program holds an SM alone; NOTES v45).
    cfg.setdefault("ws_prefill", 1)
    cfg.setdefault("ws_block_n", 128 if head_dim_pad <= 128 else 64)
    cfg.setdefault("ws_stages", 2)
    cfg.setdefault("ws_mixed_order", 1)
    if not interpret and max_seqlen_q > 1 and group > 32 and 1 < cfg["BLOCK_M"] // group < 8:
        # Tiles of 2-7 tokens of a group over 32 heads (48/1, 64/1 and 128/1 MQA prefill on the 128- and 256-row
        # tiles) took 256-512 KiB of shared memory on sm_90, more than any GPU has (tests/compile_matrix.py): such
        # groups take tiles of one token. (Not timed; such groups are rare.)
        cfg["BLOCK_M"] = group_pad
    if _config_override:
        cfg.update(_config_override)
    if cfg["BLOCK_M"] < group or cfg["BLOCK_M"] < 16 or cfg["BLOCK_N"] < 16:
        raise ValueError(f"attention config {cfg} needs BLOCK_M >= max(16, GQA group={group}) and BLOCK_N >= 16")
    return cfg


def device_is_amd(device_index: int) -> bool:
    """Whether GPU ``device_index`` is an AMD one (a ROCm build of PyTorch)."""
    return torch.version.hip is not None


def _fit_shared_memory(cfg: dict, head_dim_pad: int, itemsize: int, min_rows: int, limit: int, amd: bool) -> dict:
    """The heuristic's tiles, halved until their buffers fit ``limit`` bytes of shared memory (LDS on AMD; 0: not
    known, nothing changes). The estimate is the q tile plus one K and one V tile; compiled with Triton 3.6/3.7 the
    kernels need up to 9% more on NVIDIA GPUs with 16-bit inputs and up to 50% more with fp32 ones (layout
    conversions), and no more on AMD (``tests/compile_targets.py`` checks every heuristic variant on an MI300, a
    99 KB sm_89 GPU and an A100). KV tiles shrink first (to 32 keys), then rows (to ``min_rows``, a GQA group's),
    then KV tiles to 16. Unfitted, the heuristic needed more than GPUs of 99 KB have (sm_86/89: D256 short
    queries, fp32 from D128) or 64 KB (MI300: D256 short queries, most fp32 tiles)."""
    slack = (1, 1) if amd else (3, 2) if itemsize >= 4 else (9, 8)

    def fits(c: dict) -> bool:
        return (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * head_dim_pad * itemsize * slack[0] <= limit * slack[1]

    while limit > 0 and not fits(cfg):
        if cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        elif cfg["BLOCK_M"] > min_rows:
            cfg["BLOCK_M"] //= 2
            cfg["num_warps"] = min(cfg["num_warps"], 4 if cfg["BLOCK_M"] <= 64 else 8)
        elif cfg["BLOCK_N"] > 16:
            cfg["BLOCK_N"] //= 2
        else:
            break  # the smallest tiles: Triton reports what still does not fit
    return cfg


@triton.jit
def _attend_block(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, alibi_slopes_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    bt_row_ptr, sm_scale, softcap, window_left, num_pages, q_start, q_len, q_block, kv_head, kv_len, split,
    segment_len, stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot,
    stride_v_head, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    merge_count_ptr, final_out_ptr, final_lse_ptr, num_splits, stride_o_split, stride_lse_split, stride_fo_t,
    stride_fo_h, stride_fl_t, stride_fl_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
    WRITE_LSE: tl.constexpr, SPLIT_KV: tl.constexpr, FOLD_SEGMENTS: tl.constexpr, LEAVES: tl.constexpr,
    FP8_VIA_FP16: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_RESCALE: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr,
    SEQUENTIAL_MERGE: tl.constexpr, FINAL_LSE: tl.constexpr, PAGES_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr,
    NARROW_OFFSETS: tl.constexpr, KV_DESC: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """Query block ``q_block`` (``BLOCK_Q`` tokens x ``GROUP`` heads in ``BLOCK_M`` rows) of one sequence against
    its keys (one segment of them under split-KV): load q, run the online softmax, store out (and lse).
    ``MERGE_IN_KERNEL``: the last of the block's segment programs to finish merges them all (``_merge_segments``).
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
                PAGES_AHEAD, PAGE_IDS, DIAG_LOOP,
                CLAMP_PAGES, NARROW_OFFSETS, KV_DESC, LEAVES,
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
            PAGES_AHEAD, PAGE_IDS, DIAG_LOOP,
            CLAMP_PAGES, NARROW_OFFSETS, KV_DESC, LEAVES,
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
    if MERGE_IN_KERNEL:
        # Every thread's partial stores come before the arrival (a release at GPU scope by one thread).
        tl.debug_barrier()
        arrived = tl.atomic_add(merge_count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            # The other segments' partials are visible after the acquire; the counter is left at 0 for the next
            # launch (no other program of this launch touches it again).
            tl.atomic_xchg(merge_count_ptr, 0, sem="relaxed", scope="gpu")
            _merge_segments(
                out_ptr - split.to(tl.int64) * stride_o_split, lse_ptr - split.to(tl.int64) * stride_lse_split,
                final_out_ptr, final_lse_ptr, o_row, lse_off, q_start + q_tok, q_head, row_valid, num_splits,
                stride_o_split, stride_lse_split, stride_fo_t, stride_fo_h, stride_fl_t, stride_fl_h,
                BLOCK_M, HEAD_DIM_V, HEAD_DIM_V_PAD, SEQUENTIAL_MERGE, FINAL_LSE,
            )  # fmt: skip


@triton.jit
def _chunk_pages(bt_row_ptr, start_n, run_key, kv_len, PAGE_SIZE: tl.constexpr, CHUNKS: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    """Page ids of the keys ``start_n + run_key`` ([CHUNKS, CHUNK]; 0 past ``kv_len``): one id per chunk where a
    page holds whole chunks (``start_n`` is a multiple of the tile), else one per key."""
    if PAGE_SIZE % CHUNK == 0:
        first = start_n + tl.arange(0, CHUNKS) * CHUNK
        pages = tl.load(bt_row_ptr + first // PAGE_SIZE, mask=first < kv_len, other=0)[:, None]
    else:
        key = start_n + run_key
        pages = tl.load(bt_row_ptr + key // PAGE_SIZE, mask=key < kv_len, other=0)
    return pages


@triton.jit
def _attend_segment_chunks(
    q, seg_lo, lo, hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages, q_head, row_valid,
    qk_scale, sinks_ptr, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr,
):  # fmt: skip
    """``_attend_segment`` for one-token rows (no window, cap, ALiBi or cache scales) with each KV tile cut into
    ``CHUNKS`` runs of ``BLOCK_N // CHUNKS`` keys, one online softmax per run: batched products [CHUNKS, rows,
    keys] put one run on each warp, so a tile's row max and sum stay inside a warp (a tile shared by all warps
    reduces each across them through shared memory: ~9 CTA barriers per tile). The runs merge once at the end.
    Keys [lo, hi) with lo a multiple of BLOCK_N; the run starting at key 0 (``seg_lo == 0``) carries the sink."""
    CHUNK: tl.constexpr = BLOCK_N // CHUNKS
    offs_c = tl.arange(0, CHUNKS)
    offs_k = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    run_key = offs_c[:, None] * CHUNK + offs_k[None, :]  # [CHUNKS, CHUNK]: a key's place in the tile
    q3 = tl.broadcast_to(q[None, :, :], (CHUNKS, BLOCK_M, HEAD_DIM_PAD))
    # Run 0 starts from the segment's state (the sink, where it carries one), the others empty.
    _, m_0, l_0 = _softmax_start(sinks_ptr, q_head, row_valid, seg_lo == 0, BLOCK_M, HEAD_DIM_V_PAD, HAS_SINKS)
    m_i = tl.where(offs_c[:, None] == 0, m_0[None, :], float("-inf"))
    l_i = tl.where(offs_c[:, None] == 0, l_0[None, :], 0.0)
    acc = tl.zeros([CHUNKS, BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    # Page ids a tile ahead (plain loads): each tile's K/V addresses are known when its copies are issued.
    page_next = _chunk_pages(bt_row_ptr, lo, run_key, hi, PAGE_SIZE, CHUNKS, CHUNK)
    # No num_stages here: given any (2, 3 or 4), Triton 3.6 pipelines the page-id loads too and waits for every copy
    # each tile (H200 mixed batch 699 -> 735-814 µs, NOTES v31); left to itself it keeps two tiles of copies going.
    for start_n in tl.range(lo, hi, BLOCK_N):
        key = start_n + run_key
        page = page_next
        page_next = _chunk_pages(bt_row_ptr, start_n + BLOCK_N, run_key, hi, PAGE_SIZE, CHUNKS, CHUNK)
        key_valid = key < hi
        if CLAMP_PAGES:
            page = tl.where(page.to(tl.uint32, bitcast=True) < num_pages, page, 0)
        else:
            key_valid = key_valid & (page >= 0) & (page < num_pages)
        slot = key % PAGE_SIZE
        k_row, v_row = _kv_rows(page, slot, kv_head, stride_k_page, stride_k_slot, stride_k_head, stride_v_page,
                                stride_v_slot, stride_v_head, NARROW_OFFSETS)  # fmt: skip
        k = tl.load(k_cache_ptr + k_row[:, None, :] + offs_d[None, :, None],
                    mask=key_valid[:, None, :] & (offs_d[None, :, None] < HEAD_DIM), other=0.0)  # fmt: skip
        s = _mma(q3, k.to(q.dtype), None, DOT_PRECISION)  # [CHUNKS, rows, keys]
        s = tl.where(key_valid[:, None, :], s, float("-inf"))
        # The scale sits in the exponent's fma (qk_scale > 0, base 2), as in _tile_update.
        m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, :, None]))
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        v = tl.load(v_cache_ptr + v_row[:, :, None] + offs_dv[None, None, :],
                    mask=key_valid[:, :, None] & (offs_dv[None, None, :] < HEAD_DIM_V), other=0.0)  # fmt: skip
        acc = _mma(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, :, None], DOT_PRECISION)
        m_i = m_new
    # The runs' states merged (an exact identity: each run's sums rescaled to the common max).
    m_all = tl.max(m_i, 0)
    m_all_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    scale = tl.exp2(m_i - m_all_safe[None, :])
    return _normalize(tl.sum(acc * scale[:, :, None], 0), m_all, tl.sum(l_i * scale, 0), None, False)


@triton.jit
def _attend_segment(
    q, seg_lo, lo, hi, segment_len, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len,
    num_pages, q_pos, q_head, row_valid, qk_scale, softcap, window_left, alibi_slope, sinks_ptr, v_scale_ptr,
    stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_RESCALE: tl.constexpr,
    PAGES_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr, KV_DESC: tl.constexpr, LEAVES: tl.constexpr,
):  # fmt: skip
    """Output and base-2 lse of the keys [lo, hi) of the segment starting at ``seg_lo`` (key 0's carries the
    sink): one online softmax, or in batch-invariant mode (``LEAVES`` > 1) the in-order fold of the fixed segment's
    ``LEAVES`` leaves of ``segment_len // LEAVES`` keys (each its own online softmax, normalised), the operations by
    which the reduce folds leaves that separate programs computed, so the segment's result has the same bits
    whoever computes its leaves. Leaves outside [lo, hi) are empty (an exact identity of the fold) and skipped,
    except that the one at key 0 always counts: it carries the sink. One pipelined tile loop runs the segment
    (``_attend_tiles``): a loop per leaf would refill the pipeline every few tiles."""
    acc, m_i, l_i = _softmax_start(sinks_ptr, q_head, row_valid, seg_lo == 0, BLOCK_M, HEAD_DIM_V_PAD, HAS_SINKS)
    if LEAVES == 1:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, lo, hi, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len,
            num_pages, q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope,
            stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_N,
            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, PAGES_AHEAD, PAGE_IDS,
            DIAG_LOOP,
            CLAMP_PAGES,
            NARROW_OFFSETS,
            KV_DESC,
        )  # fmt: skip
        out, lse = _normalize(acc, m_i, l_i, v_scale_ptr, HAS_V_SCALE)
    else:
        leaf_len = segment_len // LEAVES
        out = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
        m_fold = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        # The first state is leaf 0's where it holds the sink (a window may skip that leaf's keys), else lo's leaf.
        cur_leaf = (seg_lo if HAS_SINKS else lo) // leaf_len
        acc, m_i, l_i, out, m_fold, total, cur_leaf = _attend_tiles(
            acc, m_i, l_i, out, m_fold, total, cur_leaf, leaf_len, v_scale_ptr, q, lo, hi, full_lo, full_hi,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, kv_len, num_pages, q_pos, row_valid, qk_scale, softcap,
            window_left, alibi_slope, stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot,
            stride_v_head, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_N, IS_CAUSAL,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, PAGES_AHEAD, PAGE_IDS, DIAG_LOOP,
            CLAMP_PAGES, NARROW_OFFSETS,
            KV_DESC,
            HAS_V_SCALE, LEAVES,
        )  # fmt: skip
        _, _, _, out, m_fold, total = _close_leaf(acc, m_i, l_i, out, m_fold, total, v_scale_ptr, HAS_V_SCALE)
        total_safe, lse = _fold_result(m_fold, total)
        out = out / total_safe[:, None]
    return out, lse


@triton.jit
def _merge_segments(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, o_row, lse_off, tok, head, row_valid, num_splits, stride_o_split,
    stride_lse_split, stride_fo_t, stride_fo_h, stride_fl_t, stride_fl_h,
    BLOCK_M: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, SEQUENTIAL: tl.constexpr,
    FINAL_LSE: tl.constexpr,
):  # fmt: skip
    """Merge a tile's ``num_splits`` partial results (outputs, base-2 lse) into the final output (and natural-log
    lse): weighted all at once, or (``SEQUENTIAL``, batch-invariant mode) folded in order with the same operations
    as ``_reduce_splits_kernel`` and the one-program fold, so the bits do not depend on who merges."""
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mask = row_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    part_o = part_out_ptr + o_row[:, None] + offs_dv[None, :]
    part_l = part_lse_ptr + lse_off
    m_safe = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not SEQUENTIAL:
        # The largest lse of each row over all segments, 64 segments per load (one memory latency each).
        offs_s = tl.arange(0, 64)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s0 in range(0, num_splits, 64):
            grp_mask = (s0 + offs_s < num_splits)[:, None] & row_valid[None, :]
            lse_grp = tl.load(part_l[None, :] + (s0 + offs_s)[:, None] * stride_lse_split, mask=grp_mask,
                              other=float("-inf"))  # fmt: skip
            m = tl.maximum(m, tl.max(lse_grp, 0))
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # every segment empty: weights exp2(-inf) = 0, not NaN
    out = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    m_fold = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Segments in order, each loaded two steps ahead of its use (the loads do not wait for the merge arithmetic).
    l_0 = tl.load(part_l, mask=row_valid, other=float("-inf"))
    o_0 = tl.load(part_o, mask=mask, other=0.0)
    l_1 = tl.load(part_l + stride_lse_split, mask=row_valid & (num_splits > 1), other=float("-inf"))
    o_1 = tl.load(part_o + stride_o_split, mask=mask & (num_splits > 1), other=0.0)
    for s in range(num_splits):
        ahead = s + 2 < num_splits
        l_2 = tl.load(part_l + (s + 2) * stride_lse_split, mask=row_valid & ahead, other=float("-inf"))
        o_2 = tl.load(part_o + (s + 2) * stride_o_split, mask=mask & ahead, other=0.0)
        if SEQUENTIAL:
            m_fold, total, alpha, beta = _fold_step(m_fold, total, l_0)
            out = _fold_out(out, o_0, alpha[:, None], beta[:, None])
        else:
            w = tl.exp2(l_0 - m_safe)
            total += w
            out += o_0 * w[:, None]
        l_0, o_0, l_1, o_1 = l_1, o_1, l_2, o_2
    if SEQUENTIAL:
        total_safe, lse = _fold_result(m_fold, total)
        out = out / total_safe[:, None]
    else:
        total_safe = tl.where(total > 0.0, total, 1.0)
        out = out / total_safe[:, None]
        lse = tl.where(total > 0.0, m_safe + tl.log2(total_safe), float("-inf"))
    row = tok.to(tl.int64)
    tl.store(out_ptr + (row * stride_fo_t + head * stride_fo_h)[:, None] + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    if FINAL_LSE:
        tl.store(lse_ptr + row * stride_fl_t + head * stride_fl_h, lse * LN2, mask=row_valid)


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
    merge_count_ptr,
    final_out_ptr,
    final_lse_ptr,
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
    stride_fo_t,
    stride_fo_h,
    stride_fl_t,
    stride_fl_h,
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
    KV_DESC: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr,
    SEQUENTIAL_MERGE: tl.constexpr,
    FINAL_LSE: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    QK_AHEAD: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    SKIP_EMPTY_SEGMENTS: tl.constexpr,
    MIXED_ORDER: tl.constexpr,
    PAGE_IDS: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M, "a query tile must hold at least one token's packed heads")
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
    if ONE_BLOCK_PER_SEQ and DECODE_ORDER > 1:
        # KV heads fastest in dispatch order (x, then y): a page's heads are read at about the same time.
        linear = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        kv_head = linear % tl.num_programs(1)
        rest = linear // tl.num_programs(1)
        if DECODE_ORDER == 2:
            block_id = rest // num_splits
            if SPLIT_KV:
                split = rest % num_splits
        else:
            # Segments slowest: every sequence's first segment (the longest work in a ragged batch) comes first,
            # the empty segments of short sequences last. (Order 4 remaps the segment once the length is known.)
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
        if MIXED_ORDER == 2:
            tail, tail_first, used = _one_token_tail(cu_seqlens_q_ptr, num_seqs, tail_seq, tl.num_programs(0), BLOCK_Q)
            block_id = _interleave_one_token_rows(block_id, tail_first, used)

    if ONE_BLOCK_PER_SEQ:
        # Every sequence fits one query block (decode): block b is sequence b, no search needed.
        seq = block_id
        q_block = 0
    elif MIXED_ORDER == 2:
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
    if ONE_BLOCK_PER_SEQ and DECODE_ORDER == 4 and SPLIT_KV:
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
    if MERGE_IN_KERNEL:
        merge_count_ptr += block_id * tl.num_programs(1) + kv_head  # one arrival counter per (block, KV head)
    elif SKIP_EMPTY_SEGMENTS > 0:  # noqa: SIM102 (a compile-time if around a run-time one)
        # A segment that starts past the sequence's keys (a short sequence in a batch split for long ones) holds
        # nothing: its partial is lse = -inf (1: alone, the parallel reduce reads no output where the lse is -inf;
        # 2: with zero outputs, for the sequential reduce of batch-invariant mode, whose output loads must not wait
        # for the lse: +5% on B1x32k when they did), stored without loading q. Segment 0 still runs with sinks (it
        # carries the sink's logit). (Off where the merge is in this kernel: its arrival count needs every program.)
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
                merge_count_ptr, final_out_ptr, final_lse_ptr, num_splits, stride_o_split, stride_lse_split,
                stride_fo_t, stride_fo_h, stride_fl_t, stride_fl_h,
                GROUP, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, SMALL_M, 1, SMALL_N,
                IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_K_SCALE, HAS_V_SCALE,
                WRITE_LSE, SPLIT_KV, FOLD_SEGMENTS, LEAVES, FP8_VIA_FP16, DOT_PRECISION, ACC_RESCALE, MERGE_IN_KERNEL,
                SEQUENTIAL_MERGE, FINAL_LSE, 0, 1, 1, CLAMP_PAGES, NARROW_OFFSETS, False, SMALL_CHUNKS,
            )  # fmt: skip
            return
    _attend_block(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, alibi_slopes_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
        bt_row_ptr, sm_scale, softcap, window_left, num_pages, q_start, q_len, q_block, kv_head, kv_len, split,
        segment_len, stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_k_head, stride_v_page,
        stride_v_slot, stride_v_head, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        merge_count_ptr, final_out_ptr, final_lse_ptr, num_splits, stride_o_split, stride_lse_split,
        stride_fo_t, stride_fo_h, stride_fl_t, stride_fl_h,
        GROUP, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_K_SCALE, HAS_V_SCALE, WRITE_LSE, SPLIT_KV,
        FOLD_SEGMENTS, LEAVES, FP8_VIA_FP16, DOT_PRECISION, ACC_RESCALE, MERGE_IN_KERNEL, SEQUENTIAL_MERGE, FINAL_LSE,
        2 if QK_AHEAD else 3 if IDS_AHEAD else 1, PAGE_IDS, DIAG_LOOP,
        CLAMP_PAGES, NARROW_OFFSETS, KV_DESC, 0,
    )  # fmt: skip


def split_plan_for(
    cfg: dict,
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    device_index: int | None,
    batch_invariant: bool = False,
    token_bytes: int = 0,
    block_q: int = 1,
) -> SplitPlan:
    """The split-KV plan under a launch config: its forced split count, else the planner with its split policy
    (``block_q`` query tokens per program; ``token_bytes``: workspace bytes per query token and segment).

    Batch-invariant mode cuts keys into the config's fixed segments instead (``plan.invariant_split_plan``).
    """
    if batch_invariant:
        num_sms = num_sms_at(device_index)
        # (Leaf programs need the separate reduce: the in-kernel merge folds whole segments.)
        programs = cfg.get("invariant_programs", 2) if cfg.get("split_merge", 1) == 1 else 1
        tiles = num_seqs * num_kv_heads * -(-max_seqlen_q // block_q)
        return invariant_split_plan(max_seqlen_q, max_seqlen_k, cfg["invariant_segment"], num_seqs * max_seqlen_q,
                                    token_bytes, cfg.get("invariant_leaves", 1), programs, tiles, num_sms)  # fmt: skip
    if "num_splits" in cfg:
        return forced_split_plan(cfg["num_splits"], max_seqlen_k, cfg["BLOCK_N"])
    policy = {k: cfg[k] for k in configs.SPLIT_KEYS if k in cfg}
    num_sms = num_sms_at(device_index)
    return plan_splits(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, cfg["BLOCK_N"], num_sms, **policy,
                       block_q=block_q, token_bytes=token_bytes)  # fmt: skip


def workspace_token_bytes(num_q_heads: int, head_dim_v: int) -> int:
    """Split-KV workspace per query token and segment: fp32 partial outputs and log-sum-exps."""
    return num_q_heads * (head_dim_v + 1) * 4


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything about one attention launch that is decided on the host from shapes, bounds and flags."""

    config: dict
    split: SplitPlan
    block_q: int
    one_block: bool
    constexprs: dict
    cache_dtype: torch.dtype
    batch_invariant: bool = False
    options: dict = dataclasses.field(default_factory=dict)  # Triton launch options (num_warps, num_stages, ...)
    # A small int naming (constexprs, options): the short launch path's key for them (hashed once, not per call).
    kernel_id: int = 0
    # The warp-specialized sm_90 prefill kernel's (KV tile width, stages, dispatch order) where the launch takes it
    # (``kernels.hopper``; None: the unified kernel).
    ws: tuple[int, int, int] | None = None

    def variant(self) -> tuple:
        """What selects a compiled kernel variant (given fixed tensor layouts): constexprs and launch options."""
        # The sequential reduce of batch-invariant mode has one variant for every split count.
        bucket = 0 if self.batch_invariant else triton.next_power_of_2(self.split.num_splits)
        reduce = (self.split.num_splits > 1 and not self.constexprs["MERGE_IN_KERNEL"], bucket)
        opts = tuple(sorted(self.options.items()))
        return (tuple(sorted(self.constexprs.items(), key=lambda kv: kv[0])), opts, reduce, str(self.cache_dtype))


def attention_launch_plan(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    page_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    softcap: float,
    has_alibi: bool,
    has_sinks: bool,
    has_k_scale: bool,
    has_v_scale: bool,
    has_rows: bool,
    want_lse: bool,
    device_index: int | None,
    interpret: bool,
    batch_invariant: bool = False,
    kv_desc_layout: bool = True,
    narrow_offsets: bool = True,
    decode_tail: int = -1,
) -> LaunchPlan:
    """The host-side decisions of a launch (tiles, split plan, constexprs) from host values only; also used by
    warm-up to enumerate the variants a serving configuration can reach. ``kv_desc_layout``: whether the caches'
    layout admits tensor descriptors (``kv_desc_layout_ok``; the usual contiguous caches do); ``narrow_offsets``:
    whether every element of the caches lies below 2^31 (``narrow_offsets_ok``); ``decode_tail``: the caller's
    hint, or its sign (> 0: the batch ends in one-token sequences; 0: it holds none; -1: not known)."""
    return _cached_launch_plan(
        tuple(_config_override.items()), num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, dtype,
        cache_dtype, num_seqs, max_seqlen_q, max_seqlen_k, causal, window_left, softcap, has_alibi, has_sinks,
        has_k_scale, has_v_scale, has_rows, want_lse, device_index, interpret, batch_invariant, kv_desc_layout,
        narrow_offsets, min(decode_tail, 1),
    )  # fmt: skip


# Per call the plan is a pure function of a few host values: caching it saves tens of µs of Python per launch.
# The active override is part of the key; configs.reload() (new tables) clears it.
@functools.lru_cache(maxsize=4096)
def _cached_launch_plan(
    override: tuple, num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, dtype, cache_dtype, num_seqs,
    max_seqlen_q, max_seqlen_k, causal, window_left, softcap, has_alibi, has_sinks, has_k_scale, has_v_scale,
    has_rows, want_lse, device_index, interpret, batch_invariant, kv_desc_layout, narrow_offsets, decode_tail,
) -> LaunchPlan:  # fmt: skip
    group = num_q_heads // num_kv_heads
    head_dim_pad = configs.padded_head_dim(head_dim)
    # A prefill launch said to hold no one-token sequence takes the table's ``prompts`` entry (on the H200 16-warp
    # programs, which cost a mixed batch's one-token rows more than they save its prompts: NOTES v38).
    cfg = select_attention_config(head_dim_pad, group, dtype, max_seqlen_q, interpret, device_index, cache_dtype,
                                  num_seqs * num_kv_heads,
                                  no_decodes=decode_tail == 0 and not batch_invariant)  # fmt: skip
    if batch_invariant:
        # A row's arithmetic must not depend on the regime's tiles: one decode tile (KV width, height, warps) and
        # segment length everywhere, so decode keeps its speed and long prefills run slower. (A row's softmax sum
        # is reduced across the threads of the tile's layout, which tile height and warps choose: bf16 rows of a
        # 16-row and a 64-row tile were seen to differ in the last bit of the lse on an H200, fp8 rows of a 64-key
        # tile with 1 and 4 warps in the last bits of the output.) It is the large batches' tile (``decode_large``,
        # else ``decode``): the mode's fixed segments cost least where the batch fills the GPU.
        decode = select_attention_config(head_dim_pad, group, dtype, 1, interpret, device_index, cache_dtype,
                                         regime="decode_large")  # fmt: skip
        block_n = decode["BLOCK_N"]
        segment = -(-decode.get("invariant_segment", INVARIANT_SEGMENT) // block_n) * block_n
        # Leaves of whole KV tiles: as many as asked for (a power of two) that divide the segment into tiles.
        leaves = decode.get("invariant_leaves", INVARIANT_LEAVES)
        while leaves > 1 and segment % (leaves * block_n):
            leaves //= 2
        cfg = {**cfg, "BLOCK_N": block_n, "invariant_segment": segment, "invariant_leaves": leaves,
               "BLOCK_M": decode["BLOCK_M"], "num_warps": decode["num_warps"]}  # fmt: skip
    # Query tokens per tile. Decode launches say 1 whatever the tile holds (the tile's other rows are padding);
    # longer queries get 1 too where a GQA group fills the tile. A tile of one position needs no causal mask: the
    # kernel bounds its keys by that position's own causal limit (``_attend_tiles``), whatever the launch.
    block_q = 1 if max_seqlen_q == 1 else max(1, cfg["BLOCK_M"] // group)
    small_m = small_n = 0
    if not batch_invariant and max_seqlen_q > 1 and decode_tail != 0:
        # One-token sequences in a launch of taller tiles (a mixed batch) take the decode tile. A batch said to hold
        # none (hint 0) compiles without that branch: its buffers no longer set the launch's shared memory.
        small = select_attention_config(head_dim_pad, group, dtype, 1, interpret, device_index, cache_dtype)
        small_m = min(small["BLOCK_M"], max(16, triton.next_power_of_2(group)))
        # No wider than the launch's own KV tile: the kernel's shared memory is the larger branch's, the tall tiles
        # set the pipeline depth, and segment edges (multiples of BLOCK_N, powers of two) stay tile edges for both.
        small_n = min(small["BLOCK_N"], cfg["BLOCK_N"])
        if small_m >= cfg["BLOCK_M"]:
            small_m = small_n = 0
    split = split_plan_for(cfg, num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, device_index, batch_invariant,
                           workspace_token_bytes(num_q_heads, head_dim_v), block_q)  # fmt: skip
    if small_n and split.num_splits == 1 and "small_block_n" in cfg:
        # Without segments there are no shared tile edges to keep: the one-token rows may take a wider KV tile than
        # the tall ones (more bytes in flight per program; the compiler overlaps the two branches' shared buffers).
        small_n = cfg["small_block_n"]
    cfg = {**cfg, "SMALL_M": small_m, "SMALL_N": small_n}
    # Sequence b owns query blocks from cu_seqlens_q[b] // block_q + b on, so T // block_q + B bounds them all.
    one_block = max_seqlen_q <= block_q
    # (The merge's own flags stay off without it: no extra compiled variants.)
    merge_in_kernel = split.num_splits > 1 and cfg["split_merge"] == 2
    dependent = (split.num_splits > 1 and not merge_in_kernel and cfg["reduce_launch"] == 2
                 and dependent_launch_supported(None if interpret else device_index))  # fmt: skip
    # Block copies need a tall tile inside one page, unpadded head dims, 16-bit or wider caches of the query's
    # dtype, and a device with tensor descriptors. (Not in batch-invariant mode: its rows must get the decode
    # launches' arithmetic, and those gather.)
    kv_desc = (cfg["kv_loads"] == 2 and kv_desc_layout and block_q > 1 and not batch_invariant
               and page_size % cfg["BLOCK_N"] == 0 and head_dim == head_dim_pad
               and head_dim_v == configs.padded_head_dim(head_dim_v) and cache_dtype == dtype
               and tensor_descriptors_supported(None if interpret else device_index, interpret)
               and (interpret or _copies_fit(cfg, head_dim, head_dim_v, dtype.itemsize, device_index)))  # fmt: skip
    # One-token rows in runs of keys per warp: one run per warp.
    chunked = _chunked_rows_ok(cfg, split.num_splits, dtype, cache_dtype, window_left, softcap, has_alibi,
                               has_k_scale or has_v_scale)  # fmt: skip
    small_chunks = cfg["num_warps"] if chunked else 0
    constexprs = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=configs.padded_head_dim(head_dim_v), PAGE_SIZE=page_size,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=block_q, BLOCK_N=cfg["BLOCK_N"], SMALL_M=cfg["SMALL_M"], SMALL_N=cfg["SMALL_N"],
        SMALL_CHUNKS=small_chunks,
        IS_CAUSAL=causal, HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0.0,
        HAS_ALIBI=has_alibi, HAS_SINKS=has_sinks, HAS_K_SCALE=has_k_scale, HAS_V_SCALE=has_v_scale,
        HAS_BT_ROWS=has_rows, WRITE_LSE=want_lse or split.num_splits > 1, SPLIT_KV=split.num_splits > 1,
        FOLD_SEGMENTS=batch_invariant and split.num_splits == 1, ONE_BLOCK_PER_SEQ=one_block,
        # Leaves per program's segment: a fixed segment's (1 where each program computes one leaf).
        LEAVES=cfg["invariant_leaves"] if batch_invariant and split.segment_len == cfg["invariant_segment"] else 1,
        FP8_VIA_FP16=cache_dtype.itemsize == 1 and dtype == torch.bfloat16,
        # fp32 inputs get true fp32 products: the default TF32 would silently cost ~3 decimal digits.
        DOT_PRECISION="ieee" if dtype == torch.float32 else None, ACC_RESCALE=cfg["acc_rescale"],
        DECODE_ORDER=cfg["decode_order"], CLAMP_PAGES=cfg["page_guard"] == 2, KV_DESC=kv_desc,
        NARROW_OFFSETS=narrow_offsets and cfg["kv_offsets"] == 2,
        QK_AHEAD=cfg["qk_ahead"] == 2 and block_q > 1 and not batch_invariant,
        # (Only over pages of 16+ keys: at page 1 the H200's 4x2k prompts ran 5% slower with it, NOTES v36; and
        # only where the third stage of K/V buffers that it brings fits: D256 tiles would need 262 KB.)
        IDS_AHEAD=(cfg["ids_ahead"] == 2 and block_q > 1 and page_size >= 16
                   and (interpret or _copies_fit(cfg, head_dim, head_dim_v, cache_dtype.itemsize, device_index))),
        MERGE_IN_KERNEL=merge_in_kernel, SEQUENTIAL_MERGE=merge_in_kernel and batch_invariant,
        FINAL_LSE=merge_in_kernel and want_lse, LAUNCH_DEPENDENTS=dependent,
        SKIP_EMPTY_SEGMENTS=0 if split.num_splits == 1 or merge_in_kernel else 2 if batch_invariant else 1,
        # Only where the caller says the batch ends in one-token sequences (the map reads where they start from
        # the hint; a tail beside other work needs two sequences at least).
        MIXED_ORDER=2 if (cfg["mixed_order"] == 2 and decode_tail > 0 and cfg["SMALL_M"] > 0 and not one_block
                          and split.num_splits == 1 and num_seqs > 1) else 1,
        PAGE_IDS=cfg["page_ids"],
        # (Only where the kernel takes it: other launches keep one variant. Not in batch-invariant mode: a row's
        # bits there must not depend on how ptxas compiled one loop form or the other.)
        DIAG_LOOP=(cfg["diag_loop"] if block_q > 1 and causal and window_left < 0 and cfg["page_guard"] == 2
                   and not batch_invariant else 1),
    )  # fmt: skip
    # FP fusion (a * b + c as one fma) named on every launch: the kernels were measured and their bits pinned with it
    # on, and Triton's default for it changes (off from 3.10).
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": True}
    if "maxnreg" in cfg and not interpret and device_index is not None and not device_is_amd(device_index):
        # A register cap lets two 8-warp programs share an SM (128 registers per thread), at the price of spills.
        options["maxnreg"] = cfg["maxnreg"]
    if batch_invariant and (softcap > 0.0 or has_alibi):
        # The cap and the ALiBi term put a product in front of the softmax's subtraction; without contraction the
        # compiler cannot fuse such a pair into one fma in one variant and not in another. (The last-bit differences
        # once seen with them on an H200 came from the fp16 tile height, fixed above; this stays as a guard.)
        options["enable_fp_fusion"] = False
    kernel_id = _KERNEL_IDS.setdefault((tuple(constexprs.items()), tuple(options.items())), len(_KERNEL_IDS))
    ws = None
    if (cfg["ws_prefill"] == 2 and not interpret and max_seqlen_q > 1 and not batch_invariant
            and split.num_splits == 1 and window_left < 0 and softcap == 0.0
            and not (has_alibi or has_sinks or has_k_scale or has_v_scale or want_lse)):  # fmt: skip
        from triton_paged_ops.kernels import hopper  # (it imports this module)

        if hopper.available(device_index) and hopper.shape_ok(
            group=group, head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size, block_n=cfg["ws_block_n"],
            stages=cfg["ws_stages"], dtype=dtype, cache_dtype=cache_dtype,
            shared_limit=max_shared_memory(device_index),
        ):  # fmt: skip
            mixed = 2 if cfg["ws_mixed_order"] == 2 and decode_tail > 0 and num_seqs > 1 else 1
            ws = (cfg["ws_block_n"], cfg["ws_stages"], mixed)
    return LaunchPlan(cfg, split, block_q, one_block, constexprs, cache_dtype, batch_invariant, options, kernel_id,
                      ws)  # fmt: skip


def _chunked_rows_ok(cfg: dict, num_splits: int, dtype: torch.dtype, cache_dtype: torch.dtype, window_left: int,
                     softcap: float, has_alibi: bool, has_scales: bool) -> bool:  # fmt: skip
    """Whether a launch's one-token rows cut their KV tiles into one run per warp (``small_chunks`` 2): 16-bit
    caches of the query's dtype, no window, cap, ALiBi or scales, no split (a segment edge would fall inside a
    run), and runs of at least 16 keys (a tensor-core product's K)."""
    return (cfg["SMALL_M"] > 0 and cfg["small_chunks"] == 2 and num_splits == 1 and cache_dtype == dtype
            and dtype in (torch.float16, torch.bfloat16) and window_left < 0 and softcap == 0.0 and not has_alibi
            and not has_scales and cfg["SMALL_N"] // cfg["num_warps"] >= 16)  # fmt: skip


def tensor_descriptors_supported(device_index: int | None, interpret: bool) -> bool:
    """Whether kernels can copy tiles through tensor descriptors: the interpreter, or an NVIDIA GPU of sm_90 or newer
    (TMA; elsewhere Triton would lower them to plain loads, no better than the gathers)."""
    if interpret:
        return True
    if device_index is None or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=16)
def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may use on CUDA device ``device_index`` (the driver's opt-in limit; 0 if
    this Triton cannot tell, so that nothing is planned on a guess)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except (AttributeError, KeyError, TypeError, RuntimeError):
        return 0


def _copies_fit(cfg: dict, head_dim: int, head_dim_v: int, itemsize: int, device_index: int | None) -> bool:
    """Whether the block-copy variant of a tall-tile config fits the device's shared memory. Its buffers (sm_90,
    Triton 3.6 and 3.7, ptxas): a K and a V tile per pipeline stage plus the q tile, and under 100 bytes more
    (128x128 D128 bf16 at three stages: 229,432 B against 229,376 for the tiles); the gathers' variant of the same
    config needs less (D256 128x64 at three stages: 263 KB against the gathers' fit within 227 KB), so where the
    copies would not fit the launch gathers."""
    if device_index is None:
        return False
    tiles = cfg["num_stages"] * cfg["BLOCK_N"] * (head_dim + head_dim_v) + cfg["BLOCK_M"] * head_dim
    return tiles * itemsize + 1024 <= max_shared_memory(device_index)


def narrow_offsets_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether every element of both caches lies below 2^31 elements from its base (checked strides are
    non-negative), so that in-range K/V offsets fit 32 bits."""
    return all(sum((n - 1) * st for n, st in zip(c.shape, c.stride())) < 1 << 31 for c in (k_cache, v_cache))


def kv_desc_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches' layout admits a descriptor over each KV head's rows (``_kv_descriptors``): the slots of
    consecutive pages adjacent, a contiguous head dim, 16-byte slot and head strides, under 2^31 rows. (Metadata
    only: the base addresses, which must be 16-byte aligned too, are checked per launch.)"""
    for c in (k_cache, v_cache):
        pages, page_size = c.shape[:2]
        sp, ss, sh, sd = c.stride()
        e = c.element_size()
        if sd != 1 or (sp != page_size * ss and pages > 1) or (ss * e) % 16 or (sh * e) % 16:
            return False
        if pages * page_size >= 1 << 31:
            return False
    return True


def _torch_allocation(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Descriptors built inside a kernel need scratch memory from Triton's allocator: torch's, unless the caller
    set one."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_allocation)


_KERNEL_IDS: dict[tuple, int] = {}
_launch_attention = Launcher(_paged_attention_kernel, num_tensors=16, num_floats=2)
# Scratch memory reused from call to call: the split-KV workspace (partial outputs and lse) and the in-kernel merge's
# arrival counters (zero between launches: the last program of a tile resets its counter). One buffer per (kind,
# device) and thread, used only by launches on the device's default stream: one thread's launches there run in order,
# so a buffer is free again when its next launch starts (the caching allocator gives per-call allocations the same
# guarantee; another thread's launches may interleave with them, hence per thread). Other streams get a new buffer
# per call: CUDA graphs are captured, and torch.compile's CUDA-graph trees warm up, on side streams, whose
# allocations belong to the graph's memory pool (a buffer kept here would outlive or leak into it).
_LOCAL = threading.local()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_DEFAULT_STREAMS: dict[int, int] = {}


def current_stream(device_index: int | None) -> int | None:
    """The raw handle of the current stream of CUDA (or HIP) device ``device_index`` (None: no device)."""
    return None if device_index is None else _raw_stream(device_index)


def _default_stream(device_index: int) -> int:
    handle = _DEFAULT_STREAMS.get(device_index)
    if handle is None:
        handle = _DEFAULT_STREAMS[device_index] = torch.cuda.default_stream(device_index).cuda_stream
    return handle


def _kept_on(stream: int | None, device_index: int) -> bool:
    """Whether launches on ``stream`` (None: the interpreter) reuse kept scratch buffers: only the default one."""
    return stream is None or stream == _default_stream(device_index)


def _scratch_buffers() -> dict[tuple, torch.Tensor]:
    """This thread's kept scratch buffers by (kind, device index)."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    return buffers


def _scratch(kind: str, like: torch.Tensor, n: int, dtype: torch.dtype, stream: int | None, fresh: bool,
             zero: bool = False) -> torch.Tensor:  # fmt: skip
    """At least ``n`` elements (zeros if ``zero``) for a launch on ``like``'s device and its current ``stream`` (None:
    the interpreter). ``fresh``: a new buffer whatever the stream (traced launches, ``wrap``: their memory belongs
    to their graph)."""
    device = like.get_device()  # (an index: cheaper to get and hash than a torch.device, per call)
    if fresh or not _kept_on(stream, device):
        return like.new_zeros(n, dtype=dtype) if zero else like.new_empty(n, dtype=dtype)
    buffers = _scratch_buffers()
    key = (kind, device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        # The old buffer is dropped: launches queued on the stream that still use it run before any reuse.
        size = max(n, 4096)
        buf = buffers[key] = like.new_zeros(size, dtype=dtype) if zero else like.new_empty(size, dtype=dtype)
    return buf


def _workspace(q: torch.Tensor, lse_elems: int, out_elems: int, stream: int | None, wrap) -> tuple:
    """The split-KV partials (outputs, lse): views of one fp32 buffer, ``lse_elems`` lse values then ``out_elems``
    outputs (the attention kernel addresses them through its stride arguments). A kept buffer's output view is
    kept beside it per offset (slicing costs ~1.7 µs a call). Traced launches get two tensors: a traced kernel's
    mutated arguments must not alias (functionalization would copy them apart, and the reduce would read stale
    partials)."""
    if wrap is not None:
        return q.new_empty(out_elems, dtype=torch.float32), q.new_empty(lse_elems, dtype=torch.float32)
    buf = _scratch("workspace", q, lse_elems + out_elems, torch.float32, stream, False)
    device = q.get_device()
    if not _kept_on(stream, device):
        return buf[lse_elems:], buf
    views = getattr(_LOCAL, "views", None)
    if views is None:
        views = _LOCAL.views = {}
    entry = views.get(device)
    if entry is None or entry[0] is not buf:
        # A new buffer: the old one's views go with it.
        entry = views[device] = (buf, {})
    out_view = entry[1].get(lse_elems)
    if out_view is None:
        out_view = entry[1][lse_elems] = buf[lse_elems:]
    return out_view, buf


@dataclasses.dataclass
class PreparedLaunch:
    """The host part of one attention call that depends on metadata only (shapes, strides, dtypes, bounds, flags):
    computed once per distinct metadata, so a repeated call only gathers its tensors and launches."""

    plan: LaunchPlan
    grid: tuple[int, int]
    tail: tuple  # the kernel's float and int arguments, in order
    # Split-KV: the merge of the partials by a second kernel (None: merged in the kernel, or no split), and the fp32
    # workspace holding them: ``lse_elems`` partial lse values (rounded up to keep the partial outputs 16-byte
    # aligned), then ``out_elems`` partial output values.
    reduce: ReducePlan | None
    lse_elems: int = 0
    out_elems: int = 0
    merge_counts: int = 0  # arrival counters an in-kernel merge needs (0: none)
    device_index: int | None = None  # the CUDA device launched on (None: the interpreter)
    fixed_key: tuple | None = None  # the attention launcher's address-independent key, filled in by the first launch
    rest: tuple | None = None  # what follows the addresses in a compiled launch (filled in by the first launch)
    # Block copies (KV_DESC): the same call with gathers, for caches whose base address is not 16-byte aligned (and
    # for traced launches).
    gathers: PreparedLaunch | None = None
    # The warp-specialized sm_90 kernel's launch (``kernels.hopper.prepare``), where the plan takes it and the
    # caches' layout admits its copies; traced launches and caches at an address its copies cannot take run the
    # unified kernel.
    ws: object | None = None


def compiler_refusal(config: dict, device_index: int | None) -> str | None:
    """Why the installed Triton cannot compile a launch with ``config`` for CUDA device ``device_index``, if it
    cannot: Triton 3.6 and 3.7 crash compiling tiles of 64+ query rows for Blackwell (sm_100 and newer, whose
    tensor-memory products those tiles take; "PassManager::run failed" in TritonNvidiaGPUOptimizeTMemLayoutsPass),
    fixed in 3.8 (every reachable variant compiles there, ``tests/compile_matrix.py``)."""
    installed = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if device_index is None or config["BLOCK_M"] < 64 or installed >= (3, 8):
        return None
    if device_is_amd(device_index) or int(configs.device_identity(device_index)[1].split(".")[0]) < 10:
        return None
    return (
        f"Triton {triton.__version__} cannot compile attention tiles of {config['BLOCK_M']} query rows for this GPU "
        "(sm_100 or newer; the compiler crashes): install triton>=3.8"
    )


def prepare_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    present: tuple[bool, bool, bool, bool, bool],
    out: torch.Tensor,
    lse: torch.Tensor | None,
    interpret: bool,
    batch_invariant: bool = False,
    kv_desc_layout: bool | None = None,
    narrow_offsets: bool | None = None,
    decode_tail: int = -1,
) -> PreparedLaunch | None:
    """Plan one launch over validated arguments from their metadata alone (None: nothing to compute). ``present``:
    whether ``alibi_slopes``, ``sinks``, ``k_scale``, ``v_scale`` and ``block_table_rows`` are given;
    ``kv_desc_layout``: whether the caches admit tensor descriptors (None: ``kv_desc_layout_ok``);
    ``narrow_offsets``: whether their elements lie below 2^31 (None: ``narrow_offsets_ok``); ``decode_tail``: the
    caller's hint (see ``ops.paged_attention``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    if num_seqs == 0 or num_tokens == 0:
        return None
    lp = _cached_launch_plan(
        tuple(_config_override.items()), num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, q.dtype,
        k_cache.dtype, num_seqs, max_seqlen_q, max_seqlen_k, causal, window_left, softcap, *present, lse is not None,
        None if interpret else q.device.index, interpret, batch_invariant,
        kv_desc_layout_ok(k_cache, v_cache) if kv_desc_layout is None else kv_desc_layout,
        narrow_offsets_ok(k_cache, v_cache) if narrow_offsets is None else narrow_offsets, min(decode_tail, 1),
    )  # fmt: skip
    refusal = None if interpret else compiler_refusal(lp.config, q.device.index)
    if refusal:
        raise RuntimeError(refusal)
    plan = lp.split
    splits = plan.num_splits
    reduce, lse_elems, out_elems = None, 0, 0
    if splits > 1:
        # The workspace (one fp32 buffer, see _workspace): [S, T, Hq] partial lse, then [S, T, Hq, Dv] outputs.
        o_strides = (num_tokens * num_q_heads * head_dim_v, num_q_heads * head_dim_v, head_dim_v)
        l_strides = (num_tokens * num_q_heads, num_q_heads, 1)
        lse_elems = -(-splits * num_tokens * num_q_heads // 4) * 4
        out_elems = splits * num_tokens * num_q_heads * head_dim_v
        if not lp.constexprs["MERGE_IN_KERNEL"]:
            # Leaf programs (batch-invariant mode): the reduce folds each fixed segment's leaves first.
            group = lp.config["invariant_segment"] // plan.segment_len if batch_invariant else 1
            reduce = reduce_plan(splits, num_tokens, num_q_heads, head_dim_v, o_strides, l_strides, num_seqs,
                                 out.stride()[:2], None if lse is None else lse.stride(), batch_invariant,
                                 lp.constexprs["LAUNCH_DEPENDENTS"], group)  # fmt: skip
    else:
        o_strides = (0, *out.stride()[:2])
        l_strides = (0, *(lse if lse is not None else out).stride()[:2])
    num_blocks = num_seqs if lp.one_block else num_tokens // lp.block_q + num_seqs
    merge_counts = num_blocks * num_kv_heads if lp.constexprs["MERGE_IN_KERNEL"] else 0
    final_strides = (*out.stride()[:2], *(lse.stride() if lse is not None else (0, 0))) if merge_counts else (0,) * 4
    tail = (
        float(scale), float(softcap), window_left, num_seqs, num_seqs - max(decode_tail, 0), num_tokens,
        *reversed(block_table.shape), num_pages,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *l_strides,
        block_table.stride(0), plan.segment_len, splits, *final_strides,
    )  # fmt: skip
    prepared = PreparedLaunch(lp, (num_blocks * splits, num_kv_heads), tail, reduce, lse_elems, out_elems,
                              merge_counts, None if interpret else q.device.index)  # fmt: skip
    if lp.ws is not None:
        from triton_paged_ops.kernels import hopper

        if hopper.layout_ok(k_cache, v_cache, check_address=False):
            block_n, stages, mixed = lp.ws
            prepared.ws = hopper.prepare(q, k_cache, block_table, out, has_rows=present[4], num_seqs=num_seqs,
                                         scale=float(scale), causal=causal, tail_seq=num_seqs - max(decode_tail, 0),
                                         mixed_order=mixed, block_n=block_n, stages=stages)  # fmt: skip
    if lp.constexprs["KV_DESC"]:
        # A later call with the same metadata may bring caches at an address a descriptor cannot take.
        prepared.gathers = prepare_attention_launch(q, k_cache, v_cache, block_table, num_seqs, max_seqlen_q,
                                                    max_seqlen_k, scale, causal, window_left, softcap, present, out,
                                                    lse, interpret, batch_invariant, False, narrow_offsets,
                                                    decode_tail)  # fmt: skip
    return prepared


def run_attention_launch(
    p: PreparedLaunch,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    optional: tuple[torch.Tensor | None, ...],
    out: torch.Tensor,
    lse: torch.Tensor | None,
    wrap=None,
) -> None:
    """Launch a prepared call on tensors whose metadata is the one it was prepared from. ``optional``:
    ``(alibi_slopes, sinks, k_scale, v_scale, block_table_rows)``, each a tensor or None."""
    alibi_slopes, sinks, k_scale, v_scale, block_table_rows = optional
    if p.ws is not None and wrap is None and not (k_cache.data_ptr() | v_cache.data_ptr()) & 15:
        p.ws.run(q, k_cache, v_cache, block_table, block_table_rows, cu_seqlens_q, seq_lens, out)
        return
    if p.gathers is not None:
        # Traced launches (``wrap``) cannot see the addresses their kernels will get: they gather.
        if wrap is not None or (k_cache.data_ptr() | v_cache.data_ptr()) & 15:
            p = p.gathers
        elif p.device_index is not None:
            _ensure_allocator()
    lp = p.plan
    # One stream query for the scratch buffers and both launches.
    stream = current_stream(p.device_index)
    if p.rest is not None and wrap is None:
        # A repeat of a launched plan: the kernels' addresses read once each, no argument tuples.
        ptr_q, ptr_bt, ptr_cu = q.data_ptr(), block_table.data_ptr(), cu_seqlens_q.data_ptr()
        if p.out_elems:
            workspace = _scratch("workspace", q, p.lse_elems + p.out_elems, torch.float32, stream, False)
            ptr_lse = workspace.data_ptr()
            ptr_out = ptr_lse + 4 * p.lse_elems
        else:
            ptr_out = out.data_ptr()
            ptr_lse = lse.data_ptr() if lse is not None else ptr_out
        ptr_rows = block_table_rows.data_ptr() if block_table_rows is not None else ptr_bt
        # (Spelled out: a comprehension over the four optional tensors costs a frame per call.)
        ptrs = [ptr_q, k_cache.data_ptr(), v_cache.data_ptr(), ptr_out, ptr_lse, ptr_bt, ptr_rows, ptr_cu,
                seq_lens.data_ptr(), alibi_slopes.data_ptr() if alibi_slopes is not None else ptr_q,
                sinks.data_ptr() if sinks is not None else ptr_q, k_scale.data_ptr() if k_scale is not None else ptr_q,
                v_scale.data_ptr() if v_scale is not None else ptr_q]  # fmt: skip
        if p.merge_counts:
            counts = _scratch("merge_counts", q, p.merge_counts, torch.int32, stream, False, zero=True)
            ptr_final = out.data_ptr()
            ptrs += (counts.data_ptr(), ptr_final, lse.data_ptr() if lse is not None else ptr_final)
        else:
            ptrs += (ptr_q, ptr_q, ptr_q)
        if _launch_attention.launch_addresses(p.grid, ptrs, p.rest, p.fixed_key, stream):
            r = p.reduce
            if r is None:
                return
            ptr_final = out.data_ptr()
            ptrs = [ptr_out, ptr_lse, ptr_final, lse.data_ptr() if lse is not None else ptr_lse, ptr_cu]
            if r.rest is not None and _launch_reduce.launch_addresses(r.grid, ptrs, r.rest, r.fixed_key, stream):
                return
            # The buffer the attention kernel just wrote (off the default stream a new call would get another).
            launch_reduce(r, workspace[p.lse_elems :], workspace, cu_seqlens_q, out, lse, wrap, stream)
            return
    if p.out_elems:
        dst_out, dst_lse = _workspace(q, p.lse_elems, p.out_elems, stream, wrap)
    else:
        dst_out, dst_lse = out, lse if lse is not None else out
    if p.merge_counts:
        counts = _scratch("merge_counts", q, p.merge_counts, torch.int32, stream, wrap is not None, zero=True)
        merge = (counts, out, lse if lse is not None else out)
    else:
        merge = (q, q, q)
    # Absent optional tensors are never read (their constexpr flags are off): q stands in for the pointer.
    args = (
        q, k_cache, v_cache, dst_out, dst_lse, block_table,
        block_table_rows if block_table_rows is not None else block_table, cu_seqlens_q, seq_lens,
        alibi_slopes if alibi_slopes is not None else q, sinks if sinks is not None else q,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q, *merge, *p.tail,
    )  # fmt: skip
    p.fixed_key = _launch_attention(p.grid, args, lp.constexprs, lp.options, lp.kernel_id, wrap, p.fixed_key, stream)
    if p.reduce is not None:
        launch_reduce(p.reduce, dst_out, dst_lse, cu_seqlens_q, out, lse, wrap, stream)
    if p.rest is None and p.fixed_key is not None and stream is not None:
        p.rest = _launch_attention.rest(p.tail, lp.constexprs)


def _launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_table_rows: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    interpret: bool,
    batch_invariant: bool = False,
    wrap=None,
    decode_tail: int = -1,
) -> PreparedLaunch | None:
    """Launch over validated arguments (see ``ops.paged_attention``); writes ``out`` and, if given, ``lse``.
    Returns the prepared launch (None: nothing to compute), which ``run_attention_launch`` can repeat.

    ``wrap``, if given, is applied to each kernel before launch (``torch.library.wrap_triton`` inside a
    ``triton_op``).
    """
    optional = (alibi_slopes, sinks, k_scale, v_scale, block_table_rows)
    p = prepare_attention_launch(
        q, k_cache, v_cache, block_table, seq_lens.shape[0], max_seqlen_q, max_seqlen_k, scale, causal, window_left,
        softcap, tuple(t is not None for t in optional), out, lse, interpret, batch_invariant,
        decode_tail=decode_tail,
    )  # fmt: skip
    if p is not None:
        run_attention_launch(p, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, optional, out, lse, wrap)
    return p


configs.on_reload(_cached_launch_plan.cache_clear)
configs.on_reload(PREPARED.clear)
