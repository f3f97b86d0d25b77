"""Decode benchmark: ``python -m benchmarks.decode [--out FILE] [--only NAME ...]`` (needs a CUDA GPU).

Prints a table and writes JSON with, per case, the kernel's µs, KV TB/s and fraction of the measured HBM read
bandwidth, next to dense SDPA on the same shapes from the same run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from triton_paged_ops.bench import decode_cases, finish, format_records, run_suite
from triton_paged_ops.kernels.attention import attention_config_override


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--only", nargs="*", default=None, help="run only cases whose name contains one of these")
    p.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config",
        default=None,
        help="force launch options, e.g. BLOCK_N=64,num_warps=4,num_stages=3,num_splits=8 (default: built-in choice)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the decode benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = decode_cases()
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only)]
    forced = dict(kv.split("=") for kv in args.config.split(",")) if args.config else {}
    with attention_config_override(**{k: int(v) for k, v in forced.items()}):
        result = run_suite(cases, seed=args.seed, with_sdpa=not args.no_sdpa)
    result["config"] = forced
    finish(result, format_records(result), args.out, "benchmarks.decode", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
