"""Checkouts side by side on one suite: ``python -m benchmarks.trees --tree LABEL=DIR --tree LABEL=DIR [...]
--suite {decode,prefill,short} [--only NAME ...] [--rounds N] [--out FILE]`` (CUDA GPU).

``benchmarks.ab`` compares launch configs of one checkout in one process; kernels that differ in their code need
each checkout's own package. Here every round runs ``python -m triton_paged_ops bench --suite S --no-sdpa`` in each
checkout in turn (its own process, the checkout first on the import path), so two versions of a kernel alternate on
one device and drift shows across rounds. Writes every (tree, round, case) time and error, and per case each tree's
median over the rounds and its ratio to the first tree's. A run that fails or outlasts ``--timeout`` seconds is
recorded (``failures``) and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from triton_paged_ops.bench import SUITES, finish

# Providers that are ceilings or references, not a tree's kernels.
_CEILINGS = ("sdpa", "read_same_bytes")


def parse_tree(p: argparse.ArgumentParser, text: str) -> tuple[str, Path]:
    """``LABEL=DIR`` as (label, directory holding a ``triton_paged_ops`` package); else a usage error naming it."""
    label, sep, directory = text.partition("=")
    if not sep or not label or not directory:
        p.error(f"--tree takes LABEL=DIR, got {text!r}")
    path = Path(directory).resolve()
    if not (path / "triton_paged_ops" / "__init__.py").is_file():
        p.error(f"--tree {text!r}: {path} holds no triton_paged_ops package")
    return label, path


def bench_in(directory: Path, suite: str, only: list[str] | None, timeout: float | None = None,
             python: str = sys.executable) -> dict | str:  # fmt: skip
    """The suite's JSON result from ``directory``'s own package (a fresh process whose import path starts there),
    or why there is none (exit status or timeout)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [python, "-m", "triton_paged_ops", "bench", "--suite", suite, "--no-sdpa", "--out", str(out)]
        if only:
            cmd += ["--only", *only]
        path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
        try:
            done = subprocess.run(cmd, cwd=directory, env={**os.environ, "PYTHONPATH": path}, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no result after {timeout} s"
        if done.returncode != 0 or not out.exists():
            return f"exit status {done.returncode}"
        return json.loads(out.read_text())


def collect(results: list[tuple[str, int, dict]], labels: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows: one per tree, round and timed case; summary: per case, each tree's median µs over its rounds and the
    ratio to the first of ``labels``' (none where that tree has no time)) from ``(label, round, bench result)`` in
    run order."""
    rows = []
    for label, r, result in results:
        for rec in result["records"]:
            if rec["provider"].startswith(_CEILINGS):
                continue
            case = rec["case"] + ("" if rec["provider"] == "tpa" else f" ({rec['provider']})")
            rows.append({"tree": label, "round": r, "case": case, "us": rec["us"], "rel_err": rec.get("rel_err")})
    summary = []
    for case in dict.fromkeys(row["case"] for row in rows):
        medians = {lb: statistics.median(x["us"] for x in rows if x["case"] == case and x["tree"] == lb)
                   for lb in labels if any(x["case"] == case and x["tree"] == lb for x in rows)}  # fmt: skip
        base = medians.get(labels[0])
        summary.append({"case": case, "median_us": medians,
                        "vs_first": {lb: (m / base if base else None) for lb, m in medians.items()}})  # fmt: skip
    return rows, summary


def render(summary: list[dict], labels: list[str]) -> str:
    """Median µs per case and tree, each tree after the first with its ratio to it."""
    width = max([26] + [len(s["case"]) + 2 for s in summary])
    lines = [f"{'case (median µs)':<{width}}" + "".join(f"{lb[:18]:>20}" for lb in labels)]
    for s in summary:
        cells = []
        for i, lb in enumerate(labels):
            us, ratio = s["median_us"].get(lb), s["vs_first"].get(lb)
            text = "-" if us is None else f"{us:.1f}" + (f" ({ratio:.3f})" if i and ratio else "")
            cells.append(f"{text:>20}")
        lines.append(f"{s['case']:<{width}}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trees", description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR",
                   help="a checkout to time (twice or more; the first is the baseline)")  # fmt: skip
    p.add_argument("--suite", choices=sorted(SUITES), default="prefill", help="whose cases (default prefill)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="cases whose name contains one of these, or is one written after '='")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="times every tree runs the cases (default 2)")
    p.add_argument("--timeout", type=float, default=None, help="seconds a tree's run may take (default: no limit)")
    p.add_argument("--out", default="tpa_trees.json", help="JSON file to write ('' for none)")
    args = p.parse_args(argv)
    trees = [parse_tree(p, t) for t in args.tree]
    labels = [label for label, _ in trees]
    if len(trees) < 2 or len(set(labels)) < len(labels):
        p.error(f"give at least two --tree, each its own label (got {labels})")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    runs = [(label, r, bench_in(path, args.suite, args.only, args.timeout)) for r in range(args.rounds)
            for label, path in trees]  # fmt: skip
    results = [run for run in runs if isinstance(run[2], dict)]
    failures = [{"tree": label, "round": r, "why": why} for label, r, why in runs if not isinstance(why, dict)]
    rows, summary = collect(results, labels)
    first = results[0][2] if results else {}
    result = {"gpu": first.get("gpu"), "torch": first.get("torch"), "triton": first.get("triton"),
              "date": first.get("date"), "suite": args.suite, "rounds": args.rounds,
              "trees": labels, "summary": summary, "rows": rows,
              "failures": failures}  # fmt: skip
    text = render(summary, labels) + "".join(f"\n{f['tree']} round {f['round']}: {f['why']}" for f in failures)
    finish(result, text, args.out, "benchmarks.trees", argv)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
