"""Typed, documented Python faces of the ``torch.ops.tpa`` ops (each runs the op of the same name; see
``ops.direct_attention`` for when the attention ops skip the dispatcher)."""

from __future__ import annotations

import inspect

import torch

from triton_paged_ops import ops  # registers torch.ops.tpa.*
from triton_paged_ops.attention_args import AttentionArgs, bind, record, signature

_ATTENTION_PARAMS = """
    Parameters
    ----------
    q : Tensor [T, Hq, D], float16 / bfloat16 / float32
        New query tokens of all sequences, back to back (sequence ``b`` owns rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). Only the last dim must be contiguous.
    k_cache : Tensor [num_pages, page_size, Hkv, D], float16 / bfloat16 / float32 / float8_e4m3fn
        Paged key cache ("NHD"); any ``page_size >= 1``. May be a strided view (e.g. of a combined K/V buffer);
        only the last dim must be contiguous. The new tokens' keys must already be written (``reshape_and_cache``).
        Its dtype may differ from ``q``'s: an fp8 cache (``float8_e4m3fnuz`` on ROCm) is read with ``k_scale``.
        With a bfloat16 ``q`` and an fp8 cache the products run in float16 (fp8 widens to it natively), with
        ``scale * k_scale`` folded into ``q`` first: ``|q| * scale * k_scale`` must stay below 45000.
    v_cache : Tensor [num_pages, page_size, Hkv, Dv]
        Paged value cache, same dtype and page layout as ``k_cache``; ``Dv`` may differ from ``D``.
    block_table : Tensor [B, max_pages] (or [R, max_pages] with ``block_table_rows``), int32
        Page ids of each sequence, in order: key ``j`` of sequence ``b`` is at
        ``(block_table[r, j // page_size], j % page_size)`` with ``r = b`` (or ``block_table_rows[b]``).
    cu_seqlens_q : Tensor [B + 1], int32
        Prefix sums of the new-token counts; ``cu_seqlens_q[0] = 0``. Rows of ``q`` past ``cu_seqlens_q[B]``
        (CUDA-graph padding) are ignored and their outputs left unwritten.
    seq_lens : Tensor [B], int32
        Total KV length of each sequence, *including* its new tokens.
    max_seqlen_q, max_seqlen_k : int
        Host-side upper bounds of the query lengths and of ``seq_lens`` (used to pick tile sizes and to check
        that ``block_table`` is wide enough; never read from the device).
    scale : float
        Multiplier of ``q . k`` (usually ``D ** -0.5``); finite and > 0.
    causal : bool, default True
        Bottom-right aligned causal mask: query ``i`` of a sequence with ``n`` new tokens and ``m`` keys sits at
        position ``pos = m - n + i`` and sees keys ``j <= pos``.
    window_left : int, default -1
        Sliding window: ``-1`` for none, else key ``j`` must also satisfy ``j >= pos - window_left`` (with
        ``causal`` this is the usual window ``pos - window_left <= j <= pos``).
    softcap : float, default 0.0
        ``0`` for none, else scaled logits become ``softcap * tanh(logits / softcap)``.
    alibi_slopes : Tensor [Hq], float32, optional
        Adds ``slope[h] * (j - pos)`` to the (softcapped) logits.
    sinks : Tensor [Hq], float32, optional
        A per-head logit that joins the softmax denominator only (attention sinks, as in gpt-oss).
    k_scale, v_scale : Tensor [1], float32, optional
        Dequantisation scales of the caches (> 0): keys are read as ``k_cache * k_scale``, values as
        ``v_cache * v_scale``.
    block_table_rows : Tensor [B], int32 or int64, optional
        Row of ``block_table`` that holds sequence ``b``'s pages, so a request pool's table (e.g. SGLang's
        ``req_to_token`` with ``req_pool_indices``) is used in place instead of gathered per step. A row outside
        ``[0, R)`` gives that sequence no keys.
    batch_invariant : bool, default False
        Deterministic mode: each output row is bitwise the same whatever else is in the batch, the batch order,
        padding, the bounds ``max_seqlen_q``/``max_seqlen_k``, and whether its token is computed in a prefill
        chunk or as a decode step (same cache contents, same flags). Keys are cut into fixed segments from key 0
        (1024 keys by default, ``invariant_segment`` in the config tables) of fixed leaves (4 by default,
        ``invariant_leaves``); each leaf is reduced on its own, a segment is the in-order fold of its leaves and a
        row the in-order fold of its segments. Decode still splits: one program per segment, or per leaf where
        the segments' programs would leave SMs idle. Every regime uses the decode regime's tile (long prefills run
        slower in this mode). What is bitwise where, as tested (``tests/test_batch_invariant.py``):

        * compiled kernels (GPU; H200 with Triton 3.6): all of the above;
        * Triton's interpreter (CPU tensors with ``TRITON_INTERPRET=1``): the batch, order, padding, bounds and
          prefill-chunk length, but a decode step and the same token as a later row of a prefill chunk may differ
          in the last bits (fp32: ~5e-8 relative; numpy's matrix product rounds by the row's place in the tile);
        * the plain-PyTorch fallback (CPU tensors otherwise): attends each sequence alone, so batch-mates and order
          change nothing, but prefill and decode are not bitwise equal.
    decode_tail : int, default -1
        Host-side hint of the batch's layout: how many sequences at its end are decodes (one new token each) with
        no one-token sequence before them, as in SGLang's mixed batches (:func:`decode_tail_of` computes it from
        host query lengths); -1 if not known. A prefill launch whose batch ends in decodes then dispatches
        their work interleaved with the prompts', so the decode rows stream while the prompts
        compute; one whose batch holds no one-token sequence (0) takes the tiles measured for prompts alone (the
        config table's ``prompts`` entry, where it has one: on the H200 at head dim 128, programs of 16 warps,
        which would slow a mixed batch's decode rows; at 64, two 8-warp programs per SM), compiled without the
        branch for one-token rows (whose KV buffers would otherwise count in the launch's shared memory). Any
        value gives correct results, the same bits except where 0 selects other tiles (a wrong value costs time;
        debug mode names it). Ignored by decode launches and in batch-invariant mode.
"""


