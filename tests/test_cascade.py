"""Shared-prefix (cascade) attention equals plain paged attention over each request's whole key list."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import reference
from triton_paged_ops.cascade import prefix_level

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16) if DEVICE == "cpu" else (torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


@st.composite
def cascades(draw):
    page_size = draw(st.sampled_from((1, 4, 16)))
    batch = draw(st.integers(1, 6))
    q_lens = [draw(st.integers(1, 20)) for _ in range(batch)]
    return {
        "page_size": page_size,
        # Shared prefixes are whole pages (radix/prefix caches share pages).
        "prefix_pages": draw(st.integers(0, 300 // page_size)),
        "q_lens": q_lens,
        "suffix_lens": [q + draw(st.integers(0, 60)) for q in q_lens],
        "num_kv_heads": draw(st.sampled_from((1, 2))),
        "group": draw(st.sampled_from((1, 4))),
        "dtype": draw(st.sampled_from(DTYPES)),
        "softcap": draw(st.sampled_from((0.0, 20.0))),
        "sinks": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(case=cascades())
def test_cascade_equals_plain_paged_attention(case):
    gen = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    ps, hkv = case["page_size"], case["num_kv_heads"]
    hq, d, dtype = hkv * case["group"], 64, case["dtype"]
    own_pages = [math.ceil(n / ps) for n in case["suffix_lens"]]
    num_pages = case["prefix_pages"] + sum(own_pages) + 1
    k_cache = torch.randn(num_pages, ps, hkv, d, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_pages, ps, hkv, d, generator=gen, device=DEVICE).to(dtype)
    perm = torch.randperm(num_pages, generator=gen, device=DEVICE).to(torch.int32)
    prefix = perm[: case["prefix_pages"]]
    own = torch.full((len(own_pages), max(own_pages)), -1, dtype=torch.int32, device=DEVICE)
    at = case["prefix_pages"]
    for b, n in enumerate(own_pages):
        own[b, :n] = perm[at : at + n]
        at += n
    prefix_len = case["prefix_pages"] * ps
    q = torch.randn(sum(case["q_lens"]), hq, d, generator=gen, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *case["q_lens"]], device=DEVICE).cumsum(0).to(torch.int32)
    suffix = torch.tensor(case["suffix_lens"], dtype=torch.int32, device=DEVICE)
    kw = {"softcap": case["softcap"]}
    if case["sinks"]:
        kw["sinks"] = torch.randn(hq, generator=gen, device=DEVICE)
    out = tpa.cascade_attention(q, k_cache, v_cache, prefix, prefix_len, own, cu, suffix, max(case["q_lens"]),
                                max(case["suffix_lens"]), d**-0.5, **kw)  # fmt: skip
    # The same requests as plain paged attention: the prefix pages, then each request's own pages.
    full = torch.cat([prefix.view(1, -1).expand(len(own_pages), -1), own], dim=1)
    want = reference.paged_attention(q, k_cache, v_cache, full, cu, suffix + prefix_len, max(case["q_lens"]),
                                     max(case["suffix_lens"]) + prefix_len, d**-0.5, **kw)  # fmt: skip
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err <= TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("chunk", [None, 1, 3, 16])
def test_prefix_level_in_any_chunking_is_attention_over_the_prefix(chunk):
    """Level 1 alone: each query token over all prefix keys (no mask), however the tokens are grouped."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    k_cache = torch.randn(40, 16, 2, 64, generator=gen, device=DEVICE)
    v_cache = torch.randn(40, 16, 2, 64, generator=gen, device=DEVICE)
    prefix = torch.randperm(40, generator=gen, device=DEVICE)[:30].to(torch.int32)
    prefix_len, tokens = 30 * 16 - 5, 21
    q = torch.randn(tokens, 8, 64, generator=gen, device=DEVICE)
    out, lse = prefix_level(q, k_cache, v_cache, prefix, prefix_len, 0.125, chunk=chunk)
    one_each = torch.arange(tokens + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.full((tokens,), prefix_len, dtype=torch.int32, device=DEVICE)
    want, want_lse = reference.paged_attention_with_lse(q, k_cache, v_cache, prefix.view(1, -1).expand(tokens, -1),
                                                        one_each, lens, 1, prefix_len, 0.125, causal=False)  # fmt: skip
    assert (out - want).norm() / want.norm() <= TOL[torch.float32]
    assert torch.allclose(lse, want_lse, atol=1e-4)


def test_prefix_pages_must_cover_the_prefix():
    q = torch.randn(2, 4, 64, device=DEVICE)
    cache = torch.randn(4, 16, 1, 64, device=DEVICE)
    table = torch.tensor([[1], [2]], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="prefix_pages"):
        tpa.cascade_attention(q, cache, cache, torch.tensor([0], dtype=torch.int32, device=DEVICE), 17, table, cu,
                              lens, 1, 1, 0.125)  # fmt: skip


def test_cascade_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache = torch.randn(12, 16, 2, 64, generator=gen, device=DEVICE)
    vcache = torch.randn(12, 16, 2, 64, generator=gen, device=DEVICE)
    shared = torch.tensor([3, 7, 1], dtype=torch.int32, device=DEVICE)
    own = torch.tensor([[0, 2], [5, 9]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(5, 8, 64, generator=gen, device=DEVICE)
    cu = torch.tensor([0, 1, 5], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 30], dtype=torch.int32, device=DEVICE)

    def step(q, own, cu, lens):
        return tpa.cascade_attention(q, cache, vcache, shared, 48, own, cu, lens, 4, 32, 0.125)

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, own, cu, lens), step(q, own, cu, lens), rtol=1e-5, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0
