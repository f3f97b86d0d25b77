"""Hypothesis strategies that draw whole paged-attention problems.

A problem is drawn as plain Python values (lengths, page size, heads, features, a seed) and then materialised as
tensors from that seed, so every example has fresh random data yet replays exactly when Hypothesis shrinks it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import strategies as st

from triton_paged_ops.inputs import random_paged_batch

PAGE_SIZES = (1, 2, 3, 7, 16, 32, 64, 128)
# Query heads per KV head as models have them: MHA (1), GQA (Qwen2.5-7B 7, Llama-3 8 and 16 at 405B), MQA (48/1),
# and groups that fill a whole tile (64-128), powers of two or not.
GROUPS = (1, 2, 3, 4, 7, 8, 16, 48, 64, 96, 128)
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (96, 64), (192, 128), (256, 256))


@dataclasses.dataclass
class Spec:
    q_lens: list[int]
    kv_lens: list[int]
    pad_tokens: int
    page_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    causal: bool
    window_left: int
    softcap: float
    use_alibi: bool
    use_sinks: bool
    use_kv_scale: bool
    scale: float
    strided: bool
    spare_pages: int
    extra_cols: int
    tiles: tuple[int, int] | None
    seed: int
    num_splits: int | None = None  # force split-KV segments (None: the planner decides)
    rows_dtype: torch.dtype | None = None  # sequences' rows picked from a larger table by block_table_rows
    fp8_cache: bool = False  # K/V caches in float8_e4m3fn (q keeps its dtype)


@dataclasses.dataclass
class Problem:
    spec: Spec
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    kwargs: dict

    @property
    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q, self.seq_lens,
                self.max_seqlen_q, self.max_seqlen_k, self.spec.scale)  # fmt: skip

    @property
    def num_real_tokens(self) -> int:
        return sum(self.spec.q_lens)


def _lengths(draw, small: bool, max_seqs: int, max_q: int, max_ctx: int) -> tuple[list[int], list[int]]:
    n = draw(st.integers(1, max_seqs))
    q_lens, kv_lens = [], []
    for _ in range(n):
        if small:
            q = draw(st.integers(0, min(max_q, 40)))
            ctx = draw(st.integers(0, min(max_ctx, 160)))
        else:
            # Mostly decode-like or short rows, sometimes long prefill rows and long contexts.
            # (1-16: speculative verification of draft tokens.)
            q = draw(st.one_of(st.integers(0, 2), st.integers(1, 16), st.integers(1, 48), st.integers(1, max_q)))
            ctx = draw(st.one_of(st.integers(0, 8), st.integers(0, 300), st.integers(0, max_ctx)))
        q_lens.append(q)
        kv_lens.append(q + ctx)
    return q_lens, kv_lens


def _work(q_lens, kv_lens, num_kv_heads, group) -> int:
    """Rough count of 128x128 tile steps: what the interpreter's run time is proportional to."""
    block_q = max(1, 128 // group)
    return sum(math.ceil(q / block_q) * math.ceil(kv / 128) for q, kv in zip(q_lens, kv_lens)) * num_kv_heads


def _fit_work(q_lens, kv_lens, num_kv_heads, group, max_work) -> None:
    """Shrink the longest sequence (context first, then new tokens) until the problem fits the work budget."""
    while _work(q_lens, kv_lens, num_kv_heads, group) > max_work:
        b = max(range(len(kv_lens)), key=lambda i: kv_lens[i])
        ctx = kv_lens[b] - q_lens[b]
        if ctx > q_lens[b]:
            kv_lens[b] = q_lens[b] + ctx // 2
        else:
            q_lens[b] //= 2
            kv_lens[b] = q_lens[b] + ctx // 2


@st.composite
def specs(
    draw,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16),
    max_seqs: int = 8,
    max_q: int = 300,
    max_ctx: int = 2048,
    head_dims: tuple[tuple[int, int], ...] = HEAD_DIMS,
    max_work: int | None = None,
    forced_tiles: bool = True,
) -> Spec:
    """A paged-attention problem; ``forced_tiles``: small problems may force small tiles (off where the planner's
    own tiles are under test)."""
    small = draw(st.booleans())
    q_lens, kv_lens = _lengths(draw, small, max_seqs, max_q, max_ctx)
    group = draw(st.sampled_from(GROUPS))
    num_kv_heads = draw(st.sampled_from((1, 2, 4) if group <= 8 else (1, 2)))
    if max_work is not None:
        _fit_work(q_lens, kv_lens, num_kv_heads, group, max_work)
    head_dim, head_dim_v = draw(st.sampled_from(head_dims))
    # Small tiles reach many tile and block boundaries with few tokens; only used on small problems.
    tiles = None
    if forced_tiles and small and draw(st.booleans()):
        block_m = draw(st.sampled_from([m for m in (16, 32, 64, 128) if m >= group]))
        tiles = (block_m, draw(st.sampled_from((16, 32))))
    return Spec(
        q_lens=q_lens,
        kv_lens=kv_lens,
        pad_tokens=draw(st.sampled_from((0, 0, 3))),
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=draw(st.sampled_from(dtypes)),
        causal=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 300))),
        softcap=draw(st.one_of(st.just(0.0), st.floats(1.0, 50.0))),
        use_alibi=draw(st.booleans()),
        use_sinks=draw(st.booleans()),
        use_kv_scale=draw(st.booleans()),
        scale=draw(st.one_of(st.just(head_dim**-0.5), st.floats(0.05, 1.0))),
        strided=draw(st.booleans()),
        spare_pages=draw(st.integers(0, 4)),
        extra_cols=draw(st.integers(0, 3)),
        tiles=tiles,
        seed=draw(st.integers(0, 2**31 - 1)),
        # Forced split counts on short queries (where the planner splits) and small problems; on long prefills they
        # would only multiply the interpreter's per-program cost.
        num_splits=draw(st.one_of(st.none(), st.integers(2, 9))) if small or max(q_lens) <= 16 else None,
        rows_dtype=draw(st.sampled_from((None, None, torch.int32, torch.int64))),
        fp8_cache=draw(st.sampled_from((False, False, False, True))),
    )


