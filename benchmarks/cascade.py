"""Shared-prefix decode: ``python -m benchmarks.cascade [--out FILE]`` (needs a CUDA GPU).

64 requests share a 16k-token prefix and have 256 own tokens each (bf16, Hq32/Hkv8/D128, pages of 16 randomly
permuted); one decode step timed (CUDA-graph replay, median) as plain paged attention over each request's whole key
list and as ``cascade_attention``, checked against each other, beside the HBM read ceiling of the same run.
"""

from __future__ import annotations

import argparse
import sys

import torch

import triton_paged_ops as tpa
from triton_paged_ops.bench import finish, hbm_ceilings, time_graph
from triton_paged_ops.cascade import own_level, prefix_level
from triton_paged_ops.plan import MAX_SPLIT_Q_LEN


def run(requests: int, prefix: int, own: int, page_size: int = 16, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    prefix_pages, own_pages = prefix // page_size, -(-own // page_size)
    num_pages = prefix_pages + requests * own_pages
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen, device="cuda").to(dt)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_pages, generator=gen, device="cuda").to(torch.int32)
    shared = perm[:prefix_pages]
    mine = perm[prefix_pages:].view(requests, own_pages)
    full = torch.cat([shared.view(1, -1).expand(requests, -1), mine], dim=1).contiguous()
    q = torch.randn(requests, hq, d, generator=gen, device="cuda").to(dt)
    cu = torch.arange(requests + 1, dtype=torch.int32, device="cuda")
    own_lens = torch.full((requests,), own, dtype=torch.int32, device="cuda")
    scale = d**-0.5

    def plain():
        return tpa.paged_attention(q, k_cache, v_cache, full, cu, own_lens + prefix, 1, prefix + own, scale)

    def cascade():
        return tpa.cascade_attention(q, k_cache, v_cache, shared, prefix, mine, cu, own_lens, 1, own, scale)

    want, got = plain().float(), cascade().float()
    rel = float((got - want).norm() / want.norm())
    plain_us, cascade_us = time_graph(plain), time_graph(cascade)
    # Its parts alone: where the time goes.
    own_out, own_lse = own_level(q, k_cache, v_cache, mine, cu, own_lens, 1, own, scale)
    pre_out, pre_lse = prefix_level(q, k_cache, v_cache, shared, prefix, scale)
    parts = {
        "own_level_us": time_graph(lambda: own_level(q, k_cache, v_cache, mine, cu, own_lens, 1, own, scale)),
        "prefix_level_us": time_graph(lambda: prefix_level(q, k_cache, v_cache, shared, prefix, scale)),
        # The prefix level as chunks of MAX_SPLIT_Q_LEN queries (decode-like tiles, one prefix read per chunk).
        "prefix_level_chunked_us": time_graph(
            lambda: prefix_level(q, k_cache, v_cache, shared, prefix, scale, chunk=MAX_SPLIT_Q_LEN)
        ),
        "merge_us": time_graph(lambda: tpa.merge_attn_states(pre_out, pre_lse, own_out, own_lse)),
    }
    ceil = hbm_ceilings()
    kv_plain = 2 * requests * (prefix + own) * hkv * d * 2
    return {
        "gpu": torch.cuda.get_device_name(),
        "shape": {
            "requests": requests,
            "prefix": prefix,
            "own": own,
            "page_size": page_size,
            "Hq": hq,
            "Hkv": hkv,
            "D": d,
            "dtype": "bf16",
        },  # fmt: skip
        "ceilings": ceil,
        "plain_us": plain_us,
        "cascade_us": cascade_us,
        "speedup": plain_us / cascade_us,
        "parts": parts,
        "plain_kv_tbps": kv_plain / plain_us / 1e6,
        "rel_err_cascade_vs_plain": rel,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cascade", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=16384, help="shared prefix tokens (a multiple of 16)")
    p.add_argument("--own", type=int, default=256, help="own tokens per request, the new one included")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the cascade benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    r = run(args.requests, args.prefix, args.own)
    text = (f"{r['gpu']}: {args.requests} requests, shared prefix {args.prefix}, own {args.own}: plain "
            f"{r['plain_us']:.1f} µs ({r['plain_kv_tbps']:.2f} TB/s KV), cascade {r['cascade_us']:.1f} µs, "
            f"speedup {r['speedup']:.2f}x, rel. diff {r['rel_err_cascade_vs_plain']:.1e}; parts alone (µs): "
            + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in r["parts"].items()))  # fmt: skip
    finish(r, text, args.out, "benchmarks.cascade", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
