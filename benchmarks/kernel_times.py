"""Where one call's time goes, kernel by kernel: ``python -m benchmarks.kernel_times [--suite S] [--only NAME ...]
[--calls N] [--out FILE]`` (CUDA GPU).

For each case of a suite (random inputs as in the benchmark), the op runs ``calls`` times under ``torch.profiler``
and each GPU kernel's mean device time per call is listed, beside the CUDA-graph replay time of the whole call and
a one-kernel read of the case's KV bytes. A kernel started as a programmatic dependent launch (the split decode's
reduce on sm_90) is resident early and waits for its predecessor, so its time includes that wait: such times
overlap and do not add up to the graph time.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.ab import select_cases
from triton_paged_ops.bench import SUITES, _git_sha, build_inputs, finish, same_size_read_us, time_graph


def kernel_times_us(fn, calls: int) -> dict[str, float]:
    """Mean device µs per call of each CUDA kernel ``fn`` launches (kernels named as the profiler names them)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    return {name: t / calls for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_times", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="decode")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="cases whose name contains one of these")
    p.add_argument("--calls", type=int, default=50, help="profiled calls per case (default 50)")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_times needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = select_cases(SUITES[args.suite](), args.only, None)
    records, lines = [], []
    for i, case in enumerate(cases):
        inp = build_inputs(case, seed=i)
        graph_us = time_graph(inp.call)
        kernels = kernel_times_us(inp.call, args.calls)
        read_us = same_size_read_us(inp.kv_bytes)
        records.append({"case": case.name, "graph_us": graph_us, "kernels_us": kernels, "read_same_bytes_us": read_us,
                        "kv_bytes": inp.kv_bytes})  # fmt: skip
        lines.append(f"{case.name}: graph replay {graph_us:.1f} µs, kernels {sum(kernels.values()):.1f} µs, "
                     f"read of the same bytes {read_us:.1f} µs")  # fmt: skip
        lines += [f"    {t:8.2f} µs  {name[:100]}" for name, t in kernels.items()]
        del inp
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": _git_sha(),
              "suite": args.suite, "calls": args.calls, "records": records}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.kernel_times", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
