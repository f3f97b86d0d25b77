"""Where the host time of one eager decode call goes: ``python -m benchmarks.overhead`` (needs a CUDA GPU).

Times, per call (mean of many calls, µs of wall time; the GPU work is a few µs and overlaps), the layers of one
``paged_attention_out`` call from the outside in: the typed wrapper, the ``torch.ops`` dispatch, the op body, the
argument checks, the launcher without its kernels, and the Triton launches alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from triton_paged_ops import api, checks, ops
from triton_paged_ops.bench import Case, build_inputs
from triton_paged_ops.kernels.attention import _launch_paged_attention


def _us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


class _Recorder:
    """A ``wrap`` for the launcher that records each kernel launch (kernel, grid, arguments) and skips or runs it."""

    def __init__(self, run: bool):
        self.run, self.launches = run, []

    def __call__(self, kernel):
        rec = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    rec.launches.append((kernel, grid, args, kwargs))
                    if rec.run:
                        kernel[grid](*args, **kwargs)

                return launch

        return _Grid()


def measure(num_seqs: int, context: int, calls: int = 2000) -> dict:
    inp = build_inputs(Case("overhead", [context] * num_seqs), seed=0)
    q, k, v, bt, cu, sl, max_q, max_k, scale = inp.args
    out = inp.out
    launch_args = (q, k, v, bt, cu, sl, max_q, max_k, scale, True, -1, 0.0, None, None, None, None, None, out, None)
    res = {
        "api_wrapper": _us(lambda: api.paged_attention_out(*inp.args, out=out), calls),
        "torch_ops_call": _us(lambda: torch.ops.tpa.paged_attention_out(*inp.args, out=out), calls),
        "op_body": _us(lambda: ops._attention(*inp.args, out=out, op="paged_attention_out", fake=False), calls),
        "checks": _us(lambda: checks.check_attention_args(*inp.args, -1, 0.0, None, None, None, None, None), calls),
        "launcher_without_kernels": _us(lambda: _launch_paged_attention(*launch_args, False, _Recorder(False)), calls),
    }
    rec = _Recorder(False)
    _launch_paged_attention(*launch_args, False, rec)
    for i, (kernel, grid, args, kwargs) in enumerate(rec.launches):
        run = kernel[grid]
        res[f"triton_launch_{i}_{kernel.fn.__name__}"] = _us(lambda r=run, a=args, kw=kwargs: r(*a, **kw), calls)
    res["num_launches"] = len(rec.launches)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--seqs", type=int, default=4, help="sequences in the decode call (default 4)")
    p.add_argument("--context", type=int, default=256, help="keys per sequence (default 256)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the overhead benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    res = measure(args.seqs, args.context)
    res["gpu"], res["torch"] = torch.cuda.get_device_name(), torch.__version__
    res["command"] = "python -m benchmarks.overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    for key, val in res.items():
        print(f"{key:<40} {val:.1f} µs" if isinstance(val, float) else f"{key:<40} {val}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
