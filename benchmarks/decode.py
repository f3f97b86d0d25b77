"""Decode benchmark: ``python -m benchmarks.decode [--out FILE] [--only NAME ...]`` (needs a CUDA GPU).

Prints a table and writes JSON with, per case, the kernel's µs, KV TB/s and fraction of the measured HBM read
bandwidth, next to dense SDPA on the same shapes from the same run.
"""

from __future__ import annotations

import argparse
import sys

from triton_paged_ops.bench import add_bench_arguments, bench_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__)
    add_bench_arguments(p, out_default=None, png_default=None)
    return bench_command(p.parse_args(argv), "benchmarks.decode", argv)


if __name__ == "__main__":
    sys.exit(main())
