"""Argument validation for the ``tpa`` ops.

Shape, dtype and device checks read metadata only, so they run on every call, on fake tensors under
``torch.compile`` too. Checks that must read index tensors (page ids in range, ``q_len <= kv_len`` ...) would force a
device-to-host sync, which CUDA graphs forbid and serving cannot afford; they run only in debug mode, switched on with
``TPA_DEBUG=1`` in the environment or :func:`set_debug_mode`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch

from triton_paged_ops.attention_args import AttentionArgs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp8 caches (with per-tensor k_scale / v_scale): e4m3fn (NVIDIA, OCP) and e4m3fnuz (AMD MI300).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
MAX_HEAD_DIM = 256

_debug = os.environ.get("TPA_DEBUG", "0") not in ("", "0")


def set_debug_mode(enabled: bool) -> None:
    """Turn the host-synchronising input checks on or off (default: the ``TPA_DEBUG`` environment variable)."""
    global _debug
    _debug = bool(enabled)


def debug_mode() -> bool:
    """Whether the host-synchronising input checks run."""
    return _debug


def _require(cond: bool, msg: Callable[[], str]) -> None:
    # The message is built only on failure: formatting every message eagerly cost tens of µs per call.
    if not cond:
        raise ValueError(msg())


def _check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    last_contiguous: bool = True,
) -> tuple[int, ...]:
    """Type, rank, dtype, device and (optionally) a unit last stride of one tensor; returns its shape."""
    # Every call of an op runs these: plain ifs (no per-check closures) and one read of each attribute.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = t.shape
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all tensors must share a device")
    if last_contiguous and shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return shape


def cache_dtype_supported(dtype: torch.dtype, capability: tuple[int, int], amd: bool) -> bool:
    """Whether Triton's compiler for that GPU can read a cache of ``dtype``: on NVIDIA GPUs e4m3 (``float8_e4m3fn``)
    only from sm_89 (Ada) on; AMD's backend has both e4m3 formats."""
    return amd or dtype != torch.float8_e4m3fn or capability >= (8, 9)


@functools.lru_cache(maxsize=64)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device (None for other devices)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def _check_cache_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
        raise TypeError(f"{name}: float8_e4m3fnuz caches are for AMD GPUs (ROCm); use float8_e4m3fn here")
    if t.dtype in FP8_DTYPES:
        capability = device_capability(t.device)
        if capability is not None and not cache_dtype_supported(t.dtype, capability, torch.version.hip is not None):
            raise TypeError(f"{name}: {t.dtype} caches need an NVIDIA GPU of sm_89 or newer (Triton compiles no e4m3 "
                            f"for older ones); this one is sm_{capability[0]}{capability[1]}")  # fmt: skip


