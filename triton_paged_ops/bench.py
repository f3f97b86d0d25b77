"""Benchmark suite: paged attention beside its same-run ceilings (dense SDPA and HBM bandwidth).

Every case builds random (not zero) inputs with randomly permuted pages, checks the kernel's output against the
reference on a few sequences first, then times CUDA-graph replays (median). In the same run it times dense
``scaled_dot_product_attention`` on the same shapes (contiguous, unpaged) and a large device read, so each result
carries its own ceilings.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import math
import subprocess
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from triton_paged_ops import api, configs, ops, reference
from triton_paged_ops.checks import decode_tail_of
from triton_paged_ops.inputs import random_paged_batch


@dataclasses.dataclass
class Case:
    """One benchmark problem: sequences with ``kv_lens`` keys each, their last ``q_len`` (or ``q_lens[b]``) tokens
    new (causal queries; 1 = decode)."""

    name: str
    kv_lens: list[int]
    q_len: int = 1
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None  # e.g. float8_e4m3fn, read with k/v scales (default: dtype)
    q_lens: list[int] | None = None  # per-sequence new tokens (a mixed batch); default q_len for every sequence

    def queries(self) -> list[int]:
        return list(self.q_lens) if self.q_lens is not None else [self.q_len] * len(self.kv_lens)

    def visible_pairs(self) -> int:
        """(query, key) pairs the causal mask lets through: each new token sees the keys up to its own position."""
        return sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(self.queries(), self.kv_lens))


def _ragged_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Log-uniform lengths in [lo, hi]: many short sequences, a few long ones (a fixed draw, for comparability)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen)
    return [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u.tolist()]


def decode_cases() -> list[Case]:
    return [
        Case("B1x32k", [32768]),
        Case("B8x4k", [4096] * 8),
        Case("B32x4k", [4096] * 32),
        Case("B64x8k", [8192] * 64),
        Case("B256x2k", [2048] * 256),
        Case("ragged96 128..8k", _ragged_lengths(96, 128, 8192)),
        Case("Hq8/Hkv1 B64x4k", [4096] * 64, num_q_heads=8, num_kv_heads=1),
        Case("B32x4k page1", [4096] * 32, page_size=1),
        Case("B32x4k page64", [4096] * 32, page_size=64),
        Case("B32x4k D64", [4096] * 32, head_dim=64),
        Case("B32x4k D256", [4096] * 32, head_dim=256),
        Case("B32x4k fp8", [4096] * 32, cache_dtype=torch.float8_e4m3fn),
        Case("B64x8k fp8", [8192] * 64, cache_dtype=torch.float8_e4m3fn),
        # Too few sequences to fill the GPU even split: latency-bound (appended: earlier cases keep their seeds).
        Case("B1x4k", [4096]),
        Case("B4x2k", [2048] * 4),
    ]


def capture_graph(fn: Callable[[], object], inner: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``inner`` ``fn`` calls, warmed up outside it and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fn: Callable[[], object], inner: int = 20, reps: int = 30) -> float:
    """Median µs of one ``fn`` call, from replays of a CUDA graph holding ``inner`` calls (warm-up outside)."""
    graph = capture_graph(fn, inner)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return sorted(times)[len(times) // 2]


def prefill_cases() -> list[Case]:
    """Causal prefill, chunked prefill on a cached prefix, and a mixed batch with its two parts alone."""
    mixed_q, mixed_kv = [2048] + [1] * 63, [4096 + 2048] + [4096] * 63
    return [
        Case("prefill 1x8k", [8192], q_len=8192),
        Case("prefill 4x2k", [2048] * 4, q_len=2048),
        Case("4x1k on 3k prefix", [4096] * 4, q_len=1024),
        Case("mixed 2k+63 decodes", mixed_kv, q_lens=mixed_q),
        Case("mixed: 2k chunk alone", mixed_kv[:1], q_lens=mixed_q[:1]),
        Case("mixed: 63 decodes alone", mixed_kv[1:], q_lens=mixed_q[1:]),
        Case("prefill 4x2k D64", [2048] * 4, q_len=2048, head_dim=64),
        Case("prefill 4x2k D256", [2048] * 4, q_len=2048, head_dim=256),
        Case("prefill 4x2k page1", [2048] * 4, q_len=2048, page_size=1),
        Case("prefill 4x2k page64", [2048] * 4, q_len=2048, page_size=64),
    ]


def short_cases() -> list[Case]:
    """A few new tokens per sequence on long contexts (speculative verification): 4-token queries (16 packed rows at
    GQA group 4, the ``short_narrow`` regime) at three head dims, 8 and 16 tokens (``short``, 16 at two)."""
    return [
        Case("short B32x4k q4", [4096] * 32, q_len=4),
        Case("short B64x2k q8", [2048] * 64, q_len=8),
        Case("short B8x8k q16", [8192] * 8, q_len=16),
        Case("short B64x4k q4 page64", [4096] * 64, q_len=4, page_size=64),
        Case("short B32x4k q4 D64", [4096] * 32, q_len=4, head_dim=64),
        Case("short B32x4k q4 D256", [4096] * 32, q_len=4, head_dim=256),
        Case("short B8x8k q16 D256", [8192] * 8, q_len=16, head_dim=256),
    ]


SUITES = {"decode": decode_cases, "prefill": prefill_cases, "short": short_cases}


def hbm_ceilings(gib: float = 2.0) -> dict[str, float]:
    """Measured device bandwidth in TB/s: a large read (sum) and a large copy (read + write bytes)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    read_us = time_graph(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=acc), inner=5, reps=15)
    copy_us = time_graph(lambda: dst.copy_(src), inner=5, reps=15)
    return {"read_tbps": 2 * n / read_us / 1e6, "copy_tbps": 4 * n / copy_us / 1e6}


