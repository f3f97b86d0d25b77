"""How much of a decode step is the paged read itself? ``python -m benchmarks.paged_read [--only NAME ...]
[--out FILE]`` (CUDA GPU).

A Triton kernel with the decode launch's grid (the planner's segments x KV heads, 4 warps, 128-key tiles through
the block table, the loop pipelined as the decode loop is) reads every K and V row of each segment and sums them,
with no attention arithmetic; timed beside the decode op on the same batch and a one-kernel contiguous read of the
same bytes, then in other tiles, stages, warps and split counts, and with each page's rows of a head copied by the
TMA instead of by 16-byte ``cp.async`` copies (Triton's pipelined descriptor loads, and a Gluon loop with its own
mbarrier ring). Where the paged read lands near the contiguous one, the decode step's extra time is its own work per
tile and its reduce; where it lands near the decode step, the gather through this grid is the cost.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from triton_paged_ops.bench import Case, _git_sha, build_inputs, check_case, finish, same_size_read_us, time_graph
from triton_paged_ops.kernels import hopper
from triton_paged_ops.plan import attention_launch_plan

if hopper.gluon is not None:
    from triton_paged_ops.kernels.hopper import _copy_tile, gl, mbarrier, thread_barrier

CASES = (("B1x32k", [32768]), ("B8x4k", [4096] * 8), ("B32x4k", [4096] * 32))


@triton.jit
def _program_keys(seq_lens_ptr, segment_len, num_splits):
    """This program's sequence, KV head and key range ``[lo, hi)`` (its segment, cut at the sequence's end)."""
    seq = tl.program_id(0) // num_splits
    lo = (tl.program_id(0) % num_splits) * segment_len
    return seq, tl.program_id(1), lo, tl.minimum(tl.load(seq_lens_ptr + seq), lo + segment_len)


@triton.jit
def _paged_read_kernel(
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, partial_ptr, stride_k_page, stride_k_slot,
    stride_k_head, stride_v_page, stride_v_slot, stride_v_head, stride_bt, segment_len, num_splits,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Program (segment, KV head): the sum over its segment's keys of K + V rows (fp32, [HEAD_DIM]) into
    ``partial_ptr[program, head]``; keys past the sequence's end count as 0."""
    seq, head, lo, hi = _program_keys(seq_lens_ptr, segment_len, num_splits)
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
    seq, head, lo, hi = _program_keys(seq_lens_ptr, segment_len, num_splits)
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


if hopper.gluon is not None:

    @hopper.gluon.jit
    def _paged_read_gluon_kernel(
        k_desc, v_desc, block_table_ptr, seq_lens_ptr, partial_ptr, stride_bt, segment_len, num_splits,
        PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    ):  # fmt: skip
        """``_paged_read_tma_kernel`` in Gluon with its own ring: ``STAGES`` slots of a ``BLOCK_N``-key K and V tile,
        each filled by one TMA copy per page (the warp-specialized prefill's ``_copy_tile``) completing on the slot's
        mbarrier, ``STAGES - 1`` tiles ahead of the one being summed."""
        D: gl.constexpr = k_desc.block_type.shape[1]
        tile_bytes: gl.constexpr = 2 * BLOCK_N * D * k_desc.block_type.element_ty.primitive_bitwidth // 8
        COPY: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        seq = gl.program_id(0) // num_splits
        split = gl.program_id(0) % num_splits
        head = gl.program_id(1)
        kv_len = gl.load(seq_lens_ptr + seq)
        lo = split * segment_len
        hi = gl.minimum(kv_len, lo + segment_len)
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        n_pages = gl.cdiv(kv_len, PAGE_SIZE)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        t_lo = lo // BLOCK_N  # (segments are whole tiles)
        n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 0)
        for i in gl.static_range(STAGES - 1):
            if i < n_tiles:
                mbarrier.expect(ready.index(i), tile_bytes)
                _copy_tile(k_desc, k_smem.index(i), ready.index(i), bt_row, n_pages, t_lo + i, head * D, PAGE_SIZE,
                           BLOCK_N, COPY)  # fmt: skip
                _copy_tile(v_desc, v_smem.index(i), ready.index(i), bt_row, n_pages, t_lo + i, head * D, PAGE_SIZE,
                           BLOCK_N, COPY)  # fmt: skip
        acc = gl.zeros([D], gl.float32, layout=gl.SliceLayout(0, layout))
        for t in range(n_tiles):
            nxt = t + STAGES - 1
            if nxt < n_tiles:
                # Its slot was last read in step t - 1, which every warp finished (the barrier below).
                s_n = nxt % STAGES
                mbarrier.expect(ready.index(s_n), tile_bytes)
                _copy_tile(k_desc, k_smem.index(s_n), ready.index(s_n), bt_row, n_pages, t_lo + nxt, head * D,
                           PAGE_SIZE, BLOCK_N, COPY)  # fmt: skip
                _copy_tile(v_desc, v_smem.index(s_n), ready.index(s_n), bt_row, n_pages, t_lo + nxt, head * D,
                           PAGE_SIZE, BLOCK_N, COPY)  # fmt: skip
            s = t % STAGES
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            k = k_smem.index(s).load(layout).to(gl.float32)
            v = v_smem.index(s).load(layout).to(gl.float32)
            keys = (t_lo + t) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
            acc += gl.sum(gl.where((keys < hi)[:, None], k + v, gl.zeros_like(k)), axis=0)
            thread_barrier()
        offs = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        gl.store(partial_ptr + (gl.program_id(0) * gl.num_programs(1) + head) * D + offs, acc)


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


