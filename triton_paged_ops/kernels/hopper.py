"""Warp-specialized prefill for NVIDIA Hopper (sm_90), written in Gluon (Triton's explicit-layout dialect).

The unified kernel (``attention.py``) leaves the tensor cores idle while a program computes its softmax: Triton's
pipeliner waits for each ``wgmma`` before the next step, and its 64-row warpgroup tiles either serialize under a
register cap or take so many registers that one program fills an SM. This kernel splits a 128-row
query tile (``128 // GROUP`` tokens x the ``GROUP`` query heads of one KV head) between two *consumer* warpgroups of
64 rows each, which run independently (one's softmax beside the other's products), and gives the K/V loads to a
*producer* warp: it walks the block table and copies each page's rows of a ``BLOCK_N``-key tile into shared memory
with the tensor memory accelerator (one copy per page, so pages of 16 keys need no gathers), ``STAGES`` tiles
ahead, handing buffers over through mbarriers. Pages of under 16 keys (and sizes that neither divide the tile nor
are a multiple of it) get a producer warpgroup instead, which gathers key by key with ``cp.async``, each thread's
copies arriving on the slot's barrier as they land, so that as many tiles are in flight as with the TMA (one warp
that waited for its own copies kept too few bytes in flight). Consumers get up to 232 registers each, the TMA warp
64, the gathering warpgroup 40. A consumer issues a tile's QK^T together with the previous tile's PV and computes the
tile's softmax while that PV runs (FlashAttention-3's overlap within a warpgroup).

A program runs work items (a query tile of one KV head) in a loop, a program per SM. The producer also finds each
item's sequence, query block and keys, and copies its query rows (``cp.async``) into one of two q buffers beside
that description, so consumers read an item's description from shared memory and start its products without a
load of their own, the next item's q tile and first K/V tiles in flight while they finish this one (a profile of
programs of one item each showed them waiting about a memory latency for their q rows before the first product);
the ring's slots and phases run on from item to item. Where the second q buffer does not fit (D256) or pages are
gathered a program runs one item, the hardware handing programs out as SMs free up, and its consumers load their
own q rows.

Scope (the launch planner checks it; every other launch runs the unified kernel): prefill launches of 16-bit
queries and caches of the same dtype, head dims 64/128/256 (K and V alike), GQA groups dividing 128, pages of any
size, heads adjacent within a slot, causal or not, no window, cap, ALiBi, sinks, cache scales, lse output or split,
query rows 16 bytes apart, and not under ``torch.compile`` tracing. Work items map onto query blocks exactly as the
unified kernel's programs (longest block of a sequence first, in the batch's order), so one-token sequences of a
mixed batch run here too, with one consumer warpgroup idle.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from triton_paged_ops import configs
from triton_paged_ops.kernels.schedule import _find_seq, _query_block, _sequence_keys

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # A barrier across the warps of one warpgroup (``thread_barrier`` in 3.6, ``barrier`` from 3.7 on).
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # A TMA copy of a block into shared memory (``async_copy_global_to_shared`` up to 3.7, ``async_load`` from 3.8 on;
    # 3.9 keeps the old name only to raise).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # A ``cp.async`` copy into shared memory (the same renaming, in the Ampere module).
    cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon's Hopper API: the unified kernel runs everything
    gluon = None

# Triton versions whose Gluon API this file is written and verified against (Gluon is experimental: its signatures
# change between releases).
VERIFIED_TRITON = ("3.6",)
TILE_ROWS = 128  # query rows per program: two consumer warpgroups of one wgmma M (64) each
ROWS = triton.language.constexpr(TILE_ROWS // 2)
BLOCK_M = triton.language.constexpr(TILE_ROWS)
HEAD_DIMS = (64, 128, 256)
LOG2E = 1.4426950408889634
CONSUMER_REGS = triton.language.constexpr(232)
PRODUCER_REGS = triton.language.constexpr(64)
# The gathering producer: a warpgroup (enough threads to issue a tile's copies between two of the consumers' steps)
# within what the consumers leave of the register file (65,536 - 2 x 128 x 232 = 6,144 = 128 x 48).
GATHER_WARPS = triton.language.constexpr(4)
GATHER_REGS = triton.language.constexpr(40)
ITEM_FIELDS = triton.language.constexpr(8)  # an item's description, producer to consumers (7 used)


def available(device_index: int | None) -> bool:
    """Whether this kernel can run on CUDA device ``device_index`` with the installed Triton: an sm_90 GPU (wgmma
    and TMA; not ROCm) and a verified Gluon."""
    if gluon is None or device_index is None or torch.version.hip is not None:
        return False
    if configs.triton_version() not in VERIFIED_TRITON:
        return False
    return configs.device_identity(device_index)[1] == "9.0"


def copy_rows(page_size: int, block_n: int) -> int:
    """Rows per TMA copy of a KV tile: a page, or the whole tile where a page holds several tiles."""
    return min(page_size, block_n)


def gathers(page_size: int, block_n: int) -> bool:
    """Whether the producer gathers a tile's rows key by key (``cp.async``) instead of copying whole pages with the
    TMA: pages under 16 keys (a TMA copy and a page-id load per key would not keep up), or pages that neither divide
    the tile nor are a multiple of it."""
    rows = copy_rows(page_size, block_n)
    return rows < 16 or block_n % rows != 0 or page_size % rows != 0


def copy_constexprs(page_size: int, block_n: int) -> dict:
    """The kernel's ``GATHER`` and ``COPY`` (rows per TMA copy; a gathering producer fills the ring 16 rows at a
    time, in the layout of 16-row copies)."""
    gather = gathers(page_size, block_n)
    return {"COPY": 16 if gather else copy_rows(page_size, block_n), "GATHER": gather}


def shape_ok(*, group: int, head_dim: int, head_dim_v: int, page_size: int, block_n: int, stages: int,
             dtype: torch.dtype, cache_dtype: torch.dtype, shared_limit: int) -> bool:  # fmt: skip
    """Whether a launch's shapes fit this kernel (see the module docstring) and its buffers ``shared_limit``
    bytes of shared memory."""
    if dtype not in (torch.float16, torch.bfloat16) or cache_dtype != dtype:
        return False
    if head_dim != head_dim_v or head_dim not in HEAD_DIMS or TILE_ROWS % group:
        return False
    if block_n not in (64, 128):
        return False
    return shared_bytes(head_dim, block_n, stages) <= shared_limit


def shared_bytes(head_dim: int, block_n: int, stages: int, q_buffers: int = 1) -> int:
    """Shared memory of one program: ``q_buffers`` q tiles, ``stages`` K and V tiles, and room for the compiler's
    layout conversions (measured with ptxas: 180,296 B at D128, 128-key tiles, two stages, one q tile)."""
    return 2 * (q_buffers * TILE_ROWS * head_dim + 2 * stages * block_n * head_dim) + 20 * 1024


def q_buffers(head_dim: int, block_n: int, stages: int, shared_limit: int) -> int:
    """Query tiles a program holds: two where they fit (the next item's rows copied while this one's run), else
    one (D256: the next item's copy waits for this one's last product)."""
    return 2 if shared_bytes(head_dim, block_n, stages, 2) <= shared_limit else 1


def q_layout_ok(q: torch.Tensor, check_address: bool = True) -> bool:
    """Whether the producer can copy query rows [T, Hq, D] 16 bytes at a time: D contiguous, token and head
    strides of 16 bytes' multiples (and base, unless not ``check_address``)."""
    e = q.element_size()
    if q.stride(2) != 1 or (q.stride(0) * e) % 16 or (q.stride(1) * e) % 16:
        return False
    return not (check_address and q.data_ptr() % 16)


def layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, check_address: bool = True) -> bool:
    """Whether both caches can be read as 2-D row blocks [slots, heads x D] by the TMA: slots evenly strided across
    pages, heads adjacent within a slot, 16-byte aligned strides (and base, unless not ``check_address``), under
    2^31 slots."""
    for c in (k_cache, v_cache):
        pages, page_size, heads, d = c.shape
        sp, ss, sh, sd = c.stride()
        e = c.element_size()
        if sd != 1 or sh != d or (sp != page_size * ss and pages > 1) or (ss * e) % 16:
            return False
        if check_address and c.data_ptr() % 16:
            return False
        if pages * page_size >= 1 << 31:
            return False
    return True


if gluon is not None:

    @gluon.jit
    def _copy_tile(desc, slot, bar, bt_row_ptr, n_pages, j, kv_col, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   COPY: gl.constexpr):  # fmt: skip
        """TMA copies of tile ``j``'s rows of one KV head (column ``kv_col``) into ``slot``, ``COPY`` rows each (a
        page, or the whole tile where a page holds several), completing on ``bar``. Tiles past the last page
        re-read it: those keys are masked, and the block table row holds no more entries than the sequence's
        pages."""
        for c in gl.static_range(BLOCK_N // COPY):
            key = j * BLOCK_N + c * COPY
            page = gl.load(bt_row_ptr + gl.minimum(key // PAGE_SIZE, n_pages - 1))
            tma_load(desc, [page * PAGE_SIZE + key % PAGE_SIZE, kv_col], bar,
                                            slot.slice(c * COPY, COPY))  # fmt: skip

    @gluon.jit
    def _item(r, num_items):
        """The work item this program takes in round ``r`` (``num_items`` or more: none). Rounds alternate
        direction (program p takes p, then 2P - 1 - p, ...): a sequence's items come longest first, so a program
        that drew a long one draws a short one next."""
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        return r * programs + gl.where(r % 2 == 0, pid, programs - 1 - pid)

    @gluon.jit
    def _work(item, num_items, num_kv_heads, cu_seqlens_q_ptr, seq_lens_ptr, block_table_rows_ptr, num_seqs,
              num_tokens, max_pages, num_bt_rows, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
              BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_BT_ROWS: gl.constexpr):  # fmt: skip
        """Work item -> (live, first token, new tokens, query block, KV head, keys, block table row, KV tiles).
        Items map onto (query block, KV head) as the unified kernel's prefill programs do: KV heads fastest, a
        sequence's blocks last one first. An item past the grid or its sequence's blocks is not live (no tiles)."""
        BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
        item = gl.minimum(item, num_items - 1)  # (a dead item still reads in bounds)
        block_id = item // num_kv_heads
        kv_head = item % num_kv_heads
        seq = _find_seq(cu_seqlens_q_ptr, num_seqs, block_id, BLOCK_Q)
        q_start, q_len, q_block = _query_block(cu_seqlens_q_ptr, seq, block_id, num_tokens, BLOCK_Q)
        kv_len, bt_row = _sequence_keys(seq_lens_ptr, block_table_rows_ptr, seq, max_pages, num_bt_rows, PAGE_SIZE,
                                        HAS_BT_ROWS)  # fmt: skip
        kv_end = kv_len
        if IS_CAUSAL:
            last_tok = gl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
            kv_end = gl.minimum(gl.maximum(kv_len - q_len + last_tok + 1, 0), kv_len)
        return q_start, q_len, q_block, kv_head, kv_len, bt_row, gl.cdiv(kv_end, BLOCK_N)

    @gluon.jit
    def _copy_q(q_ptr, q_smem, b, q_start, q_len, q_block, kv_head, stride_q_t, stride_q_h, GROUP: gl.constexpr,
                HEAD_DIM: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """``cp.async`` copies of an item's 128 query rows (token-major: ``GROUP`` heads of each token) into
        buffer ``b``'s two consumer tiles (``q_smem[2b]``, ``q_smem[2b + 1]``, [64, D] each), by ``WARPS`` warps,
        16 bytes each; rows of tokens past the sequence are zero-filled."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
        ROWS_AT_ONCE: gl.constexpr = 8 * WARPS
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        for wg in gl.static_range(2):
            for c in gl.static_range(ROWS // ROWS_AT_ONCE):
                rows = (q_block * BLOCK_M + wg * ROWS + c * ROWS_AT_ONCE
                        + gl.arange(0, ROWS_AT_ONCE, layout=gl.SliceLayout(1, layout)))  # fmt: skip
                tok = rows // GROUP
                off = (q_start + tok).to(gl.int64) * stride_q_t + (kv_head * GROUP + rows % GROUP) * stride_q_h
                # (Rows start 16 bytes apart, ``q_layout_ok``: the copies move 16 bytes each.)
                off = gl.multiple_of(off, 8)
                cp_async_load(
                    q_smem.index(2 * b + wg).slice(c * ROWS_AT_ONCE, ROWS_AT_ONCE),
                    q_ptr + off[:, None] + cols[None, :],
                    mask=(tok < q_len)[:, None],
                )

    @gluon.jit
    def _producer(q_ptr, k_desc, v_desc, k_ptr, v_ptr, q_smem, item_smem, k_smem, v_smem, slot_ids, q_ready, q_empty,
                  k_ready, v_ready, k_empty, v_empty, block_table_ptr, block_table_rows_ptr, cu_seqlens_q_ptr,
                  seq_lens_ptr, num_seqs, num_tokens, max_pages, num_bt_rows, num_items, num_kv_heads, stride_q_t,
                  stride_q_h, stride_bt_b, stride_k_slot, stride_v_slot, GROUP: gl.constexpr,
                  HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, COPY: gl.constexpr,
                  STAGES: gl.constexpr, Q_BUFS: gl.constexpr, PRODUCER_Q: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  HAS_BT_ROWS: gl.constexpr, GATHER: gl.constexpr):  # fmt: skip
        """The producer, over the program's work items: finds each item's sequence, query block and keys, writes
        them for the consumers into one of ``Q_BUFS`` buffers, beside the item's query rows (``PRODUCER_Q``), then
        copies its K and V tiles into the ring, whose slots and phases run on across items (``t``: tiles handed
        over so far). So the consumers go from one item's last product to the next one's first without a load of
        their own. Key-by-key gathers (``GATHER``, a warpgroup) or TMA copies of whole pages (one warp)."""
        WARPS: gl.constexpr = GATHER_WARPS if GATHER else 1
        item_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        fields = gl.arange(0, ITEM_FIELDS, layout=item_layout)
        t = 0
        fixes = 0
        rounds = gl.cdiv(num_items, gl.num_programs(0)) if PRODUCER_Q else 1  # (the consumers' count)
        for r in range(rounds):
            item = _item(r, num_items)
            q_start, q_len, q_block, kv_head, kv_len, bt_row, n_tiles = _work(
                item, num_items, num_kv_heads, cu_seqlens_q_ptr, seq_lens_ptr, block_table_rows_ptr, num_seqs,
                num_tokens, max_pages, num_bt_rows, GROUP, PAGE_SIZE, BLOCK_N, IS_CAUSAL, HAS_BT_ROWS)  # fmt: skip
            live = (item < num_items) & (q_block >= 0) & (q_block * BLOCK_M // GROUP < q_len)
            n_tiles = gl.where(live, n_tiles, 0)
            b = r % Q_BUFS
            mbarrier.wait(q_empty.index(b), ((r // Q_BUFS) & 1) ^ 1)
            if PRODUCER_Q:  # noqa: SIM102 (a compile-time test, then a run-time one)
                if live:
                    _copy_q(q_ptr, q_smem, b, q_start, q_len, q_block, kv_head, stride_q_t, stride_q_h,
                            GROUP, HEAD_DIM, WARPS)  # fmt: skip
            # (live, q_start, q_len, q_block, kv_len, n_tiles, kv_head) for the consumers: visible to them through
            # the arrival below (after every producer thread's stores).
            vals = gl.where(fields == 0, live.to(gl.int32), gl.where(fields == 1, q_start, gl.where(
                fields == 2, q_len, gl.where(fields == 3, q_block, gl.where(fields == 4, kv_len, gl.where(
                    fields == 5, n_tiles, kv_head))))))  # fmt: skip
            item_smem.index(b).store(vals)
            if PRODUCER_Q:
                async_copy.mbarrier_arrive(q_ready.index(b), increment_count=False)
            thread_barrier()
            mbarrier.arrive(q_ready.index(b), count=1)
            bt_row_ptr = block_table_ptr + bt_row * stride_bt_b
            if GATHER:
                _gather_item(k_ptr, v_ptr, k_smem, v_smem, slot_ids, k_ready, v_ready, k_empty, v_empty, bt_row_ptr,
                             kv_len, kv_head * HEAD_DIM, t, n_tiles, stride_k_slot, stride_v_slot, PAGE_SIZE,
                             HEAD_DIM, BLOCK_N, STAGES)  # fmt: skip
            else:
                fixes = _tma_item(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr,
                                  kv_len, kv_head * HEAD_DIM, t, n_tiles, fixes, PAGE_SIZE, BLOCK_N, COPY,
                                  STAGES)  # fmt: skip
            t += n_tiles

    @gluon.jit
    def _tma_item(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr, kv_len, kv_col, t0,
                  n_tiles, fixes, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, COPY: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        """One item, one warp: copies the K and V tiles of keys ``[j * BLOCK_N, (j + 1) * BLOCK_N)``, j <
        ``n_tiles``, page by page into ring slots from ``t0`` on, each once both consumers have released it. A tile
        reaching past the sequence gets its V rows there zeroed (they multiply probabilities of 0, and stale cache
        slots may hold NaN); its keys are masked by the consumers. Returns the fix-ups done so far (``fixes``: the
        phase of their barrier)."""
        D: gl.constexpr = k_desc.block_type.shape[1]
        tile_bytes: gl.constexpr = BLOCK_N * D * k_desc.block_type.element_ty.primitive_bitwidth // 8
        fix_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        n_pages = gl.cdiv(kv_len, PAGE_SIZE)
        for j in range(n_tiles):
            s = (t0 + j) % STAGES
            phase = ((t0 + j) // STAGES) & 1
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            mbarrier.expect(k_ready.index(s), tile_bytes)
            _copy_tile(k_desc, k_smem.index(s), k_ready.index(s), bt_row_ptr, n_pages, j, kv_col, PAGE_SIZE, BLOCK_N,
                       COPY)  # fmt: skip
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            tail = (j + 1) * BLOCK_N > kv_len
            # (v_ready's extra barrier, at index STAGES, takes the copies of a tile to be fixed up first.)
            bar = v_ready.index(gl.where(tail, STAGES, s))
            mbarrier.expect(bar, tile_bytes)
            _copy_tile(v_desc, v_smem.index(s), bar, bt_row_ptr, n_pages, j, kv_col, PAGE_SIZE, BLOCK_N, COPY)
            if tail:
                # The last tile of an item that reaches the sequence's end (at most once per item).
                mbarrier.wait(v_ready.index(STAGES), fixes & 1)
                fixes += 1
                for r in gl.static_range(BLOCK_N // 8):
                    if j * BLOCK_N + r * 8 + 8 > kv_len:
                        rows = v_smem.index(s).slice(r * 8, 8)
                        keys = j * BLOCK_N + r * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, fix_layout))
                        vals = rows.load(fix_layout)
                        rows.store(gl.where((keys < kv_len)[:, None], vals, gl.zeros_like(vals)))
                fence_async_shared()
                thread_barrier()
                mbarrier.arrive(v_ready.index(s), count=1)
        return fixes

    @gluon.jit
    def _gather_tile(cache_ptr, slot, slot_ids, kv_col, kv_len, j, stride_slot, HEAD_DIM: gl.constexpr,
                     BLOCK_N: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """``cp.async`` copies of tile ``j``'s rows of one KV head (column ``kv_col``) into ``slot`` by ``WARPS``
        warps, ``8 * WARPS`` rows at a time, row r from cache slot ``slot_ids[r]`` (shared memory); rows at or past
        ``kv_len`` are zero-filled. Four lanes share a row (64 contiguous bytes per copy instruction) and each lane
        copies ``HEAD_DIM // 32`` 16-byte pieces of it, so a row's address and mask are computed once per lane."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
        ROWS_AT_ONCE: gl.constexpr = 8 * WARPS
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        for c in gl.static_range(BLOCK_N // ROWS_AT_ONCE):
            ids = slot_ids.slice(c * ROWS_AT_ONCE, ROWS_AT_ONCE).load(gl.SliceLayout(1, layout))
            keys = j * BLOCK_N + c * ROWS_AT_ONCE + gl.arange(0, ROWS_AT_ONCE, layout=gl.SliceLayout(1, layout))
            # Slot ids and strides are non-negative: an unsigned 32 x 32 -> 64-bit product (one multiply-add).
            off = ids.to(gl.uint32).to(gl.uint64) * stride_slot.to(gl.uint32).to(gl.uint64)
            # (Row starts are 16-byte aligned, ``layout_ok``: the copies move 16 bytes each.)
            # (kv_col is a head's first column: a multiple of D as well.)
            rows = cache_ptr + gl.multiple_of(kv_col + off.to(gl.int64, bitcast=True), 8)
            cp_async_load(
                slot.slice(c * ROWS_AT_ONCE, ROWS_AT_ONCE), rows[:, None] + cols[None, :], mask=(keys < kv_len)[:, None]
            )

    @gluon.jit
    def _gather_item(k_ptr, v_ptr, k_smem, v_smem, slot_ids, k_ready, v_ready, k_empty, v_empty, bt_row_ptr, kv_len,
                     kv_col, t0, n_tiles, stride_k_slot, stride_v_slot, PAGE_SIZE: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """One item, ``GATHER_WARPS`` warps, for pages a TMA copy per page cannot serve (``gathers``): per tile, the
        keys' cache slots from one vector load of the block table (a tile ahead) into shared memory, then
        ``cp.async`` copies of their K and V rows into ring slots from ``t0`` on, each thread's copies arriving on
        the slot's ready barrier as they complete (the producer never waits for its own copies: two tiles' K and V
        can be in flight)."""
        WARPS: gl.constexpr = GATHER_WARPS
        ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        n_pages = gl.cdiv(kv_len, PAGE_SIZE)
        keys = gl.arange(0, BLOCK_N, layout=ids_layout)
        # (Clamped at both ends: an item without keys reads its row's first entry, never the one before it.)
        page = gl.load(bt_row_ptr + gl.maximum(gl.minimum(keys // PAGE_SIZE, n_pages - 1), 0))
        for j in range(n_tiles):
            s = (t0 + j) % STAGES
            phase = ((t0 + j) // STAGES) & 1
            # Every warp is past its reads of the previous tile's slots before they are overwritten.
            thread_barrier()
            slot_ids.store(page * PAGE_SIZE + keys % PAGE_SIZE)
            thread_barrier()
            # The next tile's page ids are loaded while this one's copies are issued.
            keys += BLOCK_N
            page = gl.load(bt_row_ptr + gl.minimum(keys // PAGE_SIZE, n_pages - 1))
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            _gather_tile(k_ptr, k_smem.index(s), slot_ids, kv_col, kv_len, j, stride_k_slot, HEAD_DIM, BLOCK_N, WARPS)
            async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            _gather_tile(v_ptr, v_smem.index(s), slot_ids, kv_col, kv_len, j, stride_v_slot, HEAD_DIM, BLOCK_N, WARPS)
            async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)

    @gluon.jit
    def _scores(q_tile, k_smem, k_empty, zero_s, g, STAGES: gl.constexpr):
        """QK^T of the tile in ring position ``g``, whose K slot is ready (waited for the product, then the slot
        released)."""
        s = g % STAGES
        k_tile = k_smem.index(s)
        qk = warpgroup_mma(q_tile, k_tile.permute([1, 0]), zero_s, use_acc=False, is_async=True)
        qk, _, _ = warpgroup_mma_wait(0, deps=[qk, q_tile, k_tile])
        # Every warp of the group is past its reads of the K slot before it is handed back.
        thread_barrier()
        mbarrier.arrive(k_empty.index(s), count=1)
        return qk

    @gluon.jit
    def _softmax_step(qk, j, n_full, s_limit, s_cols, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr):
        """Online softmax in base 2 over tile ``j``'s scores: (probabilities relative to the new running max, the
        factor that moves earlier sums to it, new max, new row sums). Tiles from ``n_full`` on are masked."""
        qk = qk * qk_scale
        if j >= n_full:
            keys = j * BLOCK_N + s_cols
            qk = gl.where(keys[None, :] < s_limit[:, None], qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        # Rows that have seen no key yet keep a finite reference (exp2(-inf - -inf) would be NaN).
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(qk - m_ref[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _release(k_ready, v_ready, k_empty, v_empty, first, end, STAGES: gl.constexpr):
        """Ring positions ``[first, end)`` released unread (past every row of this warpgroup; the other one needs
        them)."""
        for g in range(first, end):
            s = g % STAGES
            phase = (g // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            mbarrier.arrive(k_empty.index(s), count=1)
            mbarrier.wait(v_ready.index(s), phase)
            mbarrier.arrive(v_empty.index(s), count=1)

    @gluon.jit
    def _row_tiles(row0, q_len, kv_len, n_tiles, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """For the 64 rows from ``row0`` (whose first token is below ``q_len``): (tiles every row sees whole, tiles
        any row sees). Keys a row may see: up to its position (bottom-right aligned causal mask), below kv_len."""
        first_tok = row0 // GROUP
        if IS_CAUSAL:
            offset = kv_len - q_len
            n_full = gl.maximum(offset + first_tok + 1, 0) // BLOCK_N
            last_tok = gl.minimum((row0 + ROWS - 1) // GROUP, q_len - 1)
            my_tiles = gl.minimum(n_tiles, gl.cdiv(gl.maximum(offset + last_tok + 1, 0), BLOCK_N))
        else:
            n_full = kv_len // BLOCK_N
            my_tiles = n_tiles
        return n_full, my_tiles

    @gluon.jit
    def _ready(bar, phase, GATHER: gl.constexpr):
        """Waits for a ring slot's copies; gathered ones (``cp.async``, written through the generic proxy) are then
        fenced for the wgmma reads, which go through the async proxy (with those of slots waited for before)."""
        mbarrier.wait(bar, phase)
        if GATHER:
            fence_async_shared()

    @gluon.jit
    def _row_offsets(row0, q_start, q_len, kv_head, stride_t, stride_h, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                     layout: gl.constexpr):  # fmt: skip
        """Element offsets of the 64 query (or output) rows from ``row0`` (token-major, ``GROUP`` heads a token), the
        columns, and which rows hold a token of the sequence. (Computed where used: kept across the KV loop they
        would take registers the accumulators need at D256.)"""
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        tok = rows // GROUP
        off = (q_start + tok).to(gl.int64) * stride_t + (kv_head * GROUP + rows % GROUP) * stride_h
        return off, gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), (tok < q_len)[:, None]

    @gluon.jit
    def _field(vals, fields, k: gl.constexpr):
        """Field ``k`` of an item's description, every thread holding all of them."""
        return gl.sum(gl.where(fields == k, vals, 0), axis=0)

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_ptr, out_ptr, q_smem, item_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  v_ready, k_empty, v_empty, num_items, qk_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  Q_BUFS: gl.constexpr, PRODUCER_Q: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  GATHER: gl.constexpr):  # fmt: skip
        """One warpgroup over the program's work items, as the producer describes them: rows ``[WG * 64, WG * 64 +
        64)`` of each item's query tile (``t``: ring positions consumed so far), copied by the producer
        (``PRODUCER_Q``) or loaded here; each q buffer is handed back once the item's products are done."""
        fields_layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])
        fields = gl.arange(0, ITEM_FIELDS, layout=fields_layout)
        t = 0
        # (A program per item runs one round, as a constant: a loop's carried state costs the D256 accumulators
        # registers, 8 -> 48 bytes of spills.)
        rounds = gl.cdiv(num_items, gl.num_programs(0)) if PRODUCER_Q else 1
        for r in range(rounds):
            b = r % Q_BUFS
            # (The q rows were copied with cp.async, through the generic proxy: fenced for the wgmma reads.)
            mbarrier.wait(q_ready.index(b), (r // Q_BUFS) & 1)
            if PRODUCER_Q:
                fence_async_shared()
            vals = item_smem.index(b).load(fields_layout)
            n_tiles = _field(vals, fields, 5)
            if _field(vals, fields, 0) != 0:
                _consumer_item(WG, q_ptr, out_ptr, q_smem.index(2 * b + WG), k_smem, v_smem, k_ready, v_ready,
                               k_empty, v_empty, _field(vals, fields, 1), _field(vals, fields, 2),
                               _field(vals, fields, 3), _field(vals, fields, 6), _field(vals, fields, 4), t, n_tiles,
                               qk_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h, GROUP, HEAD_DIM, BLOCK_N,
                               STAGES, not PRODUCER_Q, IS_CAUSAL, GATHER)  # fmt: skip
            # Every warp of the group is past its products with this q buffer (and its reads of the description).
            thread_barrier()
            mbarrier.arrive(q_empty.index(b), count=1)
            t += n_tiles

    @gluon.jit
    def _consumer_item(WG: gl.constexpr, q_ptr, out_ptr, q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                       q_start, q_len, q_block, kv_head, kv_len, t0, n_tiles, qk_scale, stride_q_t, stride_q_h,
                       stride_o_t, stride_o_h, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, LOAD_Q: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       GATHER: gl.constexpr):  # fmt: skip
        """One item's rows ``[WG * 64, WG * 64 + 64)`` of the query tile (in ``q_tile``, loaded there first with
        ``LOAD_Q``), online softmax in base 2 over its KV tiles in ring positions from ``t0`` on, output normalized
        and stored. A warpgroup without rows only releases the tiles."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        row0 = q_block * BLOCK_M + WG * ROWS
        # Token (within the sequence) of the warpgroup's first row; rows of tokens >= q_len are padding.
        first_tok = row0 // GROUP
        if first_tok >= q_len:
            _release(k_ready, v_ready, k_empty, v_empty, t0, t0 + n_tiles, STAGES)
        else:
            if LOAD_Q:
                q_off, cols, valid = _row_offsets(row0, q_start, q_len, kv_head, stride_q_t, stride_q_h, GROUP,
                                                  HEAD_DIM, io_layout)  # fmt: skip
                q_tile.store(gl.load(q_ptr + q_off[:, None] + cols[None, :], mask=valid, other=0.0))
                fence_async_shared()
            n_full, my_tiles = _row_tiles(row0, q_len, kv_len, n_tiles, GROUP, BLOCK_N, IS_CAUSAL)
            offset = kv_len - q_len
            s_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            s_limit = kv_len + 0 * s_rows
            if IS_CAUSAL:
                s_limit = gl.minimum(s_limit, offset + s_rows // GROUP + 1)
            s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
            # Tile j's QK^T and tile j-1's PV are both issued before tile j's softmax, which then runs beside the
            # PV product (wgmma groups complete in issue order: waiting for all but one leaves PV running). The
            # first tile has no PV to run beside, the last no QK^T.
            p_op = gl.zeros([ROWS, BLOCK_N], dtype, layout=p_layout)
            if my_tiles > 0:
                _ready(k_ready.index(t0 % STAGES), (t0 // STAGES) & 1, GATHER)
                qk = _scores(q_tile, k_smem, k_empty, zero_s, t0, STAGES)
                p, alpha, m_i, l_i = _softmax_step(qk, 0, n_full, s_limit, s_cols, m_i, l_i, qk_scale, BLOCK_N)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, my_tiles):
                g = t0 + j
                s = g % STAGES
                mbarrier.wait(k_ready.index(s), (g // STAGES) & 1)
                sp = (g - 1) % STAGES
                _ready(v_ready.index(sp), ((g - 1) // STAGES) & 1, GATHER)  # (one fence for both slots)
                k_tile = k_smem.index(s)
                qk = warpgroup_mma(q_tile, k_tile.permute([1, 0]), zero_s, use_acc=False, is_async=True)
                v_tile = v_smem.index(sp)
                acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
                qk, _, _ = warpgroup_mma_wait(1, deps=[qk, q_tile, k_tile])
                thread_barrier()
                mbarrier.arrive(k_empty.index(s), count=1)
                p, alpha, m_i, l_i = _softmax_step(qk, j, n_full, s_limit, s_cols, m_i, l_i, qk_scale, BLOCK_N)
                acc, _, _ = warpgroup_mma_wait(0, deps=[acc, v_tile, p_op])
                thread_barrier()
                mbarrier.arrive(v_empty.index(sp), count=1)
                # (acc now holds every tile up to j-1, relative to their running max: rescaled to tile j's.)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            if my_tiles > 0:
                last = t0 + my_tiles - 1
                _ready(v_ready.index(last % STAGES), (last // STAGES) & 1, GATHER)
                v_tile = v_smem.index(last % STAGES)
                acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(0, deps=[acc, v_tile, p_op])
                thread_barrier()
                mbarrier.arrive(v_empty.index(last % STAGES), count=1)
            # Tiles past every row of this warpgroup (the other one needs them): released unread.
            _release(k_ready, v_ready, k_empty, v_empty, t0 + my_tiles, t0 + n_tiles, STAGES)

            inv = gl.where(l_i > 0.0, 1.0 / l_i, 0.0)  # a row with no visible key writes zeros
            acc = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
            o = gl.convert_layout(acc.to(dtype), io_layout)
            o_off, cols, valid = _row_offsets(row0, q_start, q_len, kv_head, stride_o_t, stride_o_h, GROUP, HEAD_DIM,
                                              io_layout)  # fmt: skip
            gl.store(out_ptr + o_off[:, None] + cols[None, :], o, mask=valid)

    # Per-batch values are never specialized (a value of 1 would turn them into constants, and a new batch size
    # into a new compile).
    @gluon.jit(do_not_specialize=("num_seqs", "num_tokens", "max_pages", "num_bt_rows", "num_items", "stride_bt_b"))
    def _ws_prefill_kernel(q_ptr, out_ptr, k_desc, v_desc, k_ptr, v_ptr, block_table_ptr, block_table_rows_ptr,
                           cu_seqlens_q_ptr, seq_lens_ptr, qk_scale, num_seqs, num_tokens, max_pages, num_bt_rows,
                           num_items, num_kv_heads, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_bt_b,
                           stride_k_slot, stride_v_slot, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                           PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, COPY: gl.constexpr, STAGES: gl.constexpr,
                           Q_BUFS: gl.constexpr, PRODUCER_Q: gl.constexpr, IS_CAUSAL: gl.constexpr,
                           HAS_BT_ROWS: gl.constexpr, GATHER: gl.constexpr):  # fmt: skip
        # A program runs work items (query block, KV head) ``_item`` picks until ``num_items`` are done: one per SM
        # (each takes most of an SM's registers), its producer describing, and copying the query rows and first
        # KV tiles of, the next item while the consumers finish this one.
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, ROWS, HEAD_DIM], q_layout)
        item_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFS, ITEM_FIELDS],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # A TMA copy completes its barrier's phase with one arrival and the bytes; gathers, with an arrival from
        # each gathering thread once its copies land. An item's q buffer: each producer thread's copies (where it
        # copies the rows), then one arrival once the description is written; handed back by both consumers.
        PRODUCER_THREADS: gl.constexpr = 32 * (GATHER_WARPS if GATHER else 1)
        READY: gl.constexpr = PRODUCER_THREADS if GATHER else 1
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_ready.index(i), count=PRODUCER_THREADS + 1 if PRODUCER_Q else 1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=READY)
            mbarrier.init(v_ready.index(i), count=READY)
            # Both consumer warpgroups release each slot.
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(v_ready.index(STAGES), count=1)
        # The cache slots of the tile a gathering producer copies (unused by the TMA producer).
        slot_ids = gl.allocate_shared_memory(gl.int32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        fence_async_shared()

        gl.warp_specialize([
            (_consumer, (0, q_ptr, out_ptr, q_smem, item_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         k_empty, v_empty, num_items, qk_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                         GROUP, HEAD_DIM, BLOCK_N, STAGES, Q_BUFS, PRODUCER_Q, IS_CAUSAL, GATHER)),
            (_consumer, (1, q_ptr, out_ptr, q_smem, item_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         k_empty, v_empty, num_items, qk_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                         GROUP, HEAD_DIM, BLOCK_N, STAGES, Q_BUFS, PRODUCER_Q, IS_CAUSAL, GATHER)),
            (_producer, (q_ptr, k_desc, v_desc, k_ptr, v_ptr, q_smem, item_smem, k_smem, v_smem, slot_ids, q_ready,
                         q_empty, k_ready, v_ready, k_empty, v_empty, block_table_ptr, block_table_rows_ptr,
                         cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, num_tokens, max_pages, num_bt_rows, num_items,
                         num_kv_heads, stride_q_t, stride_q_h, stride_bt_b, stride_k_slot, stride_v_slot, GROUP,
                         HEAD_DIM, PAGE_SIZE, BLOCK_N, COPY, STAGES, Q_BUFS, PRODUCER_Q, IS_CAUSAL, HAS_BT_ROWS,
                         GATHER)),
        ], [4, GATHER_WARPS if GATHER else 1], [CONSUMER_REGS, GATHER_REGS if GATHER else PRODUCER_REGS])  # fmt: skip


def program_form(head_dim: int, block_n: int, stages: int, shared_limit: int, gather: bool) -> tuple[int, bool]:
    """(q buffers, whether a program per SM runs items in a loop, its producer copying the next item's q rows into
    a second buffer while the consumers finish this item) of a launch. A program per SM where two q buffers fit
    and pages come by TMA (H100: 4x2k -3%, D64 -5%); else a program per item (handed out by the hardware as SMs
    free up), whose consumers load their own q rows into its one buffer: with one q buffer (D256) the loop cost
    5%, and pages of 1 (a gathering producer also copying the q rows) ran 4% slower."""
    per_sm = q_buffers(head_dim, block_n, stages, shared_limit) == 2 and not gather
    return (2 if per_sm else 1), per_sm


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory bytes a program may use) of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count, configs.max_shared_memory(index)


def _descriptor(cache: torch.Tensor, rows: int, layout) -> TensorDescriptor:
    """The cache as a 2-D [slots, heads x D] tensor, copied in blocks of ``rows`` slots x one head's D."""
    pages, page_size, heads, d = cache.shape
    return TensorDescriptor(cache, [pages * page_size, heads * d], [cache.stride(1), 1], [rows, d], layout)


@dataclasses.dataclass
class WsLaunch:
    """What a launch's metadata fixes (grid, scalars, constexprs, the copies' shared layout), computed once per
    metadata; a call builds the two descriptors (the caches' addresses) and launches."""

    grid: tuple[int, int]
    rows: int  # KV rows per TMA copy (the ring's layout unit where the producer gathers)
    layout: object  # the copies' NVMMA shared layout
    scalars: tuple  # the kernel's arguments after the tensors, in order, up to the caches' slot strides
    constexprs: dict

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            block_table_rows: torch.Tensor | None, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
            out: torch.Tensor) -> None:  # fmt: skip
        """Launch on tensors with the metadata prepared from (caches at 16-byte aligned addresses): writes
        ``out`` [T, Hq, D]."""
        _ws_prefill_kernel[self.grid](
            q, out, _descriptor(k_cache, self.rows, self.layout), _descriptor(v_cache, self.rows, self.layout),
            k_cache, v_cache, block_table, block_table_rows if block_table_rows is not None else block_table,
            cu_seqlens_q, seq_lens, *self.scalars, k_cache.stride(1), v_cache.stride(1), **self.constexprs,
        )  # fmt: skip


def prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    *,
    has_rows: bool,
    num_seqs: int,
    scale: float,
    causal: bool,
    block_n: int,
    stages: int,
) -> WsLaunch:
    """The launch of validated arguments that fit (``shape_ok``, ``layout_ok``, ``q_layout_ok``), from their
    metadata. Work items: ``T // (128 // GROUP) + B`` query blocks x KV heads; programs: one per SM (or per item
    where there are fewer) or one per item (shapes and the device only: CUDA-graph safe)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    copies = copy_constexprs(page_size, block_n)
    rows = copies["COPY"]
    dtype = gl.bfloat16 if k_cache.dtype == torch.bfloat16 else gl.float16
    num_items = (num_tokens // (TILE_ROWS // group) + num_seqs) * num_kv_heads
    sms, shared_limit = _device_limits(q.device)
    q_bufs, persistent = program_form(head_dim, block_n, stages, shared_limit, copies["GATHER"])
    scalars = (scale * LOG2E, num_seqs, num_tokens, block_table.shape[1], block_table.shape[0], num_items,
               num_kv_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0))  # fmt: skip
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=block_n, **copies, STAGES=stages,
                      Q_BUFS=q_bufs, PRODUCER_Q=persistent, IS_CAUSAL=causal,
                      HAS_BT_ROWS=has_rows, num_warps=4, enable_fp_fusion=True)  # fmt: skip
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], dtype)
    grid = (min(num_items, sms) if persistent else num_items,)
    return WsLaunch(grid, rows, layout, scalars, constexprs)
