"""``python -m triton_paged_ops tune``: measure launch configs on this GPU and write the winners to the user file.

For each (dtype, head dim, regime) group, every candidate config runs over a small grid of representative shapes;
the candidate with the least total time wins (ties go to the earlier candidate, so the result is a function of the
measurements alone). The best few that pass the reference check are timed again, interleaved with the config the
package would use without the user file (shipped table or heuristic: the baseline); the fastest of those — the
baseline itself if nothing beats it — is written at once to the user config file — so an
interrupted run resumes where it stopped (groups already in the file with the same candidate list are skipped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from triton_paged_ops import configs
from triton_paged_ops.bench import Case, build_inputs, check_case
from triton_paged_ops.configs import MAX_SPLIT_Q_LEN, num_sms_of
from triton_paged_ops.configs.heuristic import attention_config_override, select_attention_config
from triton_paged_ops.kernels import hopper

# (fn, config) -> µs. The real timer ignores the config; tests pass fake ones that cost configs by rule.
Timer = Callable[[Callable[[], object], dict], float]

# Best candidates of the sweep timed again beside the baseline, and how many interleaved rounds that takes.
FINALISTS = 3
FINAL_ROUNDS = 2
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@dataclasses.dataclass(frozen=True)
class Group:
    dtype: torch.dtype
    head_dim: int
    regime: str
    cache_dtype: torch.dtype | None = None

    def key(self) -> str:
        return configs.dtype_name(self.dtype, self.cache_dtype)

    def label(self) -> str:
        return f"{self.key()} D{self.head_dim} {self.regime}"


def candidates(regime: str, interpret: bool, quick: bool, cache_dtype: torch.dtype | None = None,
               warp_specialized: bool = False) -> list[dict]:  # fmt: skip
    """Configs to try, in a fixed order (the tie-break order). ``warp_specialized``: the device can run the
    warp-specialized prefill kernel (``kernels.hopper``), whose forms then join the prefill and prompts grids
    (and the unified kernel's forms say ``ws_prefill`` false, so a table entry that takes the other kernel does not
    turn them into it)."""
    cands = _unified_candidates(regime, interpret, quick, cache_dtype)
    if warp_specialized and not interpret and regime in ("prefill", "prompts"):
        space = {"ws_block_n": (128,), "ws_stages": (2,)}
        if not quick:
            space = {"ws_block_n": (64, 128), "ws_stages": (2, 3)}
        cands = [{**c, "ws_prefill": False} for c in cands] + [{"ws_prefill": True, **c} for c in _product(space)]
    return cands


def _unified_candidates(regime: str, interpret: bool, quick: bool, cache_dtype: torch.dtype | None) -> list[dict]:
    """The unified kernel's configs to try for ``regime`` (see ``candidates``)."""
    if interpret:
        # The interpreter's cost is per tile step: only tile shapes matter there.
        return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": 1} for m, n in ((128, 128), (64, 64))]
    if regime == "decode_large" and cache_dtype is not None and cache_dtype.itemsize == 1:
        # Batches that fill the GPU: the fp8 loop is latency-bound, so one- and two-warp programs (no CTA-wide
        # barriers, more programs per SM) compete with the 4-warp ones (H200: 1 warp x 64 keys won).
        space = {"BLOCK_N": (64, 128), "num_warps": (1, 4), "num_stages": (2, 3), "programs_per_sm": (2, 6)}
        if not quick:
            space = {"BLOCK_N": (32, 64, 128), "num_warps": (1, 2, 4), "num_stages": (2, 3),
                     "programs_per_sm": (2, 6, 12)}  # fmt: skip
    elif regime == "decode_large":
        space = {"BLOCK_N": (64, 128), "num_warps": (1, 4), "num_stages": (2, 3), "programs_per_sm": (2, 4)}
        if not quick:
            space = {"BLOCK_N": (32, 64, 128), "num_warps": (1, 2, 4, 8), "num_stages": (2, 3),
                     "programs_per_sm": (2, 4, 8)}  # fmt: skip
    elif regime == "decode" and cache_dtype is not None and cache_dtype.itemsize == 1:
        # fp8 tiles are half the bytes of bf16 ones: wider tiles and deeper pipelines fit in shared memory and
        # keep as many bytes in flight; two-warp programs wait at fewer CTA-wide barriers per tile (H200: 2 warps x
        # 64 keys won).
        space = {"BLOCK_N": (64, 128, 256), "num_warps": (2, 4), "num_stages": (2, 3), "programs_per_sm": (2, 4)}
        if not quick:
            space = {"BLOCK_N": (64, 128, 256), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4),
                     "programs_per_sm": (2, 4, 8)}  # fmt: skip
    elif regime == "decode":
        space = {"BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "programs_per_sm": (2, 4)}
        if not quick:
            space = {"BLOCK_N": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3),
                     "programs_per_sm": (2, 4, 8)}  # fmt: skip
    elif regime == "short_narrow":
        # The decode tile's shape with a few tokens' rows in it: KV tile width, pipeline and split policy as decode.
        space = {"BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "programs_per_sm": (2, 4)}
        if not quick:
            space = {"BLOCK_N": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (2, 3),
                     "programs_per_sm": (2, 4, 8)}  # fmt: skip
    elif regime == "short":
        space = {"BLOCK_M": (32, 64), "BLOCK_N": (32, 64), "num_warps": (4,), "num_stages": (2, 3)}
        if not quick:
            space = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
    elif regime == "prompts":
        # Launches without one-token rows: more warps per tile (H200 D128: 16 warps won) and two
        # 8-warp programs per SM under a register cap (H200 D64), which the prefill regime's mixed
        # batches cannot take. Each warp needs 16 of the tile's rows for the tensor cores. The capped forms also
        # try the diagonal tiles in the unmasked loop (H200 D64: -4.4%; D128's 16-warp tiles lost), both ways
        # explicitly: a candidate's unset keys come from the table entry it is measured over.
        space = {"BLOCK_M": (128, 256), "BLOCK_N": (32, 64), "num_warps": (8, 16), "num_stages": (2, 3)}
        capped = {"BLOCK_M": (128,), "BLOCK_N": (64,), "num_warps": (8,), "num_stages": (2, 3), "maxnreg": (128,),
                  "diag_loop": ("separate", "merged")}  # fmt: skip
        if not quick:
            space = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8, 16),
                     "num_stages": (2, 3, 4)}  # fmt: skip
            capped = {"BLOCK_M": (128,), "BLOCK_N": (32, 64, 128), "num_warps": (8,), "num_stages": (2, 3),
                      "maxnreg": (128,), "diag_loop": ("separate", "merged")}  # fmt: skip
        return [c for c in _product(space) + _product(capped) if c["BLOCK_M"] >= 16 * c["num_warps"]]
    else:
        space = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (32, 64), "num_warps": (4, 8), "num_stages": (2, 3)}
        if not quick:
            space = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8),
                     "num_stages": (1, 2, 3, 4)}  # fmt: skip
    return _product(space)


