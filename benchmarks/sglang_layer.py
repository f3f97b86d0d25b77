"""Speed where SGLang users feel it: the ``tpa`` backend against SGLang's own ``triton`` backend at SGLang's attention
layer, on the real memory pools of SGLang's attention test kit (its mock model runner), at serving shapes.

    python -m benchmarks.sglang_layer --out RESULTS.json      (a CUDA GPU and sglang 0.5.23; see .ci/gpu)

Per case, page size and backend, in one run:
* ``forward_us``: one ``forward_decode`` / ``forward_extend`` of one layer (writes the new K/V into the pool, then
  attends), as the GPU runs it: median of CUDA-graph replays of back-to-back calls, after eager metadata set-up;
* ``eager_us``: the same call issued from Python back to back (the host's cost shows where it exceeds the GPU's);
* ``metadata_us``: the backend's per-batch ``init_forward_metadata`` (host time, once per model step);
* decode only, ``graph_step_us``: a CUDA graph as SGLang's decode graphs hold it (the in-graph metadata refill of
  the captured batch, then the layer), replayed;
* ``kv_tbps``: K/V bytes the layer must read over ``forward_us``, beside the device's measured read rate.
Outputs of the two backends are checked against each other (relative L2 difference) before timing.

Data is random (bf16), pages are placed in a random order in the pool, lengths are fixed per case.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

os.environ.setdefault("TPA_WARMUP", "0")  # kernels compile at their first call, outside the timings

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B's attention
DTYPE = torch.bfloat16
BACKENDS = ("tpa", "triton")


def cases() -> list[dict]:
    """(name, mode, prefix lengths, new tokens per request)."""
    out = []
    for batch in (1, 8, 32, 64):
        for context in (2048, 8192):
            out.append(dict(name=f"decode B{batch}x{context // 1024}k", mode="DECODE", prefix=[context - 1] * batch,
                            new=[1] * batch))  # fmt: skip
    out.append(dict(name="extend 4x1k on 3k", mode="EXTEND", prefix=[3072] * 4, new=[1024] * 4))
    out.append(dict(name="mixed 2k chunk on 4k + 63 decodes at 4k", mode="MIXED", prefix=[4096] + [4095] * 63,
                    new=[2048] + [1] * 63))  # fmt: skip
    return out


def _kit():
    from triton_paged_ops.integrations.sglang import register

    register()
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    return kit


class Batch:
    """A kit runner (pools sized for the case), its pools filled with random K/V, ``req_to_token`` mapping each
    request's pages to randomly placed physical pages, and the ``ForwardBatch`` of the case."""

    def __init__(self, case: dict, page_size: int, seed: int, device: str = "cuda", dtype: torch.dtype = DTYPE):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        kit = _kit()
        gen = torch.Generator(device=device).manual_seed(seed)
        prefix, new = case["prefix"], case["new"]
        seq = [p + n for p, n in zip(prefix, new)]
        bs = len(seq)
        max_context = -(-max(seq) // page_size) * page_size + page_size
        mode = getattr(ForwardMode, case["mode"])
        self.kit_case = kit.DenseAttentionCase(
            name=case["name"], backend="tpa", forward_mode=mode, num_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
            page_size=page_size, prefix_lens=tuple(prefix), extend_lens=tuple(new),
        )  # fmt: skip
        config = kit.TinyModelConfig(num_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                     hidden_size=NUM_Q_HEADS * HEAD_DIM, context_len=max_context,
                                     sliding_window_size=None)  # fmt: skip
        self.runner = kit.MockModelRunner(case=self.kit_case, model_config=config, dtype=dtype, device=device,
                                          max_context_len=max_context, head_dim=HEAD_DIM)  # fmt: skip
        pool = self.runner.token_to_kv_pool
        for buf in (pool.k_buffer[0], pool.v_buffer[0]):
            buf.copy_(torch.randn(buf.shape, generator=gen, device=device, dtype=torch.float32).to(buf.dtype))
        # Physical pages 1.. in a random order (page 0 is SGLang's padding page).
        pages_of = [-(-s // page_size) for s in seq]
        usable = (pool.k_buffer[0].shape[0] // page_size) - 1
        physical = torch.randperm(usable, generator=gen, device=device)[: sum(pages_of)] + 1
        r2t = self.runner.req_to_token_pool.req_to_token
        start = 0
        locs = []
        for r, (s, n_pages) in enumerate(zip(seq, pages_of)):
            pos = torch.arange(s, device=device)
            slots = physical[start + pos // page_size] * page_size + pos % page_size
            start += n_pages
            r2t[r, :s] = slots.to(torch.int32)
            locs.append(slots[prefix[r] :])
        tokens = sum(new)
        batch = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            req_pool_indices=torch.arange(bs, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=torch.cat(locs).to(torch.int64),
            seq_lens_sum=sum(seq),
            positions=torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(prefix, new)]),
        )  # fmt: skip
        self.runner.kv_index_translator.bind_own_plan(batch)
        if mode.is_extend():
            batch.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=device)
            batch.extend_prefix_lens_cpu = list(prefix)
            batch.extend_seq_lens = torch.tensor(new, dtype=torch.int32, device=device)
            batch.extend_seq_lens_cpu = list(new)
            batch.extend_num_tokens = tokens
        self.batch = batch
        self.decode = case["mode"] == "DECODE"
        self.q = torch.randn(tokens, NUM_Q_HEADS * HEAD_DIM, generator=gen, device=device).to(dtype)
        self.k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
        self.v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
        from sglang.srt.layers.radix_attention import RadixAttention

        self.layer = RadixAttention(num_heads=NUM_Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5,
                                    num_kv_heads=NUM_KV_HEADS, layer_id=0)  # fmt: skip
        self.kv_bytes = 2 * sum(seq) * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
        self.flops = 4.0 * NUM_Q_HEADS * HEAD_DIM * sum(n * p + n * (n + 1) / 2 for p, n in zip(prefix, new))

    def backend(self, name: str):
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        return ATTENTION_BACKENDS[name](self.runner)

    def forward(self, backend):
        fn = backend.forward_decode if self.decode else backend.forward_extend
        return fn(self.q, self.k, self.v, self.layer, self.batch)


def _host_us(fn, calls: int = 50, repeats: int = 7) -> float:
    """Median over repeats of the mean wall time of ``calls`` back-to-back calls, the device drained at the end."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _graph_us(fn, inner: int = 10, reps: int = 30) -> float:
    from triton_paged_ops.bench import time_graph

    return time_graph(fn, inner=inner, reps=reps)


def graph_step(b: Batch, backend):
    """SGLang's decode-graph form of a step: static metadata set up outside (returned is what a graph captures:
    the in-graph refill of the batch's metadata, then the layer)."""
    bs = b.batch.batch_size
    backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    backend.init_forward_metadata_out_graph(b.batch, in_capture=True)

    def step():
        backend.init_forward_metadata_in_graph(b.batch)
        return b.forward(backend)

    return step


def first_call(b: Batch, name: str):
    """A fresh backend of ``name`` with this batch's eager metadata, and its output (fp32)."""
    backend = b.backend(name)
    backend.init_forward_metadata(b.batch)
    return backend, b.forward(backend).float()


def rel_diff(outs: dict[str, torch.Tensor]) -> float:
    a, c = outs["tpa"], outs["triton"]
    return float((a - c).norm() / c.norm())


def _timings(b: Batch, backend, read_tbps: float) -> dict:
    forward_us = _graph_us(lambda: b.forward(backend))
    kv_tbps = b.kv_bytes / forward_us / 1e6
    return {
        "forward_us": forward_us,
        "eager_us": _host_us(lambda: b.forward(backend)),
        "metadata_us": _host_us(lambda: backend.init_forward_metadata(b.batch)),
        "kv_tbps": kv_tbps,
        "kv_read_ratio": kv_tbps / read_tbps,
        "tflops": b.flops / forward_us / 1e6,
    }


def measure(case: dict, page_size: int, seed: int, read_tbps: float) -> dict:
    b = Batch(case, page_size, seed)
    rec = {"case": case["name"], "page_size": page_size, "kv_bytes": b.kv_bytes, "flops": b.flops}
    outs = {}
    with torch.no_grad():
        for name in BACKENDS:
            try:
                backend, outs[name] = first_call(b, name)
                r = _timings(b, backend, read_tbps)
            except Exception as exc:  # one backend failing a shape is reported, not fatal
                r = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            if b.decode and "error" not in r:
                try:
                    r["graph_step_us"] = _graph_us(graph_step(b, b.backend(name)))
                except Exception as exc:
                    r["graph_step_error"] = f"{type(exc).__name__}: {exc}"[:400]
            rec[name] = r
    if len(outs) == 2:
        rec["rel_diff_tpa_vs_triton"] = rel_diff(outs)
    ok = all("forward_us" in rec[n] for n in BACKENDS)
    if ok:
        rec["speedup_forward"] = rec["triton"]["forward_us"] / rec["tpa"]["forward_us"]
        rec["speedup_eager"] = rec["triton"]["eager_us"] / rec["tpa"]["eager_us"]
        if all("graph_step_us" in rec[n] for n in BACKENDS):
            rec["speedup_graph_step"] = rec["triton"]["graph_step_us"] / rec["tpa"]["graph_step_us"]
    return rec


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def run(page_sizes: list[int], seed: int = 0, only: str | None = None) -> dict:
    from triton_paged_ops.bench import _git_sha, hbm_ceilings

    ceilings = hbm_ceilings()
    records = []
    for case in cases():
        if only and only not in case["name"]:
            continue
        for page in page_sizes:
            rec = measure(case, page, seed, ceilings["read_tbps"])
            records.append(rec)
            print(_line(rec), flush=True)
    summary = {}
    for kind in ("decode", "extend", "mixed"):
        sel = [r for r in records if r["case"].startswith(kind) and "speedup_forward" in r]
        summary[kind] = {
            "geomean_speedup_forward": _geomean([r["speedup_forward"] for r in sel]),
            "geomean_speedup_eager": _geomean([r["speedup_eager"] for r in sel]),
        }
        if kind == "decode":
            summary[kind]["geomean_speedup_graph_step"] = _geomean(
                [r["speedup_graph_step"] for r in sel if "speedup_graph_step" in r]
            )
    git = _git_sha(os.path.dirname(os.path.abspath(__file__)))  # (.ci/gpu runs it from outside the checkout)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
            "sglang": _sglang_version(), "git": git, "ceilings": ceilings, "heads": [NUM_Q_HEADS, NUM_KV_HEADS],
            "head_dim": HEAD_DIM, "dtype": str(DTYPE), "records": records, "summary": summary}  # fmt: skip


def _triton_version() -> str:
    import triton

    return triton.__version__


def _sglang_version() -> str:
    import sglang

    return sglang.__version__


def _line(r: dict) -> str:
    parts = [f"{r['case']:<42} page {r['page_size']:>3}"]
    for name in BACKENDS:
        x = r[name]
        if "error" in x:
            parts.append(f"{name}: {x['error'][:60]}")
            continue
        s = f"{name} {x['forward_us']:8.1f} us {x['kv_tbps']:5.2f} TB/s eager {x['eager_us']:7.1f}"
        if "graph_step_us" in x:
            s += f" graph {x['graph_step_us']:7.1f}"
        parts.append(s)
    if "speedup_forward" in r:
        parts.append(f"x{r['speedup_forward']:.2f} (eager x{r['speedup_eager']:.2f})")
    if "rel_diff_tpa_vs_triton" in r:
        parts.append(f"diff {r['rel_diff_tpa_vs_triton']:.1e}")
    return " | ".join(parts)


def profile_host(case_name: str, page_size: int, name: str, calls: int = 300, top: int = 25) -> None:
    """Where one eager layer call's host time goes (cProfile over ``calls`` calls, cumulative order)."""
    import cProfile
    import pstats

    case = next(c for c in cases() if c["name"] == case_name)
    b = Batch(case, page_size, seed=0)
    with torch.no_grad():
        backend, _ = first_call(b, name)
        for _ in range(20):
            b.forward(backend)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            backend.init_forward_metadata(b.batch)
            b.forward(backend)
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sglang_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="cases whose name contains this text")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--profile", metavar="BACKEND", help="instead: profile the host time of BACKEND's eager calls "
                   "(metadata + one layer) on the first selected case and page size")  # fmt: skip
    args = p.parse_args(argv)
    if args.profile:
        case = next(c["name"] for c in cases() if not args.only or args.only in c["name"])
        profile_host(case, args.page_sizes[0], args.profile)
        return 0
    from triton_paged_ops.bench import finish

    result = run(args.page_sizes, args.seed, args.only)
    text = "\n".join(f"{k}: {v}" for k, v in result["summary"].items())
    finish(result, text, args.out, "benchmarks.sglang_layer", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
