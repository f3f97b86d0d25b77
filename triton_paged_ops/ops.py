"""The one place that registers the ``tpa::`` custom ops and their fake (meta) implementations.

Each op body validates its arguments and calls a kernel launcher. Tensors on a GPU run the Triton kernels. CPU
tensors run the PyTorch reference, except when Triton's interpreter is on (``TRITON_INTERPRET=1`` before this package
is imported): then they run the same Triton kernels, which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import functools

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
    block_table_rows: torch.Tensor | None,
    batch_invariant: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Shared body of the three attention ops: checks, then kernel or reference, writing ``out``/``lse``."""
    if checks.debug_mode():
        checks.debug_check_attention(
            q, k_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, block_table_rows
        )
    if _use_kernels(q):
        _launch_paged_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, out, lse, INTERPRET,
            batch_invariant,
        )  # fmt: skip
        return
    # (The reference attends each sequence on its own, in fp32: batch-invariant already.)
    ref_out, ref_lse = reference.paged_attention_with_lse(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, causal, window_left, softcap,
        alibi_slopes, sinks, k_scale, v_scale, block_table_rows,
    )  # fmt: skip
    # The reference writes every row; the kernels leave rows past cu_seqlens_q[-1] alone. Match that.
    n = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
    out[:n].copy_(ref_out[:n])
    if lse is not None:
        lse[:n].copy_(ref_lse[:n])


# The three attention ops share one argument list. The out variant takes its buffers keyword-only (like aten's
# out= overloads); torch.library.custom_op refuses keyword-only tensors, so all three are defined from schemas.
_ATTENTION_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, bool causal=True, SymInt window_left=-1, "
    "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, "
    "Tensor? block_table_rows=None, bool batch_invariant=False"
)
_ATTENTION_OPS = {
    "paged_attention": f"({_ATTENTION_ARGS}) -> Tensor",
    "paged_attention_with_lse": f"({_ATTENTION_ARGS}) -> (Tensor, Tensor)",
    "paged_attention_out": f"({_ATTENTION_ARGS}, *, Tensor(a!) out, Tensor(b!)? lse=None) -> ()",
}


def _attention(
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
    block_table_rows: torch.Tensor | None = None,
    batch_invariant: bool = False,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    op: str,
    fake: bool,
):
    """Body of all three attention ops, real (``fake=False``) and fake: same checks, same output allocation."""
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale)
    feats = (window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows)
    checks.check_attention_args(*args, *feats)
    if op == "paged_attention_out":
        checks.check_attention_outputs(q, v_cache, out, lse)
    else:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
        if op == "paged_attention_with_lse":
            lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    if not fake:
        _attention_into(*args, causal, *feats, batch_invariant, out, lse)
    if op == "paged_attention_out":
        return None
    return (out, lse) if op == "paged_attention_with_lse" else out


for _name, _schema in _ATTENTION_OPS.items():
    torch.library.define(f"tpa::{_name}", _schema)
    torch.library.impl(f"tpa::{_name}", "CompositeExplicitAutograd")(
        functools.partial(_attention, op=_name, fake=False)
    )
    torch.library.register_fake(f"tpa::{_name}")(functools.partial(_attention, op=_name, fake=True))


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
