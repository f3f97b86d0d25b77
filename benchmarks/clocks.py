"""Calls back to back against calls after idle, with the SM clock and board power beside them: ``python -m
benchmarks.clocks [--suite S] [--only NAME ...] [--seconds S] [--spaced N] [--gap-ms MS] [--out FILE]`` (CUDA
GPU and nvidia-smi).

The suites time graph replays of 20 calls back to back (about half a second of work for a 1 ms case). For each
case this runs the op and the fastest dense SDPA backend in two ways:

- sustained: after a second of idle, the 20-call graph replayed back to back for ``--seconds``; each replay is timed
  (events) and placed in time, so the first replays (a cool, idle card) and the last second (steady state) are
  reported apart;
- spaced: a one-call graph replayed ``--spaced`` times, each after ``--gap-ms`` of idle.

Meanwhile nvidia-smi samples the SM clock, the board power and the reasons the driver gives for holding the clock
down, every 20 ms. Per phase: median µs a call, TFLOP/s (prefill) or TB/s of KV (decode), the median clock and
power of the samples inside it, the reasons seen, and on Hopper (sm_90, 16-bit) the TFLOP/s as a fraction of the
tensor cores' dense peak at that clock (SMs x 4,096 FLOP a cycle). The clock reading is current; the power reading
is the driver's average over about a second, so the first stretch's shows the idle before it. A spaced call is too
short to catch a sample: its clock column is empty.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch
import triton

from triton_paged_ops.bench import (
    SDPA_BACKENDS,
    SUITES,
    _git_sha,
    build_inputs,
    capture_graph,
    check_case,
    finish,
    sdpa_runner,
    select_cases,
    time_graph,
)

SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# Bits of the driver's clock-event reasons (nvidia-smi --help-query-gpu): why the SM clock is below its maximum.
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}  # fmt: skip
HOPPER_FLOP_PER_SM_CYCLE = 4096  # dense fp16/bf16 tensor-core FLOP per SM per cycle on sm_90


def parse_sample(line: str) -> dict[str, float | int | None] | None:
    """One nvidia-smi CSV line (``SMI_FIELDS``, no header or units) as numbers; None for a line that is not one.
    A field the driver does not report ("[N/A]", "[Not Supported]") becomes None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(SMI_FIELDS):
        return None
    values: dict[str, float | int | None] = {}
    for name, text in zip(SMI_FIELDS, parts):
        try:
            values[name] = int(text, 16) if name == "clocks_event_reasons.active" else float(text)
        except ValueError:
            values[name] = None
    return values


def reason_names(mask: int) -> list[str]:
    """The named bits of a clock-event reasons mask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


class Sampler:
    """nvidia-smi's readings of one GPU every ``period_ms``, each stamped with ``time.monotonic()`` on arrival."""

    def __init__(self, gpu: str | None, period_ms: int = 20):
        self.samples: list[tuple[float, dict]] = []
        cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
               f"-lms={period_ms}"]  # fmt: skip
        if gpu:
            cmd.append(f"--id={gpu}")
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.monotonic(), sample))

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait()
        self._thread.join(timeout=2)

    def between(self, t0: float, t1: float) -> list[dict]:
        return [s for t, s in self.samples if t0 <= t <= t1]


