"""How fast one program reads K/V: ``python -m benchmarks.program_rates [--config JSON ...] [--out FILE]`` (CUDA GPU).

Two measurements, with the HBM read ceiling from the same run:

- ``stream``: a plain kernel whose programs (one per SM at most) each stream their own contiguous slice of a large
  bf16 [rows, 128] array through a pipelined loop, by pointer loads (async copies) or tensor-descriptor block
  copies, at several tile widths, warps and pipeline depths (median of single launches). Its per-program GB/s is
  what one program's copies in flight allow: the ceiling a latency-bound program of the attention kernel can reach.
- ``one_token``: prefill launches of the attention kernel (a 256-token prompt, so the launch is a prefill one)
  beside n one-token sequences of 64k keys (8 KV heads: 8n one-token programs), under each ``--config``. With
  fewer programs than SMs the per-program GB/s is the one-token rows' own rate inside a prefill launch (what the
  mixed batch's decode rows get); the mixed batch of the prefill suite and its 2k chunk alone (without and with
  the layout hint) run beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl

from benchmarks.ab import parse_configs
from triton_paged_ops.bench import Case, _git_sha, build_inputs, finish, hbm_ceilings, time_graph
from triton_paged_ops.kernels.attention import _ensure_allocator, attention_config_override


@triton.jit
def stream_rows(x_ptr, out_ptr, total_rows, rows_per_program, BLOCK_N: tl.constexpr, D: tl.constexpr,
                STAGES: tl.constexpr, BLOCK_COPIES: tl.constexpr):  # fmt: skip
    """Program p reads rows [p * rows_per_program, ...) tile by tile into a product (so every byte is used) and
    stores the column sums of its rows, [16, D] (16 equal rows: the smallest tensor-core product). Each tile by
    pointer loads, or with ``BLOCK_COPIES`` as one tensor-descriptor block copy (TMA on NVIDIA)."""
    base = tl.program_id(0).to(tl.int64) * rows_per_program
    ones = tl.full([16, BLOCK_N], 1.0, x_ptr.dtype.element_ty)
    acc = tl.zeros([16, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if BLOCK_COPIES:
        desc = tl.make_tensor_descriptor(x_ptr, shape=[total_rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    for r in tl.range(0, rows_per_program, BLOCK_N, num_stages=STAGES):
        if BLOCK_COPIES:
            x = desc.load([(tl.program_id(0) * rows_per_program + r).to(tl.int32), 0])
        else:
            x = tl.load(x_ptr + (base + r + offs_n)[:, None] * D + offs_d[None, :])
        acc = tl.dot(ones, x, acc)
    tl.store(out_ptr + tl.program_id(0) * 16 * D + tl.arange(0, 16)[:, None] * D + offs_d[None, :], acc)


# (tile rows, warps, stages): a 128-row bf16 tile at D128 is 32 KB.
STREAM_SHAPES = ((64, 4, 3), (64, 4, 6), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3))


def stream_call(kind: str, x: torch.Tensor, out: torch.Tensor, programs: int, rows: int, shape: tuple):
    """One launch of the streaming kernel (``kind`` "gathers" or "desc") over ``programs`` slices of ``rows``."""
    block_n, warps, stages = shape
    d = x.shape[1]
    if kind not in ("gathers", "desc"):
        raise ValueError(f"kind must be 'gathers' or 'desc', got {kind!r}")
    if rows % block_n or programs * rows > x.shape[0]:
        # (The kernel reads whole tiles without masks: a slice must be whole tiles inside the array.)
        raise ValueError(f"rows ({rows}) must be a multiple of the tile ({block_n}), programs x rows within the array")
    return stream_rows[(programs,)](x, out, x.shape[0], rows, BLOCK_N=block_n, D=d, STAGES=stages,
                                    BLOCK_COPIES=kind == "desc", num_warps=warps)  # fmt: skip


def run_stream(lines: list[str]) -> list[dict]:
    _ensure_allocator()
    d, total = 128, 1 << 23  # 2 GiB of bf16 rows: far past the L2
    x = torch.randn(total, d, device="cuda", dtype=torch.bfloat16)
    rows_out = []
    for programs in (8, 33, 66, 132):
        # 32 MiB a program, whole tiles of the largest shape.
        rows = min((32 << 20) // (2 * d), total // programs) // 128 * 128
        out = torch.empty(programs * 16 * d, device="cuda", dtype=torch.float32)
        for kind in ("gathers", "desc"):
            for shape in STREAM_SHAPES:
                print(f"stream {kind} {programs} programs {shape}", file=sys.stderr, flush=True)
                # (Each launch runs for a millisecond or more: events around single launches, median.)
                fn = functools.partial(stream_call, kind, x, out, programs, rows, shape)
                us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                gbs = rows * d * 2 / us / 1e3
                rows_out.append({"part": "stream", "kind": kind, "programs": programs, "tile_rows": shape[0],
                                 "warps": shape[1], "stages": shape[2], "us": us, "per_program_gbs": gbs,
                                 "total_tbps": gbs * programs / 1e3})  # fmt: skip
                lines.append(f"stream {kind:<7} {programs:>3} programs {shape[0]:>3}x{d}/{shape[1]}w/{shape[2]}s "
                             f"{us:>8.1f} µs {gbs:>6.1f} GB/s a program {gbs * programs / 1e3:>5.2f} TB/s")  # fmt: skip
    return rows_out


def one_token_cases() -> list[Case]:
    cases = [Case(f"256-token prompt + {n} decodes x 64k", [256] + [65536] * n, q_lens=[256] + [1] * n)
             for n in (4, 8, 16)]  # fmt: skip
    return cases + [
        Case("mixed 2k+63 decodes", [4096 + 2048] + [4096] * 63, q_lens=[2048] + [1] * 63),
        Case("2k chunk alone, no hint", [4096 + 2048], q_len=2048),
        Case("2k chunk alone, hint 0", [4096 + 2048], q_len=2048),
    ]


def run_one_token(configs: list[dict], lines: list[str]) -> list[dict]:
    rows_out = []
    for i, case in enumerate(one_token_cases()):
        inp = build_inputs(case, seed=i, hints="no hint" not in case.name)
        one_token = sum(q == 1 for q in case.queries())
        for cfg in configs:
            with attention_config_override(**cfg):
                us = time_graph(inp.call, inner=5, reps=10)
            programs = one_token * case.num_kv_heads
            gbs = inp.kv_bytes / us / 1e3 / programs if programs else None
            rows_out.append({"part": "one_token", "case": case.name, "config": cfg, "us": us,
                             "one_token_programs": programs, "per_program_gbs": gbs})  # fmt: skip
            rate = f"{gbs:>6.1f} GB/s a one-token program" if gbs and "prompt +" in case.name else ""
            lines.append(f"{case.name:<36} {json.dumps(cfg):<40} {us:>8.1f} µs {rate}")
    return rows_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.program_rates", description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["{}"], metavar="JSON",
                   help="launch option overrides for the one-token part ({} = defaults)")  # fmt: skip
    p.add_argument("--skip-stream", action="store_true", help="leave out the streaming kernel")
    p.add_argument("--out", default="tpa_program_rates.json", help="JSON file to write ('' for none)")
    args = p.parse_args(argv)
    configs = parse_configs(p, args.config)
    for cfg, text in zip(configs, args.config):
        if {"hints", "exact"} & set(cfg):
            p.error(f"--config {text!r}: launch options only here (no hints or exact)")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    lines: list[str] = []
    rows = [] if args.skip_stream else run_stream(lines)
    rows += run_one_token(configs, lines)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "ceilings": hbm_ceilings(), "rows": rows}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.program_rates", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
