"""Dense Triton ceiling for causal prefill: ``python -m benchmarks.dense_triton [--only TEXT ...] [--out FILE]``
(needs a CUDA GPU).

What a plain Triton flash-attention kernel reaches on the same GPU and Triton version with no paging at all:
contiguous ``[B, H, N, D]`` tensors as dense SDPA takes them, K/V tiles read through tensor descriptors (TMA on
sm_90+) or pointer blocks, the usual FlashAttention-2 loop (exp2 softmax with the scale folded in, fp32
accumulation, unmasked tiles below the diagonal, masked diagonal tiles, longest query blocks first). Each tile config
of a sweep runs beside the paged kernel (``tpa``, its shipped config, pages randomly permuted) and dense SDPA on
the same causal prefill shapes (bf16, Hq32/Hkv8/D128), all CUDA-graph replay medians from one run. So the gap
between the paged kernel and SDPA splits into what paging costs (paged vs this kernel) and what a Triton kernel
reaches at all on this stack (this kernel vs SDPA). The ``flat`` variants compute the same from a persistent grid
whose programs walk all their query blocks' KV tiles in one loop, so K/V loads continue across block boundaries:
what the per-block costs (q load, pipeline fill, epilogue) amount to on the same tiles.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

LOG2E = 1.4426950408889634


def _ensure_allocator() -> None:
    """Descriptors built inside a kernel need scratch memory from Triton's allocator: torch's, unless the caller set
    one."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def _block_rows(block, bh, seq_len, num_heads, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """Rows of query block ``block`` of ``bh`` (a (batch, head) pair, or with ``PACK`` a (batch, KV head) pair): their
    token positions, their q rows in the [B * H * N, D] view, and the KV head's first row."""
    ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK else 1
    rows = tl.arange(0, BLOCK_M)
    tok = block * (BLOCK_M // ROWS_PER_TOKEN) + rows // ROWS_PER_TOKEN
    if PACK:
        batch = bh // (num_heads // GROUP)
        head = (bh % (num_heads // GROUP)) * GROUP + rows % GROUP
        kv_bh = bh
    else:
        batch = bh // num_heads
        head = bh % num_heads + rows * 0
        kv_bh = batch * (num_heads // GROUP) + (bh % num_heads) // GROUP
    q_rows = (batch * num_heads + head).to(tl.int64) * seq_len + tok
    return tok, q_rows, kv_bh.to(tl.int64) * seq_len


@triton.jit
def _dense_causal_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qk_scale, seq_len, num_heads, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr, PACK: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    """One query block of causal attention over contiguous [B, H, N, D] tensors (K/V [B, H // GROUP, N, D]);
    ``qk_scale`` includes log2(e). A block is BLOCK_M tokens of one head, or with ``PACK`` BLOCK_M // GROUP tokens
    of the GROUP heads sharing a KV head (rows token-major, as the paged kernel packs them). ``LAZY``: the running
    max moves only by more than 8 (base 2) and the accumulator's multiply is skipped when no row's max moved, as
    in the paged kernel. ``USE_DESC``: K/V (and unpacked Q) through tensor descriptors."""
    ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK else 1
    TOKENS: tl.constexpr = BLOCK_M // ROWS_PER_TOKEN
    block = seq_len // TOKENS - 1 - tl.program_id(0)  # the blocks that see the most keys start first
    tok, q_rows, kv_row0 = _block_rows(block, tl.program_id(1), seq_len, num_heads, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, HEAD_DIM)
    if USE_DESC:
        kv_rows = (tl.num_programs(1) // (1 if PACK else GROUP)) * seq_len
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[kv_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[kv_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    if USE_DESC and not PACK:
        # 2-D view: rows of all (batch, head) pairs back to back. (Descriptor coordinates are 32-bit.)
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[tl.num_programs(1) * seq_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        q = q_desc.load([(tl.program_id(1) * seq_len + block * TOKENS).to(tl.int32), 0])
    else:
        q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag_lo = (block * TOKENS) // BLOCK_N * BLOCK_N
    for phase in tl.static_range(2):  # tiles wholly below the diagonal, then the diagonal ones (masked)
        lo = 0 if phase == 0 else diag_lo
        hi = diag_lo if phase == 0 else block * TOKENS + TOKENS
        for start_n in tl.range(lo, hi, BLOCK_N):
            if USE_DESC:
                k = k_desc.load([(kv_row0 + start_n).to(tl.int32), 0])
                v = v_desc.load([(kv_row0 + start_n).to(tl.int32), 0])
            else:
                kv_off = (kv_row0 + start_n + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM + offs_d[None, :]
                k = tl.load(k_ptr + kv_off)
                v = tl.load(v_ptr + kv_off)
            s = tl.dot(q, tl.trans(k))
            if phase == 1:
                s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] <= tok[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if LAZY:
                m_new = tl.where(m_new > m_i + 8.0, m_new, m_i)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if LAZY:
                if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
                    acc = acc * alpha[:, None]
                acc = tl.dot(p.to(v.dtype), v, acc)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :], out)


@triton.jit
def _dense_causal_flat_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qk_scale, seq_len, num_heads, num_items_per_block, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
):  # fmt: skip
    """The same attention as ``_dense_causal_kernel`` (pointer loads), from a persistent grid: program p takes work
    items p, p + P, ... (a query block of one head, or with ``PACK`` of a KV head's query heads) and walks all of
    their KV tiles in ONE loop, so the compiler's pipeline keeps loading K/V across the end of one block and the
    start of the next (a block's state is reset and its q loaded at its first tile, its output stored at its last).
    Triton's own loop flattening (``tl.range(flatten=True)``) does not apply: the causal trip count depends on the
    block."""
    ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK else 1
    TOKENS: tl.constexpr = BLOCK_M // ROWS_PER_TOKEN
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_items = NUM_BLOCKS * num_items_per_block
    total = 0
    for item in range(pid, num_items, programs):
        block = NUM_BLOCKS - 1 - item // num_items_per_block
        total += (block * TOKENS + TOKENS + BLOCK_N - 1) // BLOCK_N
    offs_d = tl.arange(0, HEAD_DIM)
    item = pid
    tile = 0
    block = NUM_BLOCKS - 1 - item // num_items_per_block  # the blocks that see the most keys first
    tok, q_rows, kv_row0 = _block_rows(block, item % num_items_per_block, seq_len, num_heads, GROUP, BLOCK_M, PACK)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = tl.zeros([BLOCK_M, HEAD_DIM], dtype=q_ptr.dtype.element_ty)
    for _ in tl.range(0, total):
        if tile == 0:
            q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :])
        start_n = tile * BLOCK_N
        kv_off = (kv_row0 + start_n + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
        s = tl.dot(q, tl.trans(k))
        if start_n + BLOCK_N > block * TOKENS:  # a tile that reaches the diagonal
            s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] <= tok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        if start_n + BLOCK_N >= block * TOKENS + TOKENS:  # the block's last tile: store, then the next item
            tl.store(
                out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :],
                (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            )
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            item += programs
            tile = 0
            block = NUM_BLOCKS - 1 - item // num_items_per_block
            tok, q_rows, kv_row0 = _block_rows(block, item % num_items_per_block, seq_len, num_heads, GROUP, BLOCK_M,
                                               PACK)  # fmt: skip
        else:
            tile += 1


def _block_shape(q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int, pack: bool) -> tuple[int, int]:
    """The GQA group and a query block's tokens for ``q [B, H, N, D]``, ``k [B, Hkv, N, D]``; raises unless H is
    a multiple of Hkv (and, packed, ``block_m`` of the group) and N of ``block_n`` and of the block's tokens."""
    h, n, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    group = h // kv_heads if h % kv_heads == 0 else 0
    tokens = block_m // group if pack and group else block_m
    if not group or n % tokens or n % block_n or (pack and block_m % group):
        raise ValueError("H must be a multiple of Hkv, and N of block_n and of the block's tokens")
    return group, tokens


def dense_causal_flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int, block_n: int,
                      num_warps: int, num_stages: int, pack: bool = False, programs: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``dense_causal`` (pointer loads) from a persistent grid of ``programs`` programs (0: one per SM) that walk
    their query blocks' KV tiles in one loop (``_dense_causal_flat_kernel``); into ``out`` (like ``q``) if given."""
    b, h, n, d = q.shape
    group, tokens = _block_shape(q, k, block_m, block_n, pack)
    if tokens % block_n:
        raise ValueError("the block's tokens must be a multiple of block_n")
    out = torch.empty_like(q) if out is None else out
    items = b * (k.shape[1] if pack else h)
    if not programs:
        programs = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    _dense_causal_flat_kernel[(min(programs, items * (n // tokens)),)](
        q, k, v, out, scale * LOG2E, n, h, items, GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        PACK=pack, NUM_BLOCKS=n // tokens, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int, block_n: int,
                 num_warps: int, num_stages: int, use_desc: bool, pack: bool = False,
                 lazy: bool = False) -> torch.Tensor:  # fmt: skip
    """Causal attention of contiguous ``q [B, H, N, D]``, ``k``/``v [B, Hkv, N, D]``: a block is ``block_m``
    tokens, or with ``pack`` ``block_m // (H // Hkv)`` tokens of a KV head's query heads (N a multiple of both
    the block's tokens and ``block_n``); ``lazy``: the paged kernel's lazy rescaling."""
    b, h, n, d = q.shape
    group, tokens = _block_shape(q, k, block_m, block_n, pack)
    out = torch.empty_like(q)
    if use_desc and q.is_cuda:
        _ensure_allocator()  # (device-built descriptors need Triton's scratch allocator; the interpreter does not)
    grid = (n // tokens, b * (k.shape[1] if pack else h))
    _dense_causal_kernel[grid](q, k, v, out, scale * LOG2E, n, h, GROUP=group, HEAD_DIM=d, BLOCK_M=block_m,
                               BLOCK_N=block_n, USE_DESC=use_desc, PACK=pack, LAZY=lazy, num_warps=num_warps,
                               num_stages=num_stages)  # fmt: skip
    return out


SHAPES = {"prefill 1x8k": (1, 8192), "prefill 4x2k": (4, 2048)}
# (block_m, block_n, warps, stages, descriptors, pack, lazy): a tile sweep, then the paged kernel's own tile with
# its GQA packing and lazy rescaling added one at a time.
TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 2), (256, 64, 8, 3),
         (256, 128, 8, 2)]  # fmt: skip
VARIANTS = [(*t, desc, False, False) for t in TILES for desc in (True, False)]
VARIANTS += [(256, 64, 8, 3, False, pack, lazy) for pack, lazy in ((True, False), (False, True), (True, True))]
VARIANTS += [(128, 128, 8, 3, desc, True, False) for desc in (True, False)]
# The persistent one-loop form (``flat``) beside its per-block twins above: (block_m, block_n, warps, stages, pack).
FLAT_VARIANTS = [(128, 64, 8, 3, False), (256, 64, 8, 3, True), (128, 128, 8, 3, True)]


def run(seed: int = 0, only: list[str] | None = None) -> tuple[dict, str]:
    """Every variant (those whose name contains one of ``only``, if given) beside the paged kernel and SDPA."""
    from triton_paged_ops.bench import Case, _git_sha, run_suite, time_graph

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    scale = head_dim**-0.5
    paged = run_suite([Case(name, [n] * b, q_len=n) for name, (b, n) in SHAPES.items()], seed=seed)
    rows = [{"case": r["case"], "provider": r["provider"], "us": r["us"], "tflops": r["tflops"]}
            for r in paged["records"]]  # fmt: skip
    lines = [f"{r['provider']:<28} {r['case']:<14} {r['us']:>9.1f} µs {r['tflops']:>7.1f} TFLOP/s" for r in rows]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, (b, n) in SHAPES.items():
        q = torch.randn(b, num_heads, n, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
        k = torch.randn(b, num_kv_heads, n, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn_like(k)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                               scale=scale, enable_gqa=True)  # fmt: skip
        flops = 4 * b * num_heads * head_dim * n * (n + 1) / 2  # causal pairs
        variants = [(f"dense {bm}x{bn}/{w}w/{st}s/{'desc' if desc else 'ptr'}" + "/pack" * pack + "/lazy" * lazy,
                     dense_causal, (bm, bn, w, st, desc, pack, lazy))
                    for bm, bn, w, st, desc, pack, lazy in VARIANTS]  # fmt: skip
        variants += [(f"flat {bm}x{bn}/{w}w/{st}s/ptr" + "/pack" * pack, dense_causal_flat, (bm, bn, w, st, pack))
                     for bm, bn, w, st, pack in FLAT_VARIANTS]  # fmt: skip
        for who, fn, c in variants:
            if only and not any(o in who for o in only):
                continue
            try:
                out = fn(q, k, v, scale, *c)
            except Exception as exc:  # (a config whose shared memory does not fit: reported, not fatal)
                lines.append(f"{who:<34} {name:<14} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us = time_graph(lambda q=q, k=k, v=v, c=c, fn=fn: fn(q, k, v, scale, *c))
            rows.append({"case": name, "provider": who, "us": us, "tflops": flops / us / 1e6, "rel_err": err})
            lines.append(f"{who:<34} {name:<14} {us:>9.1f} µs {flops / us / 1e6:>7.1f} TFLOP/s  rel err {err:.1e}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "ceilings": paged["ceilings"], "rows": rows}  # fmt: skip
    return result, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dense_triton", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tpa_dense_triton.json", help="JSON file to write")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="only the variants whose name contains one of these")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton_paged_ops.bench import finish

    result, text = run(only=args.only)
    finish(result, text, args.out, "benchmarks.dense_triton", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