@triton.jit
def _read_blocks(src, partial, n, BLOCK: tl.constexpr):
    """One block of ``src`` per program, summed to one value (a pure streaming read, nothing else)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(partial + tl.program_id(0), tl.sum(tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)))


def same_size_read_us(nbytes: int) -> float:
    """µs of the fastest single-kernel read of ``nbytes`` (contiguous bf16; ``torch.sum`` and a one-block-per-program
    Triton read at two block sizes): what a kernel reading a case's KV bytes once can take at that size, launch, ramp
    and tail included, which the large-read ceiling spreads over 2 GiB."""
    n = max(1, nbytes // 2)
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    times = [time_graph(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=acc))]
    for block in (4096, 16384):
        partial = torch.empty(triton.cdiv(n, block), device="cuda", dtype=torch.float32)
        grid = (partial.numel(),)
        times.append(time_graph(lambda b=block, p=partial, g=grid: _read_blocks[g](src, p, n, BLOCK=b, num_warps=8)))
    return min(times)


@dataclasses.dataclass
class Inputs:
    args: tuple
    out: torch.Tensor
    kv_bytes: int
    flops: float
    kwargs: dict = dataclasses.field(default_factory=dict)  # k/v scales of an fp8 cache
    decode_tail: int = -1  # the ops' layout hint (-1: none given)

    def call(self, batch_invariant: bool = False) -> None:
        """One op call on this batch into ``out``, with its cache scales and layout hint as built."""
        api.paged_attention_out(*self.args, **self.kwargs, batch_invariant=batch_invariant,
                                decode_tail=self.decode_tail, out=self.out)  # fmt: skip


def build_inputs(case: Case, seed: int, device: str = "cuda", hints: bool = True) -> Inputs:
    """The case's random batch; ``hints``: calls pass its ``decode_tail`` (its layout, as a serving framework knows
    it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pb = random_paged_batch(
        case.queries(), case.kv_lens, num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim, page_size=case.page_size, dtype=case.dtype, device=device, generator=gen,
        cache_dtype=case.cache_dtype,
    )  # fmt: skip
    out = torch.empty(sum(case.queries()), case.num_q_heads, case.head_dim, device=device, dtype=case.dtype)
    tokens = sum(case.kv_lens)
    kv_bytes = 2 * tokens * case.num_kv_heads * case.head_dim * pb.k_cache.element_size()
    flops = 4.0 * case.visible_pairs() * case.num_q_heads * case.head_dim
    kwargs = {}
    if case.cache_dtype is not None and case.cache_dtype.itemsize == 1:
        kwargs = {"k_scale": torch.tensor([0.8], device=device), "v_scale": torch.tensor([1.2], device=device)}
    return Inputs(pb.args, out, kv_bytes, flops, kwargs, decode_tail_of(case.queries()) if hints else -1)


