"""The attention kernel against the PyTorch reference, on Hypothesis-drawn paged batches."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import configs, prepared, reference
from triton_paged_ops import plan as planning
from triton_paged_ops.configs.heuristic import attention_config_override
from triton_paged_ops.inputs import random_paged_batch
from triton_paged_ops.kernels import schedule
from triton_paged_ops.ops import INTERPRET
from triton_paged_ops.plan import MAX_SPLIT_Q_LEN, attention_launch_plan

from .strategies import Spec, build, guarded, poison_unowned_slots, specs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (bf16 too under the interpreter: the kernels widen its products to fp32 there, see ``attention_tile._mma``.)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The interpreter runs a 128x128 tile step in ~10 ms: keep each CPU example to a few seconds.
MAX_WORK = 96 if DEVICE == "cpu" else None

# Relative L2 error of the whole output, largest absolute error, and absolute LSE error, per input dtype. The
# reference computes in fp32 from the same (rounded) inputs, so the gap is the kernel's own rounding: fp32 tiles,
# and P rounded to the input dtype before the P @ V product.
TOLERANCE = {
    torch.float32: {"rel": 1e-5, "abs": 1e-4, "lse": 1e-4},
    torch.float16: {"rel": 2e-3, "abs": 1e-2, "lse": 1e-3},
    torch.bfloat16: {"rel": 1e-2, "abs": 6e-2, "lse": 1e-3},
}


def _tiles(spec: Spec, num_splits: int | None = None):
    """Launch options the spec forces: tile sizes and/or the split-KV segment count."""
    cfg = {}
    if spec.tiles is not None:
        cfg.update(BLOCK_M=spec.tiles[0], BLOCK_N=spec.tiles[1])
    if (num_splits or spec.num_splits) is not None:
        cfg["num_splits"] = num_splits or spec.num_splits
    return attention_config_override(**cfg) if cfg else contextlib.nullcontext()


def assert_close_to_reference(out, lse, ref_out, ref_lse, dtype, rows):
    tol = TOLERANCE[dtype]
    out, ref_out = out[:rows].float(), ref_out[:rows].float()
    assert not out.isnan().any(), "kernel left unwritten (NaN-poisoned) or NaN outputs"
    err = (out - ref_out).norm() / ref_out.norm().clamp_min(1e-6)
    assert err <= tol["rel"], f"relative L2 error {err:.3e} > {tol['rel']}"
    max_abs = (out - ref_out).abs().max().item() if rows else 0.0
    assert max_abs <= tol["abs"], f"max abs error {max_abs:.3e} > {tol['abs']}"
    if lse is not None:
        lse, ref_lse = lse[:rows], ref_lse[:rows]
        assert torch.equal(lse.isneginf(), ref_lse.isneginf()), "rows with nothing to attend disagree"
        finite = ~ref_lse.isneginf()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        assert lse_err <= tol["lse"] * (1 + ref_lse[finite].abs().max().item() if finite.any() else 1)


def run_out_variant(p, **extra):
    """``paged_attention_out`` into NaN-poisoned buffers with guard bands around them (checked: nothing written
    outside ``out`` and ``lse``)."""
    t, hq = p.q.shape[:2]
    out, out_guards = guarded((t, hq, p.spec.head_dim_v), p.q.dtype, p.q.device)
    lse, lse_guards = guarded((t, hq), torch.float32, p.q.device)
    with _tiles(p.spec):
        tpa.paged_attention_out(*p.args, **p.kwargs, **extra, out=out, lse=lse)
    out_guards()
    lse_guards()
    return out, lse


@given(spec=specs(dtypes=DTYPES, max_work=MAX_WORK))
@example(  # every feature at once, page size 7 across 64-key tiles, GQA group 3, padding rows
    spec=Spec(q_lens=[5, 1, 0, 70], kv_lens=[40, 9, 3, 200], pad_tokens=3, page_size=7, num_kv_heads=2, group=3,
              head_dim=80, head_dim_v=80, dtype=torch.float16, causal=True, window_left=50, softcap=20.0,
              use_alibi=True, use_sinks=True, use_kv_scale=True, scale=0.11, strided=True, spare_pages=2,
              extra_cols=1, tiles=None, seed=1)
)  # fmt: skip
@example(  # token-level cache (page size 1), MQA, decode rows, small tiles, Dv != D
    spec=Spec(q_lens=[1, 1, 1], kv_lens=[1, 33, 130], pad_tokens=0, page_size=1, num_kv_heads=1, group=8,
              head_dim=96, head_dim_v=64, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=0,
              extra_cols=0, tiles=(16, 16), seed=2)
)  # fmt: skip
@example(  # every logit feature on tiles inside a page (32-token pages, 16-key tiles), a decode row beside them
    spec=Spec(q_lens=[40, 1, 17], kv_lens=[90, 33, 60], pad_tokens=2, page_size=32, num_kv_heads=2, group=2,
              head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True, window_left=-1, softcap=20.0,
              use_alibi=True, use_sinks=True, use_kv_scale=True, scale=0.2, strided=False, spare_pages=1,
              extra_cols=1, tiles=(32, 16), seed=7)
)  # fmt: skip
@example(  # forced split segments under decode rows and a short query, each past several segments
    spec=Spec(q_lens=[1, 3, 1], kv_lens=[300, 260, 70], pad_tokens=1, page_size=16, num_kv_heads=2, group=4,
              head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False, spare_pages=1,
              extra_cols=0, tiles=(16, 32), seed=12, num_splits=5)
)  # fmt: skip
@example(  # request-pool rows (block_table_rows picks each sequence's row of a larger table), MQA group 48
    spec=Spec(q_lens=[2, 1, 5], kv_lens=[40, 90, 5], pad_tokens=0, page_size=3, num_kv_heads=1, group=48,
              head_dim=64, head_dim_v=64, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.125, strided=False, spare_pages=2,
              extra_cols=1, tiles=None, seed=13, rows_dtype=torch.int64)
)  # fmt: skip
@example(  # decode rows whose window is shorter than their context (a window's first tile past key 0), group 128
    spec=Spec(q_lens=[1, 1, 2], kv_lens=[200, 37, 150], pad_tokens=0, page_size=16, num_kv_heads=1, group=128,
              head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=20, softcap=0.0,
              use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.125, strided=False, spare_pages=0,
              extra_cols=0, tiles=None, seed=14)
)  # fmt: skip
def test_matches_reference(spec):
    p = build(spec, DEVICE)
    out, lse = run_out_variant(p)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, n)
    # Padding rows past cu_seqlens_q[-1] are not written.
    assert out[n:].isnan().all() and lse[n:].isnan().all()


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(spec=specs(dtypes=DTYPES, max_work=MAX_WORK))
@example(  # decode rows with whole tiles and a partial last one (the unguarded loop and the tail after it), split
    spec=Spec(q_lens=[1, 1, 1], kv_lens=[300, 64, 5], pad_tokens=1, page_size=16, num_kv_heads=2, group=4,
              head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
              extra_cols=0, tiles=(16, 32), seed=5, num_splits=3)
)  # fmt: skip
@example(  # prefill chunks whose whole tiles below the diagonal run unguarded, beside a decode row
    spec=Spec(q_lens=[40, 1, 20], kv_lens=[120, 45, 90], pad_tokens=2, page_size=16, num_kv_heads=2, group=2,
              head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1,
              extra_cols=0, tiles=(32, 16), seed=11)
)  # fmt: skip
def test_clamped_page_ids_change_nothing_on_a_valid_table(spec):
    """``clamp_pages`` (bad page ids read page 0 instead of dropping their keys) builds its key mask from the key
    index alone, and whole tiles below kv_len (one-token rows' tiles, taller tiles' unmasked range) run unguarded:
    on a valid block table every output matches the reference, and under the interpreter the bits of the default
    guard."""
    p = build(spec, DEVICE)
    t, hq = p.q.shape[:2]
    tiles = {"BLOCK_M": spec.tiles[0], "BLOCK_N": spec.tiles[1]} if spec.tiles is not None else {}
    results = []
    # (fp8 decode and prefill default to clamping, so both ways are set. One override with the spec's tiles too:
    # an inner override replaces an outer one.)
    for guard in (False, True):
        out = torch.full((t, hq, spec.head_dim_v), float("nan"), dtype=p.q.dtype, device=p.q.device)
        lse = torch.full((t, hq), float("nan"), device=p.q.device)
        with attention_config_override(**tiles, **({"num_splits": spec.num_splits} if spec.num_splits else {}),
                                       clamp_pages=guard):  # fmt: skip
            tpa.paged_attention_out(*p.args, **p.kwargs, out=out, lse=lse)
        results.append((out, lse))
    (out, lse), (out2, lse2) = results
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    assert_close_to_reference(out2, lse2, ref_out, ref_lse, spec.dtype, n)
    if DEVICE == "cpu":
        assert torch.equal(out2[:n], out[:n]) and torch.equal(lse2[:n], lse[:n])


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(spec=specs(dtypes=(torch.bfloat16,), max_work=MAX_WORK))
def test_bf16_query_on_fp8_cache(spec):
    """A bf16 query on an fp8 cache takes the fp16 product path (scale folded into q): no bf16 product is left, so
    the interpreter checks it too."""
    spec.fp8_cache = True
    test_matches_reference.hypothesis.inner_test(spec)


# Three kernel calls per example: half the profile's examples keep the CPU run within its budget.
@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(spec=specs(dtypes=DTYPES, max_work=MAX_WORK and MAX_WORK // 3), cut=st.integers(0, 8))
def test_merge_of_two_key_halves_equals_whole(spec, cut):
    """Attention over pages [0, cut) and [cut, ...) merged with merge_attn_states equals attention over all keys.

    Non-causal with no window/alibi, so that a key's logit does not depend on its position; the sink joins one
    half only, as the merge must count it once.
    """
    spec.causal, spec.window_left, spec.use_alibi = False, -1, False
    p = build(spec, DEVICE)
    ps = spec.page_size
    whole_out, whole_lse = run_out_variant(p)
    cut = min(cut, p.block_table.shape[1])
    lens_a = torch.clamp(p.seq_lens, max=cut * ps)
    lens_b = p.seq_lens - lens_a
    table_b = torch.cat([p.block_table[:, cut:], p.block_table[:, :1].clone().fill_(-1)], dim=1)
    kw_b = {k: v for k, v in p.kwargs.items() if k != "sinks"}
    with _tiles(spec):
        out_a, lse_a = tpa.paged_attention_with_lse(
            p.q,
            p.k_cache,
            p.v_cache,
            p.block_table,
            p.cu_seqlens_q,
            lens_a,
            p.max_seqlen_q,
            min(cut * ps, p.max_seqlen_k),
            spec.scale,
            **p.kwargs,
        )
        out_b, lse_b = tpa.paged_attention_with_lse(
            p.q,
            p.k_cache,
            p.v_cache,
            table_b,
            p.cu_seqlens_q,
            lens_b,
            p.max_seqlen_q,
            max(p.max_seqlen_k - cut * ps, 0),
            spec.scale,
            **kw_b,
        )
    n = p.num_real_tokens
    out, lse = tpa.merge_attn_states(out_a[:n], lse_a[:n], out_b[:n], lse_b[:n])
    # Both the whole and the merge are kernel results: allow twice the single-run rounding.
    tol = {k: 2 * v for k, v in TOLERANCE[spec.dtype].items()}
    err = (out.float() - whole_out[:n].float()).norm() / whole_out[:n].float().norm().clamp_min(1e-6)
    assert err <= tol["rel"], f"merged vs whole relative error {err:.3e}"
    torch.testing.assert_close(lse, whole_lse[:n], rtol=tol["lse"], atol=tol["lse"])


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(spec=specs(dtypes=DTYPES, max_seqs=5, max_work=MAX_WORK), pick=st.integers(0, 7))
def test_sequence_output_independent_of_batch(spec, pick):
    """A sequence's output is bit-for-bit the same alone as inside the batch (same bounds and split plan)."""
    spec.num_splits = spec.num_splits or 1  # the planner would otherwise pick by batch size
    p = build(spec, DEVICE)
    b = pick % len(spec.q_lens)
    out, _ = run_out_variant(p)
    lo, hi = int(p.cu_seqlens_q[b]), int(p.cu_seqlens_q[b + 1])
    cu_one = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
    alone = torch.full_like(out[lo:hi], float("nan"))
    kw, table = dict(p.kwargs), p.block_table[b : b + 1]
    if "block_table_rows" in kw:
        kw["block_table_rows"], table = kw["block_table_rows"][b : b + 1], p.block_table
    with _tiles(spec):
        tpa.paged_attention_out(p.q[lo:hi], p.k_cache, p.v_cache, table, cu_one, p.seq_lens[b : b + 1],
                                p.max_seqlen_q, p.max_seqlen_k, spec.scale, **kw, out=alone)  # fmt: skip
    assert torch.equal(alone, out[lo:hi])


