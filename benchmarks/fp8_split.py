"""fp8-cache decode configs side by side: ``python -m benchmarks.fp8_split [--config JSON ...] [--only NAME ...]
[--batch-invariant] [--out FILE]`` (CUDA GPU).

The decode suite's page-16, head-dim-128 cases with ``float8_e4m3fn`` caches (bf16 queries, Hq32/Hkv8 unless the
case says otherwise, pages randomly permuted, CUDA-graph replay, median), run once per config override: by default
the policy before NOTES v27 (2048-key segments, grids split until they fill every program slot, sequences
outermost) and the current defaults. Every timing comes with its relative error against the reference (outputs
poisoned first), and the HBM read ceiling comes from the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from benchmarks import ab
from triton_paged_ops.bench import decode_cases, finish

# The policy before NOTES v27, then the defaults.
DEFAULT_CONFIGS = ['{"max_segment": 2048, "fill_percent": 100, "decode_order": 1}', "{}"]


def fp8_cases() -> list:
    fp8 = torch.float8_e4m3fn
    return [dataclasses.replace(c, name=f"{c.name} fp8", cache_dtype=fp8) for c in decode_cases()
            if c.cache_dtype is None and c.page_size == 16 and c.head_dim == 128]  # fmt: skip


def run(configs: list[dict], seed: int = 0, only: list[str] | None = None, invariant: bool = False) -> tuple[dict, str]:
    """Each config over the fp8 cases (those whose name contains one of ``only``, if given); ``invariant`` adds
    batch-invariant mode on the same inputs (rows ``... invariant``)."""
    return ab.run(ab.select_cases(fp8_cases(), only, None), configs, seed=seed, invariant=invariant)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_split", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        nargs="+",
        default=DEFAULT_CONFIGS,
        metavar="JSON",
        help="config overrides to compare, each a JSON object (e.g. '{\"max_segment\": 4096}')",
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="cases whose name contains one of these")
    p.add_argument("--batch-invariant", action="store_true", help="also time batch-invariant mode on the same inputs")
    p.add_argument("--out", default="tpa_fp8_split.json", help="JSON file to write")
    args = p.parse_args(argv)
    configs = ab.parse_configs(p, args.config)
    if args.only and not any(s in c.name for s in args.only for c in fp8_cases()):
        p.error(f"no case matches {args.only}; cases: {[c.name for c in fp8_cases()]}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result, text = run(configs, only=args.only, invariant=args.batch_invariant)
    finish(result, text, args.out, "benchmarks.fp8_split", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
