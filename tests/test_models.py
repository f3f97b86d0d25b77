"""The Llama-style model through torch.compile(fullgraph=True): no graph breaks, at most one recompile across
changing batches, same logits as eager and as the model on the PyTorch reference attention."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from triton_paged_ops.models import PRESETS, Llama, PagePool, Request, generate
from triton_paged_ops.models.llama import Batch

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


@pytest.mark.gpu
def test_cuda_graphs_greedy_tokens_match_reference_model():
    """Compiled with mode="reduce-overhead": no cudagraph skips; each step matches the same model compiled without
    graphs (Inductor picks slightly different kernels per mode: fp32 rounding only); and greedy generation yields
    exactly the tokens of the eager model on the PyTorch reference attention for 64+ steps per request."""
    torch._dynamo.reset()
    counters.clear()
    cfg = PRESETS["tiny"]
    model = Llama(cfg).init_random(0).eval().to(DEVICE)  # fp32: greedy ties cannot flip on rounding noise
    plain = Llama(cfg).to(DEVICE).eval()
    plain.load_state_dict(model.state_dict())
    ref = Llama(cfg, attention="reference").to(DEVICE)
    ref.load_state_dict(model.state_dict())
    for m in (model, plain, ref):
        m.setup_cache(num_pages=96, page_size=16)
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=True)
    compiled = torch.compile(plain, fullgraph=True, dynamic=True)
    shapes = [(5, 70), (23, 64), (1, 80), (40, 66)]

    def requests():
        g = torch.Generator().manual_seed(3)
        return [Request(i, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), m)
                for i, (n, m) in enumerate(shapes)]  # fmt: skip

    mismatches, replays = [], 0

    def graphed_step(batch):
        nonlocal replays
        torch.compiler.cudagraph_mark_step_begin()
        out = graphed(batch).clone()
        want = compiled(batch)
        err = float((out - want).norm() / want.norm())
        if err > 1e-5:
            mismatches.append(err)
        replays += int(batch.max_seqlen_q == 1)
        return out

    with torch.no_grad():
        got = requests()
        generate(graphed_step, got, PagePool(96, 16), max_batch=3, max_pages=8, device=DEVICE)
        want = requests()
        generate(ref, want, PagePool(96, 16), max_batch=3, max_pages=8, device=DEVICE)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert replays >= 64 and not mismatches, mismatches[:5]
    for a, b in zip(got, want, strict=True):
        assert len(a.generated) >= 64
        assert a.generated == b.generated, f"request {a.rid} diverges at step {_first_diff(a.generated, b.generated)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.gpu
def test_graph_replay_of_a_decode_step_is_bitwise_eager():
    """One decode step of the eager model captured in a torch.cuda.CUDAGraph, replayed while sequence lengths,
    tokens and slots change (and one batch entry is padding with length 1): bit for bit the eager step's logits."""
    cfg = PRESETS["tiny"]
    model = Llama(cfg).init_random(0).eval().to(DEVICE)
    twin = Llama(cfg).to(DEVICE).eval()
    twin.load_state_dict(model.state_dict())
    batch_size, pages_per_seq, page_size = 4, 8, 16
    num_pages = batch_size * pages_per_seq
    for m in (model, twin):
        m.setup_cache(num_pages, page_size)
    for (k, v), (k2, v2) in zip(model.kv_caches(), twin.kv_caches(), strict=True):
        k.normal_(), v.normal_()
        k2.copy_(k), v2.copy_(v)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    table = torch.randperm(num_pages, generator=gen, device=DEVICE).to(torch.int32).view(batch_size, pages_per_seq)

    def decode_batch(lens: list[int]) -> Batch:
        lens_t = torch.tensor(lens, device=DEVICE)
        pos = lens_t - 1
        return Batch(
            tokens=torch.randint(0, cfg.vocab_size, (batch_size,), generator=gen, device=DEVICE),
            positions=pos,
            slot_mapping=table[torch.arange(batch_size, device=DEVICE), pos // page_size].long() * page_size
            + pos % page_size,
            block_table=table,
            cu_seqlens_q=torch.arange(batch_size + 1, dtype=torch.int32, device=DEVICE),
            seq_lens=lens_t.to(torch.int32),
            max_seqlen_q=1,
            max_seqlen_k=pages_per_seq * page_size,
        )

    static = decode_batch([1] * batch_size)
    with torch.no_grad():
        model(static), twin(static)  # compile the kernels (and write the same slots in both caches)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(static)
        for lens in ([5, 17, 128, 1], [100, 3, 64, 1], [128, 128, 1, 1], [33, 90, 7, 1]):
            step = decode_batch(lens)
            for name in ("tokens", "positions", "slot_mapping", "seq_lens"):
                getattr(static, name).copy_(getattr(step, name))
            graph.replay()
            assert torch.equal(logits, twin(step)), lens