def poison_unowned_slots(k_cache, v_cache, block_table, seq_lens, rows=None) -> None:
    """NaN in every cache slot that no sequence owns (past each sequence's end in its last page, spare pages), as a
    reused pool may hold: a kernel that lets such a slot reach an output (0 * NaN in P @ V) fails its test."""
    page_size = k_cache.shape[1]
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b, n in enumerate(seq_lens.tolist()):
        row = block_table[int(rows[b]) if rows is not None else b]
        for j in range(-(-n // page_size)):
            owned[row[j], : min(page_size, n - j * page_size)] = True
    for cache in (k_cache, v_cache):
        # (fp8 tensors have no masked fill: their NaN bits, 0x7f in e4m3fn, go in through a byte view.)
        if cache.element_size() == 1:
            bits = cache.view(torch.uint8)
            bits[~owned] = 0x7F
        else:
            cache[~owned] = float("nan")


def build(spec: Spec, device: str | torch.device) -> Problem:
    """Materialise a drawn spec as tensors on ``device``."""
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    hq = spec.num_kv_heads * spec.group
    pb = random_paged_batch(
        spec.q_lens, spec.kv_lens, num_q_heads=hq, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v, page_size=spec.page_size, dtype=spec.dtype, device=device, generator=gen,
        scale=spec.scale, strided=spec.strided, spare_pages=spec.spare_pages, extra_cols=spec.extra_cols,
        pad_tokens=spec.pad_tokens, rows_dtype=spec.rows_dtype,
        cache_dtype=torch.float8_e4m3fn if spec.fp8_cache else None,
    )  # fmt: skip
    poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens, pb.block_table_rows)
    kwargs: dict = {"causal": spec.causal, "window_left": spec.window_left, "softcap": spec.softcap}
    if pb.block_table_rows is not None:
        kwargs["block_table_rows"] = pb.block_table_rows
    if spec.use_alibi:
        kwargs["alibi_slopes"] = torch.rand(hq, generator=gen, device=device) * 0.5
    if spec.use_sinks:
        kwargs["sinks"] = torch.randn(hq, generator=gen, device=device) * 2.0
    if spec.use_kv_scale:
        kwargs["k_scale"] = torch.rand(1, generator=gen, device=device) + 0.5
        kwargs["v_scale"] = torch.rand(1, generator=gen, device=device) + 0.5
    return Problem(
        spec=spec,
        q=pb.q,
        k_cache=pb.k_cache,
        v_cache=pb.v_cache,
        block_table=pb.block_table,
        cu_seqlens_q=pb.cu_seqlens_q,
        seq_lens=pb.seq_lens,
        max_seqlen_q=pb.max_seqlen_q,
        max_seqlen_k=pb.max_seqlen_k,
        kwargs=kwargs,
    )


def guarded(shape: tuple[int, ...], dtype: torch.dtype, device, fill: float = float("nan"), band: int = 2):
    """A tensor of ``shape`` filled with ``fill``, inside a buffer with ``band`` random slabs (along dim 0) before and
    after it: a write that strays past either end lands in a guard. Returns the tensor and a function that asserts
    both guards still hold their bits."""
    buf = torch.empty((shape[0] + 2 * band, *shape[1:]), dtype=dtype, device=device)
    bits = buf.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])
    bits.copy_(torch.randint(0, 100, bits.shape, device=device, dtype=bits.dtype))
    inner = buf[band : band + shape[0]]
    if dtype.itemsize == 1:
        inner.view(torch.uint8).fill_(0x7F)  # (NaN in e4m3fn: fp8 tensors have no fill)
    else:
        inner.fill_(fill)
    before, after = bits[:band].clone(), bits[band + shape[0] :].clone()

    def check() -> None:
        assert torch.equal(bits[:band], before), "a write landed before the tensor"
        assert torch.equal(bits[band + shape[0] :], after), "a write landed past the tensor"

    return inner, check
