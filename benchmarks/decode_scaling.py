"""Decode time against context length, with the program layout held fixed: ``python -m benchmarks.decode_scaling
[--batch B] [--lengths L ...] [--splits N] [--out FILE]`` (CUDA GPU).

A short decode step costs a fixed part (launch, each program's first page ids and tiles, the slowest program's
tail, the split reduce) plus its KV bytes at the steady streaming rate. With the split count forced (every length
then runs the same grid, each program's segment growing with the context), the op's times over several lengths fit
``us = fixed + bytes / rate``, which separates the two. The same fit over the fastest dense SDPA backend (its own
plan per length) and a one-kernel read of the same bytes, measured in the same run, gives their fixed costs and
rates beside it. A case whose KV bytes are under twice the GPU's L2 is timed and listed but left out of the fits:
replayed back to back, part of it is read from L2, which would bend the line (on an H100 a 34 MB read ran at
5.5 TB/s).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from triton_paged_ops.bench import (
    Case,
    _git_sha,
    build_inputs,
    check_case,
    finish,
    same_size_read_us,
    sdpa_dense_us,
    time_graph,
)
from triton_paged_ops.configs.heuristic import attention_config_override


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ``ys`` against ``xs`` (at least two distinct xs)."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"fit_line needs two or more (x, y) pairs, got {n} xs and {len(ys)} ys")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs two distinct xs")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fixed_and_rate(kv_bytes: list[int], us: list[float]) -> dict[str, float]:
    """The fit ``us = fixed_us + bytes / (rate_tbps * 1e6)``: fixed µs and streaming TB/s (bytes per µs / 1e6)."""
    fixed, slope = fit_line([float(b) for b in kv_bytes], us)
    return {"fixed_us": fixed, "rate_tbps": 1.0 / (slope * 1e6) if slope > 0 else float("inf")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072, 262144],
                   help="context lengths, keys per sequence (default 32k to 256k)")  # fmt: skip
    p.add_argument("--splits", type=int, default=32, help="forced split count for every length (default 32)")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if len(set(args.lengths)) < 2:
        p.error("--lengths: give two or more distinct lengths")
    if not torch.cuda.is_available():
        print("decode_scaling needs a CUDA GPU", file=sys.stderr)
        return 2
    records, lines = [], []
    for i, length in enumerate(args.lengths):
        case = Case(f"B{args.batch}x{length}", [length] * args.batch)
        inp = build_inputs(case, seed=i)
        with attention_config_override(num_splits=args.splits):
            err = check_case(inp)
            tpa_us = time_graph(inp.call)
        dense = sdpa_dense_us(case, seed=i)
        best = min(dense, key=dense.get)
        read_us = same_size_read_us(inp.kv_bytes)
        records.append({"case": case.name, "kv_bytes": inp.kv_bytes, "tpa_us": tpa_us, "rel_err": err,
                        "sdpa_us": dense, "sdpa_best": best, "read_same_bytes_us": read_us})  # fmt: skip
        lines.append(f"{case.name:12s} {inp.kv_bytes / 1e6:8.1f} MB  tpa {tpa_us:7.1f} µs "
                     f"({inp.kv_bytes / tpa_us / 1e6:.2f} TB/s, err {err:.1e})  {best} {dense[best]:7.1f}  "
                     f"read {read_us:7.1f}")  # fmt: skip
        del inp
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    fitted = [r for r in records if r["kv_bytes"] >= 2 * l2_bytes]
    for r in records:
        r["in_fit"] = r in fitted
    if len({r["kv_bytes"] for r in fitted}) < 2:
        print(f"fewer than two cases of {2 * l2_bytes / 1e6:.0f} MB or more (twice the L2): no fit; give longer "
              "--lengths", file=sys.stderr)  # fmt: skip
        return 1
    sizes = [r["kv_bytes"] for r in fitted]
    fits = {
        "tpa": fixed_and_rate(sizes, [r["tpa_us"] for r in fitted]),
        "sdpa_best": fixed_and_rate(sizes, [r["sdpa_us"][r["sdpa_best"]] for r in fitted]),
        "read_same_bytes": fixed_and_rate(sizes, [r["read_same_bytes_us"] for r in fitted]),
    }
    lines.append(f"fits over the {len(fitted)} cases of {2 * l2_bytes / 1e6:.0f} MB or more (twice the L2):")
    for name, f in fits.items():
        lines.append(f"fit {name:16s} fixed {f['fixed_us']:6.2f} µs, rate {f['rate_tbps']:.2f} TB/s")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "batch": args.batch, "splits": args.splits, "l2_bytes": l2_bytes,
              "rows": records, "fits": fits}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.decode_scaling", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
