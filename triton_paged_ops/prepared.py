"""Prepared launches, found again from a call's metadata in about a microsecond.

An eager attention call's checks and launch planning read metadata only: host values (bounds, scale, flags) and each
tensor's type, shape, strides, dtype, device and ``requires_grad``. A later call with the same metadata can skip
both and launch what the first one prepared. :class:`PreparedLaunches` files prepared launches under a dict key of
host values and compares the tensors' metadata with a *matcher* built from the first call's tensors: PyTorch's
C++ tensor guards (the check ``torch.compile`` runs before reusing a compiled graph; ~1.3 µs for an attention call's
6 to 13 tensors where building and hashing a tuple of the same facts in Python takes ~5 µs), or, where the
installed PyTorch lacks them or they behave otherwise than expected, the same comparison in Python.

An attention launch (:class:`AttentionLaunch`) is prepared from a launch plan (``plan.py``): its grid, scalar
arguments and split-KV reduce; running it gathers the call's addresses and launches the kernels.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from triton_paged_ops import configs
from triton_paged_ops import plan as planning
from triton_paged_ops.attention_args import OPTIONAL, AttentionArgs
from triton_paged_ops.configs.heuristic import override_key
from triton_paged_ops.kernels import hopper
from triton_paged_ops.kernels.attention import _launch_attention
from triton_paged_ops.kernels.merge import ReducePlan, _launch_reduce, launch_reduce, reduce_plan
from triton_paged_ops.plan import LaunchPlan, compiler_refusal


def _facts(t: torch.Tensor) -> tuple:
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad


class PythonMatcher:
    """Whether tensors have the metadata of the ones it was built from (type, shape, strides, dtype, device,
    ``requires_grad``), compared in Python."""

    __slots__ = ("facts",)

    def __init__(self, *tensors: torch.Tensor):
        self.facts = tuple(map(_facts, tensors))

    def check(self, *tensors) -> bool:
        try:
            return tuple(map(_facts, tensors)) == self.facts
        except (AttributeError, TypeError):  # not a tensor
            return False


def _tensor_guards() -> Callable[..., object] | None:
    """A factory of C++ tensor-guard matchers, or None when this PyTorch has none that passes a probe of what the
    cache relies on: same metadata matches; another shape, stride, dtype, type, ``requires_grad`` or a non-tensor
    does not."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(*tensors: torch.Tensor):
            return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

        a, b = torch.empty(2, 3), torch.empty(4)
        guard = make(a, b)
        same = guard.check(torch.empty(2, 3), torch.empty(4))
        others = (
            (torch.empty(3, 2), b), (torch.empty(3, 2).t(), b), (a.half(), b), (a, torch.empty(5)), (a, b.int()),
            (torch.empty(2, 3, requires_grad=True), b), (torch.nn.Parameter(a), b), (a, None), (a, 1),
        )  # fmt: skip
        if same and not any(guard.check(*o) for o in others):
            return make
    except Exception:  # absent or another interface: the Python matcher serves
        pass
    return None


_GUARDS = _tensor_guards()


def make_matcher(tensors: Sequence[torch.Tensor], python: bool = False):
    """A matcher (``.check(*tensors) -> bool``) for ``tensors``' metadata: C++ guards unless ``python`` or one
    tensor fills two slots (the guards never match such calls: they take each tensor object once)."""
    if _GUARDS is None or python or len(set(map(id, tensors))) < len(tensors):
        return PythonMatcher(*tensors)
    return _GUARDS(*tensors)


class Entry:
    """One prepared launch with what a hit must still verify."""

    __slots__ = ("matcher", "value", "capacity", "direct")

    def __init__(self, matcher, value, capacity: int, direct: bool):
        self.matcher = matcher
        self.value = value
        # Largest max_seqlen_k the block table admits (the one check whose value is not in the host key).
        self.capacity = capacity
        # Built from plain tensors needing no gradient: a typed wrapper may launch it without the dispatcher.
        self.direct = direct


