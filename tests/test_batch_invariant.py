"""Batch-invariant mode: a sequence's output bits do not depend on its batch, its bounds, the split plan, or
whether its tokens run as one prefill chunk or as decode steps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import configs, reference
from triton_paged_ops.configs.heuristic import attention_config_override
from triton_paged_ops.plan import attention_launch_plan

from .strategies import Spec, build
from .test_attention import DEVICE, DTYPES, assert_close_to_reference

ON_CPU = DEVICE == "cpu"
# Keys per sequence at most: past a few segments on the interpreter (its cost is per KV tile), several on a GPU.
MAX_CTX = 1100 if ON_CPU else 9000


@st.composite
def cases(draw):
    # Small KV tiles and segments reach many segment edges with few keys; otherwise the real defaults.
    small = draw(st.booleans())
    max_ctx = MAX_CTX // 4 if small else MAX_CTX
    target_q = draw(st.one_of(st.just(1), st.integers(1, 16), st.integers(17, 64 if ON_CPU else 700)))
    target_ctx = draw(st.integers(0, max_ctx))
    mates = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, max_ctx)), max_size=3))
    where = draw(st.integers(0, len(mates)))
    q_lens = [q for q, _ in mates]
    kv_lens = [q + c for q, c in mates]
    q_lens.insert(where, target_q)
    kv_lens.insert(where, target_q + target_ctx)
    tiles = None
    if small:
        block_n = draw(st.sampled_from((16, 32)))
        tiles = {"BLOCK_N": block_n, "invariant_segment": block_n * draw(st.integers(1, 4))}
    page_size = draw(st.sampled_from((1, 3, 16, 64)))
    slack_pages = draw(st.integers(0, 3))
    spec = Spec(
        q_lens=q_lens, kv_lens=kv_lens, pad_tokens=draw(st.sampled_from((0, 3))), page_size=page_size,
        num_kv_heads=draw(st.sampled_from((1, 2))), group=draw(st.sampled_from((1, 4, 5, 16, 48, 128))),
        head_dim=draw(st.sampled_from((64, 128))), head_dim_v=0, dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.booleans()), window_left=draw(st.one_of(st.just(-1), st.integers(0, 400))),
        softcap=draw(st.sampled_from((0.0, 0.0, 20.0))), use_alibi=draw(st.booleans()), use_sinks=draw(st.booleans()),
        use_kv_scale=draw(st.booleans()), scale=0.1, strided=False, spare_pages=1, extra_cols=slack_pages,
        tiles=None, seed=draw(st.integers(0, 2**31 - 1)), fp8_cache=draw(st.sampled_from((False, False, True))),
    )  # fmt: skip
    spec.head_dim_v = spec.head_dim
    # Looser bounds in the batch: more segments (split count) and, past 16 tokens, the one-program fold path.
    return spec, where, tiles, slack_pages * page_size, draw(st.integers(0, 40))


def _override(tiles):
    return attention_config_override(**tiles) if tiles else contextlib.nullcontext()


def _alone(p, b, rows: slice, seq_len: int, kv_bound: int, tiles):
    """Rows ``rows`` of sequence ``b`` as a batch of their own, with ``seq_len`` keys (bounds exact)."""
    lo = int(p.cu_seqlens_q[b])
    q = p.q[lo + rows.start : lo + rows.stop]
    n = q.shape[0]
    out = torch.full((n, q.shape[1], p.v_cache.shape[-1]), float("nan"), dtype=q.dtype, device=DEVICE)
    lse = torch.full((n, q.shape[1]), float("nan"), device=DEVICE)
    with _override(tiles):
        tpa.paged_attention_out(
            q, p.k_cache, p.v_cache, p.block_table[b : b + 1], torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            torch.tensor([seq_len], dtype=torch.int32, device=DEVICE), n, kv_bound, p.spec.scale, **p.kwargs,
            batch_invariant=True, out=out, lse=lse,
        )  # fmt: skip
    return out, lse


# Each example compiles a few new kernel variants (its features and regimes): compile time, not run time, bounds
# how many fit a GPU run.
@settings(max_examples=min(40, max(10, settings.default.max_examples // 2)))
@given(case=cases())
@example(  # 18 segments: split programs + grouped reduce alone, one-program fold in the batch; sinks, window, fp8
    case=(Spec(q_lens=[1, 40], kv_lens=[1100, 900], pad_tokens=3, page_size=16, num_kv_heads=2, group=4, head_dim=64,
               head_dim_v=64, dtype=torch.float16, causal=True, window_left=700, softcap=0.0, use_alibi=False,
               use_sinks=True, use_kv_scale=True, scale=0.1, strided=False, spare_pages=1, extra_cols=2, tiles=None,
               seed=5, fp8_cache=True),
          0, {"BLOCK_N": 32, "invariant_segment": 64}, 32, 20),
)  # fmt: skip
@example(  # ALiBi and a logit cap: prefill rows beside decode mates, decode steps of the same tokens
    case=(Spec(q_lens=[3, 30, 1], kv_lens=[700, 1500, 40], pad_tokens=0, page_size=16, num_kv_heads=2, group=4,
               head_dim=128, head_dim_v=128, dtype=torch.float16, causal=True, window_left=-1, softcap=20.0,
               use_alibi=True, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
               extra_cols=0, tiles=None, seed=11, fp8_cache=False),
          1, None, 0, 0),
)  # fmt: skip
@example(  # bf16 lse bits of a 16-row decode tile vs a 64-row short tile differed on an H200 (ALiBi, 10 segments)
    case=(Spec(q_lens=[1, 2], kv_lens=[155, 2], pad_tokens=0, page_size=1, num_kv_heads=1, group=1, head_dim=128,
               head_dim_v=128, dtype=DTYPES[0], causal=False, window_left=-1, softcap=0.0, use_alibi=True,
               use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1, extra_cols=0, tiles=None,
               seed=165, fp8_cache=False),
          0, {"BLOCK_N": 16, "invariant_segment": 16}, 0, 0),
)  # fmt: skip
@example(  # the shipped bf16 + fp8-cache decode entry (its own segment length) on a GPU: split decode steps vs fold
    case=(Spec(q_lens=[20, 1, 5], kv_lens=[900 if ON_CPU else 7000, 600 if ON_CPU else 5000, 300], pad_tokens=2,
               page_size=16, num_kv_heads=2, group=4, head_dim=128, head_dim_v=128, dtype=DTYPES[0], causal=True,
               window_left=-1, softcap=0.0, use_alibi=False, use_sinks=False, use_kv_scale=True, scale=0.1,
               strided=False, spare_pages=1, extra_cols=1, tiles=None, seed=21, fp8_cache=True),
          0, None, 16, 3),
)  # fmt: skip
def test_rows_bitwise_invariant(case):
    spec, b, tiles, slack_k, slack_q = case
    spec.kv_lens = [max(k, 1) if spec.fp8_cache else k for k in spec.kv_lens]
    p = build(spec, DEVICE)
    t = p.q.shape[0]
    out = torch.full((t, p.q.shape[1], spec.head_dim_v), float("nan"), dtype=p.q.dtype, device=DEVICE)
    lse = torch.full((t, p.q.shape[1]), float("nan"), device=DEVICE)
    # The batch: mates around it, padding rows, looser bounds (another regime and split plan).
    with _override(tiles):
        tpa.paged_attention_out(*p.args[:6], p.max_seqlen_q + slack_q, p.max_seqlen_k + slack_k, spec.scale,
                                **p.kwargs, batch_invariant=True, out=out, lse=lse)  # fmt: skip
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)

    q_len, kv_len = spec.q_lens[b], spec.kv_lens[b]
    lo = int(p.cu_seqlens_q[b])
    alone_out, alone_lse = _alone(p, b, slice(0, q_len), kv_len, kv_len, tiles)
    assert torch.equal(alone_out, out[lo : lo + q_len]), "output bits depend on the batch"
    assert torch.equal(alone_lse, lse[lo : lo + q_len]), "lse bits depend on the batch"
    if not spec.causal or q_len < 2:
        return
    # The same tokens in a shorter prefill chunk and as decode steps: token i sees the first
    # kv_len - q_len + i + 1 keys either way.
    i = q_len // 2
    chunk_out, chunk_lse = _alone(p, b, slice(0, i + 1), kv_len - q_len + i + 1, kv_len, tiles)
    assert torch.equal(chunk_out, out[lo : lo + i + 1]), "a shorter prefill chunk differs from the whole prefill"
    assert torch.equal(chunk_lse, lse[lo : lo + i + 1])
    for i in sorted({0, q_len // 2, q_len - 1}):
        step_out, step_lse = _alone(p, b, slice(i, i + 1), kv_len - q_len + i + 1, kv_len, tiles)
        if ON_CPU:
            # The interpreter's dot is numpy's matmul, whose bits depend on a row's position in the tile (a decode
            # step is row 0): only closeness holds there. Compiled kernels give every row the same arithmetic.
            assert_close_to_reference(step_out, step_lse, out[lo + i : lo + i + 1], lse[lo + i : lo + i + 1],
                                      spec.dtype, 1)  # fmt: skip
        else:
            assert torch.equal(step_out[0], out[lo + i]), f"token {i}: decode step differs from its prefill row"
            assert torch.equal(step_lse[0], lse[lo + i])


def test_invariant_plan_fixes_tile_width_and_segments():
    """Across regimes and batch sizes the mode keeps one KV tile (width, height, warps), segment length and leaves
    per segment; decode still splits, by segment or (grids short of the SMs) by leaf."""
    fixed = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128, page_size=16, dtype=torch.bfloat16,
                 cache_dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0, has_alibi=False,
                 has_sinks=False, has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=False,
                 device_index=None, interpret=False)  # fmt: skip
    plans = [attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k, batch_invariant=True, **fixed)
             for b in (1, 8, 256) for q in (1, 8, 2048) for k in (4096, 32768) if k >= q]  # fmt: skip
    assert len({lp.config["BLOCK_N"] for lp in plans}) == 1
    assert len({(lp.config["invariant_segment"], lp.config["invariant_leaves"]) for lp in plans}) == 1
    segment, leaves = plans[0].config["invariant_segment"], plans[0].config["invariant_leaves"]
    assert leaves > 1 and {lp.split.segment_len for lp in plans} == {segment, segment // leaves}
    # One sequence, 4 segments x 8 KV heads = 32 programs: 128 leaf programs instead; 256 sequences: segments.
    by_leaf = attention_launch_plan(num_seqs=1, max_seqlen_q=1, max_seqlen_k=4096, batch_invariant=True, **fixed)
    assert by_leaf.split.segment_len == segment // leaves and by_leaf.constexprs["LEAVES"] == 1
    by_segment = attention_launch_plan(num_seqs=256, max_seqlen_q=1, max_seqlen_k=4096, batch_invariant=True, **fixed)
    assert by_segment.split.segment_len == segment and by_segment.constexprs["LEAVES"] == leaves
    decode_small = attention_launch_plan(num_seqs=1, max_seqlen_q=1, max_seqlen_k=32768, batch_invariant=True, **fixed)
    assert decode_small.split.num_splits == 32768 // decode_small.split.segment_len
    assert attention_launch_plan(num_seqs=1, max_seqlen_q=2048, max_seqlen_k=32768, batch_invariant=True,
                                 **fixed).constexprs["FOLD_SEGMENTS"]  # fmt: skip
    # Loose bounds (a CUDA graph's context bound is the whole pool) would need a huge workspace: fold instead.
    assert attention_launch_plan(num_seqs=1, max_seqlen_q=1, max_seqlen_k=131072, batch_invariant=True,
                                 **fixed).split.num_splits == 128  # fmt: skip
    wide = attention_launch_plan(num_seqs=256, max_seqlen_q=1, max_seqlen_k=131072, batch_invariant=True, **fixed)
    assert wide.split.num_splits == 1 and wide.constexprs["FOLD_SEGMENTS"]
    for dtype in (torch.bfloat16, torch.float16):
        tiles = [attention_launch_plan(num_seqs=1, max_seqlen_q=q, max_seqlen_k=4096, batch_invariant=True,
                                       **{**fixed, "dtype": dtype, "cache_dtype": dtype})
                 for q in (1, 8, 2048)]  # fmt: skip
        assert len({(lp.config["BLOCK_M"], lp.config["BLOCK_N"], lp.config["num_warps"]) for lp in tiles}) == 1
    # Default mode keeps its own choices (prefill tiles differ from decode tiles; one-token sequences of a prefill
    # launch take a decode tile, which the mode leaves out: all its rows run the launch's one tile).
    prefill = attention_launch_plan(num_seqs=1, max_seqlen_q=2048, max_seqlen_k=32768, **fixed)
    assert prefill.config["BLOCK_N"] != decode_small.config["BLOCK_N"]
    assert prefill.constexprs["SMALL_M"] > 0 and all(lp.constexprs["SMALL_M"] == 0 for lp in plans)
    # A forced tile (an override) applies to every regime of the mode alike.
    with attention_config_override(BLOCK_M=64, num_warps=8):
        forced = [attention_launch_plan(num_seqs=1, max_seqlen_q=q, max_seqlen_k=32768, batch_invariant=True,
                                        **fixed) for q in (1, 2048)]  # fmt: skip
    assert {(lp.config["BLOCK_M"], lp.config["num_warps"]) for lp in forced} == {(64, 8)}


@pytest.mark.parametrize("window_left", [-1, 70])
def test_leaf_programs_give_the_segment_programs_bits(window_left, monkeypatch):
    """Fixed segments of four leaves computed by one program per segment (a GPU the segments' programs fill), by
    one program per leaf and the reduce (one they would leave idle), and by one program folding a row's segments (a
    query bound past the short regime) give the same bits: sequences ending mid-leaf and mid-segment, a sink, a
    window starting mid-segment."""
    spec = Spec(q_lens=[1, 1, 1], kv_lens=[300, 130, 47], pad_tokens=1, page_size=16, num_kv_heads=2, group=4,
                head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=window_left, softcap=0.0,
                use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=7)  # fmt: skip
    p = build(spec, DEVICE)
    tiles = {"BLOCK_N": 16, "invariant_segment": 64, "invariant_leaves": 4}
    got = []
    for sms, max_q in ((8, 1), (132, 1), (8, 17)):
        monkeypatch.setattr(configs, "num_sms_at", lambda device_index, _sms=sms: _sms)
        out = torch.full((p.q.shape[0], p.q.shape[1], 64), float("nan"), dtype=p.q.dtype, device=DEVICE)
        lse = torch.full(p.q.shape[:2], float("nan"), device=DEVICE)
        with attention_config_override(**tiles):  # (entering it drops plans made with another SM count)
            tpa.paged_attention_out(*p.args[:6], max_q, p.max_seqlen_k, spec.scale, **p.kwargs, batch_invariant=True,
                                    out=out, lse=lse)  # fmt: skip
            lp = attention_launch_plan(
                num_q_heads=8, num_kv_heads=2, head_dim=64, head_dim_v=64, page_size=16, dtype=torch.float16,
                cache_dtype=torch.float16, num_seqs=3, max_seqlen_q=max_q, max_seqlen_k=p.max_seqlen_k, causal=True,
                window_left=window_left, softcap=0.0, has_alibi=False, has_sinks=True, has_k_scale=False,
                has_v_scale=False, has_rows=False, want_lse=True,
                device_index=None if ON_CPU else torch.cuda.current_device(), interpret=ON_CPU, batch_invariant=True,
            )  # fmt: skip
        # (Which plan each run took: segments, leaves, one program.)
        want = {(8, 1): (5, 64, 4), (132, 1): (19, 16, 1), (8, 17): (1, 64, 4)}[(sms, max_q)]
        assert (lp.split.num_splits, lp.split.segment_len, lp.constexprs["LEAVES"]) == want
        got.append((out, lse))
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    for out, lse in got:
        assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, n)
        assert torch.equal(out[:n], got[0][0][:n]) and torch.equal(lse[:n], got[0][1][:n])
