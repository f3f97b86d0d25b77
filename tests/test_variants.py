"""The launch variants GPUs run, against the reference: big GQA groups, the shipped H200 table's tiles and the
heuristic's, under Triton's interpreter (``tests.posing``), and a coverage check that every variant the planner can
reach for real model shapes runs once against the reference."""

from __future__ import annotations

import contextlib
import json
import math
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import configs, reference, warmup
from triton_paged_ops.checks import decode_tail_of
from triton_paged_ops.inputs import PagedBatch, random_paged_batch
from triton_paged_ops.kernels import hopper
from triton_paged_ops.ops import INTERPRET
from triton_paged_ops.plan import MAX_SPLIT_Q_LEN, attention_launch_plan

from . import posing
from .strategies import Spec, build, guarded, poison_unowned_slots, specs
from .test_attention import DTYPES, MAX_WORK, assert_close_to_reference, run_out_variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Posing is for the interpreter: a GPU run plans for the GPU it has.
interpreted = pytest.mark.skipif(not INTERPRET, reason="poses as a GPU under Triton's interpreter")


def _run(p, kwargs: dict, *, batch_invariant: bool = False, decode_tail: int = -1, max_seqlen_q=None,
         max_seqlen_k=None):  # fmt: skip
    """The kernels' out and lse (NaN-poisoned first: unwritten rows show) and the reference's for paged batch ``p``
    with the features in ``kwargs``."""
    t, hq = p.q.shape[:2]
    out, out_guards = guarded((t, hq, p.v_cache.shape[-1]), p.q.dtype, p.q.device)
    lse, lse_guards = guarded((t, hq), torch.float32, p.q.device)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.cu_seqlens_q, p.seq_lens,
            max_seqlen_q or p.max_seqlen_q, max_seqlen_k or p.max_seqlen_k, p.scale)  # fmt: skip
    tpa.paged_attention_out(*args, **kwargs, batch_invariant=batch_invariant, decode_tail=decode_tail, out=out,
                            lse=lse)  # fmt: skip
    out_guards()
    lse_guards()
    ref_out, ref_lse = reference.paged_attention_with_lse(*args[:9], **kwargs)
    return out, lse, ref_out, ref_lse


