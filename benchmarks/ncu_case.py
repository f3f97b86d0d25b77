"""One case's kernels under Nsight Compute: ``ncu --profile-from-start off [ncu options] python -m
benchmarks.ncu_case --suite prefill --only "prefill 4x2k D64" [--sdpa cudnn]`` (CUDA GPU).

Builds the case's random batch as the benchmark does, warms up (compiles, plans, fills caches) with the profiler
off, then brackets exactly one op call, and then one call of a dense SDPA backend on the same shapes, with
``cudaProfilerStart/Stop``: the report holds those kernels alone, ours beside the dense ceiling's, for stall
reasons, pipe utilization and instruction mix compared on one shape.
"""

from __future__ import annotations

import argparse
import sys

import torch

from triton_paged_ops.bench import SUITES, _sdpa_calls, build_inputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_case", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="prefill")
    p.add_argument("--only", nargs="+", required=True, help="exact case names, e.g. 'prefill 4x2k D64'")
    p.add_argument("--sdpa", choices=("flash", "cudnn", "efficient", "none"), default="cudnn",
                   help="dense backend profiled after the op on the same shapes (default cudnn)")  # fmt: skip
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    cases = [c for c in SUITES[args.suite]() if c.name in args.only]
    if len(cases) != len(set(args.only)):
        p.error(f"--only: unknown case names {sorted(set(args.only) - {c.name for c in cases})}")
    cudart = torch.cuda.cudart()
    for case in cases:
        inp = build_inputs(case, seed=0)
        calls = _sdpa_calls(case, seed=0) if args.sdpa != "none" else []

        def dense(calls=calls):
            if not calls:  # --sdpa none
                return
            with sdpa_kernel(kinds[args.sdpa]):
                for q, k, v, kw in calls:
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)

        for _ in range(3):
            inp.call()
            dense()
        torch.cuda.synchronize()
        print(f"profiling {case.name}", flush=True)
        cudart.cudaProfilerStart()
        inp.call()
        dense()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
