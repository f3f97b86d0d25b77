"""Self-check: every op against the PyTorch reference on the current device, printed as a table.

On a GPU the cases use serving-sized shapes in bf16 and fp16; on a CPU they run the same kernels through Triton's
interpreter on small shapes in fp32 and fp16 (the test suite covers bf16 there too).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable

import torch

from triton_paged_ops import api, reference
from triton_paged_ops.inputs import random_paged_batch

# Relative L2 error allowed per dtype: the reference runs in fp32 from the same inputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclasses.dataclass
class Row:
    case: str
    op: str
    dtype: str
    shape: str
    rel_err: float
    time_ms: float
    ok: bool
    error: str = ""  # the exception a case raised, if it raised one


def _attention_cases(on_gpu: bool) -> list[tuple[str, dict]]:
    if on_gpu:
        long, mid = 4096, 1024
        base = {"page_size": 16, "hkv": 8, "hq": 32, "d": 128, "dv": 128}
    else:
        long, mid = 300, 90
        base = {"page_size": 16, "hkv": 2, "hq": 8, "d": 64, "dv": 64}
    decode = [(1, long)] * 4 + [(1, mid)] * 4
    mixed = [(mid, mid + 37), (1, long), (1, 5), (17, long)]
    prefill = [(mid, mid), (mid // 2, long)]
    return [
        ("prefill", {**base, "seqs": prefill}),
        ("decode", {**base, "seqs": decode}),
        ("mixed", {**base, "seqs": mixed}),
        ("page_size=1", {**base, "seqs": mixed, "page_size": 1}),
        ("page_size=7 strided", {**base, "seqs": mixed, "page_size": 7, "strided": True}),
        ("MQA D=80", {**base, "seqs": mixed, "hkv": 1, "d": 80, "dv": 80}),
        ("GQA 6 D=96/Dv=64", {**base, "seqs": mixed, "hkv": 1, "hq": 6, "d": 96, "dv": 64}),
        ("D=192/Dv=128", {**base, "seqs": prefill, "d": 192, "dv": 128}),
        ("D=256", {**base, "seqs": decode, "d": 256, "dv": 256}),
        ("window=64", {**base, "seqs": mixed, "kw": {"window_left": 64}}),
        ("softcap+alibi", {**base, "seqs": mixed, "kw": {"softcap": 30.0, "alibi": True}}),
        ("sinks+kv scales", {**base, "seqs": mixed, "kw": {"sinks": True, "kv_scale": True}}),
        ("non-causal", {**base, "seqs": prefill, "kw": {"causal": False}}),
    ]


def _timed(fn: Callable[[], object], on_gpu: bool) -> tuple[object, float]:
    if on_gpu:
        import triton.testing

        result = fn()
        return result, triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))


def run_selfcheck(device: str | None = None, seed: int | None = None) -> list[Row]:
    """Run every case; returns one row per (case, op, dtype)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device != "cpu"
    gen = torch.Generator(device=device).manual_seed(seed if seed is not None else int(time.time()))
    dtypes = (torch.bfloat16, torch.float16) if on_gpu else (torch.float32, torch.float16)
    rows: list[Row] = []
    for dtype in dtypes:
        checks = [functools.partial(_check_attention, name, c, dtype, device, gen, on_gpu)
                  for name, c in _attention_cases(on_gpu)]  # fmt: skip
        checks += [functools.partial(_check_cache, dtype, device, gen, on_gpu),
                   functools.partial(_check_merge, dtype, device, gen, on_gpu)]  # fmt: skip
        for check in checks:
            try:
                rows.append(check())
            except Exception as e:  # a crash fails its row; the other cases still run
                case = check.args[0] if check.func is _check_attention else check.func.__name__.removeprefix("_check_")
                rows.append(Row(case, "", str(dtype).replace("torch.", ""), "", float("nan"), float("nan"), False,
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))  # fmt: skip
    return rows


def _check_attention(name: str, c: dict, dtype, device, gen, on_gpu) -> Row:
    kw = dict(c.get("kw", {}))
    hq = c["hq"]
    q_lens, kv_lens = [ql for ql, _ in c["seqs"]], [kv for _, kv in c["seqs"]]
    args = random_paged_batch(
        q_lens, kv_lens, num_q_heads=hq, num_kv_heads=c["hkv"], head_dim=c["d"], head_dim_v=c["dv"],
        page_size=c["page_size"], dtype=dtype, device=device, generator=gen, strided=c.get("strided", False),
        spare_pages=2,
    ).args  # fmt: skip
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, generator=gen, device=device) * 0.1
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=gen, device=device)
    if kw.pop("kv_scale", False):
        kw["k_scale"] = torch.tensor([0.8], device=device)
        kw["v_scale"] = torch.tensor([1.25], device=device)
    (out, lse), ms = _timed(lambda a=args, k=kw: api.paged_attention_with_lse(*a, **k), on_gpu)
    ref_out, ref_lse = reference.paged_attention_with_lse(*args, **kw)
    err = _rel(out, ref_out)
    lse_ok = torch.allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)
    shape = f"T={args[0].shape[0]} B={len(c['seqs'])} Hq={hq} Hkv={c['hkv']} D={c['d']} ps={c['page_size']}"
    return Row(name, "paged_attention", str(dtype).replace("torch.", ""), shape, err, ms,
               err <= TOLERANCE[dtype] and lse_ok and not out.isnan().any())  # fmt: skip


def _check_cache(dtype, device, gen, on_gpu) -> Row:
    n, hkv, d, page_size, num_pages = (4096, 8, 128, 16, 512) if on_gpu else (64, 2, 64, 16, 8)
    key = torch.randn(n, hkv, d, generator=gen, device=device).to(dtype)
    value = torch.randn(n, hkv, d, generator=gen, device=device).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:n].to(torch.int32)
    slots[::7] = -1  # padding tokens
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    _, ms = _timed(lambda: api.reshape_and_cache(key, value, k_cache, v_cache, slots), on_gpu)
    ok = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    return Row("cache write", "reshape_and_cache", str(dtype).replace("torch.", ""), f"N={n} Hkv={hkv} D={d}",
               0.0 if ok else float("inf"), ms, ok)  # fmt: skip


def _check_merge(dtype, device, gen, on_gpu) -> Row:
    t, h, d = (8192, 32, 128) if on_gpu else (64, 8, 64)
    out_a = torch.randn(t, h, d, generator=gen, device=device).to(dtype)
    out_b = torch.randn(t, h, d, generator=gen, device=device).to(dtype)
    lse_a = torch.randn(t, h, generator=gen, device=device) * 4
    lse_b = torch.randn(t, h, generator=gen, device=device) * 4
    lse_b[::5] = -math.inf  # empty parts
    (out, lse), ms = _timed(lambda: api.merge_attn_states(out_a, lse_a, out_b, lse_b), on_gpu)
    ref_out, ref_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    err = _rel(out, ref_out)
    ok = err <= TOLERANCE[dtype] and torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    return Row("merge", "merge_attn_states", str(dtype).replace("torch.", ""), f"T={t} H={h} D={d}", err, ms, ok)


def format_table(rows: list[Row]) -> str:
    header = ("case", "op", "dtype", "shape", "rel err", "time ms", "status")
    body = [(r.case, r.op, r.dtype, r.shape, f"{r.rel_err:.2e}", f"{r.time_ms:.3f}",
             "ok" if r.ok else f"FAIL {r.error}".strip()) for r in rows]  # fmt: skip
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
