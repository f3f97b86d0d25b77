"""Render a results JSON as the markdown table used in README.md: ``python -m benchmarks.table FILE``."""

from __future__ import annotations

import json
import sys


def render(result: dict) -> str:
    ceil = result["ceilings"]
    by_case: dict[str, dict[str, dict]] = {}
    for r in result["records"]:
        by_case.setdefault(r["case"], {})[r["provider"]] = r
    lines = [
        f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, commit {result['git_sha'][:7]}, "
        f"{result['date'][:10]}; measured HBM read {ceil['read_tbps']:.2f} TB/s. bf16, CUDA-graph replay, median.",
        "",
        "| case | tpa µs | tpa KV TB/s | of HBM read | dense SDPA µs | SDPA KV TB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case, prov in by_case.items():
        t, s = prov["tpa"], prov.get("sdpa_dense")
        sdpa = f"{s['us']:.1f} | {s['kv_tbps']:.2f}" if s else "– | –"
        lines.append(f"| {case} | {t['us']:.1f} | {t['kv_tbps']:.2f} | {t['frac_of_hbm_read']:.2f} | {sdpa} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