class PreparedLaunches:
    """Prepared launches by host values, then tensor metadata.

    ``chains[host]`` lists the entries under one host key, newest first, at most ``chain_limit`` (a continuous
    batching loop keeps few metadata variants per host key, as the host key holds the query's shape); past
    ``limit`` entries in all, everything is dropped (plans are cheap to redo, unbounded growth is not)."""

    def __init__(self, limit: int = 4096, chain_limit: int = 8):
        self.chains: dict[tuple, list[Entry]] = {}
        self.limit, self.chain_limit = limit, chain_limit
        self._count = 0

    def find(self, host: tuple, tensors: tuple) -> Entry | None:
        chain = self.chains.get(host)
        if chain is not None:
            for entry in chain:
                if entry.matcher.check(*tensors):
                    return entry
        return None

    def add(self, host: tuple, tensors: tuple, value, capacity: int, direct: bool) -> None:
        if self._count >= self.limit:
            self.clear()
        chain = self.chains.setdefault(host, [])
        chain.insert(0, Entry(make_matcher(tensors), value, capacity, direct))
        self._count += 1
        if len(chain) > self.chain_limit:
            chain.pop()
            self._count -= 1

    def clear(self) -> None:
        self.chains.clear()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def values(self) -> list:
        """The prepared launches, oldest first within each host key."""
        return [e.value for chain in self.chains.values() for e in reversed(chain)]


# Prepared launches by call metadata (ops.py fills it): cleared whenever what a plan depends on may change (a config
# override entered or left, the tables reloaded).
PREPARED = PreparedLaunches()
configs.on_reload(PREPARED.clear)


# The split-KV workspace (partial outputs and lse) is reused from call to call: one buffer per device and thread, used
# only by launches on the device's default stream: one thread's launches there run in order, so the buffer is free
# again when its next launch starts (the caching allocator gives per-call allocations the same guarantee; another
# thread's launches may interleave with them, hence per thread). Other streams get a new buffer per call: CUDA graphs
# are captured, and torch.compile's CUDA-graph trees warm up, on side streams, whose allocations belong to the
# graph's memory pool (a buffer kept here would outlive or leak into it).
_LOCAL = threading.local()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_DEFAULT_STREAMS: dict[int, int] = {}


def current_stream(device_index: int | None) -> int | None:
    """The raw handle of the current stream of CUDA (or HIP) device ``device_index`` (None: no device)."""
    return None if device_index is None else _raw_stream(device_index)


def _default_stream(device_index: int) -> int:
    handle = _DEFAULT_STREAMS.get(device_index)
    if handle is None:
        handle = _DEFAULT_STREAMS[device_index] = torch.cuda.default_stream(device_index).cuda_stream
    return handle


def _kept_on(stream: int | None, device_index: int) -> bool:
    """Whether launches on ``stream`` (None: the interpreter) reuse the kept workspace: only the default one."""
    return stream is None or stream == _default_stream(device_index)


def _workspace(q: torch.Tensor, lse_elems: int, out_elems: int, stream: int | None) -> tuple:
    """The split-KV partials (outputs, lse): views of one fp32 buffer, ``lse_elems`` lse values then ``out_elems``
    outputs (the attention kernel addresses them through its stride arguments). A kept buffer's output view is
    kept beside it per offset (slicing costs ~1.7 µs a call)."""
    device = q.get_device()  # (an index: cheaper to get and hash than a torch.device, per call)
    n = lse_elems + out_elems
    if not _kept_on(stream, device):
        buf = q.new_empty(n, dtype=torch.float32)
        return buf[lse_elems:], buf
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    entry = buffers.get(device)
    if entry is None or entry[0].numel() < n:
        # The old buffer and its views are dropped: launches queued on the stream that still use it run first.
        entry = buffers[device] = (q.new_empty(max(n, 4096), dtype=torch.float32), {})
    buf, views = entry
    out_view = views.get(lse_elems)
    if out_view is None:
        out_view = views[lse_elems] = buf[lse_elems:]
    return out_view, buf


