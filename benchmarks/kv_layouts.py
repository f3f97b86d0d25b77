"""Does the KV cache's memory layout set a decode step's streaming rate? ``python -m benchmarks.kv_layouts
[--only NAME ...] [--out FILE]`` (CUDA GPU).

The same decode step (B1x32k and B8x4k, the suite's small 134 MB cases) is timed with its pages randomly permuted
(the suite's form), with each sequence's pages in order, with the caches stored head-major ("HND": a page's keys of
one head contiguous, passed to the op as a strided NHD view) and with pages of 64 and 128 keys, beside a one-kernel
read of the same bytes. Each form is checked against the reference before it is timed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from triton_paged_ops.bench import (
    Case,
    Inputs,
    _git_sha,
    build_inputs,
    check_case,
    finish,
    same_size_read_us,
    time_graph,
)

CASES = (("B1x32k", [32768]), ("B8x4k", [4096] * 8))
PAGE_SIZES = (16, 64, 128)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [pages, page_size, Hkv, D] copied into head-major storage [pages, Hkv, page_size, D], returned as
    a view with the op's NHD shape (same values, other strides)."""
    pages, page_size, heads, dim = cache.shape
    store = torch.empty(pages, heads, page_size, dim, dtype=cache.dtype, device=cache.device)
    store.copy_(cache.permute(0, 2, 1, 3))
    return store.permute(0, 2, 1, 3)


def pages_in_order(inp: Inputs) -> Inputs:
    """``inp`` with each sequence's pages stored in order: its keys and values moved to pages b * width + j, the
    block table rewritten to match (same attention, consecutive pages)."""
    q, k, v, table, cu, seq_lens, max_q, max_k, scale = inp.args
    rows, width = table.shape
    ordered = (torch.arange(rows, device=table.device)[:, None] * width
               + torch.arange(width, device=table.device)[None, :]).to(table.dtype)  # fmt: skip
    owned = table >= 0
    caches = []
    for cache in (k, v):
        moved = torch.zeros(rows * width, *cache.shape[1:], dtype=cache.dtype, device=cache.device)
        moved[ordered[owned].long()] = cache[table[owned].long()]
        caches.append(moved)
    return Inputs((q, caches[0], caches[1], torch.where(owned, ordered, table), cu, seq_lens, max_q, max_k, scale),
                  inp.out, inp.kv_bytes, inp.flops, inp.kwargs, inp.decode_tail)  # fmt: skip


def forms(inp: Inputs, page_size: int) -> dict[str, Inputs]:
    """The layouts timed for one batch: permuted NHD pages always; pages in order at 16 keys; HND at 16 and 64."""
    q, k, v, *rest = inp.args
    out = {"nhd_permuted": inp}
    if page_size == 16:
        out["nhd_in_order"] = pages_in_order(inp)
    if page_size in (16, 64):
        out["hnd_permuted"] = Inputs((q, head_major(k), head_major(v), *rest), inp.out, inp.kv_bytes, inp.flops,
                                     inp.kwargs, inp.decode_tail)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, choices=[name for name, _ in CASES], help="cases to run")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kv_layouts needs a CUDA GPU", file=sys.stderr)
        return 2
    records, lines = [], []
    for name, lens in CASES:
        if args.only and name not in args.only:
            continue
        for page_size in PAGE_SIZES:
            base = build_inputs(Case(name, lens, page_size=page_size), seed=1)
            for form, inp in forms(base, page_size).items():
                err = check_case(inp)
                us = sorted(time_graph(inp.call) for _ in range(3))[1]
                records.append({"case": name, "page_size": page_size, "form": form, "us": us,
                                "kv_tbps": inp.kv_bytes / us / 1e6, "rel_err": err})  # fmt: skip
                lines.append(f"{name:7s} page {page_size:<4d} {form:13s} {us:7.2f} µs  "
                             f"{inp.kv_bytes / us / 1e6:.2f} TB/s  err {err:.1e}")  # fmt: skip
            kv_bytes = base.kv_bytes
            del base
        read = same_size_read_us(kv_bytes)
        records.append({"case": name, "form": "read_same_bytes", "us": read, "kv_tbps": kv_bytes / read / 1e6})
        lines.append(f"{name:7s} read of the same bytes {read:7.2f} µs  {kv_bytes / read / 1e6:.2f} TB/s")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "records": records}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.kv_layouts", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
