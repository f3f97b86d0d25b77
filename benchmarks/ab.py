"""Launch configs side by side on one suite: ``python -m benchmarks.ab --suite {decode,prefill,short} --config JSON
[JSON ...] [--only NAME ...] [--skip NAME ...] [--rounds N] [--batch-invariant] [--sdpa] [--dtype DTYPE] [--out
FILE]`` (CUDA GPU).

Each config is a JSON object of ``attention_config_override`` keys (``{}``: the defaults), and optionally ``"hints":
false`` (the calls pass no ``decode_tail`` layout hint; by default each passes its batch's) and ``"exact": true``
(only table entries for the installed Triton and the cases' own dtype: ``configs.exact_entries_only``, no
stand-ins). ``--dtype float16`` runs the suite with fp16 queries (and fp16 caches, where a case's caches are not
fp8). All of them run the suite's cases in one process, round after round in the same order (config 0, 1, ..., then
again), so drift within the run shows beside the differences. Every timing is a CUDA-graph replay median with its
error against the reference (outputs poisoned first); the HBM read ceiling, and with ``--sdpa`` dense SDPA once per
case, come from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import torch

from triton_paged_ops import configs as config_tables
from triton_paged_ops.bench import SUITES, Case, _git_sha, finish, run_suite
from triton_paged_ops.bench import select_cases as bench_select
from triton_paged_ops.configs.heuristic import attention_config_override


def parse_configs(p: argparse.ArgumentParser, texts: list[str]) -> list[dict]:
    """``--config`` values as override dicts; anything else is a usage error (exit 2) naming the value."""
    out = []
    for text in texts:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            p.error(f"--config takes JSON objects, got {text!r}: {exc}")
        if not isinstance(cfg, dict):
            p.error(f"--config takes JSON objects, got {text!r}")
        for flag in ("hints", "exact"):
            if not isinstance(cfg.get(flag, True), bool):
                p.error(f"--config {text!r}: {flag} takes true or false")
        table_keys = {k: v for k, v in cfg.items() if k not in ("num_splits", "hints", "exact")}
        problem = config_tables.validate_config(table_keys) if table_keys else None
        if problem:
            p.error(f"--config {text!r}: {problem}")
        out.append(cfg)
    return out


def case_in(case: Case, dtype: str) -> Case:
    """``case`` with ``dtype`` queries (and caches, unless they have their own dtype: fp8 caches stay fp8)."""
    return dataclasses.replace(case, dtype=getattr(torch, dtype))


def select_cases(cases: list[Case], only: list[str] | None, skip: list[str] | None) -> list[Case]:
    """The cases ``only`` names (all if None; see ``bench.select_cases``) whose name contains none of ``skip``."""
    return [c for c in bench_select(cases, only) if not any(s in c.name for s in skip or ())]


def run(cases: list[Case], configs: list[dict], rounds: int = 1, seed: int = 0, invariant: bool = False,
        sdpa: bool = False) -> tuple[dict, str]:  # fmt: skip
    """Every config over ``cases``, ``rounds`` times; ``invariant`` adds batch-invariant mode on the same inputs
    (rows ``... invariant``), ``sdpa`` dense SDPA once per case (first round, first config)."""
    rows, ceilings, table = [], None, {}

    def column(i: int, r: int) -> str:
        return f"c{i}" + (f"/r{r}" if rounds > 1 else "")

    columns = [column(i, r) for r in range(rounds) for i in range(len(configs))]
    for r in range(rounds):
        for i, cfg in enumerate(configs):
            override = {k: v for k, v in cfg.items() if k not in ("hints", "exact")}
            tables = config_tables.exact_entries_only() if cfg.get("exact") else contextlib.nullcontext()
            with tables, attention_config_override(**override):
                res = run_suite(cases, seed=seed, with_sdpa=sdpa and r == 0 and i == 0, with_invariant=invariant,
                                hints=cfg.get("hints", True))  # fmt: skip
            ceilings = res["ceilings"]
            for rec in res["records"]:
                rows.append({"config": i, "round": r, "case": rec["case"], "provider": rec["provider"],
                             "us": rec["us"], "tflops": rec["tflops"], "kv_tbps": rec["kv_tbps"],
                             "rel_err": rec.get("rel_err")})  # fmt: skip
                if rec["provider"].startswith("sdpa") or rec["provider"] == "read_same_bytes":  # ceilings, not compared
                    continue
                name = rec["case"] + (" invariant" if rec["provider"] == "tpa_invariant" else "")
                table.setdefault(name, {})[column(i, r)] = rec["us"]
    width = max([26] + [len(n) + 2 for n in table])
    lines = [f"{'case (µs)':<{width}}" + "".join(f"{c:>10}" for c in columns)]
    lines += [f"{name:<{width}}" + "".join(f"{t.get(c, float('nan')):>10.1f}" for c in columns)
              for name, t in table.items()]  # fmt: skip
    lines.append(f"{'total':<{width}}" + "".join(f"{sum(t.get(c, 0.0) for t in table.values()):>10.1f}"
                                                  for c in columns))  # fmt: skip
    lines += [f"sdpa_dense {r['case']}: {r['us']:.1f} µs" for r in rows if r["provider"] == "sdpa_dense"]
    lines += [f"c{i}: {json.dumps(cfg)}" for i, cfg in enumerate(configs)]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": _git_sha(),
              "ceilings": ceilings, "configs": configs, "rounds": rounds, "rows": rows}  # fmt: skip
    return result, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="prefill", help="whose cases (default prefill)")
    p.add_argument("--config", nargs="+", default=["{}"], metavar="JSON",
                   help="config overrides to compare, each a JSON object "
                   "(e.g. '{\"acc_rescale\": \"always\"}')")  # fmt: skip
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="cases whose name contains one of these, or is one written after '='")  # fmt: skip
    p.add_argument("--skip", nargs="+", default=None, metavar="NAME", help="leave out cases whose name contains one")
    p.add_argument("--rounds", type=int, default=1, help="times every config runs the cases (default 1)")
    p.add_argument("--batch-invariant", action="store_true", help="also time batch-invariant mode on the same inputs")
    p.add_argument("--sdpa", action="store_true", help="dense SDPA on the same shapes, once per case")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="query dtype; also the caches' where they are not fp8 (default bfloat16)")  # fmt: skip
    p.add_argument("--out", default="tpa_ab.json", help="JSON file to write ('' for none)")
    args = p.parse_args(argv)
    configs = parse_configs(p, args.config)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    every = SUITES[args.suite]()
    cases = [case_in(c, args.dtype) for c in select_cases(every, args.only, args.skip)]
    if not cases:
        p.error(f"no case of the {args.suite} suite matches --only {args.only} --skip {args.skip}; "
                f"cases: {[c.name for c in every]}")  # fmt: skip
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result, text = run(cases, configs, args.rounds, invariant=args.batch_invariant, sdpa=args.sdpa)
    finish(result, text, args.out, "benchmarks.ab", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
