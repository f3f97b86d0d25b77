"""The dense Triton ceiling of the prefill benchmark (``benchmarks.dense_triton``) computes causal attention: its
timings are only a ceiling if its answers are right."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dense_triton import dense_causal, dense_causal_flat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("use_desc", "pack", "lazy"),
    [(False, False, False), (True, False, False), (False, True, True), (True, True, False)],
)
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "n", "block_m", "block_n"), [(2, 4, 2, 64, 32, 16), (1, 2, 2, 96, 32, 32)]
)
def test_dense_causal_matches_sdpa(use_desc, pack, lazy, batch, heads, kv_heads, n, block_m, block_n):
    gen = torch.Generator(device=DEVICE).manual_seed(n + heads)
    dtype = torch.float16
    q = torch.randn(batch, heads, n, 32, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn(batch, kv_heads, n, 32, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(batch, kv_heads, n, 32, generator=gen, device=DEVICE).to(dtype)
    out = dense_causal(q, k, v, 0.2, block_m, block_n, 4, 2, use_desc, pack, lazy)
    kr, vr = (t.float().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kr, vr, is_causal=True, scale=0.2)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3


def test_dense_causal_rejects_ragged_blocks():
    q = torch.zeros(1, 2, 48, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of"):
        dense_causal(q, q, q, 0.2, 32, 16, 4, 2, False)


@pytest.mark.parametrize(("pack", "programs"), [(False, 3), (True, 5), (True, 1)])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "n", "block_m", "block_n"), [(2, 4, 2, 64, 32, 16)])
def test_persistent_one_loop_form_matches_sdpa(pack, programs, batch, heads, kv_heads, n, block_m, block_n):
    """The persistent form walks several query blocks (of different lengths) per program in one loop: every block's
    rows must come out right, whatever program took it (outputs poisoned first: an unwritten block shows)."""
    gen = torch.Generator(device=DEVICE).manual_seed(n + heads + programs)
    q = torch.randn(batch, heads, n, 32, generator=gen, device=DEVICE).to(torch.float16)
    k = torch.randn(batch, kv_heads, n, 32, generator=gen, device=DEVICE).to(torch.float16)
    v = torch.randn(batch, kv_heads, n, 32, generator=gen, device=DEVICE).to(torch.float16)
    out = dense_causal_flat(q, k, v, 0.2, block_m, block_n, 4, 2, pack, programs, out=torch.full_like(q, float("nan")))
    kr, vr = (t.float().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kr, vr, is_causal=True, scale=0.2)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3
