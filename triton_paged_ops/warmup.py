"""Compile, before serving, every kernel variant that serving with given model settings can reach.

Which compiled variant a call uses is decided on the host from the model's fixed settings (heads, head dims, page
size, dtype, features) and from two per-batch facts: the query-length bound (decode / short / prefill tiles, and
whether each sequence fits one query block) and the split-KV plan (split or not, and the reduce kernel's
power-of-two split bucket). Everything else that changes per batch is not specialised on by the kernels. So the
reachable set is enumerated from the launch planner itself (``attention_launch_plan``) over every batch size and
context bound up to the limits, and each distinct variant is run once on tiny tensors.

Assumes serving passes tensors in the usual layouts (``q``/``out`` contiguous ``[T, H, D]``, caches
``[pages, page_size, Hkv, D]`` contiguous) and caches of fewer than 2^31 elements each (K/V offsets in 32 bits);
other layouts and larger caches are separate variants.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable

import torch
import triton

from triton_paged_ops import api, configs
from triton_paged_ops.configs import MAX_SPLIT_Q_LEN, num_sms_at
from triton_paged_ops.plan import attention_launch_plan, plan_splits, split_plan_for

_DEFAULT_PROGRAMS_PER_SM = inspect.signature(plan_splits).parameters["programs_per_sm"].default
_DEFAULT_MIN_SEGMENT = inspect.signature(plan_splits).parameters["min_segment"].default
_CONTEXT_STEP = 64  # context bounds are enumerated at this granularity (split plans change at tile multiples)


@dataclasses.dataclass
class WarmupReport:
    variants: int  # distinct attention launch variants compiled (each with its reduce kernel when split)
    calls: int  # op calls made, attention and cache writes
    seconds: float


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """What serving fixes: the model's attention shape and features, and the per-batch limits.

    ``max_batch`` sequences per batch, ``max_context`` keys per sequence, ``max_query`` new tokens per sequence
    (the prefill chunk size) at most. Features (``causal``, ``window_left``, ``softcap``, ``alibi``, ``sinks``,
    ``kv_scale``, ``block_table_rows``, ``lse``) must be set as serving will call the ops; ``decode_tail``: serving
    passes the ops' ``decode_tail`` hint (mixed batches then launch their interleaved-order variants too, and
    batches of prompts alone their ``prompts`` tiles).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None  # the K/V caches' dtype when it is not ``dtype`` (e.g. fp8)
    max_batch: int = 256
    max_context: int = 32768
    max_query: int = 8192
    causal: bool = True
    window_left: int = -1
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    kv_scale: bool = False
    block_table_rows: bool = False
    lse: bool = False
    batch_invariant: bool = False
    decode_tail: bool = False