def _attention(op: str, args: AttentionArgs, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Call attention op ``op`` with ``args`` (and the out variant's buffers): without the dispatcher in plain eager
    mode (``ops.direct_attention``), else through ``torch.ops``. Arguments go positionally: the dispatcher parses
    keywords against the schema one by one (several µs per call)."""
    done = ops.direct_attention(op, args, out, lse)
    if done is not ops.MISS:
        return done
    if op == "paged_attention_out":
        return _DISPATCHED[op](*args, out=out, lse=lse)
    return _DISPATCHED[op](*args)


# The ops by name, for the calls that take the dispatcher.
_DISPATCHED = {
    name: getattr(torch.ops.tpa, name)
    for name in ("paged_attention", "paged_attention_with_lse", "paged_attention_out")
}


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
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
) -> torch.Tensor:
    return _attention("paged_attention", record(AttentionArgs, (
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, scale,
        causal, window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, block_table_rows, batch_invariant,
        decode_tail,
    )))  # fmt: skip


paged_attention.__doc__ = f"""Attention of a ragged batch of new tokens over a paged KV cache (prefill, decode, mixed).
{_ATTENTION_PARAMS}
    Returns
    -------
    out : Tensor [T, Hq, Dv], dtype of ``q``
        Rows with no visible key (and no sink) are 0.

    Examples
    --------
    >>> import torch, triton_paged_ops as tpa
    >>> k_cache = torch.randn(8, 16, 2, 64); v_cache = torch.randn(8, 16, 2, 64)
    >>> block_table = torch.tensor([[3, 5], [0, 7]], dtype=torch.int32)
    >>> seq_lens = torch.tensor([20, 9], dtype=torch.int32)        # sequence 0: prefill of 4 new tokens
    >>> cu_seqlens_q = torch.tensor([0, 4, 5], dtype=torch.int32)   # sequence 1: one decode token
    >>> q = torch.randn(5, 8, 64)
    >>> tpa.paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, 4, 20, 64 ** -0.5).shape
    torch.Size([5, 8, 64])
"""


def paged_attention_with_lse(*args, **options) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention("paged_attention_with_lse", bind("paged_attention_with_lse", args, options))


paged_attention_with_lse.__doc__ = f"""Like :func:`paged_attention`, also returning the log-sum-exp of each row.
{_ATTENTION_PARAMS}
    Returns
    -------
    out : Tensor [T, Hq, Dv], dtype of ``q``
    lse : Tensor [T, Hq], float32
        Natural log of the softmax denominator (the sink's term included); ``-inf`` for rows that see nothing.
        Two results over disjoint key sets combine exactly with :func:`merge_attn_states`.
"""


def paged_attention_out(*args, out: torch.Tensor, lse: torch.Tensor | None = None, **options) -> None:
    _attention("paged_attention_out", bind("paged_attention_out", args, options), out, lse)


# Typed signatures for help() and IDEs (the arguments are ``paged_attention``'s).
paged_attention_with_lse.__signature__ = signature(tuple[torch.Tensor, torch.Tensor])
paged_attention_out.__signature__ = signature(None, (
    inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=torch.Tensor),
    inspect.Parameter("lse", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=torch.Tensor | None),
))  # fmt: skip
paged_attention_out.__doc__ = f"""Like :func:`paged_attention_with_lse`, writing into caller-provided buffers.

    Allocates nothing, so it suits CUDA graphs and serving frameworks that own the output memory.
{_ATTENTION_PARAMS}
    out : Tensor [T, Hq, Dv], dtype of ``q``
        Written in place (rows ``< cu_seqlens_q[B]``). Only the last dim must be contiguous.
    lse : Tensor [T, Hq], float32, optional
        Written in place with the natural-log LSE when given.
"""


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new tokens' keys and values into the paged caches, in place.

    Parameters
    ----------
    key : Tensor [N, Hkv, D]
    value : Tensor [N, Hkv, Dv]
        Keys and values of N new tokens (last dim contiguous).
    k_cache : Tensor [num_pages, page_size, Hkv, D]
    v_cache : Tensor [num_pages, page_size, Hkv, Dv]
        Paged caches (may be strided views; last dim contiguous). Values are cast to the cache dtype; fp8 caches
        (``float8_e4m3fn``, ``float8_e4m3fnuz`` on ROCm) get round-to-nearest-even values that saturate at the
        format's largest finite value instead of overflowing to NaN.
    slot_mapping : Tensor [N], int32 or int64
        Destination of token i: ``slot = page_id * page_size + offset``. Negative slots are padding and skipped.
    k_scale, v_scale : Tensor [1], float32, optional
        Quantisation scales: the cache receives ``key / k_scale`` and ``value / v_scale``.

    Examples
    --------
    >>> import torch, triton_paged_ops as tpa
    >>> k_cache = torch.zeros(4, 16, 2, 64); v_cache = torch.zeros(4, 16, 2, 64)
    >>> key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    >>> tpa.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([17, -1, 2], dtype=torch.int32))
    >>> bool((k_cache[1, 1] == key[0]).all())
    True
    """
    torch.ops.tpa.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the union of two disjoint key sets, from each part's output and LSE.

    Parameters
    ----------
    out_a, out_b : Tensor [T, H, Dv], same float dtype
        Attention outputs over key sets A and B (e.g. a shared prefix and each request's own suffix).
    lse_a, lse_b : Tensor [T, H], float32
        Their natural-log LSEs; ``-inf`` marks an empty part.

    Returns
    -------
    out : Tensor [T, H, Dv], dtype of ``out_a``, contiguous
    lse : Tensor [T, H], float32
        ``log(exp(lse_a) + exp(lse_b))``; rows empty in both parts get ``out = 0``, ``lse = -inf``.
    """
    return torch.ops.tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
