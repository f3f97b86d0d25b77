"""Eager host time of two checkouts, interleaved on one host: ``python -m benchmarks.host_ab OLD NEW [--rounds N]
[--out FILE]`` (needs a CUDA GPU; OLD and NEW are directories holding a ``triton_paged_ops`` package, e.g. a
``git worktree`` of the older commit and this one).

The host time of one call drifts between device hosts and within a session by more than most host-path changes
(``benchmarks/NOTES.md``), so comparing runs of different times says little. Here each round runs one fresh process
per checkout, alternating, each timing an eager ``torch.add(a, b, out=c)`` yardstick (the host's speed at that
moment), the floor of a Triton launch (``bench.triton_launch_floor_us``, where the checkout has it), the floor of
the ``torch.ops`` layer (``bench.dispatcher_floor_us``, idem) and the repeated-call layers of
``paged_attention_out`` (``bench.call_layer_times_us``: the typed wrapper, ``torch.ops``, the op body) on a
one-launch case (4 x 256 keys) and a split-KV case (1 x 4096 keys). The summary is each figure's median over the
rounds per checkout, and its median ratio to the same process's yardstick.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = {"one launch (4 x 256 keys)": [256] * 4, "split (1 x 4096 keys)": [4096]}
LAYERS = ("api_wrapper", "torch_ops_call", "op_body")


def measure() -> dict:
    """One process's figures (run in the checkout under test: ``--measure``)."""
    import torch

    from triton_paged_ops.bench import Case, build_inputs, call_layer_times_us, host_time_us

    one = torch.ones(1, device="cuda")
    sink = torch.empty_like(one)
    res: dict = {"aten_add_out": host_time_us(lambda: torch.add(one, one, out=sink))}
    from triton_paged_ops import bench

    # (A checkout under test may predate the floors.)
    launch_floor = getattr(bench, "triton_launch_floor_us", None)
    dispatcher_floor = getattr(bench, "dispatcher_floor_us", None)
    if launch_floor is not None:
        res["triton_launch_floor"] = launch_floor()
    for name, lens in CASES.items():
        inp = build_inputs(Case("host", lens), seed=0)
        res[name] = call_layer_times_us(inp.args, inp.out)
        if dispatcher_floor is not None:
            res[name]["dispatcher_floor"] = dispatcher_floor(inp.args, inp.out)
    return res


def _run_in(checkout: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    # This file by path: the checkout under test may predate it.
    cmd = [sys.executable, os.path.abspath(__file__), "--measure"]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: dict[str, list[dict]]) -> dict:
    out = {}
    for tag, runs in rounds.items():
        s = {"aten_add_out": statistics.median(r["aten_add_out"] for r in runs)}
        if all("triton_launch_floor" in r for r in runs):
            s["triton_launch_floor"] = statistics.median(r["triton_launch_floor"] for r in runs)
        for case in CASES:
            if all("dispatcher_floor" in r[case] for r in runs):
                s[f"{case}: dispatcher_floor"] = statistics.median(r[case]["dispatcher_floor"] for r in runs)
            for layer in LAYERS:
                s[f"{case}: {layer}"] = statistics.median(r[case][layer] for r in runs)
                s[f"{case}: {layer} / aten"] = statistics.median(r[case][layer] / r["aten_add_out"] for r in runs)
        out[tag] = s
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", nargs="?", help="directory of the older checkout")
    ap.add_argument("new", nargs="?", help="directory of the newer checkout")
    ap.add_argument("--rounds", type=int, default=6, help="processes per checkout, alternating (default 6)")
    ap.add_argument("--out", help="JSON file to write (default: none)")
    ap.add_argument("--measure", action="store_true", help="(internal) time this checkout, print one JSON line")
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure()))
        return
    if not (args.old and args.new):
        ap.error("give the two checkouts' directories")
    rounds: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for tag, path in (("old", args.old), ("new", args.new)):
            rounds[tag].append(_run_in(path))
    summary = summarize(rounds)
    lines = [f"{'figure (median over rounds)':46s} {'old':>8s} {'new':>8s}"]
    lines += [f"{k:46s} {summary['old'].get(k, float('nan')):8.2f} {summary['new'].get(k, float('nan')):8.2f}"
              for k in summary["new"]]  # fmt: skip
    from triton_paged_ops.bench import finish

    finish({"rounds": rounds, "summary": summary}, "\n".join(lines), args.out, "benchmarks.host_ab", argv)


if __name__ == "__main__":
    main()
