"""Where a kernel's warps wait, instruction by instruction: ``python -m benchmarks.ncu_source FILE [--top N]
[--json]``.

FILE is Nsight Compute's source page as CSV, ``ncu --import REP --page source --csv --print-source sass``, of a
report taken with ``--section SourceCounters`` (e.g. under ``benchmarks.ncu_case``). For each kernel in it: the warp
stall samples by reason; the samples grouped by how many times their instructions ran (a loop body runs tiles x
warps times, a kernel's prologue programs x warps: the groups say how much of the time each part of the code
holds); and the instructions with the most samples, each with the instruction before it and its main reason.
Samples of warps that only wait at a barrier for the whole kernel (a warp-specialized kernel's padding warps) show
up as a group run once per program holding a large share.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOURCE = "Source"


def parse(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, rows) for each kernel of the CSV: one row per SASS instruction, keyed by the page's header."""
    kernels: list[tuple[str, list[dict[str, str]]]] = []
    block: list[str] = []
    name = None

    def close() -> None:
        if name is not None and block:
            kernels.append((name, list(csv.DictReader(io.StringIO("\n".join(block))))))

    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            close()
            name, block = next(csv.reader([line]))[1], []
        elif name is not None and line.strip():
            block.append(line)
    close()
    return kernels


def _int(value: str | None) -> int:
    try:
        return int(float(value or 0))
    except ValueError:
        return 0


def summarize(rows: list[dict[str, str]], top: int = 10) -> dict:
    """A kernel's samples: total, by stall reason, by execution count, and the ``top`` instructions."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "(Not Issued)" not in k] if rows else []
    total = sum(_int(r.get(SAMPLES)) for r in rows)
    by_reason = {k.removeprefix("stall_"): sum(_int(r.get(k)) for r in rows) for k in reasons}
    groups: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        g = groups[_int(r.get(EXECUTED))]
        g[0] += 1
        g[1] += _int(r.get(SAMPLES))
    order = sorted(range(len(rows)), key=lambda i: -_int(rows[i].get(SAMPLES)))[:top]
    hot = []
    for i in order:
        r = rows[i]
        main = max(reasons, key=lambda k: _int(r.get(k)), default=None)
        hot.append({"index": i, "sass": (r.get(SOURCE) or "").strip(), "samples": _int(r.get(SAMPLES)),
                    "executed": _int(r.get(EXECUTED)), "reason": main.removeprefix("stall_") if main else None,
                    "after": (rows[i - 1].get(SOURCE) or "").strip() if i > 0 else ""})  # fmt: skip
    return {
        "samples": total,
        "by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
        "by_times_run": [{"executed": e, "instructions": n, "samples": s}
                         for e, (n, s) in sorted(groups.items(), key=lambda kv: -kv[1][1])],  # fmt: skip
        "top": hot,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_source", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="CSV of `ncu --import REP --page source --csv --print-source sass`")
    p.add_argument("--top", type=int, default=10, help="instructions with the most samples to list (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    with open(args.file) as f:
        kernels = parse(f.read())
    if not kernels:
        p.error(f"{args.file}: no kernel in it (expected ncu's source page as CSV)")
    results = [{"kernel": name, **summarize(rows, args.top)} for name, rows in kernels]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for res in results:
        total = max(res["samples"], 1)
        print(f"{res['kernel']}: {res['samples']} samples")
        print("  by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in res["by_reason"].items() if v))
        print("  by times run:")
        for g in res["by_times_run"][:8]:
            print(f"    {g['executed']:>10} x  {g['instructions']:>5} instructions  {100 * g['samples'] / total:5.1f}%")
        print("  top instructions:")
        for h in res["top"]:
            share = 100 * h["samples"] / total
            print(f"    {share:5.1f}%  {h['reason'] or '-':>14}  {h['sass'][:60]:60}  after: {h['after'][:40]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
