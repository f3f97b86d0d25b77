"""Host time of repeated eager decode calls without a GPU: ``python -m benchmarks.host_path``.

The attention and reduce kernels are replaced by stand-ins that record their launches instead of running them
(``benchmarks.standin``), so everything else — the typed wrapper, the ``torch.ops`` dispatch, the
prepared-launch lookup, the workspace and the short launch path's argument handling — runs as on a GPU host. What it
leaves out is the compiled launcher's own C call and the driver (a few µs per launch, timed on a GPU by
``benchmarks.overhead``). Use it to compare host-path changes on any machine (versions run in turn, a few times
each); absolute figures depend on the CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import standin
from triton_paged_ops import api
from triton_paged_ops.bench import (
    Case,
    _git_sha,
    build_inputs,
    call_layer_times_us,
    decode_loop_times_us,
    dispatcher_floor_us,
    finish,
)
from triton_paged_ops.configs import heuristic

# name: (keys per sequence, launch options)
CASES = {
    "one launch (4 x 256 keys)": ([256] * 4, {}),
    "split + reduce (1 x 4096 keys)": ([4096], {}),
}


def measure(kv_lens: list[int], calls: int, config: dict | None = None) -> dict:
    inp = build_inputs(Case("host", kv_lens), seed=0, device="cpu")
    args, out = inp.args, inp.out
    with (
        standin.recording_launches() as (attention_kernel, reduce_kernel),
        heuristic.attention_config_override(**(config or {})),
    ):
        api.paged_attention_out(*args, out=out)  # prepares the launch and records the kernels
        res = {f"{layer}_us": us for layer, us in call_layer_times_us(args, out, calls).items()}
        # PyTorch's share of the torch.ops layer: the same call into a kernel that does nothing.
        res["dispatcher_floor_us"] = dispatcher_floor_us(args, out, calls)
        # Every repeat must have taken the short path: one own launch per kernel (the first call) and no more.
        assert len(attention_kernel.own) == 1 and len(reduce_kernel.own) <= 1, "a repeat took Triton's own path"
        res["launches_per_call"] = 1 + len(reduce_kernel.own)
        # Growing bounds: each new planning bound (plan.key_bound) plans and takes Triton's own path once.
        res.update({f"{layer}_us": us for layer, us in decode_loop_times_us(args, out, calls).items()})
    return res


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_path", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed run (default 2000)")
    args = p.parse_args(argv)
    res = {name: measure(kv_lens, args.calls, config) for name, (kv_lens, config) in CASES.items()}
    res["torch"], res["cpu"], res["git_sha"] = torch.__version__, _cpu_name(), _git_sha()
    lines = [f"{name:<36} " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
             for name, r in res.items() if isinstance(r, dict)]  # fmt: skip
    finish(res, "\n".join(lines), args.out, "benchmarks.host_path", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
