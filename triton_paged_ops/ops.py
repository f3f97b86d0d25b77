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
from triton_paged_ops.attention_args import OPTIONAL, AttentionArgs, attention_schema, record
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


def _attention_into(a: AttentionArgs, out: torch.Tensor, lse: torch.Tensor | None) -> AttentionLaunch | None:
    """Shared body of the three attention ops after the checks: kernel or reference, writing ``out``/``lse``.
    Returns the prepared launch of a kernel run (None: nothing launched, or the reference ran)."""
    if checks.debug_mode():
        checks.debug_check_attention(a.q, a.k_cache, a.block_table, a.cu_seqlens_q, a.seq_lens, a.max_seqlen_q,
                                     a.max_seqlen_k, a.block_table_rows, a.decode_tail)  # fmt: skip
    if _use_kernels(a.q):
        return launch_paged_attention(a, out, lse, INTERPRET)
    # (The reference attends each sequence on its own, in fp32: batch-invariant already.)
    ref_out, ref_lse = reference.attention_of(a)
    # The reference writes every row; the kernels leave rows past cu_seqlens_q[-1] alone. Match that.
    n = int(a.cu_seqlens_q[-1]) if a.cu_seqlens_q.numel() else 0
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


def _plain_eager(a: AttentionArgs) -> bool:
    """Whether ``torch.ops`` would do nothing but call an attention op's body on the arguments ``a``, as
    far as the process state and the host values tell: not compiling or tracing (dynamo reads ``is_compiling()`` as
    True and keeps the op in its graph), no torch function or dispatch mode (fake tensors, functionalization, ``with
    torch.device``), no functorch transform, no profiler (the dispatcher records the op), and Python
    ``int``/``float``/``bool`` scalars (what the dispatcher converts or refuses otherwise). The tensors are
    ``_plain_tensors``' to judge (or a prepared launch's matcher's)."""
    # (Spelled out, on locals: loops over tuples of the scalars, or field reads, cost as much as all the hooks.)
    max_q, max_k, scale, causal, window_left, softcap = a[6:12]
    invariant, tail = a[17:]
    return not (
        type(max_q) is not int or type(max_k) is not int or type(window_left) is not int
        or type(scale) is not float or type(softcap) is not float or type(causal) is not bool
        or type(invariant) is not bool or type(tail) is not int or _compiling() or _dispatch_modes()
        or _function_modes() or _functorch_active() or _jit_tracing() is not None or _profiling()
    )  # fmt: skip


def _plain_tensors(tensors: tuple) -> bool:
    """Plain ``torch.Tensor``s (no subclass) that need no gradient (the dispatcher would attach an autograd error
    node), not on the meta device; None for absent optional tensors."""
    if type(tensors[0]) is not torch.Tensor or tensors[0].is_meta:
        return False
    return all(t is None or (type(t) is torch.Tensor and not t.requires_grad) for t in tensors)


def direct_attention(op: str, a: AttentionArgs, out: torch.Tensor | None, lse: torch.Tensor | None):
    """An attention op's result computed without the dispatcher (a prepared launch repeated, or the op body), or
    ``MISS`` when only ``torch.ops`` may run this call. The dispatcher costs
    ~6 µs of an eager decode call; it bumps no version counter for these ops, so skipping it changes nothing else
    where ``_plain_eager`` and ``_plain_tensors`` (or the matched launch's ``direct``) hold."""
    if not isinstance(a.q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(a.q).__name__}")
    if not _plain_eager(a):
        return MISS
    done = _repeat(op, a, out, lse, True)
    if done is not MISS:
        return done
    if not _plain_tensors((*a[:6], *a[OPTIONAL], out, lse)):
        return MISS
    return _attention_body(op, a, out, lse, fake=False)


_NOTHING_OPTIONAL = (True,) * 6


