"""Slow, plainly correct PyTorch versions of every ``tpa`` op.

The tests trust these functions, so they favour the obvious over the fast: a Python loop over sequences, pages
gathered into contiguous K/V, fp32 logits (float64 on the CPU) with explicit boolean masks, ``torch.softmax``.
Layouts and semantics are those documented on :func:`triton_paged_ops.paged_attention`.
"""

from __future__ import annotations

import math

import torch

from triton_paged_ops.attention_args import AttentionArgs, bind, signature


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` tokens of one sequence from a paged cache: ``[kv_len, H, D]`` in the cache's dtype.

    A page id outside ``[0, num_pages)`` reads page 0, as the kernels' default ``clamp_pages`` does (a corrupt
    table gives wrong keys, never an error or a read elsewhere; debug mode reports such ids). A ``kv_len`` past the
    table's width is the caller's error (the ops check it)."""
    page_size = cache.shape[1]
    tokens = torch.arange(kv_len, device=cache.device)
    pages = block_table_row[tokens // page_size].long()
    pages = torch.where((pages >= 0) & (pages < cache.shape[0]), pages, 0)
    return cache[pages, tokens % page_size]


def paged_attention_with_lse(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference paged attention with the arguments of ``tpa.paged_attention_with_lse`` (``AttentionArgs``: the
    same call binds the same values). Returns ``out [T, Hq, Dv]`` (q's dtype) and ``lse [T, Hq]`` (fp32, natural
    log).

    Rows with no visible key get ``out = 0`` and ``lse = -inf`` (or the sink logit when ``sinks`` is given). The
    bounds must hold (a ValueError says which does not); ``batch_invariant`` and ``decode_tail`` change nothing here
    (this computes each row alone, exactly).
    """
    return attention_of(bind("paged_attention_with_lse", args, kwargs))


def attention_of(a: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention_with_lse`` of an already bound record (the ops' CPU path without the interpreter)."""
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale = a[:9]
    causal, window_left, softcap = a.causal, a.window_left, a.softcap
    alibi_slopes, sinks, k_scale, v_scale, block_table_rows = a.optional()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if q_lens and max(q_lens) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below a query length ({max(q_lens)})")
    if seq_lens.numel() and int(seq_lens.max()) > max_seqlen_k:
        raise ValueError(f"max_seqlen_k={max_seqlen_k} is below a sequence length ({int(seq_lens.max())})")
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    rows = list(range(len(lens))) if block_table_rows is None else block_table_rows.tolist()
    # On the CPU, fp32 products split across threads came out differently from one process to the next (the same
    # inputs: 2e-7 or 1.6e-5 relative to the kernel, the tests' fp32 tolerance is 1e-5); float64 costs nothing at
    # CPU test sizes. GPUs keep fp32 (deterministic per shape, and the suites' long prompts would double in memory).
    work = torch.float64 if q.device.type == "cpu" else torch.float32
    for b in range(len(lens)):
        q_start, q_end = cu[b], cu[b + 1]
        q_len, kv_len = q_end - q_start, lens[b]
        if q_len == 0:
            continue
        row = rows[b]
        if not 0 <= row < block_table.shape[0]:
            row, kv_len = 0, 0  # a row outside the table: no keys (as the kernels define it)
        k = gather_kv(k_cache, block_table[row], kv_len).to(work)
        v = gather_kv(v_cache, block_table[row], kv_len).to(work)
        if k_scale is not None:
            k = k * k_scale.to(work)
        if v_scale is not None:
            v = v * v_scale.to(work)
        # GQA: query head h reads KV head h // group.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].to(work)
        logits = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        pos = torch.arange(q_len, device=q.device) + (kv_len - q_len)  # bottom-right aligned positions
        key = torch.arange(kv_len, device=q.device)
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.to(work)[:, None, None] * (key[None, :] - pos[:, None]).to(work)
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
        if causal:
            visible &= key[None, :] <= pos[:, None]
        if window_left >= 0:
            visible &= key[None, :] >= pos[:, None] - window_left
        logits = logits.masked_fill(~visible, -math.inf)
        if sinks is not None:
            # The sink is one more logit per head that takes part in the softmax but has no value row.
            sink_col = sinks.to(work)[:, None, None].expand(num_q_heads, q_len, 1)
            logits = torch.cat([logits, sink_col], dim=-1)
            v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
        row_lse = torch.logsumexp(logits, dim=-1)  # [Hq, q_len]
        has_any = row_lse > -math.inf
        probs = torch.where(has_any[..., None], torch.exp(logits - row_lse[..., None]), 0.0)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[q_start:q_end] = row_lse.transpose(0, 1)
    return out.to(q.dtype), lse


def paged_attention(*args, **kwargs) -> torch.Tensor:
    """Reference paged attention, output only (same arguments as :func:`paged_attention_with_lse`)."""
    return paged_attention_with_lse(*args, **kwargs)[0]


paged_attention_with_lse.__signature__ = signature(tuple[torch.Tensor, torch.Tensor])
paged_attention.__signature__ = signature(torch.Tensor)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token i's K/V to cache slot ``slot_mapping[i]`` (``page * page_size + offset``); slots outside the
    cache (negative: padding) are skipped, as the kernel drops them.

    Values are divided by the optional scales before the cast to the cache dtype (so that ``cache * scale``
    recovers them); for fp8 caches they saturate at the format's largest finite value instead of becoming NaN.
    """
    page_size = k_cache.shape[1]
    num_slots = k_cache.shape[0] * page_size
    for i, slot in enumerate(slot_mapping.tolist()):
        if not 0 <= slot < num_slots:
            continue
        k = key[i].float() if k_scale is None else key[i].float() / k_scale.float()
        v = value[i].float() if v_scale is None else value[i].float() / v_scale.float()
        k_cache[slot // page_size, slot % page_size] = saturate(k, k_cache.dtype).to(k_cache.dtype)
        v_cache[slot // page_size, slot % page_size] = saturate(v, v_cache.dtype).to(v_cache.dtype)


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp ``x`` to the finite range of an fp8 ``dtype`` (whose casts turn overflow into NaN); others unchanged."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit)
    return x


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets from each part's output and natural-log LSE."""
    lse_a, lse_b = lse_a.double(), lse_b.double()
    # Weights relative to the larger lse: exp(lse - merged) would subtract two large, rounded numbers (at |lse| of
    # 1e5 the weights lost 2e-3), while the larger part's weight is exactly 1 this way.
    top = torch.maximum(lse_a, lse_b)
    # Where both parts are empty (lse = -inf) the weights would be NaN; the merged output is 0 there.
    top = torch.where(top == -math.inf, 0.0, top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    safe_total = torch.where(total > 0, total, 1.0)
    out = (w_a[..., None] * out_a.double() + w_b[..., None] * out_b.double()) / safe_total[..., None]
    lse = torch.where(total > 0, top + torch.log(safe_total), -math.inf)
    return out.to(out_a.dtype), lse.float()