@pytest.mark.parametrize(
    "page_size,num_splits,block_n",
    [
        (16, 4, 16),  # segments a whole number of pages: edges on page edges
        (7, 5, 32),  # segment edges inside pages
        (1, 9, 16),  # token-level pages, more segments than most sequences fill
        (64, 3, 64),  # a segment shorter than a page
    ],
)
def test_split_kv_boundaries(page_size, num_splits, block_n):
    """Split-KV around its edges: 1-token sequences beside long ones, segments longer than whole sequences, empty
    segments, sinks (counted once), every sequence's last tile partial."""
    long = 4000 if DEVICE == "cpu" else 32768
    spec = Spec(q_lens=[1, 1, 2, 1, 4], kv_lens=[1, long, 17, page_size * 3, 161], pad_tokens=2, page_size=page_size,
                num_kv_heads=1, group=4, head_dim=64, head_dim_v=64, dtype=torch.float32, causal=True, window_left=-1,
                softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False,
                spare_pages=1, extra_cols=0, tiles=(16, block_n), seed=page_size, num_splits=num_splits)  # fmt: skip
    p = build(spec, DEVICE)
    out, lse = run_out_variant(p)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)
    assert out[p.num_real_tokens :].isnan().all()


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_decode_dispatch_orders(num_splits, invariant):
    """Every ``decode_order`` maps the grid onto the same (sequence, KV head, segment) programs: outputs equal the
    reference and the orders agree bit for bit. The batch has empty segments, padding and 1-token sequences."""
    spec = Spec(q_lens=[1, 1, 2, 1, 1], kv_lens=[1, 700, 17, 48, 161], pad_tokens=2, page_size=16, num_kv_heads=2,
                group=2, head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=5, num_splits=None)  # fmt: skip
    p = build(spec, DEVICE)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    got = {}
    for order in configs.CHOICES["decode_order"]:
        # (The spec forces no tiles, so run_out_variant adds no override of its own inside this one. Batch-invariant
        # mode splits by its fixed segments, here 64 keys: 11 of them for the longest row; a grid this small takes
        # one program per 32-key leaf, 22.)
        cfg = dict(BLOCK_M=16, BLOCK_N=32, num_splits=num_splits, decode_order=order, invariant_segment=64)
        with attention_config_override(**cfg):
            plan = _launch_plan(p, invariant)
            assert plan.constexprs["DECODE_ORDER"] == order
            assert plan.split.num_splits == (22 if invariant else num_splits)
            # Every segment index must be written by this run (partial or lse = -inf), not left from the last.
            kept = getattr(prepared._LOCAL, "buffers", {}).get(p.q.get_device())
            if kept is not None:
                kept[0].fill_(float("nan"))
            got[order] = run_out_variant(p, batch_invariant=invariant)
    first = got["sequences"]
    for order, (out, lse) in got.items():
        assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, n)
        assert torch.equal(out[:n], first[0][:n]) and torch.equal(lse[:n], first[1][:n]), order
        assert out[n:].isnan().all()  # padding rows stay unwritten