def _batch(q_lens, kv_lens, hq, hkv, head_dim, dtype, *, page_size=16, seed=0, width_keys=0, softcap=0.0,
           window_left=-1, sinks=False, cache_dtype=None) -> tuple[PagedBatch, dict]:  # fmt: skip
    """A random paged batch (pages permuted, NaN in every slot no sequence owns) with a block table wide enough for
    ``width_keys`` keys, and the features' arguments (with an fp8 ``cache_dtype``: its scales)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    width = max(math.ceil(n / page_size) for n in kv_lens)
    pb = random_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                            page_size=page_size, dtype=dtype, device=DEVICE, generator=gen, spare_pages=1,
                            extra_cols=max(0, math.ceil(width_keys / page_size) - width),
                            cache_dtype=cache_dtype)  # fmt: skip
    poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
    kwargs = {"causal": True, "window_left": window_left, "softcap": softcap}
    if sinks:
        kwargs["sinks"] = torch.randn(hq, generator=gen, device=DEVICE) * 2.0
    if cache_dtype is not None:
        kwargs["k_scale"] = torch.rand(1, generator=gen, device=DEVICE) + 0.5
        kwargs["v_scale"] = torch.rand(1, generator=gen, device=DEVICE) + 0.5
    return pb, kwargs


# Prefill tokens in tiles that hold one query position (a GQA group that fills the tile): each must keep its causal
# limit. Interpreter tiles (128 rows), then the tiles GPUs plan: an MQA model (48/1) verifying 4 draft tokens on the
# H200's ``short`` tile, Llama-3-405B (128/8) in batch-invariant mode (the decode tile, 16 rows), head dim 64
# prefill with groups of 65-128.
ONE_POSITION_TILES = [
    # (pose, Hq, Hkv, D, q_lens, kv_lens, batch_invariant)
    (None, 65, 1, 64, [4], [9], False),
    (None, 256, 2, 64, [3], [9], False),
    (None, 96, 1, 64, [5, 1, 3], [40, 17, 3], False),
    (None, 96, 1, 64, [5, 1, 3], [40, 17, 3], True),
    ("h200-table", 48, 1, 128, [4, 4, 1], [300, 20, 70], False),
    ("h200-table", 128, 8, 128, [3, 1], [140, 33], True),
    ("h200-table", 96, 1, 64, [70, 1], [130, 50], False),
    ("heuristic", 128, 2, 64, [6, 2], [80, 2], False),
    ("heuristic", 128, 8, 128, [2], [20], True),
]


@pytest.mark.parametrize("pose,hq,hkv,head_dim,q_lens,kv_lens,invariant", ONE_POSITION_TILES)
def test_one_position_tiles_keep_the_causal_mask(pose, hq, hkv, head_dim, q_lens, kv_lens, invariant):
    if pose is not None and not INTERPRET:
        pytest.skip("poses as a GPU under Triton's interpreter")
    p, kwargs = _batch(q_lens, kv_lens, hq, hkv, head_dim, torch.float16, seed=len(q_lens))
    with posing.planned_as(posing.POSES[pose]) if pose else contextlib.nullcontext():
        lp = _plan(p, invariant)
        assert lp.block_q == 1 < p.max_seqlen_q, "the case must put one query position in a tile of a longer query"
        out, lse, ref_out, ref_lse = _run(p, kwargs, batch_invariant=invariant)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float16, sum(q_lens))


def _plan(p, invariant: bool = False, decode_tail: int = -1):
    hq, d = p.q.shape[1:]
    return attention_launch_plan(
        num_q_heads=hq, num_kv_heads=p.k_cache.shape[2], head_dim=d, head_dim_v=p.v_cache.shape[-1],
        page_size=p.k_cache.shape[1], dtype=p.q.dtype, cache_dtype=p.k_cache.dtype, num_seqs=p.seq_lens.numel(),
        max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, causal=True, window_left=-1, softcap=0.0,
        has_alibi=False, has_sinks=False, has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=True,
        device_index=None if INTERPRET else torch.cuda.current_device(), interpret=INTERPRET,
        batch_invariant=invariant, decode_tail=decode_tail,
    )  # fmt: skip


@interpreted
@pytest.mark.parametrize("pose", sorted(posing.POSES))
@settings(max_examples=max(5, settings.default.max_examples // 5))
@given(spec=specs(dtypes=DTYPES, max_work=MAX_WORK, forced_tiles=False), invariant=st.booleans(),
       hint=st.booleans())  # fmt: skip
@example(  # Llama-3-405B's group verifying draft tokens beside decodes, in batch-invariant mode
    spec=Spec(q_lens=[4, 1, 1], kv_lens=[90, 33, 200], pad_tokens=1, page_size=16, num_kv_heads=2, group=16,
              head_dim=128, head_dim_v=128, dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0,
              use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.09, strided=False, spare_pages=1,
              extra_cols=0, tiles=None, seed=3),
    invariant=True, hint=True,
)  # fmt: skip
@example(  # gpt-oss-like: group 8 at head dim 64 with sinks and a window, a prompt chunk and decodes
    spec=Spec(q_lens=[40, 1, 1], kv_lens=[170, 64, 9], pad_tokens=0, page_size=16, num_kv_heads=2, group=8,
              head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=31, softcap=0.0,
              use_alibi=False, use_sinks=True, use_kv_scale=False, scale=0.125, strided=False, spare_pages=0,
              extra_cols=2, tiles=None, seed=4),
    invariant=False, hint=True,
)  # fmt: skip
def test_matches_reference_as_planned_on_gpus(pose, spec, invariant, hint):
    """``test_attention.test_matches_reference`` with the tiles, splits and flags the planner picks on a GPU: the
    shipped H200 table, the heuristic on an sm_90 GPU without a table, and on an MI300X (64 KiB of LDS); default and
    batch-invariant mode, with and without the caller's ``decode_tail`` hint."""
    p = build(spec, DEVICE)
    tail = decode_tail_of(spec.q_lens) if hint else -1
    with posing.planned_as(posing.POSES[pose]):
        out, lse = run_out_variant(p, batch_invariant=invariant, decode_tail=tail)
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    n = p.num_real_tokens
    assert_close_to_reference(out, lse, ref_out, ref_lse, spec.dtype, n)
    assert out[n:].isnan().all() and lse[n:].isnan().all()


# Real model shapes (query heads, KV heads, head dim, features) whose reachable variants the coverage check runs.
MODELS = {
    "llama-3-8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
    "llama-3-405b": dict(num_q_heads=128, num_kv_heads=8, head_dim=128),
    "qwen2.5-7b": dict(num_q_heads=28, num_kv_heads=4, head_dim=128),
    "mqa-48": dict(num_q_heads=48, num_kv_heads=1, head_dim=128),
    "gemma-2": dict(num_q_heads=16, num_kv_heads=8, head_dim=256, softcap=50.0, window_left=4095),
    "gpt-oss": dict(num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=True, window_left=127),
    # (A bf16 model over an fp8 KV cache with per-tensor scales: the H200 table's fp8 decode entries.)
    "llama-3-8b-fp8-kv": dict(num_q_heads=32, num_kv_heads=8, head_dim=128, cache_dtype=torch.float8_e4m3fn),
}


