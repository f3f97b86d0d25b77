"""Random paged-attention problems (for the self-check, the benchmarks, tuning and the tests).

Caches hold random values, each sequence's pages are a random permutation of the pool, and block-table entries
past a sequence's pages point at no page (``-1``), so reading them would show.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class PagedBatch:
    q: torch.Tensor  # [T + pad_tokens, Hq, D]
    k_cache: torch.Tensor  # [pages, page_size, Hkv, D]
    v_cache: torch.Tensor  # [pages, page_size, Hkv, Dv]
    block_table: torch.Tensor  # [B (+ spare rows with block_table_rows), width] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    block_table_rows: torch.Tensor | None = None  # [B]: sequence b's row of block_table

    @property
    def args(self) -> tuple:
        """The positional arguments of ``paged_attention`` (without ``block_table_rows``)."""
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q, self.seq_lens,
                self.max_seqlen_q, self.max_seqlen_k, self.scale)  # fmt: skip


def _caches(shape_k, shape_v, dtype, device, gen, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # (fp8 caches: standard normal values lie well inside the fp8 range; torch rounds them.)
    if not strided:
        k = torch.randn(shape_k, generator=gen, device=device).to(dtype)
        v = torch.randn(shape_v, generator=gen, device=device).to(dtype)
        return k, v
    # One buffer [pages, page_size, 2, Hkv + 1, max(D, Dv) + 8]: K at [:, :, 0], V at [:, :, 1] shifted by a head,
    # so both caches are strided in every dim (like a combined K/V pool with padding).
    pages, ps, hkv, d = shape_k
    dv = shape_v[3]
    buf = torch.randn(pages, ps, 2, hkv + 1, max(d, dv) + 8, generator=gen, device=device).to(dtype)
    return buf[:, :, 0, :hkv, :d], buf[:, :, 1, 1:, :dv]


def random_paged_batch(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    page_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    generator: torch.Generator,
    scale: float | None = None,
    strided: bool = False,
    spare_pages: int = 0,
    extra_cols: int = 0,
    pad_tokens: int = 0,
    rows_dtype: torch.dtype | None = None,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequence ``b`` has ``q_lens[b]`` new tokens and ``kv_lens[b]`` keys (new ones included).

    ``spare_pages`` unused pages in the pool, ``extra_cols`` unused block-table columns, ``pad_tokens`` rows of
    ``q`` past the last sequence (CUDA-graph padding); ``rows_dtype`` puts the sequences in random rows of a table
    with spare rows and returns their indices as ``block_table_rows``; ``cache_dtype`` (default ``dtype``) is the
    caches' dtype, e.g. fp8.
    """
    gen, dv = generator, head_dim_v or head_dim
    pages_per_seq = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = max(1, sum(pages_per_seq) + spare_pages)
    k_cache, v_cache = _caches((num_pages, page_size, num_kv_heads, head_dim),
                               (num_pages, page_size, num_kv_heads, dv), cache_dtype or dtype, device, gen,
                               strided)  # fmt: skip
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    batch = len(kv_lens)
    spare_rows = 3 if rows_dtype is not None else 0
    rows = torch.arange(batch, device=device)
    if rows_dtype is not None:
        rows = torch.randperm(batch + spare_rows, generator=gen, device=device)[:batch]
    width = max(1, max(pages_per_seq, default=0) + extra_cols)
    block_table = torch.full((batch + spare_rows, width), -1, dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(pages_per_seq):
        block_table[rows[b], :n] = perm[at : at + n]
        at += n
    q = torch.randn(sum(q_lens) + pad_tokens, num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        cu_seqlens_q=torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(kv_lens, default=0),
        scale=head_dim**-0.5 if scale is None else scale,
        block_table_rows=rows.to(rows_dtype) if rows_dtype is not None else None,
    )
