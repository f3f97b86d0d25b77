"""Merging partial attentions computed over disjoint key sets: ``merge_attn_states`` (two parts), the split-KV
reduce, and the in-order fold rule of batch-invariant mode they share.

With LSEs ``a`` and ``b``: ``lse = log(e^a + e^b)`` and ``out = e^(a - lse) * out_a + e^(b - lse) * out_b``
(computed in base 2: exp2 is native). One program per (token, head) pair: axis 0 = token, axis 1 = head.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from triton_paged_ops.kernels.launch import Launcher, interpreter_turn

try:  # Grid dependency control (programmatic dependent launch, sm_90+ CUDA): absent from some Triton builds.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # base-2 log-sum-exp to natural log
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # and back


@triton.jit
def _fold_weights(lse_a, lse_b):
    """Weights of ``a`` and ``b`` (attention over two disjoint key sets) in their merge, and the merged log-sum-exp,
    all from and in natural log. An empty side (-inf) gives weights exactly 1 and 0, so merging with an empty set
    changes nothing (exp2(0) / exp2(0) need not be exactly 1). (Differences first, in base 2 after: converting
    each lse would round it at its own magnitude, 4e-5 of the weights at |lse| 1e3; the difference of two close
    floats is exact.)"""
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2((lse_a - m_safe) * LOG2E)
    w_b = tl.exp2((lse_b - m_safe) * LOG2E)
    total = w_a + w_b
    total_safe = tl.where(total > 0.0, total, 1.0)
    lse = tl.where(total > 0.0, m_safe + tl.log2(total_safe) * LN2, float("-inf"))
    w_a = tl.where(lse_a == float("-inf"), 0.0, tl.where(lse_b == float("-inf"), 1.0, w_a / total_safe))
    w_b = tl.where(lse_b == float("-inf"), 0.0, tl.where(lse_a == float("-inf"), 1.0, w_b / total_safe))
    lse = tl.where(lse_b == float("-inf"), lse_a, tl.where(lse_a == float("-inf"), lse_b, lse))
    return w_a, w_b, lse


@triton.jit
def _fold_step(m, total, lse_b):
    """One step of folding runs of keys in order (batch-invariant mode): the running maximum ``m`` and sum
    ``total`` (of exp2(lse - m) over the runs so far; start: -inf and 0) take the next run's base-2 lse ``lse_b``.
    Returns the new ``m`` and ``total`` and the factors (``alpha`` for the sum of outputs so far, ``beta`` for the
    next run's normalised output) of ``_fold_out``; ``_fold_result`` normalises at the end.

    Only a max carries from step to step before the exponentials, so the steps pipeline (a normalised merge per
    step chains an exp2, a log2 and a division). An empty run (-inf) changes nothing (but the sign of a zero).
    Batch-invariant mode folds a row's fixed KV segments with these operations whether one program walks them
    (``_paged_attention_kernel``) or split programs wrote them (``_reduce_splits_kernel``):
    the same operations on the same fp32 values give the same bits either way.
    """
    m_new = tl.maximum(m, lse_b)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(lse_b == float("-inf"), 1.0, tl.exp2(m - m_safe))
    beta = tl.exp2(lse_b - m_safe)
    return m_new, tl.fma(total, alpha, beta), alpha, beta


@triton.jit
def _fold_result(m, total):
    """The divisor of a fold's output sum and its base-2 lse (-inf, divisor 1, when every run was empty)."""
    total_safe = tl.where(total > 0.0, total, 1.0)
    return total_safe, tl.where(total > 0.0, m + tl.log2(total_safe), float("-inf"))


@triton.jit
def _fold_out(o_a, o_b, w_a, w_b):
    # An explicit fma: left to itself the compiler may contract either product, differently per kernel.
    return tl.fma(o_a, w_a, o_b * w_b)


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
    w_a, w_b, lse = _fold_weights(lse_a, lse_b)
    o_a = tl.load(out_a_ptr + token * stride_oa_t + head * stride_oa_h + offs_d, mask=mask, other=0.0)
    o_b = tl.load(out_b_ptr + token * stride_ob_t + head * stride_ob_h + offs_d, mask=mask, other=0.0)
    out = _fold_out(o_a.to(tl.float32), o_b.to(tl.float32), w_a, w_b)
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
    with interpreter_turn():
        _merge_attn_states_kernel[(num_tokens, num_heads)](
            out_a, lse_a, out_b, lse_b, out, lse,
            out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
            out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=1, enable_fp_fusion=True,
        )  # fmt: skip


@triton.jit
def _load_segments(part_out_ptr, part_lse_ptr, s0, offs_s, offs_d, d_mask, num_splits, stride_po_s, stride_pl_s):
    """Partial lse [BLOCK_S] and outputs [BLOCK_S, BLOCK_D] of segments s0, s0 + 1, ... (empty past the last)."""
    s_mask = s0 + offs_s < num_splits
    lse = tl.load(part_lse_ptr + (s0 + offs_s) * stride_pl_s, mask=s_mask, other=float("-inf"))
    # (Batch-invariant mode only: every segment program there writes its output, zeros past the sequence's end, so
    # no load waits on its lse.)
    out = tl.load(
        part_out_ptr + (s0 + offs_s)[:, None].to(tl.int64) * stride_po_s + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    return lse, out


# Per-batch values (batch size, split count, workspace strides): not specialised, so batches reuse one variant.
_REDUCE_UNSPECIALISED = ("num_seqs", "num_splits", "stride_po_s", "stride_pl_s")


@triton.jit(do_not_specialize=_REDUCE_UNSPECIALISED)
def _reduce_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_splits,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_pl_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_l_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    SEQUENTIAL: tl.constexpr,
    FOLD_GROUP: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    """Merge the split-KV partials (outputs and base-2 log-sum-exps) of one (token, head): program ids (token, head).

    ``SEQUENTIAL`` (batch-invariant mode) folds segment after segment in order with ``_fold_step`` (``BLOCK_S``
    segments loaded per step); with ``FOLD_GROUP`` > 1 the partials are leaves, and each run of ``FOLD_GROUP`` is
    folded into its fixed segment's result first (as ``_attend_segment`` does in one program). Otherwise all
    segments are weighted at once, and a segment whose lse is -inf (an empty segment program stores nothing else)
    has its output read as zeros. ``WAIT_PRIOR``: launched as a
    programmatic dependent of the attention kernel, so the program may be resident before that kernel ends; it waits
    for it to finish (and its writes to be visible) before touching memory.
    """
    if WAIT_PRIOR:
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Rows past the last sequence are padding: nothing wrote their partials, and the output contract leaves them.
    if token >= tl.load(cu_seqlens_q_ptr + num_seqs):
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part_out_ptr += token * stride_po_t + head * stride_po_h
    part_lse_ptr += token * stride_pl_t + head * stride_pl_h
    if SEQUENTIAL:
        m = tl.full([], float("-inf"), dtype=tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        out = tl.zeros([BLOCK_D], dtype=tl.float32)
        # Segments in groups of BLOCK_S loaded at once, each group's loads issued before the previous group is
        # folded, then folded one by one in order; picking a row out of the group adds only zeros to it, so it is
        # exact.
        offs_s = tl.arange(0, BLOCK_S)
        lse_grp, out_grp = _load_segments(part_out_ptr, part_lse_ptr, 0, offs_s, offs_d, d_mask, num_splits,
                                          stride_po_s, stride_pl_s)  # fmt: skip
        for s0 in range(0, num_splits, BLOCK_S):
            lse_next, out_next = _load_segments(part_out_ptr, part_lse_ptr, s0 + BLOCK_S, offs_s, offs_d, d_mask,
                                                num_splits, stride_po_s, stride_pl_s)  # fmt: skip
            if FOLD_GROUP == 1:
                for g in tl.static_range(BLOCK_S):
                    lse_s = tl.max(tl.where(offs_s == g, lse_grp, float("-inf")), 0)
                    o_s = tl.sum(tl.where((offs_s == g)[:, None], out_grp, 0.0), 0)
                    # (Padding past num_splits is empty: no change.)
                    m, total, alpha, beta = _fold_step(m, total, lse_s)
                    out = _fold_out(out, o_s, alpha, beta)
            else:
                # A fixed segment's leaves (BLOCK_S is a multiple of FOLD_GROUP: no segment spans two steps). The
                # step's segments fold their leaves side by side, as vectors across segments (each value sees the
                # same operations in the same order as one at a time), then their results fold in order: a chain of
                # FOLD_GROUP + BLOCK_S / FOLD_GROUP steps instead of BLOCK_S + BLOCK_S / FOLD_GROUP.
                SEGS: tl.constexpr = BLOCK_S // FOLD_GROUP
                lse3 = tl.reshape(lse_grp, [SEGS, FOLD_GROUP])
                out3 = tl.reshape(out_grp, [SEGS, FOLD_GROUP, BLOCK_D])
                offs_j = tl.arange(0, FOLD_GROUP)
                m_in = tl.full([SEGS], float("-inf"), dtype=tl.float32)
                total_in = tl.zeros([SEGS], dtype=tl.float32)
                out_in = tl.zeros([SEGS, BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(FOLD_GROUP):
                    lse_j = tl.max(tl.where(offs_j[None, :] == j, lse3, float("-inf")), 1)
                    o_j = tl.sum(tl.where((offs_j == j)[None, :, None], out3, 0.0), 1)
                    m_in, total_in, alpha, beta = _fold_step(m_in, total_in, lse_j)
                    out_in = _fold_out(out_in, o_j, alpha[:, None], beta[:, None])
                total_in_safe, lse_segs = _fold_result(m_in, total_in)
                out_segs = out_in / total_in_safe[:, None]
                offs_g = tl.arange(0, SEGS)
                for g in tl.static_range(SEGS):
                    lse_g = tl.max(tl.where(offs_g == g, lse_segs, float("-inf")), 0)
                    o_g = tl.sum(tl.where((offs_g == g)[:, None], out_segs, 0.0), 0)
                    m, total, alpha, beta = _fold_step(m, total, lse_g)
                    out = _fold_out(out, o_g, alpha, beta)
            lse_grp, out_grp = lse_next, out_next
        total_safe, lse = _fold_result(m, total)
        out = out / total_safe
    else:
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        lse_parts = tl.load(part_lse_ptr + offs_s * stride_pl_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse_parts, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # every segment empty: weights exp(-inf) = 0, not NaN
        w = tl.exp2(lse_parts - m_safe)
        total = tl.sum(w, 0)
        total_safe = tl.where(total > 0.0, total, 1.0)
        # The outputs are loaded beside the lse values, not after them (one L2 round trip on the critical path of a
        # short decode step instead of two): an empty segment's rows were never written and may hold anything, so
        # they are dropped by a select, not weighted by their zero weight (0 * NaN is NaN).
        parts = tl.load(
            part_out_ptr + offs_s[:, None].to(tl.int64) * stride_po_s + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        parts = tl.where((lse_parts > float("-inf"))[:, None], parts * w[:, None], 0.0)
        out = tl.sum(parts, 0) / total_safe
        lse = tl.where(total > 0.0, m_safe + tl.log2(total_safe), float("-inf"))
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if WRITE_LSE:
        tl.store(lse_ptr + token * stride_l_t + head * stride_l_h, lse * LN2)


_launch_reduce = Launcher(_reduce_splits_kernel, num_tensors=5, num_floats=0)


@dataclasses.dataclass
class ReducePlan:
    """The metadata-only part of one split-KV reduce launch (see ``reduce_plan``)."""

    grid: tuple[int, int]
    tail: tuple  # the kernel's int arguments, in order
    constexprs: dict
    options: dict  # Triton launch options (num_warps, launch_pdl)
    static: tuple  # identifies ``constexprs`` and ``options`` in the launcher's key
    fixed_key: tuple | None = None  # the launcher's address-independent key, filled in by the first launch
    rest: tuple | None = None  # what follows the addresses in a compiled launch (filled in by the first launch)


def reduce_plan(
    num_splits: int,
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    part_out_strides: tuple[int, int, int],
    part_lse_strides: tuple[int, int, int],
    num_seqs: int,
    out_strides: tuple[int, int],
    lse_strides: tuple[int, int] | None,
    sequential: bool = False,
    dependent: bool = False,
    fold_group: int = 1,
) -> ReducePlan:
    """Plan merging ``part_out [S, T, H, Dv]`` / ``part_lse [S, T, H]`` (base-2 log; strides of the first three
    dims) into ``out`` (strides of its token and head dims) and, if ``lse_strides`` is given, ``lse`` (natural
    log); ``sequential``: fold the segments in order (batch-invariant mode), ``fold_group`` leaves per fixed
    segment (a power of two); ``dependent``: launch as a programmatic dependent of the kernel before it
    (``dependent_launch_supported`` devices only)."""
    # (Leaves: four segments' worth per step, folded side by side.)
    block_s = max(8, 4 * fold_group) if sequential else max(2, triton.next_power_of_2(num_splits))
    want_lse = lse_strides is not None
    tail = (num_seqs, num_splits, *part_out_strides, *part_lse_strides, *out_strides,
            *(lse_strides if want_lse else part_lse_strides[1:]))  # fmt: skip
    block_d = triton.next_power_of_2(head_dim)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=want_lse, SEQUENTIAL=sequential,
                      FOLD_GROUP=fold_group if sequential else 1, WAIT_PRIOR=dependent)  # fmt: skip
    # The sequential fold picks one segment's row out of a group per step: narrow rows on 4 warps would split the
    # group's rows across warps (a reduction through shared memory per step, seen in the sm_90 PTX); one warp
    # keeps each column's rows in one thread.
    # (FP fusion named, as on every launch: Triton's default for it changes in 3.10.)
    plain = {"num_warps": 1 if sequential and block_d <= 64 else 4, "enable_fp_fusion": True}
    # A dependent launch lets the reduce's programs be scheduled as the attention kernel's last ones run, instead of
    # after it ends: the launch gap between the two leaves the critical path of a short decode step.
    options = {**plain, "launch_pdl": True} if dependent else plain
    static = (head_dim, block_s, want_lse, sequential, constexprs["FOLD_GROUP"], dependent)
    return ReducePlan((num_tokens, num_heads), tail, constexprs, options, static)


@functools.lru_cache(maxsize=16)
def dependent_launch_supported(device_index: int | None) -> bool:
    """Whether kernels on CUDA device ``device_index`` (None: the interpreter) can be programmatic dependent launches:
    sm_90 or newer, not ROCm, and a Triton with grid dependency control."""
    if device_index is None or torch.version.hip is not None or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_reduce(
    plan: ReducePlan,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    stream: int | None = None,
) -> None:
    """Launch a planned reduce on tensors with the metadata it was planned from. Without ``lse`` the kernel is
    given ``part_lse`` in its place (never written: ``WRITE_LSE`` is off). ``stream``: the current stream's raw
    handle, if the caller has it."""
    args = (part_out, part_lse, out, lse if lse is not None else part_lse, cu_seqlens_q, *plan.tail)
    plan.fixed_key = _launch_reduce(plan.grid, args, plan.constexprs, plan.options, plan.static, plan.fixed_key,
                                    stream)  # fmt: skip
    if plan.rest is None and plan.fixed_key is not None:
        plan.rest = _launch_reduce.rest(plan.tail, plan.constexprs)