@dataclasses.dataclass
class AttentionLaunch:
    """The host part of one attention call that depends on metadata only (shapes, strides, dtypes, bounds, flags):
    computed once per distinct metadata, so a repeated call only gathers its tensors and launches."""

    plan: LaunchPlan
    grid: tuple[int, int]
    tail: tuple  # the kernel's float and int arguments, in order
    # Split-KV: the merge of the partials by a second kernel (None: no split), and the fp32 workspace holding them:
    # ``lse_elems`` partial lse values (rounded up to keep the partial outputs 16-byte aligned), then ``out_elems``
    # partial output values.
    reduce: ReducePlan | None
    lse_elems: int = 0
    out_elems: int = 0
    device_index: int | None = None  # the CUDA device launched on (None: the interpreter)
    fixed_key: tuple | None = None  # the attention launcher's address-independent key, filled in by the first launch
    rest: tuple | None = None  # what follows the addresses in a compiled launch (filled in by the first launch)
    # The warp-specialized sm_90 kernel's launch (``kernels.hopper.prepare``), where the plan takes it and the
    # caches' layout admits its copies; caches at an address its copies cannot take run the unified kernel.
    ws: object | None = None


def prepare_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    softcap: float,
    present: tuple[bool, bool, bool, bool, bool],
    out: torch.Tensor,
    lse: torch.Tensor | None,
    interpret: bool,
    batch_invariant: bool = False,
    decode_tail: int = -1,
) -> AttentionLaunch | None:
    """Plan one launch over validated arguments from their metadata alone (None: nothing to compute). ``present``:
    whether ``alibi_slopes``, ``sinks``, ``k_scale``, ``v_scale`` and ``block_table_rows`` are given;
    ``decode_tail``: the caller's hint (see ``ops.paged_attention``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    if num_seqs == 0 or num_tokens == 0:
        return None
    lp = planning._cached_launch_plan(
        override_key(), num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, q.dtype,
        k_cache.dtype, num_seqs, max_seqlen_q, max_seqlen_k, causal, window_left, softcap, *present, lse is not None,
        None if interpret else q.device.index, interpret, batch_invariant, planning.narrow_offsets_ok(k_cache, v_cache),
        min(decode_tail, 1),
    )  # fmt: skip
    refusal = None if interpret else compiler_refusal(lp.config, q.device.index)
    if refusal:
        raise RuntimeError(refusal)
    plan = lp.split
    splits = plan.num_splits
    reduce, lse_elems, out_elems = None, 0, 0
    if splits > 1:
        # The workspace (one fp32 buffer, see _workspace): [S, T, Hq] partial lse, then [S, T, Hq, Dv] outputs.
        o_strides = (num_tokens * num_q_heads * head_dim_v, num_q_heads * head_dim_v, head_dim_v)
        l_strides = (num_tokens * num_q_heads, num_q_heads, 1)
        lse_elems = -(-splits * num_tokens * num_q_heads // 4) * 4
        out_elems = splits * num_tokens * num_q_heads * head_dim_v
        # Leaf programs (batch-invariant mode): the reduce folds each fixed segment's leaves first.
        group = lp.config["invariant_segment"] // plan.segment_len if batch_invariant else 1
        reduce = reduce_plan(splits, num_tokens, num_q_heads, head_dim_v, o_strides, l_strides, num_seqs,
                             out.stride()[:2], None if lse is None else lse.stride(), batch_invariant,
                             lp.constexprs["LAUNCH_DEPENDENTS"], group)  # fmt: skip
    else:
        o_strides = (0, *out.stride()[:2])
        l_strides = (0, *(lse if lse is not None else out).stride()[:2])
    num_blocks = num_seqs if lp.one_block else num_tokens // lp.block_q + num_seqs
    tail = (
        float(scale), float(softcap), window_left, num_seqs, num_seqs - max(decode_tail, 0), num_tokens,
        *reversed(block_table.shape), num_pages,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *l_strides,
        block_table.stride(0), plan.segment_len, splits,
    )  # fmt: skip
    prepared = AttentionLaunch(lp, (num_blocks * splits, num_kv_heads), tail, reduce, lse_elems, out_elems,
                               None if interpret else q.device.index)  # fmt: skip
    if lp.ws is not None:  # noqa: SIM102 (the second test reads the caches)
        if hopper.layout_ok(k_cache, v_cache, check_address=False) and hopper.q_layout_ok(q, check_address=False):
            block_n, stages = lp.ws
            # Its mixed batches run in the batch's order: interleaving the decodes cost 580 -> 592 µs there (each
            # program holds an SM alone).
            prepared.ws = hopper.prepare(q, k_cache, block_table, out, has_rows=present[4], num_seqs=num_seqs,
                                         scale=float(scale), causal=causal, block_n=block_n,
                                         stages=stages)  # fmt: skip
    return prepared


def run_attention_launch(p: AttentionLaunch, a: AttentionArgs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Launch a prepared call on arguments whose metadata is the one it was prepared from."""
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens = a[:6]
    alibi_slopes, sinks, k_scale, v_scale, block_table_rows = a[OPTIONAL]
    if p.ws is not None and not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15:
        p.ws.run(q, k_cache, v_cache, block_table, block_table_rows, cu_seqlens_q, seq_lens, out)
        return
    lp = p.plan
    # One stream query for the workspace and both launches.
    stream = current_stream(p.device_index)
    if p.out_elems:
        dst_out, dst_lse = _workspace(q, p.lse_elems, p.out_elems, stream)
    else:
        dst_out, dst_lse = out, lse if lse is not None else out
    if p.rest is not None:
        # A repeat of a launched plan: the kernels' addresses read once each, no argument tuples.
        ptr_q, ptr_bt, ptr_cu = q.data_ptr(), block_table.data_ptr(), cu_seqlens_q.data_ptr()
        ptr_out, ptr_lse = dst_out.data_ptr(), dst_lse.data_ptr()
        ptr_rows = block_table_rows.data_ptr() if block_table_rows is not None else ptr_bt
        # (Spelled out: a comprehension over the four optional tensors costs a frame per call.)
        ptrs = [ptr_q, k_cache.data_ptr(), v_cache.data_ptr(), ptr_out, ptr_lse, ptr_bt, ptr_rows, ptr_cu,
                seq_lens.data_ptr(), alibi_slopes.data_ptr() if alibi_slopes is not None else ptr_q,
                sinks.data_ptr() if sinks is not None else ptr_q, k_scale.data_ptr() if k_scale is not None else ptr_q,
                v_scale.data_ptr() if v_scale is not None else ptr_q]  # fmt: skip
        if _launch_attention.launch_addresses(p.grid, ptrs, p.rest, p.fixed_key, stream):
            r = p.reduce
            if r is None:
                return
            ptr_final = out.data_ptr()
            ptrs = [ptr_out, ptr_lse, ptr_final, lse.data_ptr() if lse is not None else ptr_lse, ptr_cu]
            if r.rest is not None and _launch_reduce.launch_addresses(r.grid, ptrs, r.rest, r.fixed_key, stream):
                return
            launch_reduce(r, dst_out, dst_lse, cu_seqlens_q, out, lse, stream)
            return
    # Absent optional tensors are never read (their constexpr flags are off): q stands in for the pointer.
    args = (
        q, k_cache, v_cache, dst_out, dst_lse, block_table,
        block_table_rows if block_table_rows is not None else block_table, cu_seqlens_q, seq_lens,
        alibi_slopes if alibi_slopes is not None else q, sinks if sinks is not None else q,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q, *p.tail,
    )  # fmt: skip
    p.fixed_key = _launch_attention(p.grid, args, lp.constexprs, lp.options, lp.kernel_id, p.fixed_key, stream)
    if p.reduce is not None:
        launch_reduce(p.reduce, dst_out, dst_lse, cu_seqlens_q, out, lse, stream)
    if p.rest is None and p.fixed_key is not None and stream is not None:
        p.rest = _launch_attention.rest(p.tail, lp.constexprs)


def launch_paged_attention(
    a: AttentionArgs, out: torch.Tensor, lse: torch.Tensor | None, interpret: bool
) -> AttentionLaunch | None:
    """Launch over validated arguments; writes ``out`` and, if given, ``lse``. Returns the prepared launch (None:
    nothing to compute), which ``run_attention_launch`` can repeat."""
    p = prepare_attention_launch(
        a.q, a.k_cache, a.v_cache, a.block_table, a.seq_lens.shape[0], a.max_seqlen_q, a.max_seqlen_k, a.scale,
        a.causal, a.window_left, a.softcap, tuple(t is not None for t in a.optional()), out, lse, interpret,
        a.batch_invariant, a.decode_tail,
    )  # fmt: skip
    if p is not None:
        run_attention_launch(p, a, out, lse)
    return p