def _variant_batch(model: dict, lp, batch: int, q_bound: int, k_bound: int, hint: int,
                   seed: int) -> tuple[PagedBatch, dict]:  # fmt: skip
    """A batch that the planner gives the variant of (``batch``, ``q_bound``, ``k_bound``, ``hint``) as
    ``warmup.reachable_variants`` found it: one sequence of up to two query blocks (the second of one token) on
    keys that reach into a second split segment where segments are decode-sized (prefill launches' segments of
    1-4k keys would cost the interpreter minutes: there the first segment alone holds keys), and ``batch - 1``
    short ones, one token each (two in a batch said to hold no one-token sequence). The bounds, not these lengths,
    choose the variant. (A split launch's reduce runs a program per query token and head, ~10 ms each in the
    interpreter: its first sequence has two tokens.)"""
    gen = torch.Generator().manual_seed(seed)
    q_first = min(q_bound, 2 if lp.split.num_splits > 1 else lp.block_q + 1)
    segment = lp.split.segment_len
    context = segment + 37 if lp.split.num_splits > 1 and segment <= 512 else 60
    kv_first = min(k_bound, q_first + context)
    rest = 1 if hint else min(2, q_bound)
    q_lens = [q_first] + [rest] * (batch - 1)
    # (Within the bound ``max_seqlen_k`` = k_bound the launch is planned with: the ops' contract.)
    kv_lens = [kv_first] + [min(k_bound, rest + int(torch.randint(0, 40, (1,), generator=gen)))
                            for _ in range(batch - 1)]  # fmt: skip
    return _batch(q_lens, kv_lens, model["num_q_heads"], model["num_kv_heads"], model["head_dim"], torch.bfloat16,
                  seed=seed, width_keys=k_bound, softcap=model.get("softcap", 0.0),
                  window_left=model.get("window_left", -1), sinks=model.get("sinks", False),
                  cache_dtype=model.get("cache_dtype"))  # fmt: skip


