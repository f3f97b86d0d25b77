"""Merging two partial attentions computed over disjoint key sets.

One program per (token, head) pair (axis 0 = token, axis 1 = head): with natural-log LSEs ``a`` and ``b``,
``lse = log(e^a + e^b)`` and ``out = e^(a - lse) * out_a + e^(b - lse) * out_b``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_attn_states_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    stride_oa_t,
    stride_oa_h,
    stride_la_t,
    stride_la_h,
    stride_ob_t,
    stride_ob_h,
    stride_lb_t,
    stride_lb_h,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_l_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < HEAD_DIM
    lse_a = tl.load(lse_a_ptr + token * stride_la_t + head * stride_la_h).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + token * stride_lb_t + head * stride_lb_h).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    # Both parts empty (-inf): subtract 0 instead so the weights are exp(-inf) = 0, not NaN.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    total_safe = tl.where(total > 0.0, total, 1.0)
    o_a = tl.load(out_a_ptr + token * stride_oa_t + head * stride_oa_h + offs_d, mask=mask, other=0.0)
    o_b = tl.load(out_b_ptr + token * stride_ob_t + head * stride_ob_h + offs_d, mask=mask, other=0.0)
    out = (o_a.to(tl.float32) * w_a + o_b.to(tl.float32) * w_b) / total_safe
    lse = tl.where(total > 0.0, m_safe + tl.log(total_safe), float("-inf"))
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + token * stride_l_t + head * stride_l_h, lse)


def _launch_merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Launch over validated arguments (see ``ops.merge_attn_states``)."""
    num_tokens, num_heads, head_dim = out_a.shape
    if num_tokens == 0:
        return
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )  # fmt: skip