def accumulator_fits(cand: dict, head_dim_pad: int) -> bool:
    """Whether a candidate's fp32 output accumulator (``BLOCK_M`` rows x the padded head dim, over its threads)
    leaves registers for the rest of the loop: where it alone takes a thread's whole budget (65,536 registers per
    SM over the program's threads, at most 255, or ``maxnreg``) ptxas refuses the kernel (sm_90, D256 at 16 warps
    or 8 warps under a 128-register cap). Candidates without a query tile (decode) always fit."""
    if "BLOCK_M" not in cand:
        return True
    threads = 32 * cand.get("num_warps", 4)
    budget = min(255, cand.get("maxnreg", 255), 65536 // threads)
    return cand["BLOCK_M"] * head_dim_pad // threads < budget


def _product(space: dict[str, tuple]) -> list[dict]:
    """Every combination of ``space``'s values, the last key varying fastest."""
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def short_q_len(regime: str, gqa: int) -> int:
    """Query tokens of a short regime's tuning shapes for GQA group ``gqa``: ``short_narrow`` the most whose packed
    rows fit ``configs.NARROW_ROWS`` (4 at group 4), ``short`` the fewest (a power of two) whose rows do not."""
    narrow = max(1, configs.NARROW_ROWS // gqa)
    if regime == "short_narrow":
        if narrow < 2:
            raise ValueError(f"no short launch of GQA group {gqa} has its packed rows in one narrow tile")
        return min(narrow, MAX_SPLIT_Q_LEN)
    q_len = 2
    while q_len * gqa <= configs.NARROW_ROWS:
        q_len *= 2
    if q_len > MAX_SPLIT_Q_LEN:
        raise ValueError(f"every short launch of GQA group {gqa} is short_narrow: tune that regime")
    return q_len


def tuning_q_len(regime: str, gqa: int) -> int:
    """Query tokens per sequence of a regime's tuning shapes (and of its baseline's launch), GQA group ``gqa``."""
    if regime in ("short", "short_narrow"):
        return short_q_len(regime, gqa)
    return {"decode": 1, "decode_large": 1, "prefill": 256, "prompts": 256}[regime]


def shape_grid(regime: str, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
               dtype: torch.dtype, interpret: bool, quick: bool, cache_dtype: torch.dtype | None = None,
               num_sms: int = 132) -> list[Case]:  # fmt: skip
    """Representative problems of a regime (decode batches small and large, short and long contexts) on a GPU of
    ``num_sms`` SMs."""
    common = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "page_size": page_size, "dtype": dtype, "cache_dtype": cache_dtype}  # fmt: skip
    q_len = tuning_q_len(regime, num_q_heads // num_kv_heads)
    # Sequences of the smallest batch with one (sequence, KV head) pair per SM: decode_large starts there.
    full = -(-num_sms // num_kv_heads)
    if interpret:
        lens = [[40, 7], [65]] if regime not in ("prefill", "prompts") else [[160]]
        if regime == "decode_large":
            lens = [[40, 7] * -(-full // 2)]
        return [Case(f"{regime}{i}", kv, q_len=min(q_len, 24), **common) for i, kv in enumerate(lens)]
    if regime in ("prefill", "prompts"):
        # Whole causal prefills and chunks on a cached prefix: they favour different KV tiles and pipeline depths
        # (H200, D128: 64-key tiles, 3 stages for whole prompts; 32-key tiles for 256-token chunks). Prompts are
        # these batches called with their layout hint (no one-token rows), prefill the same without it. The quick
        # grid keeps a long prompt too: without it the H200's D128 quick winner (two capped programs an SM) lost
        # 2% on 1x8k to the entry it had beaten on the shorter shapes.
        shapes = [([2048] * 2, 2048), ([8192], 8192), ([4096], 256)] if quick else [([2048] * 4, 2048),
                                                                                    ([8192], 8192),
                                                                                    ([4096] * 2, 512)]  # fmt: skip
        return [Case(f"{regime}{i}", kv, q_len=q, **common) for i, (kv, q) in enumerate(shapes)]
    if regime == "decode_large":
        lens = [[8192] * max(64, 2 * full)] if quick else [[4096] * max(32, full), [8192] * max(64, 2 * full),
                                                           [2048] * max(256, 8 * full)]  # fmt: skip
    elif regime == "decode":
        # Batches below one pair per SM (larger ones are decode_large's).
        small = max(1, (full - 1) // 2)
        lens = [[8192] * min(4, small), [32768]] if quick else [[32768], [8192] * min(4, small), [4096] * small]
    else:
        lens = [[8192] * 4, [2048] * 64] if quick else [[32768], [4096] * 8, [4096] * 32, [8192] * 64, [2048] * 256]
    # One short entry serves every short launch, from just past a narrow tile's rows to MAX_SPLIT_Q_LEN tokens (H200
    # D256: a 32-row tile won by 29% on 8-token shapes alone): its shapes alternate between both ends.
    ends = (q_len, MAX_SPLIT_Q_LEN) if regime == "short" else (q_len,)
    return [Case(f"{regime}{i}", kv, q_len=ends[i % len(ends)], **common) for i, kv in enumerate(lens)]


def gpu_timer(fn: Callable[[], object], config: dict) -> float:
    from triton_paged_ops.bench import time_graph

    return time_graph(fn, inner=10, reps=15)


def wall_timer(fn: Callable[[], object], config: dict) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _fingerprint(cands: list[dict], cases: list[Case]) -> str:
    text = json.dumps([cands, [(c.kv_lens, c.q_len) for c in cases]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _done_groups(path: Path) -> dict[tuple, str]:
    """Fingerprints of the groups already tuned (for this GPU and triton) in the user file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    done = {}
    for table in data.get("tables", []) if isinstance(data, dict) else []:
        if not isinstance(table, dict):
            continue
        for e in table.get("entries", []):
            if isinstance(e, dict) and "fingerprint" in e:
                key = (table.get("gpu"), table.get("capability"), table.get("triton"), e.get("dtype"),
                       e.get("head_dim"), e.get("regime"))  # fmt: skip
                done[key] = e["fingerprint"]
    return done


class _Progress:
    def __init__(self, total: int, stream):
        self.total, self.done, self.start, self.stream = total, 0, time.perf_counter(), stream

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        width = 24
        bar = "#" * (width * self.done // self.total) + "." * (width - width * self.done // self.total)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} candidates  {label:<28} ETA {eta:5.0f} s")
        self.stream.flush()


def tune(
    dtypes: list[torch.dtype],
    head_dims: list[int],
    regimes: list[str],
    *,
    cache_dtype: torch.dtype | None = None,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    page_size: int = 16,
    device: str = "cuda",
    quick: bool = False,
    out: Path | None = None,
    fresh: bool = False,
    timer: Timer | None = None,
    stream=sys.stdout,
) -> list[dict]:
    """Tune every (dtype, head dim, regime) group; returns one record per group (also written to ``out``)."""
    interpret = device == "cpu"
    out = out or configs.user_config_path()
    timer = timer or (wall_timer if interpret else gpu_timer)
    gpu, cap = configs.device_identity(None if interpret else torch.device(device).index or 0)
    tv = configs.triton_version()
    done = {} if fresh else _done_groups(out)
    plan = []
    ws = not interpret and hopper.available(torch.device(device).index or 0)
    for dtype, head_dim, regime in itertools.product(dtypes, head_dims, regimes):
        group = Group(dtype, head_dim, regime, cache_dtype)
        dim = configs.padded_head_dim(head_dim)
        cands = [c for c in candidates(regime, interpret, quick, cache_dtype, ws) if accumulator_fits(c, dim)]
        cases = shape_grid(regime, head_dim, num_q_heads, num_kv_heads, page_size, dtype, interpret, quick,
                           cache_dtype, num_sms_of(torch.device("cpu" if interpret else device)))  # fmt: skip
        fp = _fingerprint(cands, cases)
        key = (gpu, cap, tv, group.key(), dim, regime)
        plan.append((group, cands, cases, fp, done.get(key) == fp))
    progress = _Progress(sum(len(c) for _, c, _, _, skip in plan if not skip) or 1, stream)
    records = []
    for group, cands, cases, fp, skip in plan:
        if skip:
            stream.write(f"{group.label()}: already tuned in {out}, skipped\n")
            records.append({"group": group.label(), "skipped": True})
            continue
        # Only prompts launches carry the batch's layout hint (0): with it the others' batches would be prompts too.
        hints = group.regime == "prompts"
        inputs = [build_inputs(c, seed=i, device=device, hints=hints) for i, c in enumerate(cases)]
        base = _table_entry(group, interpret, device)
        totals = []
        for cand in cands:
            totals.append(_measure(cand, inputs, timer))
            progress.step(group.label())
        order = sorted(range(len(cands)), key=lambda i: (totals[i], i))
        finalists = []
        for i in order:  # the fastest few that ran and match the reference
            if len(finalists) == FINALISTS or totals[i] == float("inf"):
                break
            if _valid(cands[i], inputs, group.dtype):
                finalists.append(i)
        stream.write("\n")
        if not finalists:
            stream.write(f"{group.label()}: no candidate ran correctly; nothing written\n")
            records.append({"group": group.label(), "winner": None})
            continue
        # Final round: the finalists and the baseline (what the package would run without the user file) timed
        # again, interleaved, so a winner is not an artefact of when in the sweep it ran (clocks, heat).
        final = dict.fromkeys(finalists, 0.0)
        baseline = 0.0
        for _ in range(FINAL_ROUNDS):
            with configs.without_user_file():
                baseline += _measure({}, inputs, timer) / FINAL_ROUNDS
            for i in finalists:
                final[i] += _measure(cands[i], inputs, timer) / FINAL_ROUNDS
        winner = min(finalists, key=lambda i: (final[i], i))
        # What the winner ran as: its keys over the table entry's (launch options a candidate does not set, e.g. the
        # H200 prefill entries' ``ids_ahead``); the entry written replaces that one, so it must carry them too.
        best, config = final[winner], {**base, **cands[winner]}
        if baseline < best:
            # Nothing measured beats the shipped table / heuristic: write that config itself, so the group counts
            # as tuned and lookups keep giving it.
            best, config = baseline, _baseline_config(group, num_q_heads // num_kv_heads, interpret, device)
        extra = {"fingerprint": fp, "measured_us": round(best, 3), "baseline_us": round(baseline, 3),
                 "shapes": [f"{len(c.kv_lens)}x{max(c.kv_lens)} q{c.q_len}" for c in cases]}  # fmt: skip
        configs.write_entry(out, gpu, cap, group.key(), configs.padded_head_dim(group.head_dim), group.regime,
                            config, extra)  # fmt: skip
        stream.write(f"{group.label()}: {config} ({best:.1f} µs over {len(cases)} shapes; shipped/heuristic "
                     f"config {baseline:.1f} µs, {baseline / best:.3f}x)\n")  # fmt: skip
        records.append({"group": group.label(), "winner": config, "total_us": best, "baseline_us": baseline})
    configs.reload()
    stream.write(f"configs written to {out}\n")
    return records


def _table_device(interpret: bool, device: str) -> int | None:
    """The device index table lookups take (None under the interpreter)."""
    return None if interpret else torch.device(device).index or 0


def _table_entry(group: Group, interpret: bool, device: str) -> dict:
    """The table entry (the user's, else the shipped one; {} if none) that a candidate's keys are laid over while
    it is measured, as ``select_attention_config`` finds it."""
    index = _table_device(interpret, device)
    return configs.lookup(index, group.key(), configs.padded_head_dim(group.head_dim), group.regime) or {}


def _baseline_config(group: Group, gqa: int, interpret: bool, device: str) -> dict:
    """The tiles, split policy and any other keys of the shipped table's entry that the shipped table or heuristic
    gives this group (not the launch options every config gets by default: a written entry pins only what it
    chose)."""
    index = _table_device(interpret, device)
    dim = configs.padded_head_dim(group.head_dim)
    with configs.without_user_file():
        cfg = select_attention_config(dim, gqa, group.dtype, tuning_q_len(group.regime, gqa), interpret, index,
                                      group.cache_dtype, regime=group.regime)  # fmt: skip
        shipped = configs.lookup(index, group.key(), dim, group.regime) or {}
    keep = {*configs.TILE_KEYS, *configs.SPLIT_KEYS, *shipped}
    return {k: v for k, v in cfg.items() if k in keep}


def _measure(cand: dict, inputs: list, timer: Timer) -> float:
    total = 0.0
    with attention_config_override(**cand):
        for inp in inputs:
            try:
                total += timer(inp.call, cand)
            except Exception as exc:  # a config that does not fit the device just loses
                if not _does_not_fit(exc):
                    raise
                return float("inf")
    return total


def _does_not_fit(exc: Exception) -> bool:
    """Whether a candidate's failure is the device's limits (shared memory, registers: Triton's ``OutOfResources``,
    or ptxas refusing a kernel whose live values exceed the registers), not a bug to report."""
    name, text = type(exc).__name__, str(exc)
    return ("OutOfResources" in name or "out of resource" in text
            or (name == "PTXASError" and "Insufficient registers" in text))  # fmt: skip


def _valid(cand: dict, inputs: list, dtype: torch.dtype) -> bool:
    with attention_config_override(**cand):
        return all(check_case(inp) <= TOLERANCE[dtype] for inp in inputs)
