"""The one place that registers the ``tpa::`` custom ops and their fake (meta) implementations.

Each op body validates its arguments and calls a kernel launcher. Tensors on a GPU run the Triton kernels. CPU
tensors run the PyTorch reference, except when Triton's interpreter is on (``TRITON_INTERPRET=1`` before this package
is imported): then they run the same Triton kernels, which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton

from triton_paged_ops import checks, reference
from triton_paged_ops.kernels.attention import _launch_paged_attention
from triton_paged_ops.kernels.cache import _launch_reshape_and_cache
from triton_paged_ops.kernels.merge import _launch_merge_attn_states

# Fixed when the kernels were defined: @triton.jit reads TRITON_INTERPRET at decoration time.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def _use_kernels(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or INTERPRET


def _attention_into(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Shared body of the three attention ops: checks, then kernel or reference, writing ``out``/``lse``."""
    if checks.debug_mode():
        checks.debug_check_attention(q, k_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k)
    if _use_kernels(q):
        _launch_paged_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, out, lse, INTERPRET,
        )  # fmt: skip
        return
    ref_out, ref_lse = reference.paged_attention_with_lse(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, causal, window_left, softcap,
        alibi_slopes, sinks, k_scale, v_scale,
    )  # fmt: skip
    # The reference writes every row; the kernels leave rows past cu_seqlens_q[-1] alone. Match that.
    n = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
    out[:n].copy_(ref_out[:n])
    if lse is not None:
        lse[:n].copy_(ref_lse[:n])


@torch.library.custom_op("tpa::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale)
    feats = (window_left, softcap, alibi_slopes, sinks, k_scale, v_scale)
    checks.check_attention_args(*args, *feats)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    _attention_into(*args, causal, *feats, out, None)
    return out


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal=True,
      window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    checks.check_attention_args(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, window_left,
        softcap, alibi_slopes, sinks, k_scale, v_scale,
    )  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])


@torch.library.custom_op("tpa::paged_attention_with_lse", mutates_args=())
def _paged_attention_with_lse_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale)
    feats = (window_left, softcap, alibi_slopes, sinks, k_scale, v_scale)
    checks.check_attention_args(*args, *feats)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    _attention_into(*args, causal, *feats, out, lse)
    return out, lse


@_paged_attention_with_lse_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal=True,
      window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    checks.check_attention_args(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, window_left,
        softcap, alibi_slopes, sinks, k_scale, v_scale,
    )  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    return out, q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


# The out variant keeps the shared arguments in order and takes the buffers keyword-only (like aten's out=
# overloads). custom_op refuses keyword-only tensors, so this one op is defined from an explicit schema.
torch.library.define(
    "tpa::paged_attention_out",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, bool causal=True, SymInt window_left=-1, "
    "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, "
    "*, Tensor(a!) out, Tensor(b!)? lse=None) -> ()",
)


@torch.library.impl("tpa::paged_attention_out", "CompositeExplicitAutograd")
def _paged_attention_out_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale)
    feats = (window_left, softcap, alibi_slopes, sinks, k_scale, v_scale)
    checks.check_attention_args(*args, *feats)
    checks.check_attention_outputs(q, v_cache, out, lse)
    _attention_into(*args, causal, *feats, out, lse)


@torch.library.register_fake("tpa::paged_attention_out")
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal=True,
      window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, *, out,
      lse=None):  # fmt: skip
    checks.check_attention_args(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, window_left,
        softcap, alibi_slopes, sinks, k_scale, v_scale,
    )  # fmt: skip
    checks.check_attention_outputs(q, v_cache, out, lse)


@torch.library.custom_op("tpa::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def _reshape_and_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    checks.check_cache_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if checks.debug_mode():
        checks.debug_check_cache(k_cache, slot_mapping)
    if _use_kernels(key):
        _launch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_reshape_and_cache_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    checks.check_cache_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@torch.library.custom_op("tpa::merge_attn_states", mutates_args=())
def _merge_attn_states_op(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_merge_args(out_a, lse_a, out_b, lse_b)
    if not _use_kernels(out_a):
        return reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = out_a.new_empty(out_a.shape[:2], dtype=torch.float32)
    _launch_merge_attn_states(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


@_merge_attn_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b):
    checks.check_merge_args(out_a, lse_a, out_b, lse_b)
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), out_a.new_empty(
        out_a.shape[:2], dtype=torch.float32
    )
