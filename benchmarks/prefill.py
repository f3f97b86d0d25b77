"""Prefill benchmark: ``python -m benchmarks.prefill [--out FILE] [--only NAME ...]`` (needs a CUDA GPU).

Causal prefill (1x8k, 4x2k), chunked prefill on a cached prefix (4x1k new tokens on 3k), a mixed batch (a 2k chunk
on a 4k prefix beside 63 decode tokens at 4k context) and its two parts alone, head dims 64/256 and page sizes 1/64:
per case the kernel's µs and TFLOP/s (causal pairs only) beside dense causal SDPA on the same shapes, same run.
"""

from __future__ import annotations

import argparse
import sys

from triton_paged_ops.bench import add_bench_arguments, bench_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__)
    add_bench_arguments(p, out_default=None, png_default=None)
    p.set_defaults(suite="prefill")
    return bench_command(p.parse_args(argv), "benchmarks.prefill", argv)


if __name__ == "__main__":
    sys.exit(main())
