"""Paged KV-cache page allocator and a greedy generation loop with continuous batching.

Requests join as soon as a batch slot and cache pages are free and leave when done; each step is one forward over
a mixed batch (new requests' prompts prefilled beside running requests' decode tokens), built in the layout of
``tpa.paged_attention``. Host-side bookkeeping (page lists, lengths) stays in Python; only the step runs on device.
The cache tensors themselves belong to the model (``Llama.setup_cache``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

import torch

from triton_paged_ops.models.llama import Batch


class PagePool:
    """Page allocator and per-request page lists for a paged KV cache of ``num_pages`` pages of ``page_size``."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def append(self, rid: int, new_tokens: int) -> list[int]:
        """Grow request ``rid`` by ``new_tokens`` and return their cache slots (allocating pages as needed)."""
        pages = self.pages.setdefault(rid, [])
        start = self.lengths.get(rid, 0)
        need = self.pages_for(start + new_tokens) - len(pages)
        if need > len(self._free):
            raise RuntimeError(f"KV cache out of pages: request {rid} needs {need}, {len(self._free)} free")
        pages.extend(self._free.pop() for _ in range(need))
        self.lengths[rid] = start + new_tokens
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, start + new_tokens)]

    def release(self, rid: int) -> None:
        self._free.extend(reversed(self.pages.pop(rid, [])))
        self.lengths.pop(rid, None)


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    prefilled: bool = False

    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


def build_batch(reqs: list[Request], cache: PagePool, max_pages: int, device) -> Batch:
    """Lay out one step: a prompt for each new request, the last generated token for each running one."""
    tokens, positions, slots, q_lens, kv_lens = [], [], [], [], []
    table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
    for b, r in enumerate(reqs):
        new = r.prompt if not r.prefilled else r.generated[-1:]
        start = cache.lengths.get(r.rid, 0)
        slots += cache.append(r.rid, len(new))
        tokens += new
        positions += range(start, start + len(new))
        q_lens.append(len(new))
        kv_lens.append(start + len(new))
        pages = cache.pages[r.rid]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return Batch(
        tokens=torch.tensor(tokens, device=device),
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=table.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max_pages * cache.page_size,
    )


@dataclasses.dataclass
class StepStats:
    batch_size: int
    new_tokens: int
    seconds: float


def generate(
    step: Callable[[Batch], torch.Tensor],
    requests: list[Request],
    cache: PagePool,
    max_batch: int,
    max_pages: int,
    device,
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """Greedy decoding of ``requests`` with continuous batching; fills each request's ``generated`` list.

    ``step(batch)`` runs the model and returns each sequence's last-token logits ``[B, vocab]``.
    """
    waiting, running, stats = deque(requests), [], []
    while waiting or running:
        # Admit while a batch slot and the pages for the whole request (prompt + answer) are free.
        while waiting and len(running) < max_batch:
            r = waiting[0]
            need = cache.pages_for(len(r.prompt) + r.max_new_tokens)
            reserved = sum(cache.pages_for(len(x.prompt) + x.max_new_tokens) - len(cache.pages.get(x.rid, []))
                           for x in running)  # fmt: skip
            if need > min(max_pages, cache.free_pages() - reserved):
                break
            running.append(waiting.popleft())
        if not running:
            raise RuntimeError("a request does not fit the KV cache even alone")
        start = time.perf_counter()
        batch = build_batch(running, cache, max_pages, device)
        next_tokens = step(batch).argmax(-1).tolist()
        seconds = time.perf_counter() - start
        stats.append(StepStats(len(running), int(batch.tokens.shape[0]), seconds))
        if on_step is not None:
            on_step(stats[-1])
        for r, t in zip(running, next_tokens, strict=True):
            r.prefilled = True
            r.generated.append(t)
        for r in [r for r in running if r.done()]:
            cache.release(r.rid)
            running.remove(r)
    return stats
