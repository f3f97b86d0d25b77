"""merge_attn_states against the reference, including empty (-inf) parts."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16) if DEVICE == "cpu" else (torch.float32, torch.float16, torch.bfloat16)


@given(
    tokens=st.integers(0, 40),
    heads=st.integers(1, 9),
    head_dim=st.sampled_from((64, 80, 128, 256)),
    dtype=st.sampled_from(DTYPES),
    empty_frac=st.sampled_from((0.0, 0.3)),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(tokens, heads, head_dim, dtype, empty_frac, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out_a = torch.randn(tokens, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    out_b = torch.randn(tokens, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    lse_a = torch.randn(tokens, heads, generator=gen, device=DEVICE) * 5
    lse_b = torch.randn(tokens, heads, generator=gen, device=DEVICE) * 5
    # Empty parts: -inf in a, in b, or in both.
    lse_a[torch.rand(tokens, heads, generator=gen, device=DEVICE) < empty_frac] = -math.inf
    lse_b[torch.rand(tokens, heads, generator=gen, device=DEVICE) < empty_frac] = -math.inf
    out, lse = tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    both_empty = lse_a.isneginf() & lse_b.isneginf()
    assert (out[both_empty] == 0).all() and lse[both_empty].isneginf().all()


def test_one_empty_part_returns_the_other():
    out_a = torch.randn(3, 2, 64, device=DEVICE)
    lse_a = torch.randn(3, 2, device=DEVICE)
    out_b = torch.randn(3, 2, 64, device=DEVICE)
    lse_b = torch.full((3, 2), -math.inf, device=DEVICE)
    out, lse = tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)


def test_strided_inputs():
    big = torch.randn(5, 4, 2, 64, device=DEVICE)
    out_a, out_b = big[:, :, 0], big[:, :, 1]  # non-contiguous head strides
    lse = torch.randn(4, 5, 2, device=DEVICE)
    lse_a, lse_b = lse[..., 0].t(), lse[..., 1].t()
    out, merged = tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(merged, ref_lse)
