"""A model of the warp-specialized prefill kernel's barrier protocol (``kernels.hopper``, a program per SM):
``python -m benchmarks.ws_protocol_model [--trials N] [--seed S]``. No GPU.

The producer and the two consumer warpgroups are Python generators that wait on and arrive at mbarriers with the
kernel's counts and phase parities (a wait for parity P passes once the barrier's phase P has completed: the
hardware's ``try_wait.parity``). Copies land at once, so only the order of waits and arrivals is modelled, not
their timing. The model runs random items through random interleavings: an item's KV tile count and how many of
its tiles each warpgroup reads (causal rows leave the first warpgroup fewer tiles; a warpgroup may hold no rows).
It reports each consumer form that can stop with every process waiting: the kernel's (``main``) and one built
wrong on purpose (``wait-first``: a warpgroup that waits for the next item's description while it still holds
slots the producer needs for this item's later tiles), the check that the model finds a deadlock where one is.
"""

from __future__ import annotations

import argparse
import random

STAGES = 2
Q_BUFS = 2
CONSUMER_FORMS = ("main", "wait-first")


class Barrier:
    def __init__(self, count: int):
        self.count, self.arrived, self.completed = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.completed = 0, self.completed + 1

    def passes(self, parity: int) -> bool:
        return self.completed % 2 != parity


class Ring:
    """The kernel's barriers: K/V slots (ready: one arrival, the copy; empty: both consumers) and q buffers."""

    def __init__(self):
        self.bars = {name: [Barrier(count) for _ in range(n)] for name, count, n in (
            ("k_ready", 1, STAGES), ("v_ready", 1, STAGES), ("k_empty", 2, STAGES), ("v_empty", 2, STAGES),
            ("q_ready", 1, Q_BUFS), ("q_empty", 2, Q_BUFS))}  # fmt: skip

    def wait(self, name: str, i: int, parity: int):
        return self.bars[name][i], parity, f"{name}[{i}] parity {parity}"

    def arrive(self, name: str, i: int) -> None:
        self.bars[name][i].arrive()


def _slot(g: int) -> tuple[int, int]:
    return g % STAGES, (g // STAGES) & 1


def producer(ring: Ring, items: list[dict]):
    """Describes each item (once both consumers handed back its q buffer's last user), then copies its tiles."""
    t = 0
    for r, item in enumerate(items):
        yield ring.wait("q_empty", r % Q_BUFS, ((r // Q_BUFS) & 1) ^ 1)
        ring.arrive("q_ready", r % Q_BUFS)
        for j in range(item["n"]):
            s, ph = _slot(t + j)
            yield ring.wait("k_empty", s, ph ^ 1)
            ring.arrive("k_ready", s)
            yield ring.wait("v_empty", s, ph ^ 1)
            ring.arrive("v_ready", s)
        t += item["n"]


def consumer(ring: Ring, items: list[dict], wg: int, form: str):
    """A consumer warpgroup: per item, its first QK^T, then each tile's QK^T with the previous tile's PV, the last
    PV, and the tiles past its rows released unread. ``wait-first`` (built wrong on purpose) waits for the next
    item's description before that release."""
    t = 0
    for r, item in enumerate(items):
        if form == "main" or r == 0:
            yield ring.wait("q_ready", r % Q_BUFS, (r // Q_BUFS) & 1)
        my, n = item["my"][wg], item["n"]
        if my > 0:
            s, ph = _slot(t)
            yield ring.wait("k_ready", s, ph)
            ring.arrive("k_empty", s)
            for g in range(t + 1, t + my):
                (s, ph), (sp, pp) = _slot(g), _slot(g - 1)
                yield ring.wait("k_ready", s, ph)
                yield ring.wait("v_ready", sp, pp)
                ring.arrive("k_empty", s)
                ring.arrive("v_empty", sp)
            s, ph = _slot(t + my - 1)
            yield ring.wait("v_ready", s, ph)
            ring.arrive("v_empty", s)
        if form == "wait-first" and r + 1 < len(items):
            yield ring.wait("q_ready", (r + 1) % Q_BUFS, ((r + 1) // Q_BUFS) & 1)
        for g in range(t + my, t + n):
            s, ph = _slot(g)
            yield ring.wait("k_ready", s, ph)
            ring.arrive("k_empty", s)
            yield ring.wait("v_ready", s, ph)
            ring.arrive("v_empty", s)
        ring.arrive("q_empty", r % Q_BUFS)
        t += n


def run(items: list[dict], consumer_form: str, rng: random.Random) -> list[str] | None:
    """One random interleaving; None if every process finished, else what each one was waiting for."""
    ring = Ring()
    procs = [producer(ring, items), consumer(ring, items, 0, consumer_form),
             consumer(ring, items, 1, consumer_form)]  # fmt: skip
    pending: list = [None] * 3
    done = [False] * 3
    while not all(done):
        runnable = [i for i in range(3) if not done[i] and (pending[i] is None or pending[i][0].passes(pending[i][1]))]
        if not runnable:
            return [p[2] if p else "done" for p in pending]
        i = rng.choice(runnable)
        try:
            pending[i] = next(procs[i])
        except StopIteration:
            done[i], pending[i] = True, None
    return None


def random_items(rng: random.Random) -> list[dict]:
    """1-12 items of 0-7 tiles; one warpgroup reads them all, the other all, 1-3 fewer, or none."""
    items = []
    for _ in range(rng.randint(1, 12)):
        n = rng.choice([0, 0, 1, 1, 2, 3, 4, 5, 7])
        full = rng.randint(0, 1)
        my = [0, 0]
        my[full] = n
        my[1 - full] = rng.choice([n, max(n - 1, 0), max(n - 2, 0), max(n - 3, 0), 0])
        items.append({"n": n, "my": tuple(my)})
    return items


def check(trials: int, seed: int) -> dict[str, tuple[list[dict], list[str]]]:
    """Per consumer form: the first deadlock found (items, what each process waited for)."""
    rng = random.Random(seed)
    found = {}
    for _ in range(trials):
        items = random_items(rng)
        for form in CONSUMER_FORMS:
            waiting = run(items, form, rng)
            if waiting is not None and form not in found:
                found[form] = (items, waiting)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ws_protocol_model", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    found = check(args.trials, args.seed)
    for form in CONSUMER_FORMS:
        hit = found.get(form)
        verdict = "no deadlock" if hit is None else f"DEADLOCK on {hit[0]}: waiting {hit[1]}"
        print(f"consumers {form:10}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
