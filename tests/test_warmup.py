"""Warm-up: the enumerated variants cover every launch a serving loop within the limits makes; on a GPU, such a
loop after warm-up compiles nothing new."""

from __future__ import annotations

import random

import pytest
import torch

import triton_paged_ops as tpa
from triton_paged_ops.__main__ import main
from triton_paged_ops.plan import attention_launch_plan
from triton_paged_ops.warmup import ServingSettings, compiled_kernel_count, reachable_variants, warmup

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"
SETTINGS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16)
LIMITS = dict(max_batch=12, max_context=3000, max_query=300)


FEATURES = dict(causal=True, window_left=-1, softcap=0.0, has_alibi=False, has_sinks=False, has_k_scale=False,
                has_v_scale=False, has_rows=False, want_lse=False)  # fmt: skip


def _use_user_table(tmp_path, monkeypatch, dev, entries: list[tuple[str, dict]]) -> None:
    """A user config file with these (regime, config) entries for float16 at head dim 64 on this device."""
    import json

    from triton_paged_ops import configs

    gpu, cap = configs.device_identity(dev)
    rows = [{"dtype": "float16", "head_dim": 64, "regime": regime, "config": config} for regime, config in entries]
    user = tmp_path / "configs.json"
    user.write_text(json.dumps({"schema": configs.SCHEMA, "tables": [
        {"gpu": gpu, "capability": cap, "triton": configs.triton_version(), "entries": rows}]}))  # fmt: skip
    monkeypatch.setenv("TPA_CONFIG_FILE", str(user))


@pytest.mark.parametrize("invariant,hints,prompts", [(False, False, False), (True, False, False),
                                                     (False, True, False), (False, True, True), (True, True, True)],
                         ids=["default", "batch_invariant", "decode_tail_hints", "prompts_entry",
                              "prompts_entry_invariant"])  # fmt: skip
def test_enumerated_variants_cover_random_serving_batches(invariant, hints, prompts, tmp_path, monkeypatch):
    """(With ``decode_tail`` hints, batches said to end in one-token sequences or to hold none too: mixed batches'
    variants and, with a table whose ``prompts`` entry has other tiles than its ``prefill`` one, prompts'.)"""
    from triton_paged_ops import configs

    dev = None if INTERPRET else torch.cuda.current_device()
    if prompts:
        tiles = {"prefill": (32, 16, 4), "prompts": (64, 32, 8)}
        _use_user_table(tmp_path, monkeypatch, dev, [(regime, {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w})
                                                     for regime, (m, n, w) in tiles.items()])  # fmt: skip
    configs.reload()
    try:
        _cover_random_serving_batches(invariant, hints, prompts, dev)
    finally:
        configs.reload()