def paged_read_gluon(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     num_splits: int, segment_len: int, partial: torch.Tensor, block_n: int = 128, stages: int = 3,
                     warps: int = 4) -> None:  # fmt: skip
    """``paged_read`` by the Gluon kernel (sm_90: TMA copies a page each into its own mbarrier ring)."""
    copy = min(k_cache.shape[1], block_n)
    dtype = gl.bfloat16 if k_cache.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([copy, k_cache.shape[3]], dtype)
    descs = [hopper._descriptor(c, copy, layout) for c in (k_cache, v_cache)]
    grid = (seq_lens.numel() * num_splits, k_cache.shape[2])
    _paged_read_gluon_kernel[grid](
        *descs, block_table, seq_lens, partial, block_table.stride(0), segment_len, num_splits,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n, STAGES=stages, WARPS=warps, num_warps=warps,
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


def _gluon_forms(splits: int) -> list[tuple[int, tuple[int, int]]]:
    """(splits, (keys per tile, stages)) of the Gluon TMA ring (one program per SM at 128-key tiles: 64 KB a stage):
    at the decode's split count, and 128-key tiles x 3 at four times it."""
    forms = [(128, 2), (128, 3), (64, 4), (64, 3)]
    return [(splits, f) for f in forms] + [(4 * splits, forms[1])]


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

        def timed(copy: str, launch, requested: int, tile_keys: int, **form) -> None:
            """Time one read form: ``requested`` segments per sequence (whole tiles of ``tile_keys``), ``launch(n,
            segment_len, partial)``; its sums checked against ``want``."""
            seg = -(-max_k // (requested * tile_keys)) * tile_keys
            n = -(-max_k // seg)
            partial = torch.empty(len(lens) * n, case.num_kv_heads, case.head_dim, device=k.device)
            launch(n, seg, partial)
            got = partial.view(len(lens), n, *partial.shape[1:]).sum(1)
            us = sorted(time_graph(lambda: launch(n, seg, partial)) for _ in range(3))[1]
            record["paged_reads"].append({"copy": copy, "splits": n, "block_n": tile_keys, **form, "us": us,
                                          "err": float((got - want).norm() / want.norm())})  # fmt: skip

        for n, (block_n, stages, warps) in _read_forms(splits):
            timed("cp.async", lambda n, seg, part, t=(block_n, stages, warps): paged_read(
                k, v, table, seq_lens, n, seg, part, *t), n, block_n, stages=stages, warps=warps)  # fmt: skip
        # (The TMA: NVIDIA sm_90 and newer; Gluon's ring: sm_90 with a Triton the warp-specialized kernel is verified
        # on.)
        if torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9:
            descriptors = tma_descriptors(k, v)
            for n, (pages, stages, warps) in _tma_forms(splits):
                timed("tma", lambda n, seg, part, f=(pages, stages, warps): paged_read_tma(
                    descriptors, table, seq_lens, n, seg, part, *f), n, pages * case.page_size, stages=stages,
                    warps=warps)  # fmt: skip
        if hopper.available(torch.cuda.current_device()):
            for n, (block_n, stages) in _gluon_forms(splits):
                timed("gluon tma", lambda n, seg, part, f=(block_n, stages): paged_read_gluon(
                    k, v, table, seq_lens, n, seg, part, *f), n, block_n, stages=stages, warps=4)  # fmt: skip
        records.append(record)
        same = record["paged_reads"][0]
        lines.append(f"{name:7s} decode {record['decode_us']:7.2f} µs  paged read, decode's grid and tile "
                     f"{same['us']:7.2f}  contiguous read {record['contiguous_read_us']:7.2f}  "
                     f"({inp.kv_bytes / 1e6:.0f} MB)")  # fmt: skip
        for copy in ("cp.async", "tma", "gluon tma"):
            of_copy = [r for r in record["paged_reads"] if r["copy"] == copy]
            if not of_copy:
                continue
            best = min(of_copy, key=lambda r: r["us"])
            lines.append(f"{'':7s} fastest {copy} paged read {best['us']:7.2f} ({best['splits']} splits, "
                         f"{best['block_n']} keys x {best['stages']} stages, {best['warps']} warps)")  # fmt: skip
        del inp, k, v
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": _git_sha(), "records": records}  # fmt: skip
    finish(result, "\n".join(lines), args.out, "benchmarks.paged_read", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