def _launch_plan(p, batch_invariant: bool = False, decode_tail: int = -1):
    """The launch plan a call on the built batch ``p`` (no scales or row indirection) gets (``decode_tail``: with
    that hint)."""
    spec = p.spec
    return attention_launch_plan(
        num_q_heads=spec.num_kv_heads * spec.group, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v, page_size=spec.page_size, dtype=spec.dtype, cache_dtype=spec.dtype,
        num_seqs=len(spec.q_lens), max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, causal=spec.causal,
        window_left=spec.window_left, softcap=spec.softcap, has_alibi=spec.use_alibi, has_sinks=spec.use_sinks,
        has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=True,
        device_index=None if INTERPRET else torch.cuda.current_device(), interpret=INTERPRET,
        batch_invariant=batch_invariant, decode_tail=decode_tail,
    )  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
def test_planner_splits_a_small_prefill_chunk_over_a_long_context(causal):
    """A prefill chunk too small to fill the GPU with query tiles: the planner splits its keys (no forced count)."""
    spec = Spec(q_lens=[40, 20], kv_lens=[3000, 2100], pad_tokens=1, page_size=16, num_kv_heads=1, group=4,
                head_dim=64, head_dim_v=64, dtype=torch.float16, causal=causal, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=7)  # fmt: skip
    p = build(spec, DEVICE)
    lp = _launch_plan(p)
    assert p.max_seqlen_q > MAX_SPLIT_Q_LEN and lp.split.num_splits > 1
    out, lse = run_out_variant(p)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)
    assert out[p.num_real_tokens :].isnan().all()


