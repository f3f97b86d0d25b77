"""How much of a decode step is the paged read itself? ``python -m benchmarks.paged_read [--only NAME ...]
[--out FILE]`` (CUDA GPU).

A Triton kernel with the decode launch's grid (the planner's segments x KV heads, 4 warps, 128-key tiles through
the block table, the loop pipelined as the decode loop is) reads every K and V row of each segment and sums them,
with no attention arithmetic; timed beside the decode op on the same batch and a one-kernel contiguous read of the
same bytes, then in other tiles, stages, warps and split counts, and with each page's rows of a head copied by the
TMA instead of by 16-byte ``cp.async`` copies. Where the paged read lands near the contiguous one, the decode step's extra time is its own work per
tile and its reduce; where it lands near the decode step, the gather through this grid is the cost.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from triton_paged_ops.bench import Case, _git_sha, build_inputs, check_case, finish, same_size_read_us, time_graph
from triton_paged_ops.plan import attention_launch_plan

CASES = (("B1x32k", [32768]), ("B8x4k", [4096] * 8), ("B32x4k", [4096] * 32))


@triton.jit
def _paged_read_kernel(
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, partial_ptr, stride_k_page, stride_k_slot,
    stride_k_head, stride_v_page, stride_v_slot, stride_v_head, stride_bt, segment_len, num_splits,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Program (segment, KV head): the sum over its segment's keys of K + V rows (fp32, [HEAD_DIM]) into
    ``partial_ptr[program, head]``; keys past the sequence's end count as 0."""
    seq = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    head = tl.program_id(1)
    lo = split * segment_len
    hi = tl.minimum(tl.load(seq_lens_ptr + seq), lo + segment_len)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        key = start + offs_n
        ok = key < hi
        page = tl.load(bt_row + key // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = key % PAGE_SIZE
        k_row = page * stride_k_page + slot * stride_k_slot + head * stride_k_head
        v_row = page * stride_v_page + slot * stride_v_slot + head * stride_v_head
        k = tl.load(k_cache_ptr + k_row[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_row[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(partial_ptr + (tl.program_id(0) * tl.num_programs(1) + head) * HEAD_DIM + offs_d, acc)


@triton.jit
def _paged_read_tma_kernel(
    k_desc, v_desc, block_table_ptr, seq_lens_ptr, partial_ptr, stride_bt, segment_len, num_splits,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """``_paged_read_kernel`` with each page's rows of one head copied by the TMA: one [PAGE_SIZE, HEAD_DIM] box of
    the cache seen as [pages x PAGE_SIZE, Hkv x HEAD_DIM], ``PAGES`` pages a loop step."""
    seq = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    head = tl.program_id(1)
    lo = split * segment_len
    hi = tl.minimum(tl.load(seq_lens_ptr + seq), lo + segment_len)
    offs_p = tl.arange(0, PAGE_SIZE)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in tl.range(lo, hi, PAGES * PAGE_SIZE, num_stages=STAGES):
        for j in tl.static_range(PAGES):
            first = start + j * PAGE_SIZE
            # Past the segment's end: page 0's rows (in bounds), dropped below.
            page = tl.load(bt_row + first // PAGE_SIZE, mask=first < hi, other=0)
            k = k_desc.load([page * PAGE_SIZE, head * HEAD_DIM])
            v = v_desc.load([page * PAGE_SIZE, head * HEAD_DIM])
            ok = first + offs_p < hi
            acc += tl.sum(tl.where(ok[:, None], k.to(tl.float32) + v.to(tl.float32), 0.0), axis=0)
    tl.store(partial_ptr + (tl.program_id(0) * tl.num_programs(1) + head) * HEAD_DIM + tl.arange(0, HEAD_DIM), acc)


def paged_read(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               num_splits: int, segment_len: int, partial: torch.Tensor, block_n: int = 128, stages: int = 2,
               warps: int = 4) -> None:  # fmt: skip
    """Launch the read: ``partial`` [num_seqs * num_splits, Hkv, D] fp32 receives each program's sum."""
    grid = (seq_lens.numel() * num_splits, k_cache.shape[2])
    _paged_read_kernel[grid](
        k_cache, v_cache, block_table, seq_lens, partial, *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0), segment_len, num_splits, HEAD_DIM=k_cache.shape[3], PAGE_SIZE=k_cache.shape[1],
        BLOCK_N=block_n, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """TMA descriptors of both caches (contiguous [pages, page_size, Hkv, D]) seen as [pages x page_size, Hkv x D],
    one box a page's rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, page_size, heads, dim = k_cache.shape
    return tuple(TensorDescriptor.from_tensor(c.view(-1, heads * dim), [page_size, dim]) for c in (k_cache, v_cache))


def paged_read_tma(descriptors: tuple, block_table: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                   segment_len: int, partial: torch.Tensor, pages: int = 8, stages: int = 2,
                   warps: int = 4) -> None:  # fmt: skip
    """``paged_read`` by the TMA (``descriptors`` from ``tma_descriptors``), ``pages`` pages a loop step."""
    k_desc, v_desc = descriptors
    page_size, dim = k_desc.block_shape
    grid = (seq_lens.numel() * num_splits, k_desc.shape[1] // dim)
    _paged_read_tma_kernel[grid](
        k_desc, v_desc, block_table, seq_lens, partial, block_table.stride(0), segment_len, num_splits,
        HEAD_DIM=dim, PAGE_SIZE=page_size, PAGES=pages, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def _read_forms(splits: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(splits, (keys per tile, stages, warps)) timed per case: the decode launch's own first, then other tiles at
    its split count and its tile at half and twice the count."""
    tiles = [(128, 2, 4), (64, 4, 4), (32, 8, 4), (64, 2, 4), (128, 2, 8), (128, 3, 4)]
    return ([(splits, t) for t in tiles] + [(max(1, splits // 2), tiles[0]), (2 * splits, tiles[0]),
                                            (4 * splits, tiles[0])])  # fmt: skip


def _tma_forms(splits: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(splits, (pages a loop step, stages, warps)) of the TMA read: 8 pages (the decode tile's 128 keys at pages of
    16) at 2 and 3 stages, 4 pages at 4, at the decode's split count, and 8 at four times it."""
    forms = [(8, 2, 4), (8, 3, 4), (4, 4, 4)]
    return [(splits, f) for f in forms] + [(4 * splits, forms[0])]


def reference_sums(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Per sequence and KV head, the fp32 sum of its keys' K + V rows [num_seqs, Hkv, D] (plain PyTorch)."""
    page_size = k_cache.shape[1]
    sums = []
    for b, n in enumerate(seq_lens.tolist()):
        keys = torch.arange(n, device=k_cache.device)
        pages = block_table[b, keys // page_size].long()
        rows = (k_cache[pages, keys % page_size].float() + v_cache[pages, keys % page_size].float()).sum(0)
        sums.append(rows)
    return torch.stack(sums)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paged_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, choices=[name for name, _ in CASES], help="cases to run")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("paged_read needs a CUDA GPU", file=sys.stderr)
        return 2
    records, lines = [], []
    for name, lens in CASES:
        if args.only and name not in args.only:
            continue
        case = Case(name, lens)
        inp = build_inputs(case, seed=1)
        q, k, v, table, cu, seq_lens, max_q, max_k, scale = inp.args
        lp = attention_launch_plan(
            num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
            head_dim_v=case.head_dim, page_size=case.page_size, dtype=case.dtype, cache_dtype=case.dtype,
            num_seqs=len(lens), max_seqlen_q=1, max_seqlen_k=max_k, causal=True, window_left=-1, softcap=0.0,
            has_alibi=False, has_sinks=False, has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=False,
            device_index=torch.cuda.current_device(), interpret=False, batch_invariant=False,
        )  # fmt: skip
        splits, segment = lp.split.num_splits, lp.split.segment_len if lp.split.num_splits > 1 else max_k
        err = check_case(inp)
        record = {"case": name, "splits": splits, "segment_len": segment, "kv_bytes": inp.kv_bytes, "rel_err": err,
                  "decode_us": sorted(time_graph(inp.call) for _ in range(3))[1],
                  "contiguous_read_us": same_size_read_us(inp.kv_bytes), "paged_reads": []}  # fmt: skip
        want = reference_sums(k, v, table, seq_lens)
        for num_splits, (block_n, stages, warps) in _read_forms(splits):
            seg = -(-max_k // (num_splits * block_n)) * block_n
            num_splits = -(-max_k // seg)
            partial = torch.empty(len(lens) * num_splits, case.num_kv_heads, case.head_dim, device="cuda")
            def run(n=num_splits, seg=seg, partial=partial, tile=(block_n, stages, warps)):
                paged_read(k, v, table, seq_lens, n, seg, partial, *tile)

            run()
            got = partial.view(len(lens), num_splits, *partial.shape[1:]).sum(1)
            record["paged_reads"].append({
                "copy": "cp.async", "splits": num_splits, "block_n": block_n, "stages": stages, "warps": warps,
                "err": float((got - want).norm() / want.norm()), "us": sorted(time_graph(run) for _ in range(3))[1],
            })  # fmt: skip
        # (The TMA: NVIDIA sm_90 and newer.)
        has_tma = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
        descriptors = tma_descriptors(k, v) if has_tma else None
        for num_splits, (pages, stages, warps) in _tma_forms(splits) if has_tma else []:
            seg = -(-max_k // (num_splits * pages * case.page_size)) * pages * case.page_size
            num_splits = -(-max_k // seg)
            partial = torch.empty(len(lens) * num_splits, case.num_kv_heads, case.head_dim, device="cuda")

            def run_tma(n=num_splits, seg=seg, partial=partial, form=(pages, stages, warps)):
                paged_read_tma(descriptors, table, seq_lens, n, seg, partial, *form)

            run_tma()
            got = partial.view(len(lens), num_splits, *partial.shape[1:]).sum(1)
            record["paged_reads"].append({
                "copy": "tma", "splits": num_splits, "block_n": pages * case.page_size, "stages": stages,
                "warps": warps, "err": float((got - want).norm() / want.norm()),
                "us": sorted(time_graph(run_tma) for _ in range(3))[1],
            })  # fmt: skip
        records.append(record)
        same = record["paged_reads"][0]
        lines.append(f"{name:7s} decode {record['decode_us']:7.2f} µs  paged read, decode's grid and tile "
                     f"{same['us']:7.2f}  contiguous read {record['contiguous_read_us']:7.2f}  "
                     f"({inp.kv_bytes / 1e6:.0f} MB)")  # fmt: skip
        for copy in ("cp.async", "tma")[: 2 if has_tma else 1]:
            best = min((r for r in record["paged_reads"] if r["copy"] == copy), key=lambda r: r["us"])
            lines.append(f"{'':7s} fastest {copy} paged read {best['us']:7.2f} ({best['splits']} splits, "
                         f"{best['block_n']} keys x {best['stages']} stages, {best['warps']} warps)")  # fmt: skip
        del inp, k, v
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "records": records}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.paged_read", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
