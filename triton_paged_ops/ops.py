"""The one place that registers the ``tpa::`` custom ops and their fake (meta) implementations.

Each op body validates its arguments and calls a kernel launcher. Tensors on a GPU run the Triton kernels. CPU
tensors run the PyTorch reference, except when Triton's interpreter is on (``TRITON_INTERPRET=1`` before this package
is imported): then they run the same Triton kernels, which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from triton_paged_ops import checks, reference
from triton_paged_ops.kernels.cache import _launch_reshape_and_cache
from triton_paged_ops.kernels.merge import _launch_merge_attn_states
from triton_paged_ops.plan import key_bound
from triton_paged_ops.prepared import PREPARED, AttentionLaunch, launch_paged_attention, run_attention_launch

# Fixed when the kernels were defined: @triton.jit reads TRITON_INTERPRET at decoration time.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


_debug_mode = checks.debug_mode


def _use_kernels(t: torch.Tensor) -> bool:
    return not t.is_cpu or INTERPRET


# The current CUDA (or HIP) device's index; absent from builds without CUDA.
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _foreign_device(t: torch.Tensor) -> int | None:
    """The index of ``t``'s GPU when it is not the current device, else None. Triton launches (and loads compiled
    kernels) on the current device whatever the tensors' device, so a call with tensors on another GPU must switch
    to theirs first, as every aten CUDA op does; otherwise its kernels would run on the wrong GPU, reading another
    device's memory."""
    index = t.get_device()
    if index < 0 or _current_device is None or index == _current_device():
        return None
    return index


def _on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context in which Triton launches run on ``t``'s device (see ``_foreign_device``)."""
    device = _foreign_device(t)
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


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
    decode_tail: int = -1,
) -> AttentionLaunch | None:
    """Shared body of the three attention ops after the checks: kernel or reference, writing ``out``/``lse``.
    Returns the prepared launch of a kernel run (None: nothing launched, or the reference ran)."""
    if checks.debug_mode():
        checks.debug_check_attention(
            q, k_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, block_table_rows, decode_tail
        )
    if _use_kernels(q):
        return launch_paged_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, out, lse, INTERPRET,
            batch_invariant, decode_tail=decode_tail,
        )  # fmt: skip
    # (The reference attends each sequence on its own, in fp32: batch-invariant already.)
    ref_out, ref_lse = reference.paged_attention_with_lse(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal=causal,
        window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, block_table_rows=block_table_rows,
    )  # fmt: skip
    # The reference writes every row; the kernels leave rows past cu_seqlens_q[-1] alone. Match that.
    n = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
    out[:n].copy_(ref_out[:n])
    if lse is not None:
        lse[:n].copy_(ref_lse[:n])
    return None


# What ``_repeat`` returns when there is no prepared launch to repeat, and ``direct_attention`` when the call must go
# through the dispatcher.
MISS = object()


def _torch_hook(module, name: str):
    # A missing hook (another torch) reads as "active": the caller then takes the dispatcher.
    return getattr(module, name, lambda: True)


_compiling = _torch_hook(torch.compiler, "is_compiling")
_dispatch_modes = _torch_hook(torch._C, "_len_torch_dispatch_stack")
_function_modes = _torch_hook(torch._C, "_is_torch_function_mode_enabled")
_functorch_active = _torch_hook(torch._C, "_are_functorch_transforms_active")
_jit_tracing = _torch_hook(torch._C, "_get_tracing_state")
_profiling = _torch_hook(torch._C._autograd, "_profiler_enabled")