@pytest.mark.parametrize(
    ("tiles", "window_left", "num_splits"),
    [(None, -1, None), ((32, 16), -1, None), ((32, 16), 40, None), ((32, 16), -1, 3)],
)
def test_mixed_batch_prefill_chunks_and_decodes(tiles, window_left, num_splits):
    """One launch of tall (prefill) tiles over prefill chunks and one-token sequences: the one-token sequences run
    the decode tile (SMALL_M), the chunks' query blocks run last-first with KV heads interleaved; every row is
    written, and matches the reference, with windows and split-KV too."""
    spec = Spec(q_lens=[45, 1, 1, 3, 1, 20], kv_lens=[300, 70, 1, 50, 260, 20], pad_tokens=2, page_size=16,
                num_kv_heads=2, group=4, head_dim=64, head_dim_v=64, dtype=torch.float32, causal=True,
                window_left=window_left, softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False,
                scale=0.125, strided=False, spare_pages=1, extra_cols=0, tiles=tiles, seed=11,
                num_splits=num_splits)  # fmt: skip
    p = build(spec, DEVICE)
    with _tiles(spec):
        lp = _launch_plan(p)
    assert lp.constexprs["SMALL_M"] == 16 and lp.constexprs["BLOCK_M"] > 16
    assert not lp.one_block and lp.block_q < 45
    out, lse = run_out_variant(p)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)
    assert out[p.num_real_tokens :].isnan().all()


@pytest.mark.parametrize("num_splits", [None, 3])
def test_mixed_batch_decode_rows_take_a_wider_kv_tile_when_nothing_splits(num_splits):
    """``small_block_n``: one-token rows of a mixed launch take a KV tile wider than the tall tiles' when no
    sequence is split (segment edges must stay tile edges of both branches otherwise); same results."""
    spec = Spec(q_lens=[45, 1, 1, 3, 1], kv_lens=[300, 70, 1, 50, 260], pad_tokens=2, page_size=16, num_kv_heads=2,
                group=4, head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=12)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, small_block_n=64, **({"num_splits": num_splits} if num_splits else {}))
    t, hq = p.q.shape[:2]
    out = torch.full((t, hq, spec.head_dim_v), float("nan"), dtype=p.q.dtype, device=p.q.device)
    lse = torch.full((t, hq), float("nan"), device=p.q.device)
    with attention_config_override(**cfg):
        lp = _launch_plan(p)
        assert lp.constexprs["SMALL_M"] == 16 and lp.constexprs["SMALL_N"] == (64 if num_splits is None else 16)
        tpa.paged_attention_out(*p.args, **p.kwargs, out=out, lse=lse)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)
    assert out[p.num_real_tokens :].isnan().all()


@pytest.mark.gpu
@settings(max_examples=100)
@given(spec=specs(dtypes=(torch.bfloat16,), max_seqs=16, max_q=1024, max_ctx=8192))
def test_matches_reference_large_bf16(spec):
    """Larger bf16 problems on the GPU: long prefills and contexts, many sequences."""
    p = build(spec, DEVICE)
    out, lse = run_out_variant(p)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_prompt_batches_said_to_hold_no_decodes(data):
    """Prefill batches passed with ``decode_tail`` 0 take the table's ``prompts`` entry where it has one (the
    H200's bf16 D128 entry: 16-warp programs; D64: two 8-warp programs per SM under a register cap): whole prompts
    and chunks on a prefix, pages of 1, 16 and 64 keys, sinks, padding rows, against the reference (NaN-poisoned
    outputs, and NaN in the slots past each sequence's end), with the entry's tiles and launch options."""
    from triton_paged_ops import configs

    batch = data.draw(st.integers(1, 5))
    q_lens = data.draw(st.lists(st.integers(2, 1200), min_size=batch, max_size=batch))
    q_lens[0] = max(q_lens[0], MAX_SPLIT_Q_LEN + 1)
    kv_lens = [q + data.draw(st.sampled_from((0, data.draw(st.integers(1, 3000))))) for q in q_lens]
    page_size = data.draw(st.sampled_from((1, 16, 64)))
    head_dim = data.draw(st.sampled_from((64, 128)))
    gen = torch.Generator(device=DEVICE).manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    p = random_paged_batch(q_lens, kv_lens, num_q_heads=32, num_kv_heads=8, head_dim=head_dim, page_size=page_size,
                           dtype=torch.bfloat16, device=DEVICE, generator=gen, pad_tokens=3)  # fmt: skip
    poison_unowned_slots(p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    extra = {"sinks": torch.randn(32, device=DEVICE)} if data.draw(st.booleans()) else {}
    hint = tpa.decode_tail_of(q_lens)
    assert hint == 0
    lp = attention_launch_plan(
        num_q_heads=32, num_kv_heads=8, head_dim=head_dim, head_dim_v=head_dim, page_size=page_size,
        dtype=torch.bfloat16, cache_dtype=torch.bfloat16, num_seqs=batch, max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens), causal=True, window_left=-1, softcap=0.0, has_alibi=False, has_sinks=bool(extra),
        has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=True, device_index=torch.cuda.current_device(),
        interpret=False, decode_tail=hint,
    )  # fmt: skip
    entry = configs.lookup(torch.cuda.current_device(), "bfloat16", head_dim, "prompts")
    if entry is not None:
        assert lp.options["num_warps"] == entry["num_warps"]
        assert lp.options.get("maxnreg") == entry.get("maxnreg")
        assert lp.constexprs["DIAG_LOOP"] == entry.get("diag_loop", "separate")
    out = torch.full((p.q.shape[0], 32, head_dim), float("nan"), dtype=p.q.dtype, device=DEVICE)
    lse = torch.full(p.q.shape[:2], float("nan"), device=DEVICE)
    tpa.paged_attention_out(*p.args, **extra, decode_tail=hint, out=out, lse=lse)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **extra)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.bfloat16, sum(q_lens))