def summarize(samples: list[dict]) -> dict:
    """Median SM clock (MHz), power (W) and temperature (C) of ``samples``, and the clock-event reasons seen."""

    def med(key):
        vals = [s[key] for s in samples if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    mask = 0
    for s in samples:
        mask |= s.get("clocks_event_reasons.active") or 0
    return {"samples": len(samples), "sm_mhz": med("clocks.sm"), "power_w": med("power.draw"),
            "temp_c": med("temperature.gpu"), "reasons": reason_names(mask)}  # fmt: skip


def sustained(fn, sampler: Sampler | None, seconds: float, inner: int = 20) -> dict:
    """Replays of ``inner`` calls back to back for ``seconds`` after a second of idle: the first three replays'
    median µs a call, the last second's, and the nvidia-smi readings of each stretch."""
    graph = capture_graph(fn, inner)
    time.sleep(1.0)
    events, stamps = [], []
    t0 = time.monotonic()
    # Host-side pacing: enqueue replays while keeping at most a few in flight, so each replay's host time is close
    # to when it ran.
    while time.monotonic() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
        if len(events) > 3:
            events[-4][1].synchronize()
            stamps.append(time.monotonic())
    torch.cuda.synchronize()
    stamps += [time.monotonic()] * (len(events) - len(stamps))
    per_call = [s.elapsed_time(e) * 1e3 / inner for s, e in events]
    t_end = time.monotonic()
    head = per_call[:3]
    tail = [us for us, t in zip(per_call, stamps) if t >= t_end - 1.0] or per_call[-3:]
    first = sampler.between(t0, t0 + 0.1) if sampler else []
    last = sampler.between(t_end - 1.0, t_end) if sampler else []
    return {"replays": len(per_call), "first_us": statistics.median(head), "steady_us": statistics.median(tail),
            "first_smi": summarize(first), "steady_smi": summarize(last)}  # fmt: skip


def spaced(fn, count: int, gap_ms: float) -> dict:
    """Median µs of one call (a one-call graph), each replay after ``gap_ms`` of idle."""
    graph = capture_graph(fn, 1)
    times = []
    for _ in range(count):
        time.sleep(gap_ms / 1e3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return {"calls": count, "gap_ms": gap_ms, "us": statistics.median(times)}


def peak_tflops(mhz: float | None, dtype: torch.dtype) -> float | None:
    """The tensor cores' dense 16-bit peak at ``mhz`` on sm_90; None elsewhere (another rate per cycle)."""
    if mhz is None or torch.cuda.get_device_capability() != (9, 0) or dtype.itemsize != 2:
        return None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return sms * HOPPER_FLOP_PER_SM_CYCLE * mhz * 1e6 / 1e12


def _dense_best(case, seed: int):
    """(name, call) of the fastest SDPA backend on the case's dense shapes; None where none takes them."""
    best = None
    for name in SDPA_BACKENDS:
        run = sdpa_runner(case, seed, name)
        if run is not None:
            us = time_graph(run)
            if best is None or us < best[0]:
                best = (us, f"sdpa_{name}", run)
    return best[1:] if best else None


def _run_case(case, seed: int, sampler: Sampler | None, args, lines: list[str]) -> dict:
    """Both phases for the op and the fastest dense backend on ``case``; a text line per kernel and phase."""
    inp = build_inputs(case, seed=seed)
    err = check_case(inp)
    decode = max(case.queries()) == 1
    kernels = {"tpa": inp.call}
    dense = _dense_best(case, seed)
    if dense:
        kernels[dense[0]] = dense[1]
    rec = {"case": case.name, "rel_err": err, "flops": inp.flops, "kv_bytes": inp.kv_bytes, "kernels": {}}
    for name, fn in kernels.items():
        r = {"sustained": sustained(fn, sampler, args.seconds), "spaced": spaced(fn, args.spaced, args.gap_ms)}
        phases = (("first", r["sustained"]["first_us"]), ("steady", r["sustained"]["steady_us"]),
                  ("spaced", r["spaced"]["us"]))  # fmt: skip
        for phase, us in phases:
            smi = r["sustained"].get(f"{phase}_smi", {})
            if decode:
                r[f"{phase}_tbps"] = inp.kv_bytes / us / 1e6
                txt = f"{r[f'{phase}_tbps']:5.2f} TB/s"
            else:
                r[f"{phase}_tflops"] = tflops = inp.flops / us / 1e6
                peak = peak_tflops(smi.get("sm_mhz"), case.dtype)
                r[f"{phase}_of_peak_at_clock"] = tflops / peak if peak else None
                txt = f"{tflops:6.1f} TFLOP/s" + (f" ({tflops / peak:.0%} of peak at clock)" if peak else "")
            if smi.get("sm_mhz"):
                txt += f"  {smi['sm_mhz']:.0f} MHz {smi['power_w'] or 0:.0f} W {','.join(smi['reasons'])}"
            lines.append(f"{case.name:20s} {name:12s} {phase:7s} {us:8.1f} µs  {txt}")
        rec["kernels"][name] = r
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.clocks", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="prefill", help="benchmark suite (default prefill)")
    p.add_argument(
        "--only",
        nargs="+",
        default=["=prefill 1x8k"],
        metavar="NAME",
        help="cases: a name containing NAME, or exactly it with a leading '=' (default '=prefill 1x8k')",
    )
    p.add_argument("--seconds", type=float, default=4.0, help="back-to-back stretch per kernel (default 4)")
    p.add_argument("--spaced", type=int, default=20, help="calls after idle per kernel (default 20)")
    p.add_argument("--gap-ms", type=float, default=200.0, help="idle before each spaced call (default 200)")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if args.seconds < 1.5:
        p.error("--seconds: at least 1.5 (the steady figure is the last second's)")
    if not torch.cuda.is_available():
        print("clocks needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = select_cases(SUITES[args.suite](), args.only)
    if not cases:
        p.error(f"--only: no {args.suite} case matches {args.only}")
    # nvidia-smi numbers GPUs its own way: name this one by UUID unless it is the machine's only GPU.
    only_gpu = torch.cuda.device_count() == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    gpu = None if only_gpu or uuid is None else f"GPU-{uuid}"
    sampler = Sampler(gpu) if shutil.which("nvidia-smi") else None
    records, lines = [], []
    try:
        for i, case in enumerate(cases):
            records.append(_run_case(case, i, sampler, args, lines))
    finally:
        if sampler:
            sampler.close()
    limits = None
    if sampler:
        q = ["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"]
        run = subprocess.run(q + ([f"--id={gpu}"] if gpu else []), capture_output=True, text=True)
        limits = run.stdout.strip() if run.returncode == 0 else None
        print(f"power limit W, max SM clock MHz: {limits}")
    result = {"gpu": torch.cuda.get_device_name(), "power_limit_w_max_sm_mhz": limits,
              "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "sampled": sampler is not None and bool(sampler.samples),
              "seconds": args.seconds, "gap_ms": args.gap_ms, "rows": records}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.clocks", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
