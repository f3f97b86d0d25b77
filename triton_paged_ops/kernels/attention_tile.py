"""Tile maths of the unified attention kernel: a KV tile's gather, scores, masks and online-softmax step, the tile
loops over a range of keys, the per-warp runs of one-token rows, and a segment's normalised result.

Softmax runs in base 2 (``exp2`` is native): ``LOG2E`` sits in the score scale, the cap or the ALiBi slopes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_paged_ops.kernels.merge import _fold_out, _fold_result, _fold_step

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
    """
    s, key_valid, v_loc = _tile_scores(
        q, start_n, page, k_cache_ptr, kv_head, kv_len, num_pages, stride_k_page, stride_k_slot, stride_k_head,
        stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
        MASKED, CLAMP_PAGES, NARROW_OFFSETS,
    )  # fmt: skip
    return _tile_update(
        acc, m_i, l_i, s, key_valid, v_loc, q, start_n, v_cache_ptr, q_pos, row_valid, qk_scale, softcap,
        window_left, alibi_slope, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
        DOT_PRECISION, ACC_RESCALE, MASKED, diag_lo,
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
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr,
):  # fmt: skip
    """The first half of ``_attend_tile``: the tile's raw scores q @ K^T, its key mask, and its V rows' offsets."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    key_valid = offs_n < kv_len
    # A page id outside the cache would be an illegal access (debug mode reports them). Such keys are dropped, or
    # with CLAMP_PAGES read page 0 instead: the key mask then depends on the key index alone, and no tile converts
    # it from the page ids' register layout to the K and score layouts through shared memory.
    if CLAMP_PAGES:
        # (One unsigned compare: a negative id reads as a huge one.)
        page = tl.where(page.to(tl.uint32, bitcast=True) < num_pages, page, 0)
    else:
        key_valid = key_valid & (page >= 0) & (page < num_pages)
    # Tiles start at multiples of BLOCK_N (_attend_range): where pages divide the tile a key's slot is fixed by its
    # place in the tile, and where the tile lies in one page (``page`` then is one id) it is the tile's offset in the
    # page plus its place, so the per-key part of the offset is loop-invariant.
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
    return s, key_valid, v_row


@triton.jit
def _tile_update(
    acc, m_i, l_i, s, key_valid, v_loc, q, start_n, v_cache_ptr, q_pos, row_valid, qk_scale, softcap, window_left,
    alibi_slope, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC_RESCALE: tl.constexpr, MASKED: tl.constexpr, diag_lo=0,
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
    l_i = l_i * alpha + tl.sum(p, 1)
    if ACC_RESCALE == "lazy":
        # alpha is exactly 1 where the max stayed: skip the tile's accumulator multiply when no row moved.
        if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
            acc = acc * alpha[:, None]
    else:
        tl.static_assert(ACC_RESCALE == "always", "acc_rescale is 'lazy' or 'always'")
        # Every tile (the same bits: x * 1 is x), no CTA-wide test. (With Triton 3.7 the skip's branch between the
        # MMAs made ptxas serialize every wgmma of the kernel at 128x128 tiles on sm_90: C7515.)
        acc = acc * alpha[:, None]

    if MASKED >= 2 and HEAD_DIM_V == HEAD_DIM_V_PAD:
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
    ACC_RESCALE: tl.constexpr, IDS_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Keys [lo, hi) (lo a tile edge) tile by tile: masked tiles before ``full_lo``, unmasked ones in
    [full_lo, full_hi) (tile edges; every row of the block sees those tiles whole), masked ones after."""
    acc, m_i, l_i, _, _, _, _ = _attend_tiles(
        acc, m_i, l_i, acc, m_i, l_i, 0, 1, None, q, lo, hi, full_lo, full_hi, k_cache_ptr, v_cache_ptr, bt_row_ptr,
        kv_head, kv_len, num_pages, q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope,
        stride_k_page, stride_k_slot, stride_k_head, stride_v_page, stride_v_slot, stride_v_head,
        HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_N, IS_CAUSAL,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, IDS_AHEAD, PAGE_IDS, DIAG_LOOP,
        CLAMP_PAGES, NARROW_OFFSETS, False, 1,
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
    ACC_RESCALE: tl.constexpr, IDS_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr,
    CLAMP_PAGES: tl.constexpr, NARROW_OFFSETS: tl.constexpr, HAS_V_SCALE: tl.constexpr, LEAVES: tl.constexpr,
):  # fmt: skip
    """``_attend_range``; with ``LEAVES`` > 1 the softmax state (acc, m_i, l_i) is that of leaf ``cur_leaf`` (keys
    [cur_leaf * leaf_len, ...)), and a tile of a later leaf first folds it into (out_f, m_f, t_f) (``_close_leaf``)
    and starts afresh: leaves inside one pipelined loop. ``IDS_AHEAD``: each tile's page ids are loaded in the
    iteration before it (one-token rows: all their tiles; taller tiles: their unmasked loop)."""
    # A tile of one query position (a decode step, or one token of a longer query when a GQA group fills the tile)
    # without a window sees exactly the keys [lo, hi): hi already ends at that position's causal limit (and at the
    # segment's end). So the key guard is hi, not kv_len, and it is all the masking those rows need: one unmasked
    # range, one pipelined loop (lean code). (Guarding with kv_len let a prefill token see its successors.)
    one_token = BLOCK_Q == 1 and not HAS_WINDOW
    if one_token:
        kv_len = hi
    # Page ids once per page for taller tiles (one-token rows keep one load per key).
    per_page: tl.constexpr = PAGE_IDS == "per_page" and BLOCK_Q > 1
    # With clamped page ids a one-token row's whole tiles need no key guard at all: they run unguarded (MASKED 2)
    # and the last, partial tile alone after them.
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
    # Causal taller tiles whose diagonal tiles run in the unmasked loop (``DIAG_LOOP`` "merged"): one pipeline fill
    # per block instead of two, the diagonal tiles' mask applied at run time (MASKED 3). The tile that crosses kv_len
    # stays in the masked loop after it: its V rows past the sequence must be zeroed, which the unguarded loads of
    # the unmasked loop do not do.
    merged: tl.constexpr = (DIAG_LOOP == "merged" and IS_CAUSAL and not HAS_WINDOW and BLOCK_Q > 1 and CLAMP_PAGES
                            and LEAVES == 1)  # fmt: skip
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
            # Page ids a tile ahead: the tile's K/V addresses are then known when its loads are issued, not after a
            # block-table load (decode; taller tiles' unmasked loop where set: the pipeliner then gives the ids'
            # loads no stage of their own). The one-token rows of a prefill launch load them in their own iteration:
            # with the launch's stages they would cost its tall tiles shared memory and speed.
            page = _tile_pages(bt_row_ptr, start, kv_len, PAGE_SIZE, BLOCK_N, per_page)
            for start_n in tl.range(start, stop, BLOCK_N):
                if IDS_AHEAD and (one_token or (phase == 1 and BLOCK_Q > 1)):
                    tile_page = page
                    page = _tile_pages(bt_row_ptr, start_n + BLOCK_N, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                else:
                    tile_page = _tile_pages(bt_row_ptr, start_n, kv_len, PAGE_SIZE, BLOCK_N, per_page)
                if LEAVES > 1:
                    acc, m_i, l_i, out_f, m_f, t_f, cur_leaf = _enter_leaf(
                        start_n // leaf_len, cur_leaf, acc, m_i, l_i, out_f, m_f, t_f, v_scale_ptr, HAS_V_SCALE
                    )
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, start_n, tile_page, k_cache_ptr, v_cache_ptr, kv_head, kv_len, num_pages,
                    q_pos, row_valid, qk_scale, softcap, window_left, alibi_slope, stride_k_page, stride_k_slot,
                    stride_k_head, stride_v_page, stride_v_slot, stride_v_head, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                    HEAD_DIM_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                    DOT_PRECISION, ACC_RESCALE,
                    (3 if merged else 2) if unguarded and phase == 1 else 0 if phase == 1 else 1,
                    CLAMP_PAGES, NARROW_OFFSETS, mid_hi,
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
                HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, 0, CLAMP_PAGES, NARROW_OFFSETS,
            )  # fmt: skip
    return acc, m_i, l_i, out_f, m_f, t_f, cur_leaf


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
    # each tile (H200 mixed batch 699 -> 735-814 µs); left to itself it keeps two tiles of copies going.
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
    IDS_AHEAD: tl.constexpr, PAGE_IDS: tl.constexpr, DIAG_LOOP: tl.constexpr, CLAMP_PAGES: tl.constexpr,
    NARROW_OFFSETS: tl.constexpr, LEAVES: tl.constexpr,
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
            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, IDS_AHEAD, PAGE_IDS,
            DIAG_LOOP, CLAMP_PAGES, NARROW_OFFSETS,
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
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ACC_RESCALE, IDS_AHEAD, PAGE_IDS, DIAG_LOOP,
            CLAMP_PAGES, NARROW_OFFSETS, HAS_V_SCALE, LEAVES,
        )  # fmt: skip
        _, _, _, out, m_fold, total = _close_leaf(acc, m_i, l_i, out, m_fold, total, v_scale_ptr, HAS_V_SCALE)
        total_safe, lse = _fold_result(m_fold, total)
        out = out / total_safe[:, None]
    return out, lse
