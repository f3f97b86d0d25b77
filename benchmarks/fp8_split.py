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
import json
import sys

import torch

from triton_paged_ops.bench import _git_sha, decode_cases, finish, run_suite
from triton_paged_ops.kernels.attention import attention_config_override

# The policy before NOTES v27, then the defaults.
DEFAULT_CONFIGS = ['{"max_segment": 2048, "fill_percent": 100, "decode_order": 1}', "{}"]


def fp8_cases() -> list:
    fp8 = torch.float8_e4m3fn
    return [dataclasses.replace(c, name=f"{c.name} fp8", cache_dtype=fp8) for c in decode_cases()
            if c.cache_dtype is None and c.page_size == 16 and c.head_dim == 128]  # fmt: skip


def run(configs: list[dict], seed: int = 0, only: list[str] | None = None, invariant: bool = False) -> tuple[dict, str]:
    """Each config over the fp8 cases (those whose name contains one of ``only``, if given); ``invariant`` adds
    batch-invariant mode on the same inputs (rows ``... invariant``)."""
    cases = [c for c in fp8_cases() if not only or any(s in c.name for s in only)]
    table: dict[str, list[float]] = {}
    rows, ceilings = [], None
    for cfg in configs:
        with attention_config_override(**cfg):
            r = run_suite(cases, seed=seed, with_sdpa=False, with_invariant=invariant)
        ceilings = r["ceilings"]
        for rec in r["records"]:
            rows.append({"config": cfg, "case": rec["case"], "provider": rec["provider"], "us": rec["us"],
                         "kv_tbps": rec["kv_tbps"], "rel_err": rec["rel_err"]})  # fmt: skip
            name = rec["case"] + (" invariant" if rec["provider"] == "tpa_invariant" else "")
            table.setdefault(name, []).append(rec["us"])
    head = f"{'case':<26}" + "".join(f"{'config ' + str(i):>10}" for i in range(len(configs)))
    lines = [head] + [f"{name:<26}" + "".join(f"{us:>10.1f}" for us in times) for name, times in table.items()]
    lines.append(f"{'total':<26}" + "".join(f"{sum(t[i] for t in table.values()):>10.1f}" for i in range(len(configs))))
    lines += [f"config {i}: {json.dumps(cfg)}" for i, cfg in enumerate(configs)]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": _git_sha(),
              "ceilings": ceilings, "configs": configs, "rows": rows}  # fmt: skip
    return result, "\n".join(lines)


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
    try:
        configs = [json.loads(c) for c in args.config]
    except json.JSONDecodeError as exc:
        p.error(f"--config takes JSON objects: {exc}")
    if not all(isinstance(c, dict) for c in configs):
        p.error("--config takes JSON objects")
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