def _cover_random_serving_batches(invariant: bool, hints: bool, prompts: bool, dev) -> None:
    settings = ServingSettings(**SETTINGS, **LIMITS, batch_invariant=invariant, decode_tail=hints)
    found = reachable_variants(settings, dev, INTERPRET)
    rng = random.Random(0)
    orders, warps = set(), set()
    for _ in range(3000):
        batch = rng.randint(1, LIMITS["max_batch"])
        # Decode, speculative-verify-like and prefill-chunk bounds, and any context bound up to the limit.
        q = rng.choice([1, rng.randint(2, 16), rng.randint(17, LIMITS["max_query"])])
        k = rng.randint(q, LIMITS["max_context"])
        # Not known, no one-token sequence, or all but the first (none for a lone sequence).
        tail = rng.choice([-1, 0, batch - 1]) if hints else -1
        lp = attention_launch_plan(**SETTINGS, cache_dtype=SETTINGS["dtype"], num_seqs=batch, max_seqlen_q=q,
                                   max_seqlen_k=k, head_dim_v=64, device_index=dev, interpret=INTERPRET,
                                   **FEATURES, batch_invariant=invariant, decode_tail=tail)  # fmt: skip
        assert lp.variant() in found, (batch, q, k, tail)
        orders.add(lp.constexprs["MIXED_ORDER"])
        if q > 16:
            warps.add(lp.config["num_warps"])
    assert orders == ({False, True} if hints and not invariant else {False})
    if prompts and not invariant:
        assert warps == {4, 8}  # both prefill entries were in use
        # Warm-up runs each variant, the prompts' ones with a batch said to hold no one-token sequence.
        small = ServingSettings(**SETTINGS, max_batch=3, max_context=256, max_query=40, decode_tail=True)
        report = warmup(small, DEVICE)
        assert report.variants == len(reachable_variants(small, dev, INTERPRET))


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_enumerated_variants_cover_the_large_batch_decode_entry(tmp_path, monkeypatch, invariant):
    """With a table whose ``decode_large`` entry (batches with a (sequence, KV head) pair per SM) has its own tiles
    and split policy, the enumeration reaches the variants of both decode entries."""
    from triton_paged_ops import configs
    from triton_paged_ops.configs import num_sms_of

    dev = None if INTERPRET else torch.cuda.current_device()
    _use_user_table(tmp_path, monkeypatch, dev, [
        ("decode", {"BLOCK_N": 32, "num_warps": 4, "programs_per_sm": 2}),
        ("decode_large", {"BLOCK_N": 64, "num_warps": 1, "programs_per_sm": 6, "max_segment": 1024,
                          "min_segment": 256, "invariant_segment": 1024})])  # fmt: skip
    configs.reload()
    try:
        full = -(-num_sms_of(torch.device(DEVICE)) // SETTINGS["num_kv_heads"])
        limits = dict(max_batch=full + 20, max_context=4096, max_query=16)
        found = reachable_variants(ServingSettings(**SETTINGS, **limits, batch_invariant=invariant), dev, INTERPRET)
        rng = random.Random(2)
        tiles = set()
        for _ in range(1500):
            batch = rng.choice([rng.randint(1, full - 1), rng.randint(full, limits["max_batch"])])
            q = rng.choice([1, 1, rng.randint(2, 16)])
            k = rng.randint(q, limits["max_context"])
            lp = attention_launch_plan(**SETTINGS, cache_dtype=SETTINGS["dtype"], num_seqs=batch, max_seqlen_q=q,
                                       max_seqlen_k=k, head_dim_v=64, device_index=dev, interpret=INTERPRET,
                                       **FEATURES, batch_invariant=invariant)  # fmt: skip
            assert lp.variant() in found, (batch, q, k)
            tiles.add((q == 1, lp.config["BLOCK_N"], lp.config["num_warps"]))
        # Both decode entries were in use (the mode: the large entry's tile everywhere).
        assert {(True, 32, 4), (True, 64, 1)} <= tiles if not invariant else {t[1:] for t in tiles} == {(64, 1)}
    finally:
        configs.reload()


def test_invariant_variants_cover_leaf_and_segment_programs():
    """Batch-invariant serving whose batches split by leaf (small grids) and by segment (large ones): the
    enumeration reaches both kinds of split program and the one-program fold."""
    settings = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.float16)
    dev = None if INTERPRET else torch.cuda.current_device()
    found = reachable_variants(ServingSettings(**settings, max_batch=64, max_context=8192, max_query=64,
                                               batch_invariant=True), dev, INTERPRET)  # fmt: skip
    rng = random.Random(1)
    kinds = set()
    for _ in range(1500):
        batch, q = rng.randint(1, 64), rng.choice([1, rng.randint(2, 16), rng.randint(17, 64)])
        lp = attention_launch_plan(**settings, cache_dtype=torch.float16, num_seqs=batch, max_seqlen_q=q,
                                   max_seqlen_k=rng.randint(q, 8192), head_dim_v=128, device_index=dev,
                                   interpret=INTERPRET, **FEATURES, batch_invariant=True)  # fmt: skip
        assert lp.variant() in found
        kinds.add((lp.split.num_splits > 1, lp.constexprs["LEAVES"]))
    assert {(True, 1), (True, 4), (False, 4)} <= kinds


