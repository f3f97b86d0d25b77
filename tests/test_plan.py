"""The split-KV planner: a pure function of shapes and host-side bounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from triton_paged_ops.plan import (
    MAX_SPLIT_Q_LEN,
    MAX_SPLITS,
    MAX_WAVES,
    SPLIT_WORKSPACE_BYTES,
    forced_split_plan,
    plan_splits,
)


@given(
    num_seqs=st.integers(1, 1024),
    num_kv_heads=st.sampled_from((1, 2, 4, 8, 16)),
    max_seqlen_q=st.integers(1, 64),
    max_seqlen_k=st.integers(0, 200_000),
    block_n=st.sampled_from((16, 32, 64, 128)),
    num_sms=st.sampled_from((78, 108, 132, 304)),
)
def test_plan_covers_every_key_with_whole_tiles(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, block_n, num_sms):
    block_q = 8
    plan = plan_splits(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, block_n, num_sms, block_q=block_q,
                       token_bytes=32 * 129 * 4)  # fmt: skip
    assert 1 <= plan.num_splits <= MAX_SPLITS
    if plan.num_splits > 1:
        if max_seqlen_q > MAX_SPLIT_Q_LEN:
            # Long queries split only while their tiles fill at most half the SMs, to at most two programs per SM.
            blocks = num_seqs * -(-max_seqlen_q // block_q) * num_kv_heads
            assert 2 * blocks <= num_sms and blocks * plan.num_splits <= 2 * num_sms
            assert plan.num_splits * num_seqs * max_seqlen_q * 32 * 129 * 4 <= SPLIT_WORKSPACE_BYTES
        else:
            assert num_seqs * num_kv_heads * plan.num_splits <= max(MAX_WAVES * num_sms * 4, num_seqs * num_kv_heads)
        assert plan.segment_len % block_n == 0
        # Every key below the bound falls in some segment, and no segment is wholly past the bound.
        assert plan.num_splits * plan.segment_len >= max_seqlen_k
        assert (plan.num_splits - 1) * plan.segment_len < max_seqlen_k


def test_plan_fills_the_gpu_only_when_needed():
    small = plan_splits(1, 8, 1, 32768, 64, 132)  # 8 programs without splitting
    assert small.num_splits >= 32
    big = plan_splits(256, 8, 1, 2048, 64, 132)  # 2048 programs already
    assert big.num_splits == 1
    ragged = plan_splits(96, 8, 1, 8192, 64, 132)  # enough programs, but the longest rows would finish last
    assert ragged.num_splits >= 4
    prefill = plan_splits(1, 8, 512, 32768, 64, 132, block_q=32)  # 16 query blocks x 8 KV heads already
    assert prefill.num_splits == 1
    chunk = plan_splits(1, 8, 64, 16384, 64, 132, block_q=32)  # 2 query blocks x 8 KV heads over a long prefix
    assert chunk.num_splits == 16
    short = plan_splits(4, 8, 1, 500, 64, 132)  # under two of the shortest segments: not worth a merge
    assert short.num_splits == 1
    # A CUDA graph's context bound is the whole pool: a full batch is not split 64 ways by it.
    pool = plan_splits(256, 8, 1, 1 << 20, 64, 132)
    assert pool.num_splits * 256 * 8 <= MAX_WAVES * 132 * 4 and pool.num_splits < MAX_SPLITS


def test_a_grid_just_short_of_its_slots_is_not_doubled():
    # 32 sequences x 8 KV heads: 256 programs for 132 SMs x 2 slots.
    args = (32, 8, 1, 4096, 128, 132)
    assert plan_splits(*args, programs_per_sm=2, max_segment=4096).num_splits == 2
    assert plan_splits(*args, programs_per_sm=2, max_segment=4096, fill_percent=90).num_splits == 1
    # Half the slots: split either way.
    assert plan_splits(16, 8, 1, 4096, 128, 132, programs_per_sm=2, max_segment=4096, fill_percent=90).num_splits == 2


@given(
    num_seqs=st.integers(1, 512),
    num_kv_heads=st.sampled_from((1, 2, 8)),
    max_seqlen_k=st.integers(1, 100_000),
    programs_per_sm=st.integers(1, 4),
    fill_percent=st.integers(1, 100),
)
def test_a_lower_fill_share_never_adds_segments(num_seqs, num_kv_heads, max_seqlen_k, programs_per_sm, fill_percent):
    """``fill_percent`` only lowers the fill target: never more segments than with the whole slots, and a grid whose
    unsplit programs already fill that share of the slots is not split (no other reason to split here: segments
    have no upper bound)."""
    kw = {"programs_per_sm": programs_per_sm, "max_segment": 1 << 20, "fill_segment": 1 << 20, "min_segment": 128}
    part = plan_splits(num_seqs, num_kv_heads, 1, max_seqlen_k, 128, 132, fill_percent=fill_percent, **kw)
    whole = plan_splits(num_seqs, num_kv_heads, 1, max_seqlen_k, 128, 132, **kw)
    assert part.num_splits <= whole.num_splits
    if 100 * num_seqs * num_kv_heads >= 132 * programs_per_sm * fill_percent:
        assert part.num_splits == 1


@given(num_splits=st.integers(1, 100), max_seqlen_k=st.integers(0, 100_000), block_n=st.sampled_from((16, 64)))
def test_forced_plan_respects_tiles(num_splits, max_seqlen_k, block_n):
    plan = forced_split_plan(num_splits, max_seqlen_k, block_n)
    assert plan.num_splits <= max(1, num_splits)
    if plan.num_splits > 1:
        assert plan.segment_len % block_n == 0 and plan.num_splits * plan.segment_len >= max_seqlen_k


@given(
    num_seqs=st.integers(1, 64),
    num_kv_heads=st.sampled_from((1, 2, 8)),
    max_seqlen_k=st.integers(1, 40_000),
    block_n=st.sampled_from((32, 64, 128)),
    num_sms=st.sampled_from((78, 132, 304)),
)
def test_a_grid_short_of_the_sms_takes_shorter_segments(num_seqs, num_kv_heads, max_seqlen_k, block_n, num_sms):
    """Decode grids with fewer programs than SMs (a lone program is latency-bound) cut segments down to
    ``fill_segment`` keys until there are about two programs per SM; grids that fill the SMs keep the usual
    ``min_segment`` floor."""
    base = num_seqs * num_kv_heads
    plan = plan_splits(num_seqs, num_kv_heads, 1, max_seqlen_k, block_n, num_sms, fill_segment=256)
    usual = plan_splits(num_seqs, num_kv_heads, 1, max_seqlen_k, block_n, num_sms, fill_segment=1 << 30)
    programs = base * plan.num_splits
    if base * usual.num_splits >= num_sms:
        assert plan == usual
        return
    assert plan.num_splits >= usual.num_splits
    if plan.num_splits > usual.num_splits:
        # No segment shorter than the floor (rounded up to whole tiles), and no more programs than two per SM
        # need, give or take the rounding of the segment to whole tiles.
        assert plan.segment_len >= min(256, max_seqlen_k)
        assert base * (plan.num_splits - 1) < 2 * num_sms
    else:
        # Not split further: already two programs per SM, or the keys do not make two segments of the floor.
        assert programs >= 2 * num_sms or max_seqlen_k // 256 <= usual.num_splits or usual.num_splits == MAX_SPLITS