@pytest.mark.gpu
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_fp8_decode_of_batches_that_fill_the_gpu(data):
    """One-token batches with at least one (sequence, KV head) pair per SM (the ``decode_large`` table entry where a
    table has one: the H200's fp8 entry runs one-warp programs) on an fp8 cache: ragged lengths from 1 key, page
    sizes 1 and 16, padding rows, against the reference on the dequantized cache."""
    from triton_paged_ops.configs import num_sms_of

    num_kv_heads = data.draw(st.sampled_from((8, 4)))
    full = -(-num_sms_of(torch.device(DEVICE)) // num_kv_heads)
    batch = data.draw(st.integers(full, 3 * full))
    kv_lens = data.draw(st.lists(st.integers(1, 6000), min_size=batch, max_size=batch))
    page_size = data.draw(st.sampled_from((1, 16)))
    gen = torch.Generator(device=DEVICE).manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    p = random_paged_batch([1] * batch, kv_lens, num_q_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads,
                           head_dim=128, page_size=page_size, dtype=torch.bfloat16, device=DEVICE, generator=gen,
                           pad_tokens=3, cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    scales = {"k_scale": torch.tensor([0.7], device=DEVICE), "v_scale": torch.tensor([1.3], device=DEVICE)}
    out = torch.full((p.q.shape[0], p.q.shape[1], 128), float("nan"), dtype=p.q.dtype, device=DEVICE)
    lse = torch.full(p.q.shape[:2], float("nan"), device=DEVICE)
    tpa.paged_attention_out(*p.args, **scales, out=out, lse=lse)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **scales)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.bfloat16, batch)


def test_interpreter_is_on_without_gpu():
    """Guards the CI set-up: without a GPU the suite must be testing kernels (interpreter), not the reference."""
    assert INTERPRET or torch.cuda.is_available()


def test_narrow_offsets_only_where_every_cache_element_fits_31_bits():
    """K/V offsets are 32-bit only while each cache's last element lies below 2^31 elements from
    its base; a larger K or V cache gets 64-bit offsets (metadata only: meta tensors hold no memory)."""
    fits = torch.empty(1 << 17, 16, 8, 128, device="meta")  # last element at 2^31 - 1
    past = torch.empty((1 << 17) + 1, 16, 8, 128, device="meta")
    assert planning.narrow_offsets_ok(fits, fits)
    assert not planning.narrow_offsets_ok(past, fits) and not planning.narrow_offsets_ok(fits, past)
    # A view's strides count, not its element count: every other page of the larger cache reaches past 2^31.
    assert past[::2].numel() < fits.numel() and not planning.narrow_offsets_ok(past[::2], past[::2])
    spec = Spec(q_lens=[1], kv_lens=[40], pad_tokens=0, page_size=16, num_kv_heads=2, group=2, head_dim=32,
                head_dim_v=32, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0, use_alibi=False,
                use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=0, extra_cols=0,
                tiles=None, seed=0)  # fmt: skip
    p = build(spec, DEVICE)
    fixed = dict(
        num_q_heads=4, num_kv_heads=2, head_dim=32, head_dim_v=32, page_size=16, dtype=torch.float16,
        cache_dtype=torch.float16, num_seqs=1, max_seqlen_q=1, max_seqlen_k=40, causal=True, window_left=-1,
        softcap=0.0, has_alibi=False, has_sinks=False, has_k_scale=False, has_v_scale=False, has_rows=False,
        want_lse=False, device_index=None if INTERPRET else torch.cuda.current_device(), interpret=INTERPRET,
    )  # fmt: skip
    assert planning.narrow_offsets_ok(p.k_cache, p.v_cache)
    assert attention_launch_plan(**fixed).constexprs["NARROW_OFFSETS"]
    assert not attention_launch_plan(**fixed, narrow_offsets=False).constexprs["NARROW_OFFSETS"]


@pytest.mark.parametrize("guard", [False, True], ids=["dropped", "page 0"])
def test_wide_and_narrow_offsets_give_the_same_bits(guard, monkeypatch):
    """The offset width changes addresses only: 64-bit offsets (what caches past 2^31 elements get) and 32-bit
    ones give bitwise the same outputs on a mixed batch with split decode rows and prefill chunks
    over strided caches and spare pages, both close to the reference."""
    spec = Spec(q_lens=[1, 30, 1], kv_lens=[200, 90, 33], pad_tokens=1, page_size=16, num_kv_heads=2, group=2,
                head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2, strided=True, spare_pages=3,
                extra_cols=1, tiles=(32, 16), seed=3, num_splits=2)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_splits=2, clamp_pages=guard)
    narrow = _assert_same_bits_under(p, [cfg])
    asked = []
    monkeypatch.setattr(planning, "narrow_offsets_ok", lambda k_cache, v_cache: asked.append(1) and False)
    wide = _assert_same_bits_under(p, [cfg])
    assert asked  # the launches were planned with 64-bit offsets
    n = p.num_real_tokens
    assert torch.equal(wide[0][0][:n], narrow[0][0][:n]) and torch.equal(wide[0][1][:n], narrow[0][1][:n])


