"""Shared-prefix ("cascade") attention: many requests after one common prefix read the prefix's pages once per
group of queries instead of once per request.

Two levels, each an ordinary ``tpa`` call, merged exactly with ``merge_attn_states``:

1. The prefix, attended by every query token of the batch as ONE "sequence" over the prefix pages (block-table row
   ``prefix_pages``), so each prefix page is read once per batch and once per query tile: the tokens' packed rows
   form prefill-sized tiles (64 decode requests x 4 query heads per KV head = one 256-row tile on an H200), and
   the planner splits the prefix's keys over programs when those tiles are too few to fill the GPU. Measured on an
   H200 (benchmarks/NOTES.md) faster than chunks of ``MAX_SPLIT_Q_LEN`` tokens, which read the prefix once per
   chunk with small decode-like tiles. The prefix lies before every query, so this level has no causal mask.
2. Each request's own keys after the prefix (its pages, its new tokens included), causal as usual.
"""

from __future__ import annotations

import torch

import triton_paged_ops.ops  # noqa: F401  (registers torch.ops.tpa.*)


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_len: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a batch whose requests all start with the same ``prefix_len`` keys.

    Parameters
    ----------
    q : Tensor [T, Hq, D]
        New query tokens of all requests, back to back (as for ``paged_attention``).
    k_cache, v_cache : Tensor [num_pages, page_size, Hkv, D / Dv]
        The paged caches holding the prefix and every request's own keys.
    prefix_pages : Tensor [P], int32
        Page ids of the shared prefix, in order (``P * page_size >= prefix_len``).
    prefix_len : int
        Keys in the shared prefix (host value). 0 means no shared prefix: plain paged attention.
    block_table : Tensor [B, max_pages], int32
        Each request's pages *after* the prefix: its key ``prefix_len + j`` is at
        ``(block_table[b, j // page_size], j % page_size)``.
    cu_seqlens_q : Tensor [B + 1], int32
        Query offsets of the requests, as for ``paged_attention``.
    seq_lens : Tensor [B], int32
        Keys of each request after the prefix, its new tokens included.
    max_seqlen_q, max_seqlen_k : int
        Host bounds of the query lengths and of ``seq_lens``.
    scale, softcap, sinks, k_scale, v_scale
        As for ``paged_attention`` (the sinks join the softmax once).

    Returns
    -------
    out : Tensor [T, Hq, Dv], dtype of ``q``
        Equal, up to rounding, to ``paged_attention`` over each request's full key list (prefix + own keys). Rows of
        ``q`` past ``cu_seqlens_q[B]`` (padding) hold unspecified values.
    """
    own_out, own_lse = own_level(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                                 scale, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if prefix_len <= 0 or q.shape[0] == 0:
        return own_out
    prefix_out, prefix_lse = prefix_level(q, k_cache, v_cache, prefix_pages, prefix_len, scale, softcap=softcap,
                                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out, _ = torch.ops.tpa.merge_attn_states(prefix_out, prefix_lse, own_out, own_lse)
    return out


def own_level(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale, *,
              softcap=0.0, sinks=None, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Level 2 of ``cascade_attention``: each request's own keys (causal, the sinks counted here); (out, lse)."""
    return torch.ops.tpa.paged_attention_with_lse(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale,
        True, -1, softcap, None, sinks, k_scale, v_scale,
    )  # fmt: skip


def prefix_level(q, k_cache, v_cache, prefix_pages, prefix_len, scale, *, softcap=0.0, k_scale=None,
                 v_scale=None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Level 1 of ``cascade_attention``: every query token over the shared prefix; (out, lse). ``chunk``: query
    tokens per "sequence" over the prefix (default: all of them; never more than ``prefix_len``)."""
    if not isinstance(prefix_pages, torch.Tensor) or prefix_pages.dtype != torch.int32:
        what = prefix_pages.dtype if isinstance(prefix_pages, torch.Tensor) else type(prefix_pages).__name__
        raise TypeError(f"prefix_pages must be an int32 tensor of page ids, got {what}")
    if prefix_pages.dim() != 1 or prefix_pages.shape[0] * k_cache.shape[1] < prefix_len:
        raise ValueError(
            f"prefix_pages must be [P] with P * page_size >= prefix_len={prefix_len}, got {tuple(prefix_pages.shape)}"
        )
    num_tokens = q.shape[0]
    # (A chunk never has more queries than the prefix has keys, as the ops' lengths contract asks.)
    chunk = max(1, min(chunk or num_tokens, num_tokens, prefix_len))
    chunks = -(-num_tokens // chunk)
    cu_chunks = torch.clamp(torch.arange(chunks + 1, device=q.device, dtype=torch.int32) * chunk, max=num_tokens)
    return torch.ops.tpa.paged_attention_with_lse(
        q, k_cache, v_cache, prefix_pages.view(1, -1), cu_chunks,
        torch.full((chunks,), prefix_len, dtype=torch.int32, device=q.device),
        min(num_tokens, chunk), prefix_len, scale, False, -1, softcap, None, None, k_scale, v_scale,
        torch.zeros(chunks, dtype=torch.int32, device=q.device),
    )  # fmt: skip
