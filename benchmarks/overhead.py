"""Where the host time of one eager decode call goes: ``python -m benchmarks.overhead`` (needs a CUDA GPU).

Times, per call (``bench.host_time_us``: µs of host time, the median over runs of the mean of 200 calls that
never wait for the device), the layers of one repeated ``paged_attention_out`` call from the outside in: the
typed wrapper, the ``torch.ops`` dispatch, the op body (a repeat of earlier metadata: the prepared launch),
and, for comparison, what a first call with new metadata adds: the argument checks, the launch planning
(``prepare_attention_launch``), and Triton's own launch path for each kernel. A yardstick of the host's own
speed comes first: one eager ``torch.add(a, b, out=c)`` on one-element device tensors (an aten op's dispatch and
launch), so runs on hosts of different speed can be compared, the floor of any Triton launch there (a compiled
kernel of two arguments that does nothing, launched through its compiled launcher) and that of the ``torch.ops``
layer (the same arguments into a custom op of the same schema whose kernel does nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import standin
from triton_paged_ops import checks
from triton_paged_ops.attention_args import AttentionArgs
from triton_paged_ops.bench import (
    Case,
    build_inputs,
    call_layer_times_us,
    decode_loop_times_us,
    dispatcher_floor_us,
    finish,
    host_time_us,
    triton_launch_floor_us,
)
from triton_paged_ops.kernels import attention, merge
from triton_paged_ops.prepared import prepare_attention_launch


def measure(num_seqs: int, context: int, calls: int = 200) -> dict:
    inp = build_inputs(Case("overhead", [context] * num_seqs), seed=0)
    q, k, v, bt, cu, sl, max_q, max_k, scale = inp.args
    out = inp.out
    absent = (False,) * 5  # no ALiBi slopes, sinks, cache scales or block_table_rows
    one = torch.ones(1, device=q.device)
    sink = torch.empty_like(one)
    res = {
        "aten_add_out": host_time_us(lambda: torch.add(one, one, out=sink), calls),
        "triton_launch_floor": triton_launch_floor_us(calls),
        "dispatcher_floor": dispatcher_floor_us(inp.args, out, calls),
        **call_layer_times_us(inp.args, out, calls),
        **decode_loop_times_us(inp.args, out, calls),
        "first_call_checks": host_time_us(lambda: checks.check_attention_args(AttentionArgs(*inp.args)), calls),
        "first_call_planning_without_kernels": host_time_us(
            lambda: prepare_attention_launch(
                q, k, v, bt, sl.shape[0], max_q, max_k, scale, True, -1, 0.0, absent, out, None, False
            ),
            calls,  # fmt: skip
        ),
    }
    # The call's kernel launches as Triton's own path takes them (recorded by stand-ins, then timed for real).
    with standin.recording_launches() as (attention_kernel, reduce_kernel):
        torch.ops.tpa.paged_attention.default(*inp.args)
    launches = [(real, *own) for real, stand_in in ((attention._paged_attention_kernel, attention_kernel),
                                                     (merge._reduce_splits_kernel, reduce_kernel))
                for own in stand_in.own]  # fmt: skip
    for i, (kernel, grid, args, kwargs) in enumerate(launches):
        run = kernel[grid[: 2 if grid[2] == 1 else 3]]
        res[f"triton_own_launch_{i}_{kernel.fn.__name__}"] = host_time_us(
            lambda r=run, a=args, kw=kwargs: r(*a, **kw), calls
        )
    res["num_launches"] = len(launches)
    return res


def over_rounds(rounds: list[dict]) -> dict:
    """One record from several rounds of ``measure``: each timing the median over the rounds, with every round's
    figure beside it (a host's first seconds of calls often run slower than the rest; a round is seconds long, so
    that shows as one high round instead of moving every figure)."""
    import statistics

    res = {}
    for key, val in rounds[0].items():
        if isinstance(val, float):
            res[key] = statistics.median(r[key] for r in rounds)
            if len(rounds) > 1:
                res[f"{key}_rounds"] = [round(r[key], 2) for r in rounds]
        else:
            res[key] = val
    return res


def profile(num_seqs: int, context: int, top: int, calls: int = 2000) -> None:
    """Where the host time of ``torch.ops.tpa.paged_attention_out`` goes, function by function (own time)."""
    import cProfile
    import pstats

    inp = build_inputs(Case("overhead", [context] * num_seqs), seed=0)
    call = lambda: torch.ops.tpa.paged_attention_out(*inp.args, out=inp.out)  # noqa: E731
    host_time_us(call, 10)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--seqs", type=int, default=4, help="sequences in the decode call (default 4)")
    p.add_argument("--context", type=int, default=256, help="keys per sequence (default 256)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N functions with most own time in 2000 torch.ops calls (cProfile)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3,
                   help="times the whole set is measured, in turn; each figure is the median over rounds, and "
                   "'<name>_rounds' lists them (default 3)")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the overhead benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    res = over_rounds([measure(args.seqs, args.context) for _ in range(args.rounds)])
    if args.profile:
        profile(args.seqs, args.context, args.profile)
    res["gpu"], res["torch"] = torch.cuda.get_device_name(), torch.__version__
    lines = []
    for k, v in res.items():
        if isinstance(v, float):
            spread = ", ".join(f"{x:.1f}" for x in res.get(f"{k}_rounds", ()))
            lines.append(f"{k:<40} {v:6.1f} µs" + (f"  (rounds: {spread})" if spread else ""))
        elif not k.endswith("_rounds"):
            lines.append(f"{k:<40} {v}")
    text = "\n".join(lines)
    finish(res, text, args.out, "benchmarks.overhead", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
