"""The Llama-style model through torch.compile(fullgraph=True): no graph breaks, at most one recompile across
changing batches, same logits as eager and as the model on the PyTorch reference attention."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from triton_paged_ops.models import PRESETS, Llama, PagePool, Request, generate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_compiled_generation_matches_eager_and_reference():
    torch._dynamo.reset()
    counters.clear()
    cfg = PRESETS["tiny"]
    model = Llama(cfg).init_random(0).eval().to(DEVICE)
    ref = Llama(cfg, attention="reference").to(DEVICE)
    ref.load_state_dict(model.state_dict())
    twin = Llama(cfg).to(DEVICE).eval()  # same weights, own cache: the eager run of the compiled model
    twin.load_state_dict(model.state_dict())
    for m in (model, ref, twin):
        m.setup_cache(num_pages=64, page_size=4)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    pool = PagePool(num_pages=64, page_size=4)
    gen = torch.Generator().manual_seed(1)
    # Five requests, at most three at a time: prompts of 1..30 tokens join while others decode, and leave.
    shapes = [(5, 6), (17, 3), (1, 8), (30, 4), (9, 5)]
    requests = [Request(i, torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(), m)
                for i, (n, m) in enumerate(shapes)]  # fmt: skip
    worst = {"compiled": 0.0, "reference": 0.0}
    mixed_steps = 0

    def step(batch):
        nonlocal mixed_steps
        # The three models write the same slots of their own caches, planned by one page pool.
        out = compiled(batch)
        eager = twin(batch)
        reference = ref(batch)
        worst["compiled"] = max(worst["compiled"], (out - eager).abs().max().item())
        worst["reference"] = max(worst["reference"], (eager - reference).abs().max().item())
        mixed_steps += int(1 < batch.max_seqlen_q < batch.tokens.shape[0])
        return out

    with torch.no_grad():
        stats = generate(step, requests, pool, max_batch=3, max_pages=16, device=DEVICE)
    assert all(r.done() for r in requests)
    assert {s.batch_size for s in stats} == {1, 2, 3} and mixed_steps > 0
    assert worst["compiled"] < 1e-4, worst
    assert worst["reference"] < 1e-4, worst
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, f"{graphs} graphs: more than one recompile across batch changes"