def _lookup(op: str, a: AttentionArgs, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[tuple, tuple]:
    """A call's prepared-launch key: host values (with ``max_seqlen_k``'s planning bound, ``plan.key_bound``, and
    which optional tensors are absent), and the tensors a matcher compares (the present ones, in schema order)."""
    # (One unpacking into locals: a field read per value costs more.)
    max_q, max_k, scale, causal, window_left, softcap, alibi, sinks, k_scale, v_scale, rows, invariant, tail = a[6:]
    absent = (alibi is None, sinks is None, k_scale is None, v_scale is None, rows is None, lse is None)
    host = (op, a[0].shape, max_q, key_bound(max_k), scale, causal, window_left, softcap, invariant, tail, absent)
    tensors = a[:6] if out is None else (*a[:6], out)
    if absent != _NOTHING_OPTIONAL:
        tensors += tuple([t for t in (*a[OPTIONAL], lse) if t is not None])
    return host, tensors


def _table_keys(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """Keys a block-table row can address: its columns times the page size."""
    return block_table.shape[1] * k_cache.shape[1]


def _repeat(op: str, a: AttentionArgs, out: torch.Tensor | None, lse: torch.Tensor | None, direct: bool = False):
    """Run the launch an earlier successful call with the same metadata prepared, on these tensors, and return the
    op's result; ``MISS`` (nothing done) when there is none, or the call needs the full path (debug mode, another
    current device, ``max_seqlen_k`` past the block table's reach, or ``direct`` and a launch not prepared from
    plain tensors).

    The host key holds ``max_seqlen_k``'s planning bound (``plan.key_bound``) instead of its value, so a decode loop
    whose bound grows by one per step keeps hitting; the entry's capacity stands in for the check of the value."""
    if _debug_mode():
        return MISS
    try:
        entry = PREPARED.find(*_lookup(op, a, out, lse))
    except (AttributeError, TypeError):  # not a tensor, not an int
        return MISS
    if (
        entry is None or not 0 <= a.max_seqlen_k <= entry.capacity or (direct and not entry.direct)
        or _foreign_device(a.q) is not None
    ):  # fmt: skip
        return MISS
    if op != "paged_attention_out":
        out, lse = _new_outputs(a.q, a.v_cache, op)
    if entry.value is not None:
        run_attention_launch(entry.value, a, out, lse)
    return _result(op, out, lse)


# The three attention ops share one argument list. The out variant takes its buffers keyword-only (like aten's
# out= overloads); torch.library.custom_op refuses keyword-only tensors, so all three are defined from schemas.
_ATTENTION_ARGS = attention_schema()
_ATTENTION_OPS = {
    "paged_attention": f"({_ATTENTION_ARGS}) -> Tensor",
    "paged_attention_with_lse": f"({_ATTENTION_ARGS}) -> (Tensor, Tensor)",
    "paged_attention_out": f"({_ATTENTION_ARGS}, *, Tensor(a!) out, Tensor(b!)? lse=None) -> ()",
}


def _attention(*args, op: str, fake: bool, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, **kwargs):
    """The registered implementation (``fake=False``) and fake of attention op ``op``: its schema arguments as
    passed by the dispatcher, gathered into one record."""
    # (The dispatcher passes all 19 positionally: the record is then that tuple.)
    a = record(AttentionArgs, args) if len(args) == 19 and not kwargs else AttentionArgs(*args, **kwargs)
    return _attention_body(op, a, out, lse, fake)


def _attention_body(op: str, a: AttentionArgs, out: torch.Tensor | None, lse: torch.Tensor | None, fake: bool):
    """Body of all three attention ops, real (``fake=False``) and fake: same checks, same output allocation.

    A real call whose metadata (shapes, strides, dtypes, devices, host values) equals an earlier successful call's
    skips the checks and the launch planning and launches what that call prepared (``_repeat``): the eager host
    path of a serving loop's repeated shapes is then the dispatch, that lookup and the launch itself."""
    out_arg, lse_arg = out, lse  # (the other ops allocate theirs below: the key holds what the caller passed)
    q = a.q
    if torch.is_grad_enabled():
        checks.check_no_grad(op, q=q, k_cache=a.k_cache, v_cache=a.v_cache, alibi_slopes=a.alibi_slopes,
                             sinks=a.sinks, k_scale=a.k_scale, v_scale=a.v_scale)  # fmt: skip
    if not fake:
        done = _repeat(op, a, out, lse)
        if done is not MISS:
            return done
        device = _foreign_device(q)
        if device is not None:
            with torch.cuda.device(device):
                return _attention_body(op, a, out, lse, fake)
    checks.check_attention_args(a)
    if op == "paged_attention_out":
        checks.check_attention_outputs(q, a.v_cache, out, lse)
    else:
        out, lse = _new_outputs(q, a.v_cache, op)
    if not fake:
        keep = not checks.debug_mode() and _use_kernels(q)
        capacity = _table_keys(a.k_cache, a.block_table)
        planned = a
        if keep:
            # Planned for the bound the host key holds (capped by the table, as the checks passed for the exact one).
            planned = a._replace(max_seqlen_k=min(key_bound(a.max_seqlen_k), capacity))
        launch = _attention_into(planned, out, lse)
        if keep:
            host, tensors = _lookup(op, a, out_arg, lse_arg)
            PREPARED.add(host, tensors, launch, capacity, _plain_tensors(tensors))
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