def _assert_same_bits_under(p, overrides: list[dict], same_bits: bool = True, calls: list[dict] | None = None) -> list:
    """The built batch ``p`` run under each config override (outputs NaN-poisoned first; ``calls``: extra call
    arguments per run): every run close to the reference, and (``same_bits``) all of them bitwise equal. Returns
    the runs' (out, lse)."""
    spec = p.spec
    t, hq = p.q.shape[:2]
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    got = []
    for cfg, extra in zip(overrides, calls or [{}] * len(overrides), strict=True):
        out = torch.full((t, hq, spec.head_dim_v), float("nan"), dtype=p.q.dtype, device=p.q.device)
        lse = torch.full((t, hq), float("nan"), device=p.q.device)
        with attention_config_override(**cfg):
            tpa.paged_attention_out(*p.args, **p.kwargs, **extra, out=out, lse=lse)
        assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, n)
        got.append((out, lse))
    for out, lse in got[1:] if same_bits else ():
        assert torch.equal(out[:n], got[0][0][:n]) and torch.equal(lse[:n], got[0][1][:n])
    return got


def _assert_close_under(p, overrides: list[dict], calls: list[dict] | None = None) -> None:
    """The built batch ``p`` run under each config override (outputs NaN-poisoned first; ``calls``: extra call
    arguments per run): every run close to the reference (the overrides may change the arithmetic)."""
    _assert_same_bits_under(p, overrides, same_bits=False, calls=calls)


@pytest.mark.parametrize("window_left", [-1, 40])
def test_accumulator_rescaled_every_tile_gives_the_same_bits(window_left):
    """``acc_rescale`` "always" multiplies the accumulator every tile instead of skipping tiles where no row's running
    max moved; a row whose max stayed is multiplied by exactly 1, so a mixed batch (split decode rows, prefill chunks
    over a prefix, a window) gives the bits of the skipping loop, both close to the reference."""
    spec = Spec(q_lens=[40, 1, 3, 20], kv_lens=[200, 177, 3, 150], pad_tokens=2, page_size=16, num_kv_heads=2,
                group=2, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True, window_left=window_left,
                softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2, strided=False,
                spare_pages=2, extra_cols=1, tiles=(32, 16), seed=29, num_splits=2)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_splits=2)
    for mode in configs.CHOICES["acc_rescale"]:
        with attention_config_override(**cfg, acc_rescale=mode):
            assert _launch_plan(p).constexprs["ACC_RESCALE"] == mode
    _assert_same_bits_under(p, [dict(cfg, acc_rescale=mode) for mode in configs.CHOICES["acc_rescale"]])


@pytest.mark.parametrize("page_size,tile,warps,sinks,guard", [
    (16, 64, 4, True, True),  # runs of 16 keys: one page id per run
    (64, 128, 2, False, True),  # runs of 64 keys inside 64-key pages
    (16, 128, 2, True, False),  # runs of 64 keys over 4 pages: one id per key, bad ids dropped
    (1, 64, 4, False, False),  # token-level pages
])  # fmt: skip
def test_one_token_rows_cut_into_runs_per_warp_match_the_reference(page_size, tile, warps, sinks, guard):
    """A mixed launch's one-token rows cut each KV tile into one run of keys per warp, each run
    its own online softmax, merged at the end. Every row is written and matches the reference: rows shorter than a
    run, a single key, lengths that end inside a run or a tile, a row spanning many tiles, the sink counted once;
    prefill chunks beside them unchanged."""
    spec = Spec(q_lens=[40, 1, 3, 1, 1, 1, 20], kv_lens=[200, 177, 3, 1, 16, 301, 150], pad_tokens=2,
                page_size=page_size, num_kv_heads=2, group=2, head_dim=32, head_dim_v=32, dtype=torch.float16,
                causal=True, window_left=-1, softcap=0.0, use_alibi=False, use_sinks=sinks, use_kv_scale=False,
                scale=0.2, strided=False, spare_pages=2, extra_cols=1, tiles=(32, 16), seed=37)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, small_block_n=tile, num_warps=warps, clamp_pages=guard)
    with attention_config_override(**cfg):
        lp = _launch_plan(p)
        assert lp.constexprs["SMALL_M"] > 0 and lp.constexprs["SMALL_CHUNKS"] == warps
    _assert_close_under(p, [cfg])


@pytest.mark.parametrize("what", ["window", "softcap", "alibi", "split"])
def test_one_token_rows_keep_the_shared_tile_where_runs_do_not_apply(what):
    """Runs per warp take no window, cap, ALiBi or split segments: such launches keep one tile for all warps (and
    still match the reference)."""
    spec = Spec(q_lens=[40, 1, 3, 1], kv_lens=[200, 177, 3, 60], pad_tokens=2, page_size=16, num_kv_heads=2, group=2,
                head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=50 if what == "window" else -1, softcap=20.0 if what == "softcap" else 0.0,
                use_alibi=what == "alibi", use_sinks=False, use_kv_scale=False, scale=0.2, strided=False,
                spare_pages=2, extra_cols=1, tiles=(32, 16), seed=41)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, small_block_n=64, num_warps=4)
    if what == "split":
        cfg["num_splits"] = 2
    with attention_config_override(**cfg):
        assert _launch_plan(p).constexprs["SMALL_CHUNKS"] == 0
    _assert_close_under(p, [cfg])


@triton.jit
def _dispatch_order_kernel(cu_seqlens_q_ptr, out_ptr, seq_ptr, num_seqs, tail_seq, BLOCK_Q: tl.constexpr):
    block = tl.program_id(0)
    tail, first, used = schedule._one_token_tail(cu_seqlens_q_ptr, num_seqs, tail_seq, tl.num_programs(0), BLOCK_Q)
    mapped = schedule._interleave_one_token_rows(block, first, used)
    tl.store(out_ptr + block, mapped)
    # Each block's sequence, found with the hint's shortcuts and by the plain search.
    tl.store(seq_ptr + 2 * block, schedule._find_seq_with_tail(cu_seqlens_q_ptr, num_seqs, block, tail, first, BLOCK_Q))
    tl.store(seq_ptr + 2 * block + 1, schedule._find_seq(cu_seqlens_q_ptr, num_seqs, block, BLOCK_Q))