def check_case(inp: Inputs, max_seqs: int = 4, batch_invariant: bool = False) -> float:
    """Relative L2 error of the kernel against the reference on up to ``max_seqs`` sequences (poisoned output)."""
    q, k_cache, v_cache, block_table, cu, seq_lens, mq, mk, scale = inp.args
    inp.out.fill_(float("nan"))
    inp.call(batch_invariant)
    n_tok = int(cu[max_seqs]) if len(seq_lens) > max_seqs else q.shape[0]
    sub = slice(0, min(max_seqs, len(seq_lens)))
    ref = reference.paged_attention(q[:n_tok], k_cache, v_cache, block_table[sub], cu[: sub.stop + 1],
                                    seq_lens[sub], mq, mk, scale, **inp.kwargs)  # fmt: skip
    got = inp.out[:n_tok].float()
    if got.isnan().any():
        return float("inf")
    return float((got - ref.float()).norm() / ref.float().norm())


# PyTorch's fused dense attention backends: each is timed alone (one that refuses a shape is skipped) and the
# fastest is the ceiling.
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def _sdpa_calls(case: Case, seed: int) -> list[tuple]:
    """Dense contiguous SDPA on the case's shapes, causal as the kernel (new tokens last): sequences with the same
    (new tokens, keys) run as one batch; a decode batch (one new token each) runs as one uniform batch with the
    same KV tokens."""
    queries = case.queries()
    if all(q == 1 for q in queries):
        groups = {(1, sum(case.kv_lens) // len(case.kv_lens)): len(case.kv_lens)}
    else:
        groups: dict[tuple[int, int], int] = {}
        for q, k in zip(queries, case.kv_lens):
            groups[(q, k)] = groups.get((q, k), 0) + 1
    gen = torch.Generator(device="cuda").manual_seed(seed)
    calls = []
    for (q_len, length), b in groups.items():
        q = torch.randn(b, case.num_q_heads, q_len, case.head_dim, generator=gen, device="cuda").to(case.dtype)
        k = torch.randn(b, case.num_kv_heads, length, case.head_dim, generator=gen, device="cuda").to(case.dtype)
        v = torch.randn_like(k)
        kw: dict = {"enable_gqa": case.num_q_heads != case.num_kv_heads}
        if q_len == length:
            kw["is_causal"] = True
        elif q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(q_len, length)  # the new tokens are the last keys
        calls.append((q, k, v, kw))
    return calls


def sdpa_runner(case: Case, seed: int, name: str) -> Callable[[], object] | None:
    """A call of PyTorch's SDPA backend ``name`` (one of ``SDPA_BACKENDS``) on the case's dense shapes
    (``_sdpa_calls``), run once to check it; None where the backend refuses the shapes (or this GPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    calls = _sdpa_calls(case, seed)

    def run(kind=kinds[name]):
        with sdpa_kernel(kind):
            return [sdpa(q, k, v, **kw) for q, k, v, kw in calls]

    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError:  # "No available kernel": this backend does not take these shapes
        return None
    return run


def sdpa_dense_us(case: Case, seed: int) -> dict[str, float]:
    """µs of each of PyTorch's fused SDPA backends (``SDPA_BACKENDS``) on the case's dense shapes (``_sdpa_calls``);
    a backend that refuses the shapes (or this GPU) is left out."""
    times = {}
    for name in SDPA_BACKENDS:
        run = sdpa_runner(case, seed, name)
        if run is not None:
            times[name] = time_graph(run)
            del run
    return times


def host_time_us(fn, calls: int = 200, warmup: int = 10, repeats: int = 15, runs: list | None = None) -> float:
    """Host (CPU) time of one ``fn()`` in µs: the median over ``repeats`` runs of the mean of ``calls`` back-to-back
    calls. Each run starts on an idle device and stops its clock before waiting for it; ``calls`` launches stay
    well below the launch queue's depth, so the host never waits for the device and the figure is the CPU-side cost
    whatever the kernels' own duration (a cold, clocked-down GPU made earlier wall-time figures read high).
    The median, because a shared host's hiccups skew single runs; one more run comes first and is dropped (the first
    timed run in a process read 31-57 µs where the next read 19-36 on an H200 host). ``runs``, if given, receives
    every kept run's figure (e.g. for its minimum: the cost with the fewest interruptions)."""
    import statistics
    import time

    # Without a GPU (kernel stand-ins, ``benchmarks.host_path``) there is no device to wait for.
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    sync()
    if runs is not None:
        runs.extend(times[1:])
    return statistics.median(times[1:])


def _median_and_min(name: str, fn, calls: int) -> dict[str, float]:
    runs: list[float] = []
    return {name: host_time_us(fn, calls, runs=runs), f"{name}_min": min(runs)}


@triton.jit
def _empty_kernel(a, b):
    # Does nothing: its launch is the host-time floor of any Triton launch.
    pass


def triton_launch_floor_us(calls: int = 200) -> float:
    """Host time of the cheapest Triton launch on this host: a compiled two-argument kernel that does nothing,
    launched through its compiled launcher (what ``kernels.launch`` calls), the floor under every launch of ours."""
    a = torch.empty(4, device="cuda")
    compiled = _empty_kernel[(1,)](a, a)
    stream = torch.cuda.current_stream().cuda_stream
    hook, ptr = triton.knobs.runtime.launch_exit_hook, a.data_ptr()
    fn, meta = compiled.function, compiled.packed_metadata
    return host_time_us(lambda: compiled.run(1, 1, 1, stream, fn, meta, None, None, hook, ptr, ptr), calls)


# A custom op with the out variant's schema whose Python kernel does nothing (registered on first use).
_FLOOR_LIB: list = []


def dispatcher_floor_us(args: tuple, out: torch.Tensor, calls: int = 200) -> float:
    """Host time of ``torch.ops`` with these arguments into a Python kernel that does nothing: the part of a
    ``torch.ops.tpa.paged_attention_out(*args, out=out)`` call that is PyTorch's (argument conversion both ways
    through the schema, dispatch), the floor under that layer of ``call_layer_times_us``."""
    if not _FLOOR_LIB:
        lib = torch.library.Library("tpa_floor", "DEF")
        lib.define(f"paged_attention_out{ops._ATTENTION_OPS['paged_attention_out']}")
        lib.impl("paged_attention_out", lambda *a, **kw: None, "CompositeExplicitAutograd")
        _FLOOR_LIB.append(lib)  # (the registration lives as long as the Library object)
    noop = torch.ops.tpa_floor.paged_attention_out
    return host_time_us(lambda: noop(*args, out=out), calls)


def call_layer_times_us(args: tuple, out: torch.Tensor, calls: int = 200) -> dict[str, float]:
    """Host time of one repeated ``paged_attention_out(*args, out=out)`` call through each layer, outside in: the
    typed wrapper, the ``torch.ops`` dispatch, and the op body alone (see ``host_time_us``: median, and ``_min``
    the fastest run)."""
    return {
        **_median_and_min("api_wrapper", lambda: api.paged_attention_out(*args, out=out), calls),
        **_median_and_min("torch_ops_call", lambda: torch.ops.tpa.paged_attention_out(*args, out=out), calls),
        **_median_and_min(
            "op_body", lambda: ops._attention(*args, out=out, op="paged_attention_out", fake=False), calls
        ),
    }


def decode_loop_times_us(args: tuple, out: torch.Tensor, calls: int = 200, window: int = 1024) -> dict[str, float]:
    """Host time of the typed wrapper called as a decode loop calls it: ``max_seqlen_k`` one larger each call, from
    the given one over ``window`` steps, then again from the start with the prepared launches forgotten, so every
    pass plans as often as a real loop does (median and fastest run, as ``call_layer_times_us``). The block table
    is widened to allow the larger bounds."""
    q, k_cache, v_cache, block_table, cu, seq_lens, max_q, max_k, scale = args
    page = k_cache.shape[1]
    # Extra columns point at page 0: never read, the keys past each sequence's length are masked.
    wide = torch.zeros(block_table.shape[0], block_table.shape[1] + -(-window // page), dtype=block_table.dtype,
                       device=block_table.device)  # fmt: skip
    wide[:, : block_table.shape[1]] = block_table
    steps = itertools.cycle(range(max_k, max_k + window))

    def decode_step():
        m = next(steps)
        if m == max_k:
            ops.PREPARED.clear()
        api.paged_attention_out(q, k_cache, v_cache, wide, cu, seq_lens, max_q, m, scale, out=out)

    return _median_and_min("decode_loop", decode_step, calls)


def host_overhead_us(calls: int = 200) -> float:
    """Eager wall time of one small decode call (Python, checks, launch): GPU work is too small to matter."""
    inp = build_inputs(Case("overhead", [256] * 4), seed=0)
    return host_time_us(lambda: api.paged_attention_out(*inp.args, out=inp.out), calls)


def finish(result: dict, text: str, out: str | None, prog: str, argv: list[str] | None) -> None:
    """Record the command line in ``result``, print ``text``, and write ``result`` as JSON to ``out`` if given."""
    import json
    import shlex
    import sys

    # (Quoted as a shell would need it: JSON configs hold spaces and quotes.)
    result["command"] = f"python -m {prog} " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(text)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def _git_sha(cwd: str | None = None) -> str:
    """The checkout's commit (of the working directory, or ``cwd``)."""
    try:
        # "-dirty" when the working tree differs from the commit: the numbers then belong to uncommitted code.
        cmd = ["git", "describe", "--always", "--dirty", "--abbrev=40"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_suite(cases: list[Case], seed: int = 0, with_sdpa: bool = True, with_invariant: bool = False,
              hints: bool = True) -> dict:  # fmt: skip
    """Run ``cases``; returns a JSON-ready dict with environment, ceilings and one record per (case, provider).

    ``with_invariant`` adds the batch-invariant mode of the kernel on the same inputs ("tpa_invariant"); ``hints``:
    the calls pass each batch's ``decode_tail`` hint.
    """
    ceil = hbm_ceilings()
    # The eager call's host time, before and after the suite: the later figure has read higher on a shared host.
    overhead_before = host_overhead_us()
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    records = []
    for i, case in enumerate(cases):
        inp = build_inputs(case, seed + i, hints=hints)
        shape = {
            "B": len(case.kv_lens),
            "kv_tokens": sum(case.kv_lens),
            "q_tokens": sum(case.queries()),
            "q_len": max(case.queries()),
            "Hq": case.num_q_heads,
            "Hkv": case.num_kv_heads,
            "D": case.head_dim,
            "page_size": case.page_size,
        }
        base = {"case": case.name, "shape": shape, "dtype": str(case.dtype).replace("torch.", ""),
                "cache_dtype": str(case.cache_dtype or case.dtype).replace("torch.", "")}  # fmt: skip
        ours = []
        for provider, invariant in (("tpa", False), ("tpa_invariant", True))[: 2 if with_invariant else 1]:
            err = check_case(inp, batch_invariant=invariant)
            us = time_graph(functools.partial(inp.call, invariant))
            tbps = inp.kv_bytes / us / 1e6
            ours.append({**base, "provider": provider, "us": us, "kv_tbps": tbps, "tflops": inp.flops / us / 1e6,
                         "frac_of_hbm_read": tbps / ceil["read_tbps"], "rel_err": err})  # fmt: skip
        if with_sdpa and max(case.queries()) == 1 and inp.kv_bytes > 2 * l2_bytes:
            # Decode reads each KV byte once: beside the 2 GiB read, a read of exactly this case's bytes (where
            # they are well beyond the L2 cache, which repeated replays of a smaller read would hit instead).
            read_us = same_size_read_us(inp.kv_bytes)
            read_tbps = inp.kv_bytes / read_us / 1e6
            for r in ours:
                r["vs_same_size_read"] = read_us / r["us"]
            ours.append({**base, "provider": "read_same_bytes", "us": read_us, "kv_tbps": read_tbps, "tflops": 0.0,
                         "frac_of_hbm_read": read_tbps / ceil["read_tbps"]})  # fmt: skip
        del inp
        records += ours
        if with_sdpa:
            dense = _sdpa_records(case, seed + i, base, ceil)
            records += dense
            for r in ours:
                if r["provider"].startswith("tpa"):
                    # Speed relative to the fastest dense backend (> 1: faster than it).
                    r["vs_fastest_sdpa"] = dense[-1]["us"] / r["us"] if dense else None
        torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": _git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceil,
        "eager_host_overhead_us": overhead_before,
        "eager_host_overhead_after_suite_us": host_overhead_us(),
        "records": records,
    }


def _sdpa_records(case: Case, seed: int, base: dict, ceil: dict) -> list[dict]:
    """One record per SDPA backend that ran ("sdpa_flash", ...), then "sdpa_dense": the fastest of them."""
    kv_bytes = 2 * sum(case.kv_lens) // len(case.kv_lens) * len(case.kv_lens) * case.num_kv_heads
    kv_bytes *= case.head_dim * (torch.finfo(case.dtype).bits // 8)
    flops = 4.0 * case.visible_pairs() * case.num_q_heads * case.head_dim  # the same problem as the kernel's
    out = []
    for name, us in sdpa_dense_us(case, seed).items():
        tbps = kv_bytes / us / 1e6
        out.append({**base, "provider": f"sdpa_{name}", "us": us, "kv_tbps": tbps, "tflops": flops / us / 1e6,
                    "frac_of_hbm_read": tbps / ceil["read_tbps"]})  # fmt: skip
    if out:
        best = min(out, key=lambda r: r["us"])
        out.append({**best, "provider": "sdpa_dense", "backend": best["provider"].removeprefix("sdpa_")})
    return out


def format_records(result: dict) -> str:
    ceil = result["ceilings"]
    lines = [
        f"{result['gpu']}  torch {result['torch']}  triton {result['triton']}  "
        f"HBM read {ceil['read_tbps']:.2f} TB/s, copy {ceil['copy_tbps']:.2f} TB/s; "
        f"eager decode call {result['eager_host_overhead_us']:.1f} µs"
        + (f" ({after:.1f} after the suite)" if (after := result.get("eager_host_overhead_after_suite_us")) else ""),
        f"{'case':<20} {'provider':<13} {'µs':>9} {'KV TB/s':>8} {'TFLOP/s':>8} {'of HBM':>7} {'rel err':>9}",
    ]
    for r in result["records"]:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(f"{r['case']:<20} {r['provider']:<13} {r['us']:>9.1f} {r['kv_tbps']:>8.2f} "
                     f"{r['tflops']:>8.1f} {r['frac_of_hbm_read']:>7.2f} {err:>9}")  # fmt: skip
    return "\n".join(lines)


def parse_config(text: str | None) -> dict[str, object]:
    """``"BLOCK_N=64,ids_ahead=true,diag_loop=merged"`` -> ``{"BLOCK_N": 64, "ids_ahead": True, "diag_loop":
    "merged"}`` (integers, true/false, or names); raises ValueError naming a bad part."""
    out: dict[str, object] = {}
    for part in filter(None, (text or "").split(",")):
        key, sep, val = (s.strip() for s in part.partition("="))
        if not sep or not key or not val:
            raise ValueError(f"--config part {part!r} is not KEY=VALUE")
        if val.lstrip("-").isdigit():
            out[key] = int(val)
        elif val in ("true", "false"):
            out[key] = val == "true"
        else:
            out[key] = val
    return out


def plot_records(result: dict, path: str) -> None:
    """Two panels per case — KV read TB/s and TFLOP/s — tpa beside same-run dense SDPA, with the measured HBM read
    ceiling drawn on the bandwidth panel. Needs matplotlib (``pip install triton-paged-ops[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in result["records"]))
    # ("sdpa_dense" repeats the fastest SDPA backend's bars.)
    providers = list(dict.fromkeys(r["provider"] for r in result["records"] if r["provider"] != "sdpa_dense"))
    value = {(r["case"], r["provider"]): r for r in result["records"]}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cases) + 2), 8), sharex=True)
    width = 0.8 / max(1, len(providers))
    for ax, key, label in ((axes[0], "kv_tbps", "KV read TB/s"), (axes[1], "tflops", "TFLOP/s")):
        for j, prov in enumerate(providers):
            xs = [i + (j - (len(providers) - 1) / 2) * width for i in range(len(cases))]
            ys = [value[(c, prov)][key] if (c, prov) in value else 0.0 for c in cases]
            ax.bar(xs, ys, width, label=prov)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    read = result["ceilings"]["read_tbps"]
    axes[0].axhline(read, color="black", linestyle="--", linewidth=1, label=f"HBM read {read:.2f} TB/s (measured)")
    axes[0].set_ylim(0, read * 1.25)  # room for the legend above the bars
    axes[0].legend(loc="upper center", ncol=3, fontsize=8)
    axes[1].set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"{result['gpu']} — torch {result['torch']}, triton {result['triton']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select_cases(cases: list, only: list[str] | None) -> list:
    """The cases named by ``only`` (all without it), in suite order: a name containing one of its entries, or equal
    to one written after ``=``."""
    if not only:
        return cases
    exact = {s[1:] for s in only if s.startswith("=")}
    parts = [s for s in only if not s.startswith("=")]
    return [c for c in cases if c.name in exact or any(s in c.name for s in parts)]


def run_benchmark(
    out: str | None, png: str | None, only: list[str] | None, with_sdpa: bool, config: dict[str, int], seed: int,
    prog: str, argv: list[str] | None, with_invariant: bool = False, suite: str = "decode", hints: bool = True,
) -> int:  # fmt: skip
    """A suite (``SUITES``) as a command: table on stdout, JSON to ``out``, chart to ``png`` (each if given)."""
    import sys

    from triton_paged_ops.configs.heuristic import attention_config_override

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = select_cases(SUITES[suite](), only)
    if not cases:
        print(f"no case matches {only}; cases: {[c.name for c in SUITES[suite]()]}", file=sys.stderr)
        return 2
    with attention_config_override(**config):
        result = run_suite(cases, seed=seed, with_sdpa=with_sdpa, with_invariant=with_invariant, hints=hints)
    result["config"], result["suite"], result["decode_tail_hints"] = config, suite, hints
    finish(result, format_records(result), out, prog, argv)
    if png:
        try:
            plot_records(result, png)
            print(f"chart written to {png}")
        except ImportError:
            print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
    return 0


def add_bench_arguments(p, out_default: str | None, png_default: str | None, seed: bool = True) -> None:
    """The benchmark's command-line flags (shared by ``python -m triton_paged_ops bench`` and
    ``python -m benchmarks.decode`` / ``benchmarks.prefill``; ``seed``: add ``--seed``, which the package's command
    line has for every sub-command)."""
    p.add_argument("--suite", choices=sorted(SUITES), default="decode",
                   help="decode (one new token per sequence), short (4-16 new tokens per sequence on long "
                   "contexts: speculative verification) or prefill (causal prefill, chunked prefill on a prefix, a "
                   "mixed batch and its parts) (default decode)")  # fmt: skip
    p.add_argument("--out", default=out_default, help=f"JSON file to write (default: {out_default or 'none'})")
    p.add_argument("--png", default=png_default, help=f"bar chart to write (default: {png_default or 'none'})")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only the cases whose name contains one of these (e.g. B32x4k ragged), or is one "
                        "written after '=' (e.g. '=prefill 4x2k')")  # fmt: skip
    p.add_argument("--no-sdpa", action="store_true", help="skip the same-run dense SDPA comparison")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time batch-invariant mode on the same inputs (provider tpa_invariant)")  # fmt: skip
    if seed:
        p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-hints", action="store_true",
                   help="call without the decode_tail layout hint (by default each passes its batch's)")  # fmt: skip
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help="force launch options for every case, e.g. BLOCK_N=64,num_warps=4,num_stages=3,num_splits=8 "
                   "or decode_order=sequences / small_block_n=128 (keys: attention_config_override; default: "
                   "the tuned table or built-in choice)")  # fmt: skip


def bench_command(args, prog: str, argv: list[str] | None) -> int:
    """Run a benchmark suite from parsed ``add_bench_arguments`` flags."""
    import sys

    try:
        config = parse_config(args.config)
        table_keys = {k: v for k, v in config.items() if k != "num_splits"}
        problem = configs.validate_config(table_keys) if table_keys else None
        if problem:
            raise ValueError(f"--config: {problem}")
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return run_benchmark(args.out, args.png, args.only, not args.no_sdpa, config, args.seed or 0, prog, argv,
                         args.batch_invariant, args.suite, not args.no_hints)  # fmt: skip