def test_warmup_runs_each_variant_and_reports(capsys):
    limits = dict(max_batch=4, max_context=2048, max_query=40)
    dev = None if INTERPRET else torch.cuda.current_device()
    settings = ServingSettings(**SETTINGS, **limits, sinks=True)
    found = reachable_variants(settings, dev, INTERPRET)
    report = warmup(settings, DEVICE)
    assert report.variants == len(found) >= 2
    assert report.calls == len(found) + 2  # plus the two slot-mapping dtypes of the cache write
    assert main(["warmup", "--head-dim", "64", "--num-heads", "8", "--num-kv-heads", "2", "--dtype", "fp16",
                 "--max-batch", "2", "--max-context", "256", "--max-query", "16"]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert "attention variants" in printed.out and "variants compiled" in printed.out
    assert ("compiling nothing" in printed.err) == INTERPRET  # (said on a CPU: warm-up is GPU work)
    # With the layout hint, the hinted batches' variants too (the interleaved mixed order).
    cli = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch=3, max_context=256,
               max_query=40)  # fmt: skip
    hinted = len(reachable_variants(ServingSettings(**cli, decode_tail=True), dev, INTERPRET))
    assert hinted > len(reachable_variants(ServingSettings(**cli), dev, INTERPRET))
    assert main(["warmup", "--head-dim", "64", "--num-heads", "8", "--num-kv-heads", "2", "--dtype", "fp16",
                 "--max-batch", "3", "--max-context", "256", "--max-query", "40", "--decode-tail"]) == 0  # fmt: skip
    assert f"warm-up: {hinted} attention variants" in capsys.readouterr().out
    assert main(["warmup", "--head-dim", "64", "--num-heads", "6", "--num-kv-heads", "4"]) == 2
    fp8 = warmup(ServingSettings(**SETTINGS, **limits, cache_dtype=torch.float8_e4m3fn), DEVICE)
    assert fp8.variants == report.variants  # same launch decisions, other kernels (fp8 pointers)


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_serving_loop_after_warmup_compiles_nothing(invariant, fp8):
    """(An fp8 cache on an H200 also has a table entry of its own for batches with a pair per SM.) The loop passes
    each batch's ``decode_tail`` hint, so mixed batches take their interleaved variants."""
    settings = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    limits = dict(max_batch=48, max_context=8192, max_query=512)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    st = ServingSettings(**settings, **limits, batch_invariant=invariant, cache_dtype=cache_dtype, kv_scale=fp8,
                         decode_tail=True)  # fmt: skip
    scales = (
        {"k_scale": torch.tensor([0.5], device="cuda"), "v_scale": torch.tensor([2.0], device="cuda")} if fp8 else {}
    )
    report = warmup(st)
    before = compiled_kernel_count()
    # Each variant has its own attention kernel (variants may share a reduce kernel: decode and prefill splits).
    found = reachable_variants(st, torch.cuda.current_device(), False)
    attention_kernels = {(v[0], v[1], v[3]) for v in found}
    assert report.variants == len(found)
    assert before is not None and before >= len(attention_kernels)
    rng = random.Random(1)
    pages = 48 * 8192 // 16
    k_cache = torch.randn(pages, 16, 8, 128, device="cuda").to(cache_dtype)
    v_cache = torch.randn(pages, 16, 8, 128, device="cuda").to(cache_dtype)
    for step in range(60):
        batch = rng.randint(1, limits["max_batch"])
        kind = step % 3  # decode, short (speculative verify), mixed prefill chunk + decodes
        q_lens = [1] * batch if kind == 0 else [rng.randint(1, 16) for _ in range(batch)]
        if kind == 2:
            if rng.random() < 0.5:  # a prompt's chunk, then decodes (a decode tail)
                q_lens = [1] * batch
            q_lens[0] = rng.randint(17, limits["max_query"])
        kv_lens = [q + rng.randint(0, limits["max_context"] - limits["max_query"]) for q in q_lens]
        width = -(-max(kv_lens) // 16)
        table = torch.randint(0, pages, (batch, width), dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(0, pages * 16, (sum(q_lens),), device="cuda")
        kv = torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
        tpa.reshape_and_cache(kv, kv, k_cache, v_cache, slots, **scales)
        tpa.paged_attention(q, k_cache, v_cache, table, cu, torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
                            max(q_lens), max(kv_lens), 128**-0.5, batch_invariant=invariant,
                            decode_tail=tpa.decode_tail_of(q_lens), **scales)  # fmt: skip
    torch.cuda.synchronize()
    assert compiled_kernel_count() == before
