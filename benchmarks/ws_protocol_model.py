"""A model of the warp-specialized prefill kernel's barrier protocol (``kernels.hopper``, a program per SM):
``python -m benchmarks.ws_protocol_model [--trials N] [--seed S]``. No GPU.

The producer and the two consumer warpgroups are Python generators that wait on and arrive at mbarriers with the
kernel's counts and phase parities (a wait for parity P passes once the barrier's phase P has completed: the
hardware's ``try_wait.parity``). Copies land at once, so only the order of waits and arrivals is modelled, not
their timing. The model runs random items through random interleavings: an item's KV tile count and how many of
its tiles each warpgroup reads (causal rows leave the first warpgroup fewer tiles; a warpgroup may hold no rows).
It reports each form that can stop with every process waiting. Forms: the producer describing each item after
the previous one's last copy (``main``) or once the current item's first ``STAGES`` copies are out (``ahead``);
the consumers ending each item before the next (``main``) or issuing the next item's first QK^T with this one's
last PV (``stream``; ``stream-v1`` waits for the next description first, which can deadlock: the model's check
that it finds one).
"""

from __future__ import annotations

import argparse
import itertools
import random

STAGES = 2
Q_BUFS = 2


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


def producer(ring: Ring, items: list[dict], form: str):
    def tiles(t0, j0, j1):
        for j in range(j0, j1):
            s, ph = _slot(t0 + j)
            yield ring.wait("k_empty", s, ph ^ 1)
            ring.arrive("k_ready", s)
            yield ring.wait("v_empty", s, ph ^ 1)
            ring.arrive("v_ready", s)

    def publish(r):
        yield ring.wait("q_empty", r % Q_BUFS, ((r // Q_BUFS) & 1) ^ 1)
        ring.arrive("q_ready", r % Q_BUFS)

    if form == "main":
        t = 0
        for r, item in enumerate(items):
            yield from publish(r)
            yield from tiles(t, 0, item["n"])
            t += item["n"]
        return
    prev_t = prev_head = prev_n = 0
    for k, item in enumerate(items):
        yield from publish(k)
        yield from tiles(prev_t, prev_head, prev_n)
        t, head = prev_t + prev_n, min(item["n"], STAGES)
        yield from tiles(t, 0, head)
        prev_t, prev_head, prev_n = t, head, item["n"]
    yield from tiles(prev_t, prev_head, prev_n)


def _release(ring, a, e):
    for g in range(a, e):
        s, ph = _slot(g)
        yield ring.wait("k_ready", s, ph)
        ring.arrive("k_empty", s)
        yield ring.wait("v_ready", s, ph)
        ring.arrive("v_empty", s)


def _first(ring, g):
    s, ph = _slot(g)
    yield ring.wait("k_ready", s, ph)
    ring.arrive("k_empty", s)


def _step(ring, g):
    (s, ph), (sp, pp) = _slot(g), _slot(g - 1)
    yield ring.wait("k_ready", s, ph)
    yield ring.wait("v_ready", sp, pp)
    ring.arrive("k_empty", s)
    ring.arrive("v_empty", sp)


def _last_pv(ring, g):
    s, ph = _slot(g)
    yield ring.wait("v_ready", s, ph)
    ring.arrive("v_empty", s)


def _overlap(ring, n_t, last):
    """The next item's first QK^T issued with this item's last PV."""
    s, ph = _slot(n_t)
    yield ring.wait("k_ready", s, ph)
    yield ring.wait("v_ready", *_slot(last))
    ring.arrive("k_empty", s)
    ring.arrive("v_empty", last % STAGES)


def consumer(ring: Ring, items: list[dict], wg: int, form: str):
    if form == "main":
        t = 0
        for r, item in enumerate(items):
            yield ring.wait("q_ready", r % Q_BUFS, (r // Q_BUFS) & 1)
            my, n = item["my"][wg], item["n"]
            if my > 0:
                yield from _first(ring, t)
                for j in range(1, my):
                    yield from _step(ring, t + j)
                yield from _last_pv(ring, t + my - 1)
            yield from _release(ring, t + my, t + n)
            ring.arrive("q_empty", r % Q_BUFS)
            t += n
        return
    yield ring.wait("q_ready", 0, 0)
    my, n, t = items[0]["my"][wg], items[0]["n"], 0
    if my > 0:
        yield from _first(ring, t)
    for r in range(len(items)):
        for j in range(1, my):
            yield from _step(ring, t + j)
        n_t, nb, has_next = t + n, (r + 1) % Q_BUFS, r + 1 < len(items)
        may = my > 0 and n - my < STAGES and has_next
        if form == "stream" and not may:
            if my > 0:
                yield from _last_pv(ring, t + my - 1)
            yield from _release(ring, t + my, n_t)
        if has_next:
            yield ring.wait("q_ready", nb, ((r + 1) // Q_BUFS) & 1)
        nmy, nn = (items[r + 1]["my"][wg], items[r + 1]["n"]) if has_next else (0, 0)
        if form == "stream-v1":
            may = my > 0 and n - my < STAGES
        overlap = may and nmy > 0
        if may:
            yield from _release(ring, t + my, n_t)
            if overlap:
                yield from _overlap(ring, n_t, t + my - 1)
            else:
                yield from _last_pv(ring, t + my - 1)
        elif form == "stream-v1":
            if my > 0:
                yield from _last_pv(ring, t + my - 1)
            yield from _release(ring, t + my, n_t)
        ring.arrive("q_empty", r % Q_BUFS)
        if not overlap and nmy > 0:
            yield from _first(ring, n_t)
        t, my, n = n_t, nmy, nn


def run(items: list[dict], producer_form: str, consumer_form: str, rng: random.Random) -> list[str] | None:
    """One random interleaving; None if every process finished, else what each one was waiting for."""
    ring = Ring()
    procs = [producer(ring, items, producer_form), consumer(ring, items, 0, consumer_form),
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


def check(trials: int, seed: int) -> dict[tuple[str, str], tuple[list[dict], list[str]]]:
    """Per (producer form, consumer form): the first deadlock found (items, what each process waited for)."""
    rng = random.Random(seed)
    found = {}
    forms = list(itertools.product(("main", "ahead"), ("main", "stream", "stream-v1")))
    for _ in range(trials):
        items = random_items(rng)
        for form in forms:
            waiting = run(items, *form, rng)
            if waiting is not None and form not in found:
                found[form] = (items, waiting)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ws_protocol_model", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    found = check(args.trials, args.seed)
    for prod, cons in itertools.product(("main", "ahead"), ("main", "stream", "stream-v1")):
        hit = found.get((prod, cons))
        verdict = "no deadlock" if hit is None else f"DEADLOCK on {hit[0]}: waiting {hit[1]}"
        print(f"producer {prod:5}  consumers {cons:9}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
