"""A fluid model of how the split decode grid of the ragged batch runs: ``python -m benchmarks.schedule_model``.

No GPU: programs are dispatched in grid order into ``slots`` resident places; a running program first spends a fixed
cost (prologue, epilogue: no bandwidth), then reads its keys, all reading programs sharing the HBM bandwidth
equally, each at most ``lone`` bytes/s (a program alone on an SM waits out each tile's load latency). Programs of
segments past their sequence's end cost ``empty``. It prints the makespan of the shipped dispatch order (decode
order 4: each sequence's segments in the last groups) and of variants, and how it moves with the lone rate and the
fixed cost: what a change to the kernel's per-tile or per-program latency can buy on this case (NOTES v19).
"""

from __future__ import annotations

import argparse
import math

from triton_paged_ops.bench import _ragged_lengths


def dispatch(lengths: list[int], heads: int, segment: int, splits: int, balanced: bool, sort_groups: bool) -> list:
    """Keys per program in dispatch order: segment groups slowest, sequences, then KV heads; each sequence's
    segments right-aligned in the last groups (``balanced``: its segments equal instead of full-then-partial;
    ``sort_groups``: each group longest first, which needs the lengths on the device)."""
    order = []
    for g in range(splits):
        group = []
        for length in lengths:
            n = max(1, min(math.ceil(length / segment), splits))
            j = g - (splits - n)
            if j < 0:
                group += [0] * heads
                continue
            seg = math.ceil(math.ceil(length / n) / 128) * 128 if balanced else segment
            group += [max(0, min(length, (j + 1) * seg) - j * seg)] * heads
        order += sorted(group, reverse=True) if sort_groups else group
    return order


def makespan(keys: list[int], key_bytes: int, slots: int, bandwidth: float, lone: float, fixed: float,
             empty: float) -> float:  # fmt: skip
    """Seconds until the last program ends (event-driven: rates change only when a program starts or ends)."""
    t, i, active = 0.0, 0, []  # active: [fixed cost left (s), bytes left]
    while i < len(keys) or active:
        while len(active) < slots and i < len(keys):
            active.append([fixed if keys[i] else empty, keys[i] * key_bytes])
            i += 1
        reading = sum(1 for a in active if a[0] <= 0 and a[1] > 0)
        rate = min(lone, bandwidth / reading) if reading else 0.0
        dt = max(min(a[0] if a[0] > 0 else a[1] / rate if a[1] > 0 else 0.0 for a in active), 1e-10)
        for a in active:
            if a[0] > 0:
                a[0] -= dt
            elif a[1] > 0:
                a[1] -= rate * dt
        t += dt
        active = [a for a in active if a[0] > 1e-12 or a[1] > 1e-3]
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.schedule_model", description=__doc__)
    p.add_argument("--slots", type=int, default=132 * 3, help="resident programs (SMs x programs per SM)")
    p.add_argument("--bandwidth", type=float, default=4.3, help="HBM read bandwidth, TB/s (default 4.3)")
    p.add_argument("--lone", type=float, default=32.0, help="one program's read rate alone, GB/s (default 32)")
    p.add_argument("--fixed", type=float, default=2.0, help="fixed cost per program, µs (default 2)")
    p.add_argument("--empty", type=float, default=0.5, help="cost of an empty program, µs (default 0.5)")
    args = p.parse_args(argv)
    lengths = _ragged_lengths(96, 128, 8192)  # the decode suite's ragged batch (8 KV heads, D128 bf16)
    heads, key_bytes, segment, splits = 8, 2 * 2 * 128, 2048, 4

    def run(balanced=False, sort_groups=False, lone=args.lone, fixed=args.fixed) -> float:
        keys = dispatch(lengths, heads, segment, splits, balanced, sort_groups)
        return 1e6 * makespan(keys, key_bytes, args.slots, args.bandwidth * 1e12, lone * 1e9, fixed * 1e-6,
                              args.empty * 1e-6)  # fmt: skip

    total = sum(lengths) * heads * key_bytes
    print(f"ragged batch: {total / 1e9:.3f} GB of KV, {total / (args.bandwidth * 1e12) * 1e6:.1f} µs at the bandwidth")
    for name, kw in [("decode order 4 (shipped)", {}), ("segments balanced per sequence", {"balanced": True}),
                     ("each group longest first", {"sort_groups": True})]:  # fmt: skip
        print(f"{name:<34} {run(**kw):7.1f} µs")
    for lone in (24.0, 32.0, 48.0):
        for fixed in (1.0, 2.0, 3.0):
            print(f"order 4, lone {lone:4.0f} GB/s, fixed {fixed:.0f} µs  {run(lone=lone, fixed=fixed):7.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
