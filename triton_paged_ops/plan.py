"""Host-side planning: how many KV segments each (query block, KV head) of a batch is cut into.

Decode reads each sequence's whole KV once; with few sequences there are too few (sequence, KV head) programs to
keep every SM's memory pipeline busy, so the KV range is cut into segments ("split-KV") processed by separate
programs and merged exactly afterwards. The plan depends on shapes and host-side bounds only (batch size, heads,
``max_seqlen_k``, SM count) — never on device data — so it is fixed for a CUDA-graph capture and replays correctly
with any lengths below the bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from triton_paged_ops import configs
from triton_paged_ops.configs import MAX_SPLIT_Q_LEN
from triton_paged_ops.configs.heuristic import override_key, select_attention_config
from triton_paged_ops.kernels import hopper
from triton_paged_ops.kernels.merge import dependent_launch_supported

MAX_SPLITS = 64
# Short queries: at most this many times the programs that fill the GPU (split programs past a sequence's end exit
# at once, but each still costs a launch slot).
MAX_WAVES = 16
# Batch-invariant mode: keys per fixed KV segment (default), and the most segments it splits across programs; past
# that one program folds all of a row's segments (same bits, less parallel).
INVARIANT_SEGMENT = 1024
# Leaves per fixed segment (batch-invariant mode): small batches run one program per leaf.
INVARIANT_LEAVES = 4
MAX_INVARIANT_SPLITS = 256
# The most split-KV workspace a plan allocates per call where it depends on the token count (batch-invariant short
# queries, long queries; the default short-query plan's worst case is 64 splits of 256 sequences x 32 heads x 128
# dims in fp32): past it, batch-invariant mode folds in one program and long queries split less.
SPLIT_WORKSPACE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """``num_splits`` segments of ``segment_len`` keys each (a multiple of the KV tile); 1 means no split."""

    num_splits: int
    segment_len: int


def plan_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_n: int,
    num_sms: int,
    programs_per_sm: int = 4,
    min_segment: int = 1024,
    max_segment: int = 2048,
    fill_segment: int = 256,
    fill_percent: int = 100,
    *,
    block_q: int = 1,
    token_bytes: int = 0,
) -> SplitPlan:
    """Choose the KV segment length so that the programs (query blocks x KV heads x segments) fill the GPU.

    Short queries (decode): ``num_seqs * num_kv_heads * splits`` programs, ``programs_per_sm`` per SM, split until
    they fill ``fill_percent`` of those slots. Segments are
    at least ``min_segment`` keys (shorter loops are dominated by their start-up latency and the merge), and at most
    ``max_segment`` keys so that in a ragged batch the few longest sequences are spread over several programs
    instead of finishing last; sequences shorter than ``max_seqlen_k`` simply use fewer segments (their other
    programs exit at once). A grid that would still hold fewer programs than SMs (one or a few short sequences)
    takes shorter segments, down to ``fill_segment`` keys, until there are two per SM.

    Longer queries (``block_q`` query tokens per program) split only while their query blocks fill at most half
    the SMs, up to two programs per SM, and only as far as a workspace of ``token_bytes`` per query token and
    segment stays within ``SPLIT_WORKSPACE_BYTES``.
    """
    if max_seqlen_k <= 0:
        return SplitPlan(1, 0)
    by_length = max(1, max_seqlen_k // min_segment)
    if max_seqlen_q > MAX_SPLIT_Q_LEN:
        base = num_seqs * -(-max_seqlen_q // max(1, block_q)) * num_kv_heads
        splits = min(2 * num_sms // base, by_length, MAX_SPLITS) if 2 * base <= num_sms else 1
        if token_bytes:
            splits = min(splits, SPLIT_WORKSPACE_BYTES // (num_seqs * max_seqlen_q * token_bytes))
    else:
        base = max(1, num_seqs * num_kv_heads)
        # Enough segments that the programs fill ``fill_percent`` of the SMs' program slots: a grid just short of
        # them (B32 x 8 KV heads: 256 of 264) would otherwise double its programs for the last few slots.
        fill_target = num_sms * programs_per_sm * fill_percent  # (in hundredths of a program)
        want = max(-(-fill_target // (100 * base)), -(-max_seqlen_k // max_segment))
        # A loose context bound (a CUDA graph's is the whole pool) must not multiply the programs of a batch that
        # already fills the GPU: at most MAX_WAVES times the programs that fill it, counting empty ones.
        splits = min(want, by_length, MAX_SPLITS, max(1, MAX_WAVES * num_sms * programs_per_sm // base))
        plan = _segments(max_seqlen_k, splits, block_n)
        if base * plan.num_splits < num_sms:
            # Idle SMs, and programs that each run alone on one: a lone program is latency-bound (its next tile's
            # loads start when the current tile's math ends: ~2 us per 128-key tile on an H200), so shorter
            # segments pay although each adds a merge: up to two programs per SM (1 x 4096 keys, 8 KV heads:
            # 23.5 us at 4 segments, 10.2 at 16).
            fill = _segments(max_seqlen_k, min(-(-2 * num_sms // base), max_seqlen_k // fill_segment, MAX_SPLITS),
                             block_n)  # fmt: skip
            if fill.num_splits > plan.num_splits:
                return fill
        return plan
    return _segments(max_seqlen_k, splits, block_n)


def _segments(max_seqlen_k: int, splits: int, block_n: int) -> SplitPlan:
    """About ``splits`` segments of whole ``block_n``-key tiles covering ``max_seqlen_k`` keys (rounding may drop
    one or more: no segment lies wholly past the bound)."""
    if splits <= 1:
        return SplitPlan(1, 0)
    segment = -(-max_seqlen_k // splits)
    segment = -(-segment // block_n) * block_n
    return SplitPlan(-(-max_seqlen_k // segment), segment)


def key_bound(max_seqlen_k: int) -> int:
    """``max_seqlen_k`` rounded up to a multiple of 1/32 of the next power of two (of 256 keys at least): the bound an
    eager call plans with, so that a decode loop, whose ``max_seqlen_k`` grows by one each step, reuses one
    prepared launch for 256 steps or more instead of planning every step (a new plan costs ~10 calls' host time).
    Any bound at least the true maximum gives the same outputs (kernels read each sequence's length from
    ``seq_lens``); past 4096 keys this one adds at most 1/16 to the planned keys, below that at most 255."""
    # (Per eager call: integer operations only. Up to 8192 keys 1/32 of the next power of two is at most 256.)
    if max_seqlen_k <= 8192:
        return max_seqlen_k if max_seqlen_k <= 0 else (max_seqlen_k + 255) & -256
    step = 1 << ((max_seqlen_k - 1).bit_length() - 5)
    return (max_seqlen_k + step - 1) & -step


def forced_split_plan(num_splits: int, max_seqlen_k: int, block_n: int) -> SplitPlan:
    """The plan for a caller-chosen split count (tuning, tests); segments stay multiples of ``block_n``."""
    return SplitPlan(1, 0) if max_seqlen_k <= 0 else _segments(max_seqlen_k, num_splits, block_n)


def invariant_split_plan(
    max_seqlen_q: int,
    max_seqlen_k: int,
    segment_len: int,
    max_tokens: int = 1,
    token_bytes: int = 0,
    leaves: int = 1,
    tiles: int = 0,
    num_sms: int = 132,
) -> SplitPlan:
    """Batch-invariant mode: a row's keys always fall into segments of ``segment_len`` from key 0, each the fold of
    ``leaves`` equal leaves. Short queries run one segment per program (a bounded count and workspace of
    ``max_tokens * token_bytes`` per segment; the sequential reduce folds them), or one leaf per program where
    ``tiles`` (query tiles x KV heads) times the segments would leave some of the ``num_sms`` SMs idle (the reduce
    then folds each segment's leaves first); other queries fold all of a row's segments in one program. Only who
    computes what varies, never the arithmetic."""
    n = -(-max_seqlen_k // segment_len)
    leaf_len = segment_len // leaves
    n_leaves = -(-max_seqlen_k // leaf_len)
    fits = n_leaves * max_tokens * token_bytes <= SPLIT_WORKSPACE_BYTES and n_leaves <= MAX_INVARIANT_SPLITS
    by_leaf = leaves > 1 and max_seqlen_q <= MAX_SPLIT_Q_LEN and n_leaves > 1 and fits
    by_leaf = by_leaf and tiles * n < num_sms
    if by_leaf:
        return SplitPlan(n_leaves, leaf_len)
    split = max_seqlen_q <= MAX_SPLIT_Q_LEN and 1 < n <= MAX_INVARIANT_SPLITS
    split = split and n * max_tokens * token_bytes <= SPLIT_WORKSPACE_BYTES
    return SplitPlan(n if split else 1, segment_len)


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
        num_sms = configs.num_sms_at(device_index)
        tiles = num_seqs * num_kv_heads * -(-max_seqlen_q // block_q)
        return invariant_split_plan(max_seqlen_q, max_seqlen_k, cfg["invariant_segment"], num_seqs * max_seqlen_q,
                                    token_bytes, cfg.get("invariant_leaves", 1), tiles, num_sms)  # fmt: skip
    if "num_splits" in cfg:
        return forced_split_plan(cfg["num_splits"], max_seqlen_k, cfg["BLOCK_N"])
    policy = {k: cfg[k] for k in configs.SPLIT_KEYS if k in cfg}
    num_sms = configs.num_sms_at(device_index)
    return plan_splits(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, cfg["BLOCK_N"], num_sms, **policy,
                       block_q=block_q, token_bytes=token_bytes)  # fmt: skip


def workspace_token_bytes(num_q_heads: int, head_dim_v: int) -> int:
    """Split-KV workspace per query token and segment: fp32 partial outputs and log-sum-exps."""
    return num_q_heads * (head_dim_v + 1) * 4


# Small ints naming (constexprs, options) pairs: the short launch path keys compiled kernels with them.
_KERNEL_IDS: dict[tuple, int] = {}


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
    # The warp-specialized sm_90 prefill kernel's (KV tile width, stages) where the launch takes it
    # (``kernels.hopper``; None: the unified kernel).
    ws: tuple[int, int] | None = None

    def variant(self) -> tuple:
        """What selects a compiled kernel variant (given fixed tensor layouts): constexprs and launch options."""
        # The sequential reduce of batch-invariant mode has one variant for every split count.
        bucket = 0 if self.batch_invariant else triton.next_power_of_2(self.split.num_splits)
        reduce = (self.split.num_splits > 1, bucket)
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
    narrow_offsets: bool = True,
    decode_tail: int = -1,
) -> LaunchPlan:
    """The host-side decisions of a launch (tiles, split plan, constexprs) from host values only; also used by
    warm-up to enumerate the variants a serving configuration can reach. ``narrow_offsets``: whether every element
    of the caches lies below 2^31 (``narrow_offsets_ok``); ``decode_tail``: the caller's hint, or its sign (> 0: the
    batch ends in one-token sequences; 0: it holds none; -1: not known)."""
    return _cached_launch_plan(
        override_key(), num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, dtype,
        cache_dtype, num_seqs, max_seqlen_q, max_seqlen_k, causal, window_left, softcap, has_alibi, has_sinks,
        has_k_scale, has_v_scale, has_rows, want_lse, device_index, interpret, batch_invariant, narrow_offsets,
        min(decode_tail, 1),
    )  # fmt: skip


# Per call the plan is a pure function of a few host values: caching it saves tens of µs of Python per launch.
# The active override is part of the key; configs.reload() (new tables) clears it.
@functools.lru_cache(maxsize=4096)
def _cached_launch_plan(
    override: tuple, num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, dtype, cache_dtype, num_seqs,
    max_seqlen_q, max_seqlen_k, causal, window_left, softcap, has_alibi, has_sinks, has_k_scale, has_v_scale,
    has_rows, want_lse, device_index, interpret, batch_invariant, narrow_offsets, decode_tail,
) -> LaunchPlan:  # fmt: skip
    group = num_q_heads // num_kv_heads
    head_dim_pad = configs.padded_head_dim(head_dim)
    # A prefill launch said to hold no one-token sequence takes the table's ``prompts`` entry (on the H200 16-warp
    # programs, which cost a mixed batch's one-token rows more than they save its prompts).
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
    # The reduce kernel as a programmatic dependent launch where the device has it (its launch overlaps this one's
    # tail).
    pdl = dependent_launch_supported(None if interpret else device_index)
    dependent = split.num_splits > 1 and pdl
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
        DECODE_ORDER=cfg["decode_order"], CLAMP_PAGES=cfg["clamp_pages"],
        # 32-bit K/V offsets where the caches allow them: ~9% fewer instructions per page-16 prefill tile.
        NARROW_OFFSETS=narrow_offsets,
        # (Only over pages of 16+ keys: at page 1 the H200's 4x2k prompts ran 5% slower with it; and only where the
        # third stage of K/V buffers that it brings fits: D256 tiles would need 262 KB.)
        IDS_AHEAD=(cfg["ids_ahead"] and block_q > 1 and page_size >= 16
                   and (interpret or _third_stage_fits(cfg, head_dim, head_dim_v, cache_dtype.itemsize,
                                                       device_index))),  # fmt: skip
        LAUNCH_DEPENDENTS=dependent,
        # This kernel itself a dependent launch of the one before it on the stream (its programs resident as that
        # one drains, waiting for its end before any memory access).
        WAIT_PRIOR=pdl,
        SKIP_EMPTY_SEGMENTS=0 if split.num_splits == 1 else 2 if batch_invariant else 1,
        # A batch the caller says ends in one-token sequences: their query blocks alternate with the others' (the
        # map reads where they start from the hint; a tail beside other work needs two sequences at least). H200:
        # the mixed batch -3.2%; finding the tail without the hint cost launches of several prompts 0.5-2.5%.
        MIXED_ORDER=(decode_tail > 0 and cfg["SMALL_M"] > 0 and not one_block and split.num_splits == 1
                     and num_seqs > 1),  # fmt: skip
        PAGE_IDS=cfg["page_ids"],
        # (Only where the kernel takes it: other launches keep one variant. Not in batch-invariant mode: a row's
        # bits there must not depend on how ptxas compiled one loop form or the other.)
        DIAG_LOOP=(cfg["diag_loop"] if block_q > 1 and causal and window_left < 0 and cfg["clamp_pages"]
                   and not batch_invariant else "separate"),
    )  # fmt: skip
    # FP fusion (a * b + c as one fma) named on every launch: the kernels were measured and their bits pinned with it
    # on, and Triton's default for it changes (off from 3.10).
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": True}
    if pdl:
        options["launch_pdl"] = True
    if "maxnreg" in cfg and not interpret and device_index is not None and not configs.device_is_amd(device_index):
        # A register cap lets two 8-warp programs share an SM (128 registers per thread), at the price of spills.
        options["maxnreg"] = cfg["maxnreg"]
    if batch_invariant and (softcap > 0.0 or has_alibi):
        # The cap and the ALiBi term put a product in front of the softmax's subtraction; without contraction the
        # compiler cannot fuse such a pair into one fma in one variant and not in another. (The last-bit differences
        # once seen with them on an H200 came from the fp16 tile height, fixed above; this stays as a guard.)
        options["enable_fp_fusion"] = False
    kernel_id = _KERNEL_IDS.setdefault((tuple(constexprs.items()), tuple(options.items())), len(_KERNEL_IDS))
    # The warp-specialized kernel takes what it was measured on: prefill without split, window, cap, ALiBi, sinks,
    # scales or lse, on an sm_90 device, in shapes it covers.
    ws = None
    ws_asked = (cfg["ws_prefill"] and not interpret and max_seqlen_q > 1 and not batch_invariant
                and split.num_splits == 1 and window_left < 0 and softcap == 0.0
                and not (has_alibi or has_sinks or has_k_scale or has_v_scale or want_lse))  # fmt: skip
    if ws_asked and hopper.available(device_index) and hopper.shape_ok(
        group=group, head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size, block_n=cfg["ws_block_n"],
        stages=cfg["ws_stages"], dtype=dtype, cache_dtype=cache_dtype,
        shared_limit=configs.max_shared_memory(device_index),
    ):  # fmt: skip
        ws = (cfg["ws_block_n"], cfg["ws_stages"])
    return LaunchPlan(cfg, split, block_q, one_block, constexprs, cache_dtype, batch_invariant, options, kernel_id,
                      ws)  # fmt: skip


def _chunked_rows_ok(cfg: dict, num_splits: int, dtype: torch.dtype, cache_dtype: torch.dtype, window_left: int,
                     softcap: float, has_alibi: bool, has_scales: bool) -> bool:  # fmt: skip
    """Whether a launch's one-token rows cut their KV tiles into one run per warp (each run its own online softmax,
    merged at the end: 2 CTA barriers per tile instead of ~9; H200: the mixed batch 730 -> 705 µs): 16-bit caches
    of the query's dtype, no window, cap, ALiBi or scales, no split (a segment edge would fall inside a run), and
    runs of at least 16 keys (a tensor-core product's K)."""
    return (cfg["SMALL_M"] > 0 and num_splits == 1 and cache_dtype == dtype
            and dtype in (torch.float16, torch.bfloat16) and window_left < 0 and softcap == 0.0 and not has_alibi
            and not has_scales and cfg["SMALL_N"] // cfg["num_warps"] >= 16)  # fmt: skip


def _third_stage_fits(cfg: dict, head_dim: int, head_dim_v: int, itemsize: int, device_index: int | None) -> bool:
    """Whether a tall-tile config's K/V buffers fit the device's shared memory with one pipeline stage more than it
    names (``ids_ahead``: the page ids' loads then take no stage, and the copies run a tile further ahead): a K and
    a V tile per stage plus the q tile, and under 1 KB more (sm_90 with Triton 3.6 and 3.7, from ptxas)."""
    if device_index is None:
        return False
    tiles = cfg["num_stages"] * cfg["BLOCK_N"] * (head_dim + head_dim_v) + cfg["BLOCK_M"] * head_dim
    return tiles * itemsize + 1024 <= configs.max_shared_memory(device_index)


def narrow_offsets_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether every element of both caches lies below 2^31 elements from its base (checked strides are
    non-negative), so that in-range K/V offsets fit 32 bits."""
    return all(sum((n - 1) * st for n, st in zip(c.shape, c.stride())) < 1 << 31 for c in (k_cache, v_cache))


def compiler_refusal(config: dict, device_index: int | None) -> str | None:
    """Why the installed Triton cannot compile a launch with ``config`` for CUDA device ``device_index``, if it
    cannot: Triton 3.6 and 3.7 crash compiling tiles of 64+ query rows for Blackwell (sm_100 and newer, whose
    tensor-memory products those tiles take; "PassManager::run failed" in TritonNvidiaGPUOptimizeTMemLayoutsPass),
    fixed in 3.8 (every reachable variant compiles there, ``tests/compile_matrix.py``)."""
    installed = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if device_index is None or config["BLOCK_M"] < 64 or installed >= (3, 8):
        return None
    if configs.device_is_amd(device_index) or int(configs.device_identity(device_index)[1].split(".")[0]) < 10:
        return None
    return (
        f"Triton {triton.__version__} cannot compile attention tiles of {config['BLOCK_M']} query rows for this GPU "
        "(sm_100 or newer; the compiler crashes): install triton>=3.8"
    )


configs.on_reload(_cached_launch_plan.cache_clear)
