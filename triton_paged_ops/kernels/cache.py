"""Writing new tokens' K/V into a paged cache.

One program per new token (axis 0): it stores that token's ``[Hkv, D]`` key and ``[Hkv, Dv]`` value rows at cache
slot ``slot_mapping[token]`` = ``page * page_size + offset``. Negative slots are padding and write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_paged_ops.kernels.launch import interpreter_turn


@triton.jit
def _store_rows(
    src_ptr,
    dst_ptr,
    scale_ptr,
    token,
    page,
    offset,
    valid,
    num_heads,
    stride_src_t,
    stride_src_h,
    stride_dst_page,
    stride_dst_slot,
    stride_dst_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SATURATE: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid & (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    src = src_ptr + token.to(tl.int64) * stride_src_t + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        # Correctly rounded division: the fast approximate x / y would not match torch (or a re-quantisation) bitwise.
        x = tl.math.div_rn(x, tl.load(scale_ptr))
    if SATURATE > 0:
        # fp8 has no infinity: out-of-range values would become NaN in the cast, so they saturate instead; and
        # round to nearest even, as torch's cast does.
        x = tl.minimum(tl.maximum(x, -SATURATE), SATURATE)
        y = x.to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        y = x.to(dst_ptr.dtype.element_ty)
    # int64: page * stride overflows int32 for caches past 2 G elements.
    dst = (
        dst_ptr
        + page.to(tl.int64) * stride_dst_page
        + offset.to(tl.int64) * stride_dst_slot
        + offs_h[:, None] * stride_dst_head
        + offs_d[None, :]
    )
    tl.store(dst, y, mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_heads,
    num_slots,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    K_SATURATE: tl.constexpr,
    V_SATURATE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Slots past the cache would write out of bounds; they are dropped here and reported by debug mode.
    valid = (slot >= 0) & (slot < num_slots)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    _store_rows(
        key_ptr, k_cache_ptr, k_scale_ptr, token, page, offset, valid, num_heads,
        stride_key_t, stride_key_h, stride_k_page, stride_k_slot, stride_k_head,
        HEAD_DIM, BLOCK_H, BLOCK_D, HAS_K_SCALE, K_SATURATE,
    )  # fmt: skip
    _store_rows(
        value_ptr, v_cache_ptr, v_scale_ptr, token, page, offset, valid, num_heads,
        stride_value_t, stride_value_h, stride_v_page, stride_v_slot, stride_v_head,
        HEAD_DIM_V, BLOCK_H, BLOCK_DV, HAS_V_SCALE, V_SATURATE,
    )  # fmt: skip


def _saturation(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 cache dtype (writes clamp to it); 0 for other dtypes (no clamp)."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 else 0.0


def _launch_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Launch over validated arguments (see ``ops.reshape_and_cache``)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_pages, page_size = k_cache.shape[:2]
    head_dim_v = value.shape[-1]
    with interpreter_turn():
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            k_scale if k_scale is not None else key,
            v_scale if v_scale is not None else key,
            num_heads, num_pages * page_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_DV=triton.next_power_of_2(head_dim_v),
            HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
            K_SATURATE=_saturation(k_cache.dtype), V_SATURATE=_saturation(v_cache.dtype),
            num_warps=4, enable_fp_fusion=True,  # (named: Triton's default changes in 3.10)
        )  # fmt: skip