def reachable_variants(
    settings: ServingSettings, device_index: int | None, interpret: bool
) -> dict[tuple, tuple[int, int, int, int]]:
    """Each reachable variant with one (batch size, query bound, context bound, hint) that reaches it; the hint:
    -1 none, 1 a batch of one prompt then one-token sequences (passed with its ``decode_tail``), 0 a batch of prompts
    alone (passed with ``decode_tail`` 0)."""
    st = settings
    max_batch, max_context, max_query, num_kv_heads = st.max_batch, st.max_context, st.max_query, st.num_kv_heads
    fixed = dict(
        num_q_heads=st.num_q_heads, num_kv_heads=num_kv_heads, head_dim=st.head_dim,
        head_dim_v=st.head_dim_v or st.head_dim, page_size=st.page_size, dtype=st.dtype,
        cache_dtype=st.cache_dtype or st.dtype, causal=st.causal,
        window_left=st.window_left, softcap=st.softcap, has_alibi=st.alibi, has_sinks=st.sinks,
        has_k_scale=st.kv_scale, has_v_scale=st.kv_scale, has_rows=st.block_table_rows, want_lse=st.lse,
        device_index=device_index, interpret=interpret, batch_invariant=st.batch_invariant,
    )  # fmt: skip
    # Query bounds: every short length (tiles and one-block-per-sequence change among them), then the bounds
    # around each regime's query-block size, then the largest.
    queries = set(range(1, min(max_query, MAX_SPLIT_Q_LEN + 1) + 1))
    for q in sorted(queries | {max_query}):
        block_q = attention_launch_plan(num_seqs=1, max_seqlen_q=q, max_seqlen_k=q, **fixed).block_q
        queries |= {b for b in (block_q, block_q + 1) if b <= max_query}
    queries.add(max_query)
    contexts = sorted({*range(_CONTEXT_STEP, max_context + 1, _CONTEXT_STEP), max_context})
    found: dict[tuple, tuple[int, int, int]] = {}
    num_sms = num_sms_at(device_index)
    buckets_of: dict[tuple, dict[tuple, tuple[int, int]]] = {}
    for q in sorted(queries):
        if q > MAX_SPLIT_Q_LEN:
            lp = attention_launch_plan(num_seqs=1, max_seqlen_q=q, max_seqlen_k=max(q, max_context), **fixed)
            found.setdefault(lp.variant(), (1, q, max(q, max_context)))
            continue
        cfg = attention_launch_plan(num_seqs=1, max_seqlen_q=q, max_seqlen_k=q, **fixed).config
        if st.batch_invariant:
            # Fixed segments: a batch either fits one segment (no split) or splits (one sequential reduce variant,
            # whatever the count), by segment or, where the segments leave SMs idle, by leaf (and within the split
            # limits): batch sizes and segment counts by powers of two reach each kind that any batch can.
            seg = cfg["invariant_segment"]
            counts = [1 << i for i in range(max(1, -(-max_context // seg)).bit_length() + 1)]
            bounds = {q, max(q, max_context)} | {max(q, min(max_context, n * seg + 1)) for n in counts}
            for b in sorted({1 << i for i in range(max_batch.bit_length())} | {max_batch}):
                for k in bounds:
                    lp = attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k, **fixed)
                    found.setdefault(lp.variant(), (b, q, k))
            continue
        # The config depends on the batch size too (one-token batches with a (sequence, KV head) pair per SM take
        # the decode_large entry), the split plan on batch size and context bound only (not on q): the batch sizes
        # of each config, then one (batch, context) for each reachable (split?, power-of-two split count), found
        # once per config and batch range.
        batches: dict[tuple, tuple[dict, list[int]]] = {}  # config key -> (config, batch sizes)
        for b in range(1, max_batch + 1):
            cfg = attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=q, **fixed).config
            policy = tuple((k, cfg[k]) for k in configs.SPLIT_KEYS if k in cfg)
            # Past this batch size the GPU is full without splitting, and the plan depends on the context only
            # (nor does the regime change any more: such a batch has a pair per SM).
            if b > -(-num_sms * dict(policy).get("programs_per_sm", _DEFAULT_PROGRAMS_PER_SM) // num_kv_heads) + 1:
                break
            key = (tuple(cfg.get(k) for k in configs.TILE_KEYS), policy, cfg.get("num_splits"))
            batches.setdefault(key, (cfg, []))[1].append(b)
        for key, (cfg, sizes) in batches.items():
            cached = (key, sizes[0], sizes[-1])
            if cached not in buckets_of:
                buckets: dict[tuple, tuple[int, int]] = {}
                for b in sizes:
                    for k in contexts:
                        n = split_plan_for(cfg, b, num_kv_heads, q, k, device_index).num_splits
                        buckets.setdefault((n > 1, triton.next_power_of_2(n)), (b, k))
                buckets_of[cached] = buckets
            for b, k in buckets_of[cached].values():
                if k >= q:
                    lp = attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k, **fixed)
                    found.setdefault(lp.variant(), (b, q, k))
    if max_query > MAX_SPLIT_Q_LEN and not st.batch_invariant:
        _prefill_splits(found, fixed, max_query, max_batch, max_context, num_sms)
    reached = {variant: (*where, -1) for variant, where in found.items()}
    if st.decode_tail:
        # The same bounds for batches said to end in one-token sequences (two sequences at least) or to hold none:
        # only prefill launches can differ.
        for b, q, k in found.values():
            for hint in (1, 0) if q > 1 else ():
                if hint and max_batch < 2:
                    continue
                b = max(b, 1 + hint)
                lp = attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k, decode_tail=hint, **fixed)
                reached.setdefault(lp.variant(), (b, q, k, hint))
    return reached


def _prefill_splits(found: dict, fixed: dict, max_query: int, max_batch: int, max_context: int,
                    num_sms: int) -> None:  # fmt: skip
    """Long queries split only while batch x query blocks x KV heads <= SMs / 2: each such (batch, query blocks) with
    each context bound that changes the split count (multiples of the minimum segment), so every reduce variant
    they reach is found."""
    lp = attention_launch_plan(num_seqs=1, max_seqlen_q=max_query, max_seqlen_k=max(max_query, max_context), **fixed)
    block_q, min_segment = lp.block_q, lp.config.get("min_segment", _DEFAULT_MIN_SEGMENT)
    contexts = sorted({*range(min_segment, max_context + 1, min_segment), max_context})
    for blocks in range(1, num_sms // (2 * fixed["num_kv_heads"]) + 1):
        for b in (b for b in range(1, min(max_batch, blocks) + 1) if blocks % b == 0):
            q = max(MAX_SPLIT_Q_LEN + 1, blocks // b * block_q)
            for k in contexts:
                if q <= min(k, max_query):
                    lp = attention_launch_plan(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k, **fixed)
                    found.setdefault(lp.variant(), (b, q, k))


def warmup(settings: ServingSettings, device: str | torch.device = "cuda",
           progress: Callable[[int, int], None] | None = None) -> WarmupReport:  # fmt: skip
    """Compile every attention and cache-write variant that serving with ``settings`` can launch; ``progress(done,
    total)`` is called after each attention variant."""
    device = torch.device(device)
    interpret = device.type == "cpu"
    device_index = None if interpret else (device.index if device.index is not None else torch.cuda.current_device())
    st = settings
    num_q_heads, num_kv_heads, head_dim, page_size, dtype = (st.num_q_heads, st.num_kv_heads, st.head_dim,
                                                             st.page_size, st.dtype)  # fmt: skip
    dv = st.head_dim_v or head_dim
    start = time.perf_counter()
    found = reachable_variants(st, device_index, interpret)
    # A tiny cache: the calls only need to compile and run, so every sequence is its own queries and nothing more.
    k_cache = torch.randn(2, page_size, num_kv_heads, head_dim, device=device).to(st.cache_dtype or dtype)
    v_cache = torch.randn(2, page_size, num_kv_heads, dv, device=device).to(st.cache_dtype or dtype)
    extra: dict = {"causal": st.causal, "window_left": st.window_left, "softcap": st.softcap,
                   "batch_invariant": st.batch_invariant}  # fmt: skip
    if st.alibi:
        extra["alibi_slopes"] = torch.rand(num_q_heads, device=device)
    if st.sinks:
        extra["sinks"] = torch.randn(num_q_heads, device=device)
    if st.kv_scale:
        extra["k_scale"] = extra["v_scale"] = torch.ones(1, device=device)
    calls = 0
    for batch, q_bound, k_bound, hint in found.values():
        # One sequence reaches the query bound (it must fit its own keys), the rest are one token each (two in a
        # batch said to hold no one-token sequence).
        q_lens = [q_bound] + [1 if hint else min(2, q_bound)] * (batch - 1)
        total = sum(q_lens)
        q = torch.randn(total, num_q_heads, head_dim, device=device).to(dtype)
        cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor(q_lens, dtype=torch.int32, device=device)
        width = -(-k_bound // page_size)
        table = torch.zeros(batch, width, dtype=torch.int32, device=device)
        table[:, : -(-q_bound // page_size)] = torch.arange(-(-q_bound // page_size), device=device) % 2
        kw = dict(extra)
        if st.block_table_rows:
            kw["block_table_rows"] = torch.arange(batch, device=device)
        out = torch.empty(total, num_q_heads, dv, device=device, dtype=dtype)
        lse_buf = torch.empty(total, num_q_heads, device=device) if st.lse else None
        api.paged_attention_out(q, k_cache, v_cache, table, cu, seq_lens, q_bound, k_bound, head_dim**-0.5, **kw,
                                decode_tail=-1 if hint < 0 else hint and batch - 1, out=out, lse=lse_buf)  # fmt: skip
        calls += 1
        if progress is not None:
            progress(calls, len(found))
    key = torch.randn(1, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(1, num_kv_heads, dv, device=device).to(dtype)
    for slot_dtype in (torch.int32, torch.int64):
        scales = (extra["k_scale"], extra["v_scale"]) if st.kv_scale else (None, None)
        api.reshape_and_cache(key, value, k_cache, v_cache, torch.zeros(1, dtype=slot_dtype, device=device), *scales)
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return WarmupReport(variants=len(found), calls=calls, seconds=time.perf_counter() - start)


def compiled_kernel_count() -> int | None:
    """Compiled variants held by this process's Triton kernel caches (all tpa kernels); None under the interpreter."""
    from triton_paged_ops.kernels import attention, cache, merge

    kernels = (attention._paged_attention_kernel, merge._reduce_splits_kernel, merge._merge_attn_states_kernel,
               cache._reshape_and_cache_kernel)  # fmt: skip
    if not all(hasattr(k, "device_caches") for k in kernels):
        return None
    # Each device's entry starts with its {specialisation key: compiled kernel} dict.
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())
