"""Decode step of the ~1B Llama-shaped model: ``python -m benchmarks.model_step [--out FILE]`` (needs a CUDA GPU).

One decode step (B sequences, one new token each, ``--context`` cached tokens, 16-token pages randomly permuted) of
``models.Llama`` with the ``1b`` preset in bf16, timed (median, ``triton.testing.do_bench``) three ways: eager,
``torch.compile(fullgraph=True)``, and compiled with CUDA graphs (``mode="reduce-overhead"``). In the same run:

- the attention share: every layer's ``reshape_and_cache`` + ``paged_attention`` alone, replayed as a CUDA graph;
- the step's floor: weights + KV bytes over the HBM read bandwidth measured in this run;
- the eager host cost of one attention call.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from triton_paged_ops.bench import finish, hbm_ceilings, host_time_us
from triton_paged_ops.models import PRESETS, Llama
from triton_paged_ops.models.llama import Batch

PAGE_SIZE = 16


def decode_batch(batch: int, context: int, vocab: int, device) -> tuple[Batch, int]:
    """B sequences of ``context`` keys (the last one new), pages randomly permuted; returns the batch, page count."""
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    table = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
    pos = context - 1
    slots = (table[:, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE).contiguous()
    return Batch(
        tokens=torch.randint(0, vocab, (batch,), device=device),
        positions=torch.full((batch,), pos, device=device),
        slot_mapping=slots,
        block_table=table,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        max_seqlen_q=1,
        max_seqlen_k=pages_per_seq * PAGE_SIZE,
    ), num_pages


def _bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def _first_call_s(fn) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _step_variants(model: Llama, batch: Batch) -> dict:
    """Step time eager / compiled / compiled + CUDA graphs, and the compile wall time of the first call."""
    res = {"eager_ms": _bench_ms(lambda: model(batch))}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    res["compile_s"] = _first_call_s(lambda: compiled(batch))
    res["compiled_ms"] = _bench_ms(lambda: compiled(batch))
    torch._dynamo.reset()
    graphed = torch.compile(model, fullgraph=True, mode="reduce-overhead")

    def graph_step():
        torch.compiler.cudagraph_mark_step_begin()
        return graphed(batch)

    res["compile_graphs_s"] = _first_call_s(graph_step)
    res["compiled_graphs_ms"] = _bench_ms(graph_step)
    got, want = graph_step().float(), model(batch).float()
    # Whole-model bf16 logits: Inductor's fused kernels round differently from eager; the relative L2 error shows
    # both ran the same model (garbage would be ~1).
    res["graphs_vs_eager_rel_l2"] = float((got - want).norm() / want.norm())
    if not res["graphs_vs_eager_rel_l2"] < 5e-2:
        raise AssertionError(f"compiled+graphs step differs from eager: {res['graphs_vs_eager_rel_l2']:.3e}")
    return res


def run(batch_size: int, context: int, seed: int = 0) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(seed)
    cfg = PRESETS["1b"]
    dev = "cuda"
    model = Llama(cfg, max_positions=context + 1).init_random(seed).to(device=dev, dtype=torch.bfloat16).eval()
    batch, num_pages = decode_batch(batch_size, context, cfg.vocab_size, dev)
    model.setup_cache(num_pages, PAGE_SIZE)
    for k_cache, v_cache in model.kv_caches():
        k_cache.normal_()
        v_cache.normal_()
    ceil = hbm_ceilings()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Each step reads every sequence's K and V in every layer (the embedding reads only B rows, but is counted whole).
    kv_bytes = cfg.num_layers * 2 * batch_size * context * cfg.num_kv_heads * cfg.head_dim * 2
    floor_ms = (weight_bytes + kv_bytes) / (ceil["read_tbps"] * 1e12) * 1e3

    counters.clear()
    with torch.no_grad():
        custom = _step_variants(model, batch)
        custom["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])

        # The attention work alone: each layer's cache write and attention, as one graph replay.
        q = torch.randn(batch_size, cfg.num_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(batch_size, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
        caches = model.kv_caches()
        targs = (batch.block_table, batch.cu_seqlens_q, batch.seq_lens, 1, batch.max_seqlen_k, cfg.head_dim**-0.5)

        def attention_only():
            for k_cache, v_cache in caches:
                torch.ops.tpa.reshape_and_cache(kv, kv, k_cache, v_cache, batch.slot_mapping)
                torch.ops.tpa.paged_attention(q, k_cache, v_cache, *targs)

        attention_only()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attention_only()
        attention_ms = _bench_ms(graph.replay)

        host = {
            "custom_op_us": host_time_us(lambda: torch.ops.tpa.paged_attention(q, caches[0][0], caches[0][1], *targs)),
        }

    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"preset": "1b", "batch": batch_size, "context": context, "page_size": PAGE_SIZE, "dtype": "bf16"},
        "ceilings": ceil,
        "floor_ms": floor_ms,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "attention_ms": attention_ms,
        "custom_op": custom,
        "eager_op_host_us": host,
    }


def format_result(r: dict) -> str:
    c = r["custom_op"]
    best = c["compiled_graphs_ms"]
    lines = [
        f"{r['gpu']}  torch {r['torch']}  triton {r['triton']}  1b bf16, B={r['shape']['batch']}, "
        f"context {r['shape']['context']}, page {r['shape']['page_size']}",
        f"floor (weights {r['weight_bytes'] / 1e9:.2f} GB + KV {r['kv_bytes'] / 1e9:.2f} GB at "
        f"{r['ceilings']['read_tbps']:.2f} TB/s): {r['floor_ms']:.3f} ms",
        f"{'registration':<13} {'eager ms':>9} {'compiled':>9} {'+graphs':>9} {'compile s':>10} {'skips':>6}",
    ]
    for name, v in (("custom op", c),):
        lines.append(f"{name:<13} {v['eager_ms']:>9.3f} {v['compiled_ms']:>9.3f} {v['compiled_graphs_ms']:>9.3f} "
                     f"{v['compile_s'] + v['compile_graphs_s']:>10.1f} {v['cudagraph_skips']:>6}  "
                     f"graphs vs eager logits: rel. L2 {v['graphs_vs_eager_rel_l2']:.1e}")  # fmt: skip
    lines.append(
        f"attention (cache write + attention, all layers, graph replay): {r['attention_ms']:.3f} ms = "
        f"{r['attention_ms'] / best:.0%} of the compiled+graphs step; step at {r['floor_ms'] / best:.0%} of its floor"
    )
    h = r["eager_op_host_us"]
    lines.append(f"eager host cost of one attention call: {h['custom_op_us']:.1f} µs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_step", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--batch", type=int, default=32, help="sequences in the decode step (default 32)")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per sequence, new one included")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the model benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args.batch, args.context, args.seed)
    finish(result, format_result(result), args.out, "benchmarks.model_step", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
