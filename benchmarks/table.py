"""Render a results JSON as the markdown table used in README.md: ``python -m benchmarks.table FILE``. The dense
SDPA columns are the fastest of PyTorch's SDPA backends on the case (named where the results record it)."""

from __future__ import annotations

import json
import sys


def _us(sdpa: dict) -> str:
    """The dense ceiling's time, with the SDPA backend that gave it (the fastest of those run) where recorded."""
    return f"{sdpa['us']:.1f}" + (f" ({sdpa['backend']})" if "backend" in sdpa else "")


def render(result: dict) -> str:
    ceil = result["ceilings"]
    by_case: dict[str, dict[str, dict]] = {}
    for r in result["records"]:
        by_case.setdefault(r["case"], {})[r["provider"]] = r
    lines = [
        f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, commit {result['git_sha'][:7]}, "
        f"{result['date'][:10]}; measured HBM read {ceil['read_tbps']:.2f} TB/s. bf16, CUDA-graph replay, median.",
        "",
    ]
    if result.get("suite") == "prefill":
        # Compute-bound: TFLOP/s (causal visible pairs) and the ratio to the same-run dense SDPA.
        header = "| case | tpa µs | tpa TFLOP/s | dense SDPA µs | SDPA TFLOP/s | tpa / SDPA |"
        ours = lambda t: f"{t['us']:.1f} | {t['tflops']:.1f}"  # noqa: E731
        theirs = lambda t, s: f"{_us(s)} | {s['tflops']:.1f} | {t['tflops'] / s['tflops']:.2f}"  # noqa: E731
    else:
        header = "| case | tpa µs | tpa KV TB/s | of HBM read | dense SDPA µs | SDPA KV TB/s |"
        ours = lambda t: f"{t['us']:.1f} | {t['kv_tbps']:.2f} | {t['frac_of_hbm_read']:.2f}"  # noqa: E731
        theirs = lambda t, s: f"{_us(s)} | {s['kv_tbps']:.2f}"  # noqa: E731
        if any("read_same_bytes" in prov for prov in by_case.values()):
            # A one-kernel read of exactly the case's KV bytes: what launch, ramp and tail leave at that size.
            header += " read of the same bytes µs (TB/s) |"
    lines += [header, "| --- " + "| ---: " * (header.count("|") - 2) + "|"]
    for case, prov in by_case.items():
        t, s, r = prov["tpa"], prov.get("sdpa_dense"), prov.get("read_same_bytes")
        # Without an SDPA record: a dash in each of its columns (those after the kernel's own).
        sdpa = theirs(t, s) if s else " | ".join("–" * (header.count("|") - 3 - ours(t).count("|")))
        if "read of the same bytes" in header and s:
            sdpa += f" | {r['us']:.1f} ({r['kv_tbps']:.2f})" if r else " | –"
        lines.append(f"| {case} | {ours(t)} | {sdpa} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
