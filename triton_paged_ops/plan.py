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
# Queries up to this long per sequence (decode, speculative verification) are the short-query regime; longer ones
# split only when their query blocks cannot fill the GPU once (e.g. a small chunk or a cascade's queries over a long
# prefix), within SPLIT_WORKSPACE_BYTES.
MAX_SPLIT_Q_LEN = 16


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
            # 23.5 us at 4 segments, 10.2 at 16; NOTES v19).
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


def num_sms_of(device: torch.device) -> int:
    """Streaming multiprocessors (or compute units) of ``device``; a nominal 132 elsewhere (interpreter runs)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


def num_sms_at(device_index: int | None) -> int:
    """``num_sms_of`` the CUDA device ``device_index``; None: the nominal count (CPU tensors, interpreter runs)."""
    return num_sms_of(torch.device("cuda", device_index) if device_index is not None else torch.device("cpu"))


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
    programs: int = 2,
    tiles: int = 0,
    num_sms: int = 132,
) -> SplitPlan:
    """Batch-invariant mode: a row's keys always fall into segments of ``segment_len`` from key 0, each the fold of
    ``leaves`` equal leaves. Short queries run one segment per program (a bounded count and workspace of
    ``max_tokens * token_bytes`` per segment; the sequential reduce folds them), or one leaf per program where
    ``tiles`` (query tiles x KV heads) times the segments would leave some of the ``num_sms`` SMs idle
    (``programs`` 2; 3: whenever split, 1: never; the reduce then folds each segment's leaves first); other queries
    fold all of a row's segments in one program. Only who computes what varies, never the arithmetic."""
    n = -(-max_seqlen_k // segment_len)
    leaf_len = segment_len // leaves
    n_leaves = -(-max_seqlen_k // leaf_len)
    fits = n_leaves * max_tokens * token_bytes <= SPLIT_WORKSPACE_BYTES and n_leaves <= MAX_INVARIANT_SPLITS
    by_leaf = leaves > 1 and max_seqlen_q <= MAX_SPLIT_Q_LEN and n_leaves > 1 and fits
    by_leaf = by_leaf and (programs == 3 or (programs == 2 and tiles * n < num_sms))
    if by_leaf:
        return SplitPlan(n_leaves, leaf_len)
    split = max_seqlen_q <= MAX_SPLIT_Q_LEN and 1 < n <= MAX_INVARIANT_SPLITS
    split = split and n * max_tokens * token_bytes <= SPLIT_WORKSPACE_BYTES
    return SplitPlan(n if split else 1, segment_len)
