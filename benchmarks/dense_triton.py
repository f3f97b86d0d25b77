"""Dense Triton ceiling for causal prefill: ``python -m benchmarks.dense_triton [--out FILE]`` (needs a CUDA GPU).

What a plain Triton flash-attention kernel reaches on the same GPU and Triton version with no paging at all:
contiguous ``[B, H, N, D]`` tensors as dense SDPA takes them, K/V tiles read through tensor descriptors (TMA on
sm_90+) or pointer blocks, the usual FlashAttention-2 loop (exp2 softmax with the scale folded in, fp32
accumulation, unmasked tiles below the diagonal, masked diagonal tiles, longest query blocks first). Each tile config
of a sweep runs beside the paged kernel (``tpa``, its shipped config, pages randomly permuted) and dense SDPA on
the same causal prefill shapes (bf16, Hq32/Hkv8/D128), all CUDA-graph replay medians from one run. So the gap
between the paged kernel and SDPA splits into what paging costs (paged vs this kernel) and what a Triton kernel
reaches at all on this stack (this kernel vs SDPA).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dense_causal_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qk_scale, seq_len, num_heads, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr,
):  # fmt: skip
    """One (query block, batch x head): causal attention of contiguous [B, H, N, D] tensors (K/V [B, H // GROUP,
    N, D]); ``qk_scale`` includes log2(e). BLOCK_M is a multiple of BLOCK_N, N of BLOCK_M."""
    num_blocks = seq_len // BLOCK_M
    block = num_blocks - 1 - tl.program_id(0)  # the blocks that see the most keys start first
    bh = tl.program_id(1)
    batch = bh // num_heads
    kv_bh = batch * (num_heads // GROUP) + (bh % num_heads) // GROUP
    q_row0 = bh.to(tl.int64) * seq_len + block * BLOCK_M
    kv_row0 = kv_bh.to(tl.int64) * seq_len
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if USE_DESC:
        # 2-D views: rows of all (batch, head) pairs back to back.
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[tl.num_programs(1) * seq_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        kv_rows = (tl.num_programs(1) // GROUP) * seq_len
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[kv_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[kv_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        # (Descriptor coordinates are 32-bit.)
        q = q_desc.load([q_row0.to(tl.int32), 0])
    else:
        q = tl.load(q_ptr + (q_row0 + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag_lo = block * BLOCK_M
    for phase in tl.static_range(2):  # tiles wholly below the diagonal, then the diagonal ones (masked)
        lo = 0 if phase == 0 else diag_lo
        hi = diag_lo if phase == 0 else diag_lo + BLOCK_M
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
                s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (q_row0 + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + offs_d[None, :], out)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int, block_n: int,
                 num_warps: int, num_stages: int, use_desc: bool) -> torch.Tensor:  # fmt: skip
    """Causal attention of contiguous ``q [B, H, N, D]``, ``k``/``v [B, Hkv, N, D]`` (N a multiple of block_m)."""
    b, h, n, d = q.shape
    if n % block_m or block_m % block_n or h % k.shape[1]:
        raise ValueError("N must be a multiple of block_m, block_m of block_n, and H of Hkv")
    out = torch.empty_like(q)
    if use_desc:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    grid = (n // block_m, b * h)
    _dense_causal_kernel[grid](q, k, v, out, scale * LOG2E, n, h, GROUP=h // k.shape[1], HEAD_DIM=d,
                               BLOCK_M=block_m, BLOCK_N=block_n, USE_DESC=use_desc, num_warps=num_warps,
                               num_stages=num_stages)  # fmt: skip
    return out


SHAPES = {"prefill 1x8k": (1, 8192), "prefill 4x2k": (4, 2048)}
TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 2), (256, 64, 8, 3),
         (256, 128, 8, 2)]  # fmt: skip


def run(seed: int = 0) -> tuple[dict, str]:
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
        for (bm, bn, warps, stages), desc in itertools.product(TILES, (True, False)):
            who = f"dense {bm}x{bn}/{warps}w/{stages}s/{'desc' if desc else 'ptr'}"
            try:
                out = dense_causal(q, k, v, scale, bm, bn, warps, stages, desc)
            except Exception as exc:  # (a config whose shared memory does not fit: reported, not fatal)
                lines.append(f"{who:<28} {name:<14} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us = time_graph(lambda q=q, k=k, v=v, c=(bm, bn, warps, stages, desc): dense_causal(q, k, v, scale, *c))
            rows.append({"case": name, "provider": who, "us": us, "tflops": flops / us / 1e6, "rel_err": err})
            lines.append(f"{who:<28} {name:<14} {us:>9.1f} µs {flops / us / 1e6:>7.1f} TFLOP/s  rel err {err:.1e}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "rows": rows}  # fmt: skip
    return result, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dense_triton", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tpa_dense_triton.json", help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton_paged_ops.bench import finish

    result, text = run()
    finish(result, text, args.out, "benchmarks.dense_triton", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