@interpreted
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("pose", ["h200-table", "heuristic"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_reachable_variant_runs_against_the_reference(model, pose, invariant):
    """Serving ``model`` (bf16, pages of 16, up to 256 sequences of 32k keys and 8k-token chunks, with the
    ``decode_tail`` hint) on the H200 (its table) or on a GPU the planner has no table for (the heuristic): each
    variant ``warmup.reachable_variants`` finds is launched once, checked to be the variant launched, and compared
    with the reference."""
    m = MODELS[model]
    features = {k: m[k] for k in ("softcap", "window_left", "sinks", "cache_dtype") if k in m}
    st_ = warmup.ServingSettings(num_q_heads=m["num_q_heads"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"],
                                 dtype=torch.bfloat16, decode_tail=True, batch_invariant=invariant, lse=True,
                                 kv_scale="cache_dtype" in m, **features)  # fmt: skip
    fixed = dict(num_q_heads=st_.num_q_heads, num_kv_heads=st_.num_kv_heads, head_dim=st_.head_dim,
                 head_dim_v=st_.head_dim, page_size=st_.page_size, dtype=st_.dtype,
                 cache_dtype=st_.cache_dtype or st_.dtype, causal=True, window_left=st_.window_left,
                 softcap=st_.softcap, has_alibi=False, has_sinks=st_.sinks, has_k_scale=st_.kv_scale,
                 has_v_scale=st_.kv_scale, has_rows=False, want_lse=True, device_index=0, interpret=False,
                 batch_invariant=invariant)  # fmt: skip
    covered = 0
    with posing.planned_as(posing.POSES[pose]):
        reachable = warmup.reachable_variants(st_, 0, False)
        for i, (variant, (batch, q, k, hint)) in enumerate(sorted(reachable.items(), key=lambda kv: kv[1])):
            lp = attention_launch_plan(num_seqs=batch, max_seqlen_q=q, max_seqlen_k=k, decode_tail=hint, **fixed)
            assert lp.variant() == variant
            p, kwargs = _variant_batch(m, lp, batch, q, k, hint, seed=i)
            posing.LAUNCHED.clear()
            out, lse, ref_out, ref_lse = _run(p, kwargs, batch_invariant=invariant, max_seqlen_q=q, max_seqlen_k=k,
                                              decode_tail=-1 if hint < 0 else hint and batch - 1)  # fmt: skip
            assert {variant} == posing.LAUNCHED, f"{(batch, q, k, hint)} did not launch the variant it reaches"
            assert_close_to_reference(out, lse, ref_out, ref_lse, torch.bfloat16, int(p.cu_seqlens_q[-1]))
            covered += 1
    # (Printed after the run by conftest's summary: covered/reachable per model, planner and mode.)
    with open(os.environ["TPA_VARIANT_COVERAGE"], "a") as f:
        name = f"{model} {pose} {'batch-invariant' if invariant else 'default'}"
        f.write(json.dumps([name, covered, len(reachable)]) + "\n")
    assert covered == len(reachable) > 0


# Big GQA groups through the GPU's fast paths (each case checks that its launch takes the path it names): the
# warp-specialized sm_90 prefill kernel (groups dividing its 128-row tile), ``decode_large`` (fp8 decode of a batch
# with a (sequence, KV head) pair per SM), ``short_narrow`` (a short query's packed rows in one decode-style tile),
# bf16 and fp8 caches.
FAST_PATHS = [
    # (path, Hq, Hkv, D, q_lens, ctx_lens, cache dtype name)
    ("ws_prefill", 128, 8, 128, [300, 77], [0, 500], "bfloat16"),
    ("ws_prefill", 64, 2, 128, [129, 1, 1], [40, 700, 30], "bfloat16"),
    ("ws_prefill", 128, 1, 256, [100], [60], "bfloat16"),
    ("decode_large", 128, 8, 128, [1] * 40, [100 * i + 7 for i in range(40)], "float8_e4m3fn"),
    ("decode", 128, 8, 128, [1] * 3, [4000, 17, 900], "float8_e4m3fn"),
    ("short_narrow", 16, 4, 128, [4, 1, 3], [300, 70, 9], "bfloat16"),
    ("short_narrow", 8, 1, 64, [2, 1, 2], [90, 30, 500], "bfloat16"),
    ("short", 48, 1, 128, [4, 4, 1], [600, 40, 300], "bfloat16"),
    ("short", 128, 8, 128, [16, 3], [1000, 5], "float8_e4m3fn"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("path,hq,hkv,head_dim,q_lens,ctx_lens,cache", FAST_PATHS)
def test_big_groups_on_the_gpu_fast_paths(path, hq, hkv, head_dim, q_lens, ctx_lens, cache, invariant):
    cache_dtype = getattr(torch, cache)
    kv_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    gen = torch.Generator(device=DEVICE).manual_seed(len(q_lens))
    pb = random_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=16,
                            dtype=torch.bfloat16, device=DEVICE, generator=gen, spare_pages=1,
                            cache_dtype=cache_dtype)  # fmt: skip
    poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
    kwargs = {}
    if cache_dtype != torch.bfloat16:
        kwargs = {"k_scale": torch.tensor([0.7], device=DEVICE), "v_scale": torch.tensor([1.3], device=DEVICE)}
    lp = attention_launch_plan(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, head_dim_v=head_dim, page_size=16,
        dtype=torch.bfloat16, cache_dtype=cache_dtype, num_seqs=len(q_lens), max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens), causal=True, window_left=-1, softcap=0.0, has_alibi=False, has_sinks=False,
        has_k_scale=bool(kwargs), has_v_scale=bool(kwargs), has_rows=False, want_lse=False,
        device_index=torch.cuda.current_device(), interpret=False, batch_invariant=invariant,
    )  # fmt: skip
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    regime = configs.regime_of(max(q_lens), MAX_SPLIT_Q_LEN, len(q_lens) * hkv, num_sms, False, hq // hkv)
    if not invariant:
        if path == "ws_prefill":
            # (Where this GPU's config takes the kernel: the shipped H200 table and the sm_90 heuristic do.)
            takes = lp.config["ws_prefill"] and torch.cuda.get_device_capability()[0] == 9
            assert (lp.ws is not None) == bool(takes and hopper.available(torch.cuda.current_device()))
        else:
            assert regime == path
    t = pb.q.shape[0]
    out = torch.full((t, hq, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    tpa.paged_attention_out(*pb.args, **kwargs, batch_invariant=invariant, out=out)
    ref = reference.paged_attention(*pb.args[:9], **kwargs)
    n = sum(q_lens)
    err = ((out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
    assert not out[:n].isnan().any() and err <= 1e-2, f"relative error {err:.2e}"