@pytest.mark.parametrize("q_lens,pad", [
    ([2048] + [1] * 63, 0),  # the mixed batch: a chunk, then decodes
    ([40, 3, 1, 1, 1, 1, 1, 1], 5),  # more tail blocks than others, padding tokens after the batch
    ([70, 1, 3, 1, 20, 1], 0),  # one-token rows inside the batch: only the tail counts
    ([1, 1, 1], 0),  # decodes only
    ([300, 64], 2),  # no one-token tail
    ([0, 5, 0, 1], 0),  # empty sequences
    ([33, 7] + [1] * 40, 3),  # a tail crossing several query blocks (its sequences' blocks shift by one there)
    ([1] * 50, 0),  # decodes only, over several blocks
])  # fmt: skip
def test_interleaved_dispatch_order_is_a_permutation(q_lens, pad):
    """The interleaved dispatch order's map from dispatch position to query block is a permutation of the launch's
    blocks for any tail start it is given (a wrong ``decode_tail`` hint included); with the batch's own one-token tail
    it alternates the others' blocks (in order, from block 0) with the tail's (in order, from the tail's first) while
    both last. The hinted sequence search gives every block the plain search's sequence, whatever the hint."""
    block_q = 16
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    num_blocks = (int(cu[-1]) + pad) // block_q + len(q_lens)  # the launcher's grid
    tail = len(q_lens)
    while tail > 0 and q_lens[tail - 1] == 1:
        tail -= 1
    for tail_seq in sorted({tail, 0, len(q_lens), len(q_lens) // 2, -3, len(q_lens) + 4}):
        out = torch.full((num_blocks,), -1, dtype=torch.int32, device=DEVICE)
        seqs = torch.full((num_blocks, 2), -1, dtype=torch.int32, device=DEVICE)
        _dispatch_order_kernel[(num_blocks,)](cu, out, seqs, len(q_lens), tail_seq, BLOCK_Q=block_q)
        mapped = out.tolist()
        assert sorted(mapped) == list(range(num_blocks)), tail_seq
        assert torch.equal(seqs[:, 0], seqs[:, 1]), (tail_seq, seqs.tolist())
        if tail_seq == tail:
            first = int(cu[tail]) // block_q + tail  # the tail's first block (the natural numbering)
            used = int(cu[-1]) // block_q + len(q_lens)
            pairs = min(first, used - first)
            assert mapped[: 2 * pairs : 2] == list(range(pairs))
            assert mapped[1 : 2 * pairs : 2] == list(range(first, first + pairs))


def test_decode_tail_hint_interleaves_the_order_and_keeps_the_bits():
    """A program computes its block whatever position dispatched it: with the ``decode_tail`` hint (right or wrong) the
    interleaved order gives the batch's bits (chunks on a prefix, then one-token rows, with sinks), all close to the
    reference. The order is taken only with a hint > 0, and never for a lone sequence. A wrong hint of 0 (no one-token
    rows) compiles the launch without the one-token branch: its rows then take the tall tile, still close to the
    reference."""
    spec = Spec(q_lens=[40, 20, 1, 1, 1, 1, 1], kv_lens=[200, 150, 177, 3, 60, 1, 90], pad_tokens=2, page_size=16,
                num_kv_heads=2, group=2, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=-1, softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2,
                strided=False, spare_pages=2, extra_cols=1, tiles=(32, 16), seed=43)  # fmt: skip
    p = build(spec, DEVICE)
    assert tpa.decode_tail_of(spec.q_lens) == 5
    cfg = dict(BLOCK_M=32, BLOCK_N=16)
    with attention_config_override(**cfg):
        for hint, expect in ((-1, False), (0, False), (5, True)):
            assert _launch_plan(p, decode_tail=hint).constexprs["MIXED_ORDER"] == expect
    hints = (-1, 5, 2, 7)  # unknown, right, and two wrong ones
    _assert_same_bits_under(p, [cfg] * len(hints), calls=[{"decode_tail": h} for h in hints])
    with attention_config_override(**cfg):
        assert [_launch_plan(p, decode_tail=h).constexprs["SMALL_M"] > 0 for h in (-1, 0, 5)] == [True, False, True]
    _assert_close_under(p, [cfg], calls=[{"decode_tail": 0}])
    # A lone sequence has no tail beside other work: the hint leaves its launch alone.
    one = build(dataclasses.replace(spec, q_lens=[40], kv_lens=[200]), DEVICE)
    with attention_config_override(**cfg):
        assert not _launch_plan(one, decode_tail=1).constexprs["MIXED_ORDER"]


@pytest.mark.parametrize("page_size,block_n,split", [(16, 16, 1), (16, 16, 2), (16, 64, 1), (1, 16, 1), (64, 16, 1)])
def test_page_ids_a_tile_ahead_give_the_same_bits(page_size, block_n, split):
    """``ids_ahead`` loads taller tiles' page ids a tile ahead in their unmasked range over pages of 16+ keys: the
    same ids, so the same bits, on chunks over a prefix, a short chunk and one-token rows beside them (split or not;
    tiles inside a page, over several pages with one id per page); one-token pages keep the ids in the iteration."""
    spec = Spec(q_lens=[40, 1, 3, 20, 1], kv_lens=[300, 77, 3, 150, 200], pad_tokens=2, page_size=page_size,
                num_kv_heads=2, group=2, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=-1, softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2,
                strided=False, spare_pages=2, extra_cols=1, tiles=(32, 16), seed=53)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=block_n, num_splits=split, page_ids="per_page")
    for ahead in (False, True):
        with attention_config_override(**cfg, ids_ahead=ahead):
            assert _launch_plan(p).constexprs["IDS_AHEAD"] == (ahead and page_size >= 16)
    _assert_same_bits_under(p, [dict(cfg, ids_ahead=False), dict(cfg, ids_ahead=True)])


@pytest.mark.parametrize("page_size,block_n,split,guard", [
    (16, 32, 1, True),
    (16, 32, 4, True),  # split: short sequences' empty segments remapped (tails last)
    (16, 32, 4, False),  # dropped page ids: the key guard alone keeps them out
    (1, 16, 3, True),
    (64, 32, 2, True),  # tiles inside a page: one id a tile
])  # fmt: skip
def test_block_table_entries_past_a_sequence_are_never_read(page_size, block_n, split, guard):
    """Decode rows whose block table entries past their pages name a page of NaN keys and values, or lie outside
    the cache (a reused request pool's table): outputs equal the reference, for full and partial last tiles, split
    segments and remapped empty ones, with page ids clamped or dropped."""
    spec = Spec(q_lens=[1, 1, 1, 1, 1], kv_lens=[5, 260, 40, 1, 97], pad_tokens=1, page_size=page_size,
                num_kv_heads=2, group=4, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=-1, softcap=0.0, use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.2,
                strided=False, spare_pages=1, extra_cols=3, tiles=(16, block_n), seed=61, num_splits=split)  # fmt: skip
    p = build(spec, DEVICE)
    q, k_cache, v_cache, block_table, cu, seq_lens = p.args[:6]
    owned = set(block_table[block_table >= 0].tolist())
    spare = next(i for i in range(k_cache.shape[0]) if i not in owned)  # no sequence owns it (spare_pages=1)
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    for b, n in enumerate(seq_lens.tolist()):
        used = -(-n // page_size)
        block_table[b, used:] = spare
        block_table[b, used + 1 :: 2] = k_cache.shape[0] + 5  # and ids past the cache
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    with attention_config_override(BLOCK_M=16, BLOCK_N=block_n, num_splits=split, decode_order="tails_last",
                                   clamp_pages=guard):  # fmt: skip
        plan = _launch_plan(p)
        assert plan.constexprs["ONE_BLOCK_PER_SEQ"] and plan.constexprs["CLAMP_PAGES"] == guard
        out, lse = run_out_variant(p)
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, p.num_real_tokens)


@pytest.mark.parametrize("page_size,guard,window_left,ids_ahead,split", [
    (16, True, -1, False, 1),
    (16, True, -1, True, 1),  # page ids a tile ahead in the one loop
    (16, True, -1, False, 2),  # split segments: the loop's ends inside a segment
    (1, True, -1, False, 1),
    (64, True, -1, True, 1),
    (16, False, -1, False, 1),  # dropped page ids: two loops (the key guard)
    (16, True, 40, False, 1),  # a window: two loops
])  # fmt: skip
def test_diagonal_tiles_in_the_unmasked_loop_give_the_same_bits(page_size, guard, window_left, ids_ahead, split):
    """``diag_loop`` "merged" runs causal taller tiles' diagonal tiles in their unmasked loop, masked from the first
    tile that reaches the block's first row's diagonal; the tile that crosses kv_len keeps its masked loop (the slots
    past each sequence are NaN here). Close to the reference, and under the interpreter the bits of the two-loop form
    (compiled, the two forms may differ in lse's last bits: ptxas schedules and contracts each loop on its own; seen at
    page 1 on an H200), on whole prompts and chunks over a prefix whose lengths end inside a tile, a short chunk,
    one-token rows beside them and padding rows; launches with a window or dropped page ids keep two loops (the plan
    says which), and so do batch-invariant ones."""
    spec = Spec(q_lens=[40, 1, 3, 20, 70, 1], kv_lens=[300, 77, 3, 150, 70, 200], pad_tokens=2, page_size=page_size,
                num_kv_heads=2, group=2, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=window_left, softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2,
                strided=False, spare_pages=2, extra_cols=1, tiles=(32, 16), seed=59, num_splits=split)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, clamp_pages=guard, ids_ahead=ids_ahead, num_splits=split)
    for mode in configs.CHOICES["diag_loop"]:
        with attention_config_override(**cfg, diag_loop=mode):
            taken = mode == "merged" and guard and window_left < 0
            assert _launch_plan(p).constexprs["DIAG_LOOP"] == ("merged" if taken else "separate")
            assert _launch_plan(p, batch_invariant=True).constexprs["DIAG_LOOP"] == "separate"
    _assert_same_bits_under(p, [dict(cfg, diag_loop=m) for m in configs.CHOICES["diag_loop"]], same_bits=INTERPRET)