def _plain_eager(args: tuple) -> bool:
    """Whether ``torch.ops`` would do nothing but call an attention op's body on its 19 schema arguments ``args``, as
    far as the process state and the host values tell: not compiling or tracing (dynamo reads ``is_compiling()`` as
    True and keeps the op in its graph), no torch function or dispatch mode (fake tensors, functionalization, ``with
    torch.device``), no functorch transform, no profiler (the dispatcher records the op), and Python
    ``int``/``float``/``bool`` scalars (what the dispatcher converts or refuses otherwise). The tensors are
    ``_plain_tensors``' to judge (or a prepared launch's matcher's)."""
    # (Spelled out: loops over tuples of the scalars cost as much as all the hooks together.)
    return not (
        type(args[6]) is not int or type(args[7]) is not int or type(args[10]) is not int
        or type(args[8]) is not float or type(args[11]) is not float or type(args[9]) is not bool
        or type(args[17]) is not bool or type(args[18]) is not int or _compiling() or _dispatch_modes()
        or _function_modes() or _functorch_active() or _jit_tracing() is not None or _profiling()
    )  # fmt: skip


def _plain_tensors(tensors: tuple) -> bool:
    """Plain ``torch.Tensor``s (no subclass) that need no gradient (the dispatcher would attach an autograd error
    node), not on the meta device; None for absent optional tensors."""
    if type(tensors[0]) is not torch.Tensor or tensors[0].is_meta:
        return False
    return all(t is None or (type(t) is torch.Tensor and not t.requires_grad) for t in tensors)


def direct_attention(op: str, args: tuple, out: torch.Tensor | None, lse: torch.Tensor | None):
    """An attention op's result computed without the dispatcher (a prepared launch repeated, or the op body), or
    ``MISS`` when only ``torch.ops`` may run this call. ``args``: the 19 schema arguments. The dispatcher costs
    ~6 µs of an eager decode call; it bumps no version counter for these ops, so skipping it changes nothing else
    where ``_plain_eager`` and ``_plain_tensors`` (or the matched launch's ``direct``) hold."""
    if not isinstance(args[0], torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(args[0]).__name__}")
    if not _plain_eager(args):
        return MISS
    done = _repeat(op, *args, out, lse, True)
    if done is not MISS:
        return done
    if not _plain_tensors((*args[:6], *args[12:17], out, lse)):
        return MISS
    return _attention(*args, out=out, lse=lse, op=op, fake=False)


_NOTHING_OPTIONAL = (True,) * 6


def _lookup(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, batch_invariant,
            decode_tail, out, lse) -> tuple[tuple, tuple]:  # fmt: skip
    """A call's prepared-launch key: host values (with ``max_seqlen_k``'s planning bound, ``plan.key_bound``, and
    which optional tensors are absent), and the tensors a matcher compares (the present ones, in schema order)."""
    absent = (alibi_slopes is None, sinks is None, k_scale is None, v_scale is None, block_table_rows is None,
              lse is None)  # fmt: skip
    host = (op, q.shape, max_seqlen_q, key_bound(max_seqlen_k), scale, causal, window_left, softcap, batch_invariant,
            decode_tail, absent)  # fmt: skip
    if out is None:
        tensors = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
    else:
        tensors = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out)
    if absent != _NOTHING_OPTIONAL:
        optional = (alibi_slopes, sinks, k_scale, v_scale, block_table_rows, lse)
        tensors += tuple([t for t in optional if t is not None])
    return host, tensors