def _check_per_head(name: str, t: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    if t is None:
        return
    _check_tensor(name, t, 1, (torch.float32,), device)
    _require(t.shape[0] == num_q_heads, lambda: f"{name} must have shape [Hq={num_q_heads}], got {tuple(t.shape)}")


def _check_scale_tensor(name: str, t: torch.Tensor | None, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 1-element float32 tensor, got {type(t).__name__}")
    _require(t.numel() == 1, lambda: f"{name} must have exactly 1 element, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    _require(t.device == device, lambda: f"{name} is on {t.device} but q is on {device}")


def check_attention_args(a: AttentionArgs) -> None:
    """Metadata-only checks of an attention call's arguments; raises ``ValueError``/``TypeError`` naming one."""
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale = a[:9]
    window_left, softcap, decode_tail = a.window_left, a.softcap, a.decode_tail
    alibi_slopes, sinks, k_scale, v_scale, block_table_rows = a.optional()
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    _, num_q_heads, head_dim = _check_tensor("q", q, 3, FLOAT_DTYPES, dev)
    k_shape = _check_tensor("k_cache", k_cache, 4, CACHE_DTYPES, dev)
    v_shape = _check_tensor("v_cache", v_cache, 4, CACHE_DTYPES, dev)
    _check_cache_dtype("k_cache", k_cache)
    bt_shape = _check_tensor("block_table", block_table, 2, (torch.int32,), dev)
    # 1-D index tensors are read with unit stride: a strided view (every other entry) is refused, not misread.
    (cu_len,) = _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), dev)
    (batch,) = _check_tensor("seq_lens", seq_lens, 1, (torch.int32,), dev)
    num_pages, page_size, num_kv_heads, head_dim_k = k_shape
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if v_shape[:3] != k_shape[:3]:
        raise ValueError(
            f"v_cache must be [num_pages={num_pages}, page_size={page_size}, Hkv={num_kv_heads}, Dv], "
            f"got {tuple(v_shape)}"
        )
    if page_size < 1 or num_pages < 1:
        raise ValueError(f"k_cache must hold at least one page, got {tuple(k_shape)}")
    if num_kv_heads < 1:
        raise ValueError("k_cache must have at least one KV head")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's head count Hq={num_q_heads} must be divisible by k_cache's Hkv={num_kv_heads}")
    if head_dim != head_dim_k:
        raise ValueError(f"head-dim mismatch: q has D={head_dim}, k_cache has D={head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if not 1 <= v_shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"v_cache head dim must be in [1, {MAX_HEAD_DIM}], got {v_shape[3]}")
    if cu_len != batch + 1:
        raise ValueError(f"cu_seqlens_q must have B+1={batch + 1} entries (B = len(seq_lens)), got {cu_len}")
    if block_table_rows is None:
        if bt_shape[0] != batch:
            raise ValueError(f"block_table must have B={batch} rows (B = len(seq_lens)), got {bt_shape[0]}")
    else:
        (n_rows,) = _check_tensor("block_table_rows", block_table_rows, 1, (torch.int32, torch.int64), dev)
        if n_rows != batch:
            raise ValueError(f"block_table_rows must have B={batch} entries (B = len(seq_lens)), got {n_rows}")
        if bt_shape[0] < 1:
            raise ValueError("block_table must have at least one row")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
    if bt_shape[1] * page_size < max_seqlen_k:
        raise ValueError(
            f"block_table too narrow: {bt_shape[1]} pages x page_size {page_size} < max_seqlen_k={max_seqlen_k}"
        )
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left}")
    if not 0.0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be 0 (off) or a finite > 0, got {softcap}")
    if not -1 <= decode_tail <= batch:
        raise ValueError(
            f"decode_tail must be -1 (not known) or a count of sequences in [0, B={batch}], got {decode_tail}"
        )
    _check_per_head("alibi_slopes", alibi_slopes, num_q_heads, dev)
    _check_per_head("sinks", sinks, num_q_heads, dev)
    _check_scale_tensor("k_scale", k_scale, dev)
    _check_scale_tensor("v_scale", v_scale, dev)


def check_no_grad(op: str, **tensors: torch.Tensor | None) -> None:
    """The ops are for inference (no backward is registered): under grad mode a tensor that requires grad would get
    an output that silently never passes a gradient back, so it is refused, named."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(
                f"tpa.{op} has no backward, but {name} requires grad: call it under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach()"
            )


def check_attention_outputs(q: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None):
    """Checks of the caller-provided ``out [T, Hq, Dv]`` (q's dtype) and ``lse [T, Hq]`` (fp32) buffers."""
    q_shape = q.shape
    expect = (q_shape[0], q_shape[1], v_cache.shape[3])
    if _check_tensor("out", out, 3, (q.dtype,), q.device) != expect:
        raise ValueError(f"out must have shape [T, Hq, Dv]={list(expect)}, got {tuple(out.shape)}")
    if lse is not None and _check_tensor("lse", lse, 2, (torch.float32,), q.device, False) != expect[:2]:
        raise ValueError(f"lse must have shape [T, Hq]={list(expect[:2])}, got {tuple(lse.shape)}")


def decode_tail_of(q_lens: Sequence[int]) -> int:
    """The ``decode_tail`` hint of a batch from its query lengths (host values, e.g. SGLang's
    ``extend_seq_lens_cpu``): how many sequences at its end have one new token, if no earlier one has; else -1."""
    n = len(q_lens)
    tail = 0
    while tail < n and q_lens[n - 1 - tail] == 1:
        tail += 1
    return tail if all(x != 1 for x in q_lens[: n - tail]) else -1


def debug_check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table_rows: torch.Tensor | None = None,
    decode_tail: int = -1,
) -> None:
    """Checks that read index tensors (device-to-host sync): run only in debug mode."""
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    _require(cu.numel() == 0 or int(cu[0]) == 0, lambda: f"cu_seqlens_q must start at 0, got {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    _require(bool((q_lens >= 0).all()), lambda: f"cu_seqlens_q must be non-decreasing, got {cu.tolist()}")
    _require(
        cu.numel() == 0 or int(cu[-1]) <= q.shape[0],
        lambda: f"cu_seqlens_q[-1]={int(cu[-1])} exceeds the token count of q ({q.shape[0]})",
    )
    _require(
        bool((q_lens <= max_seqlen_q).all()),
        lambda: f"a query length exceeds max_seqlen_q={max_seqlen_q}: {q_lens.tolist()}",
    )
    _require(bool((lens <= max_seqlen_k).all()), lambda: f"a seq_lens entry exceeds max_seqlen_k={max_seqlen_k}")
    _require(
        bool((q_lens <= lens).all()),
        lambda: "seq_lens must count the new tokens too: some sequence has q_len > seq_len",
    )
    # The hint only steers the schedule, but a wrong one is a caller's bug worth naming here.
    _require(
        decode_tail < 0 or decode_tail_of(q_lens.tolist()) == decode_tail,
        lambda: (
            f"decode_tail={decode_tail} does not describe the batch: its query lengths are {q_lens.tolist()} "
            f"(the last decode_tail sequences must have one new token each, and no earlier one; -1 if not known)"
        ),
    )
    page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    bt = block_table.cpu()
    rows = list(range(len(lens))) if block_table_rows is None else block_table_rows.cpu().tolist()
    for b, (row, n) in enumerate(zip(rows, lens.tolist())):
        if not 0 <= row < bt.shape[0]:
            raise ValueError(f"block_table_rows[{b}]={row} is outside block_table's rows [0, {bt.shape[0]})")
        used = bt[row, : (n + page_size - 1) // page_size]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(f"block_table row {row} references a page outside [0, {num_pages}): {used.tolist()}")


def check_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Metadata-only checks of ``reshape_and_cache``'s arguments."""
    if not isinstance(key, torch.Tensor):
        raise TypeError(f"key must be a torch.Tensor, got {type(key).__name__}")
    dev = key.device
    _check_tensor("key", key, 3, FLOAT_DTYPES, dev)
    _check_tensor("value", value, 3, FLOAT_DTYPES, dev)
    _check_tensor("k_cache", k_cache, 4, CACHE_DTYPES, dev)
    _check_tensor("v_cache", v_cache, 4, CACHE_DTYPES, dev)
    _check_cache_dtype("k_cache", k_cache)
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), dev)
    n, num_kv_heads, head_dim = key.shape
    _require(
        tuple(value.shape[:2]) == (n, num_kv_heads),
        lambda: f"value must be [N={n}, Hkv={num_kv_heads}, Dv], got {tuple(value.shape)}",
    )
    _require(
        tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim),
        lambda: f"k_cache must be [num_pages, page_size, Hkv={num_kv_heads}, D={head_dim}], got {tuple(k_cache.shape)}",
    )
    _require(
        tuple(v_cache.shape) == (*k_cache.shape[:3], value.shape[2]),
        lambda: f"v_cache must be {[*k_cache.shape[:3], value.shape[2]]}, got {tuple(v_cache.shape)}",
    )
    _require(slot_mapping.shape[0] == n, lambda: f"slot_mapping must have N={n} entries, got {slot_mapping.shape[0]}")
    _check_scale_tensor("k_scale", k_scale, dev)
    _check_scale_tensor("v_scale", v_scale, dev)


def debug_check_cache(k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Slots must be negative (skip) or inside the cache: debug mode only (host sync)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping has a slot >= num_pages * page_size = {num_slots}")


def check_merge_args(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Metadata-only checks of ``merge_attn_states``'s arguments."""
    if not isinstance(out_a, torch.Tensor):
        raise TypeError(f"out_a must be a torch.Tensor, got {type(out_a).__name__}")
    dev = out_a.device
    _check_tensor("out_a", out_a, 3, FLOAT_DTYPES, dev)
    _check_tensor("out_b", out_b, 3, (out_a.dtype,), dev)
    _check_tensor("lse_a", lse_a, 2, (torch.float32,), dev, last_contiguous=False)
    _check_tensor("lse_b", lse_b, 2, (torch.float32,), dev, last_contiguous=False)
    _require(out_a.shape == out_b.shape, lambda: f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _require(
            tuple(lse.shape) == tuple(out_a.shape[:2]),
            lambda name=name, lse=lse: f"{name} must have shape [T, H]={list(out_a.shape[:2])}, got {tuple(lse.shape)}",
        )