@pytest.mark.parametrize("page_size,guard", [(16, True), (16, False), (32, True)])
def test_page_ids_once_per_page_give_the_same_bits(page_size, guard):
    """``page_ids`` "per_page" loads a taller tile's page ids once per page (pages dividing the tile) instead of once
    per key: the same ids, so the same bits, on chunks over a prefix, a short chunk and one-token rows beside them."""
    spec = Spec(q_lens=[40, 1, 3, 20, 1], kv_lens=[300, 77, 3, 150, 200], pad_tokens=2, page_size=page_size,
                num_kv_heads=2, group=2, head_dim=32, head_dim_v=32, dtype=torch.float16, causal=True,
                window_left=-1, softcap=0.0, use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.2,
                strided=False, spare_pages=2, extra_cols=1, tiles=(32, 64), seed=47)  # fmt: skip
    p = build(spec, DEVICE)
    cfg = dict(BLOCK_M=32, BLOCK_N=64, clamp_pages=guard)
    for mode in configs.CHOICES["page_ids"]:
        with attention_config_override(**cfg, page_ids=mode):
            assert _launch_plan(p).constexprs["PAGE_IDS"] == mode
    _assert_same_bits_under(p, [dict(cfg, page_ids=m) for m in configs.CHOICES["page_ids"]])