def _table_keys(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """Keys a block-table row can address: its columns times the page size."""
    return block_table.shape[1] * k_cache.shape[1]


def _repeat(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, batch_invariant,
            decode_tail, out, lse, direct: bool = False):  # fmt: skip
    """Run the launch an earlier successful call with the same metadata prepared, on these tensors, and return the
    op's result; ``MISS`` (nothing done) when there is none, or the call needs the full path (debug mode, another
    current device, ``max_seqlen_k`` past the block table's reach, or ``direct`` and a launch not prepared from
    plain tensors).

    The host key holds ``max_seqlen_k``'s planning bound (``plan.key_bound``) instead of its value, so a decode loop
    whose bound grows by one per step keeps hitting; the entry's capacity stands in for the check of the value."""
    if _debug_mode():
        return MISS
    try:
        entry = PREPARED.find(*_lookup(
            op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, batch_invariant,
            decode_tail, out, lse,
        ))  # fmt: skip
    except (AttributeError, TypeError):  # not a tensor, not an int
        return MISS
    if (
        entry is None or not 0 <= max_seqlen_k <= entry.capacity or (direct and not entry.direct)
        or _foreign_device(q) is not None
    ):  # fmt: skip
        return MISS
    if op != "paged_attention_out":
        out, lse = _new_outputs(q, v_cache, op)
    if entry.value is not None:
        optional = (alibi_slopes, sinks, k_scale, v_scale, block_table_rows)
        run_attention_launch(entry.value, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, optional, out, lse)
    return _result(op, out, lse)


# The three attention ops share one argument list. The out variant takes its buffers keyword-only (like aten's
# out= overloads); torch.library.custom_op refuses keyword-only tensors, so all three are defined from schemas.
_ATTENTION_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, bool causal=True, SymInt window_left=-1, "
    "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, "
    "Tensor? block_table_rows=None, bool batch_invariant=False, SymInt decode_tail=-1"
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
    decode_tail: int = -1,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    op: str,
    fake: bool,
):
    """Body of all three attention ops, real (``fake=False``) and fake: same checks, same output allocation.

    A real call whose metadata (shapes, strides, dtypes, devices, host values) equals an earlier successful call's
    skips the checks and the launch planning and launches what that call prepared (``_repeat``): the eager host
    path of a serving loop's repeated shapes is then the dispatch, that lookup and the launch itself."""
    out_arg, lse_arg = out, lse  # (the other ops allocate theirs below: the key holds what the caller passed)
    if torch.is_grad_enabled():
        checks.check_no_grad(op, q=q, k_cache=k_cache, v_cache=v_cache, alibi_slopes=alibi_slopes, sinks=sinks,
                             k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if not fake:
        done = _repeat(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                       scale, causal, window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows,
                       batch_invariant, decode_tail, out, lse)  # fmt: skip
        if done is not MISS:
            return done
        device = _foreign_device(q)
        if device is not None:
            with torch.cuda.device(device):
                tensors = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
                flags = (causal, window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows)
                return _attention(*tensors, max_seqlen_q, max_seqlen_k, scale, *flags, batch_invariant, decode_tail,
                                  out=out, lse=lse, op=op, fake=fake)  # fmt: skip
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale)
    feats = (window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows)
    checks.check_attention_args(*args, *feats, decode_tail)
    if op == "paged_attention_out":
        checks.check_attention_outputs(q, v_cache, out, lse)
    else:
        out, lse = _new_outputs(q, v_cache, op)
    if not fake:
        keep = not checks.debug_mode() and _use_kernels(q)
        capacity = _table_keys(k_cache, block_table)
        if keep:
            # Planned for the bound the host key holds (capped by the table, as the checks passed for the exact one).
            args = (*args[:7], min(key_bound(max_seqlen_k), capacity), scale)
        prepared = _attention_into(*args, causal, *feats, batch_invariant, out, lse, decode_tail)
        if keep:
            host, tensors = _lookup(
                op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale,
                causal, window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows,
                batch_invariant, decode_tail, out_arg, lse_arg,
            )  # fmt: skip
            PREPARED.add(host, tensors, prepared, capacity, _plain_tensors(tensors))
    return _result(op, out, lse)


def _new_outputs(q: torch.Tensor, v_cache: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32) if op == "paged_attention_with_lse" else None
    return out, lse


def _result(op: str, out: torch.Tensor, lse: torch.Tensor | None):
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
        with _on_device_of(key):
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
    with _on_device_of(out_a):
        _launch_merge_attn_states(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


@_merge_attn_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b):
    checks.check_merge_args(out_a, lse_a, out_b, lse_b)
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), out_a.new_empty(
        out_a.shape[:2], dtype=torch.float32
    )
