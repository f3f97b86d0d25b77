"""The built-in launch-config heuristic (any GPU, AMD included), the table lookup in front of it, and the override.

``select_attention_config`` is the single place that chooses an attention launch's tiles and options; each default
below carries the measurement that chose it (H200 unless said otherwise; the decision log is
``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton

from triton_paged_ops import configs

_config_override: dict[str, object] = {}


@contextlib.contextmanager
def attention_config_override(**cfg: object) -> Iterator[None]:
    """Force launch options in a block: any of ``configs.CONFIG_KEYS`` (each documented there: tiles, split policy,
    batch-invariant segments, dispatch order, page-id handling, the warp-specialized prefill kernel), or a fixed
    split count (``num_splits``).

    For tuning and for tests that must reach tile boundaries with small shapes; unset keys keep their default.
    """
    global _config_override
    unknown = set(cfg) - {*configs.CONFIG_KEYS, "num_splits"}
    if unknown:
        raise ValueError(f"unknown attention config keys: {sorted(unknown)}")
    # The table entries' rules (positive integers, power-of-two tiles, ...): a zero segment would divide by zero.
    table_keys = {k: v for k, v in cfg.items() if k != "num_splits"}
    problem = configs.validate_config(table_keys) if table_keys else None
    splits = cfg.get("num_splits", 1)
    if problem is None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        problem = f"num_splits must be a positive integer, got {splits!r}"
    if problem is not None:
        raise ValueError(f"attention config override: {problem}")
    previous, _config_override = _config_override, dict(sorted(cfg.items()))
    configs.changed()
    try:
        yield
    finally:
        _config_override = previous
        configs.changed()


def select_attention_config(
    head_dim_pad: int,
    group: int,
    dtype: torch.dtype,
    max_seqlen_q: int,
    interpret: bool,
    device_index: int | None = None,
    cache_dtype: torch.dtype | None = None,
    pairs: int = 0,
    regime: str | None = None,
    no_decodes: bool = False,
) -> dict[str, int]:
    """Tile sizes, launch options and split policy for one call: the single place that chooses them.

    A tuned table entry for this GPU (``configs.lookup``) wins over the built-in heuristic, and an active
    ``attention_config_override`` over both. Keys only on values fixed per model (head dim, GQA group, dtype) plus
    the regime: from the host-side bound ``max_seqlen_q`` (with the group: whether a short launch's packed rows
    fit one decode-style tile, ``short_narrow``) and, for one-token queries, whether the launch's
    ``pairs`` (sequences x KV heads, a shape) reach one per SM (``decode_large``; a table without that entry gives
    its ``decode`` one) and ``no_decodes`` (the caller says the batch holds no one-token sequence: a prefill launch
    is then ``prompts``). ``regime`` forces one. So a serving loop compiles a bounded set of variants.
    """
    group_pad = triton.next_power_of_2(group)
    if interpret:
        # The interpreter pays per operation, not per element: few large tiles are fastest.
        cfg = {"BLOCK_M": max(128, group_pad), "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}
    else:
        if max_seqlen_q * group <= configs.NARROW_ROWS:
            # Decode (and short queries with as few packed rows): one tile of packed rows. Memory-bound, so wide KV
            # tiles keep more bytes in flight.
            block_m, block_n = max(16, group_pad), 64 if head_dim_pad > 128 else 128
        elif max_seqlen_q <= configs.MAX_SPLIT_Q_LEN:
            block_m, block_n = max(64, group_pad), 64  # short queries (speculative verification)
        else:
            block_m, block_n = max(64 if head_dim_pad > 128 else 128, group_pad), 32 if head_dim_pad > 128 else 64
        num_warps = 4 if block_m <= 64 else 8
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 2}
    if regime is None:
        num_sms = 0
        if max_seqlen_q <= 1 and pairs > 0:
            num_sms = configs.num_sms_at(None if interpret else device_index)
        regime = configs.regime_of(max_seqlen_q, configs.MAX_SPLIT_Q_LEN, pairs, num_sms, no_decodes, group)
    table_device, name = None if interpret else device_index, configs.dtype_name(dtype, cache_dtype)
    tuned = configs.lookup(table_device, name, head_dim_pad, regime)
    if tuned:
        cfg.update(tuned)
        # A table's tile height is per regime; a wider GQA group still needs its heads in one tile.
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], group_pad)
    elif not interpret and device_index is not None:
        limit = configs.max_shared_memory(device_index)
        cfg = _fit_shared_memory(cfg, head_dim_pad, dtype.itemsize, max(16, group_pad), limit,
                                 configs.device_is_amd(device_index))  # fmt: skip
    # Decode programs with KV heads fastest read a page's heads at about the same time: +2% on the large bf16
    # decode cases (H200), within noise on the small ones, -1-2% with fp8 caches. "tails_last" adds the
    # longest-work-first segment order: +2.7% on a ragged batch, the same elsewhere.
    byte_cache = cache_dtype is not None and cache_dtype.itemsize == 1
    cfg.setdefault("decode_order", "sequences" if byte_cache and max_seqlen_q > 1 else "tails_last")
    if byte_cache and max_seqlen_q <= 1:
        # fp8 decode: a program of one 2048-key segment costs relatively more to start (two programs per SM), so
        # segments are bounded in bytes, as 16-bit caches' are (4096 one-byte keys), and a grid within 10% of the
        # program slots is not doubled to fill the rest (B32 x 8 KV heads: 256 programs of 264; H200: the decode
        # suite's fp8 copies 2.1% faster in total).
        cfg.setdefault("max_segment", 4096)
        cfg.setdefault("fill_percent", 90)
    # Keys whose page id is outside the cache: dropped (False) or read from page 0 (True; a cheaper key mask, and
    # whole tiles below the sequence length unguarded). H200: page 0 made fp8-cache decode 16% faster, short
    # queries 18-23% and bf16 prefill 6-24%, but 16-bit decode lost on the ragged batch (-4%) and D64 (-25%).
    bf16_decode = max_seqlen_q <= 1 and (cache_dtype is None or cache_dtype.itemsize > 1)
    cfg.setdefault("clamp_pages", not bf16_decode)
    # Online softmax: the accumulator's multiply skipped where no row's running max moved ("lazy": a CTA-wide test
    # and a branch per tile) or done every tile ("always"). H200: lazy wins on D128/D256 prefill and decode,
    # always on D64 prefill (+6%).
    cfg.setdefault("acc_rescale", "lazy")
    # Taller tiles over pages of 16+ keys that divide the tile: one page-id load per key or per page. H200, page 16:
    # per page is 2-10% faster at D128/D256 and 4% slower at D64 (its loop grows).
    cfg.setdefault("page_ids", "per_page" if head_dim_pad >= 128 else "per_key")
    # Taller tiles' unmasked gathers over pages of 16+ keys: a tile's page ids loaded in its own iteration (False),
    # or a tile ahead (True: the pipeliner then gives the ids' loads no stage of their own, so K/V copies run two
    # tiles ahead instead of one). H200 (its table sets it at D64/D128): prompts and the mixed batch -2..-7%. Off
    # in the heuristic: other GPUs' shared memory and pipelines were not measured.
    cfg.setdefault("ids_ahead", False)
    # Causal taller tiles' diagonal tiles in a masked loop of their own ("separate"), or in the unmasked loop
    # ("merged"), masked from the first tile that reaches the block's first row's diagonal: one pipeline fill per
    # block instead of two, a branch per tile. H200: D64 prompts -4.4%, D128 +3-8%: only the D64 prompts entry
    # takes it.
    cfg.setdefault("diag_loop", "separate")
    # Prefill on sm_90 through the warp-specialized kernel (``kernels.hopper``; True), or the unified one. H200
    # (its table), bf16: 128-key tiles in two stages beat 64-key tiles in three (D128 1x8k 1059 vs 1156 µs); D256
    # takes 64-key tiles (128 would not fit). H100 (this heuristic otherwise): 1.5-1.9x faster than the unified
    # kernel on every prefill case it serves (1x8k 1653 -> 1031 µs, a 1k chunk on a 3k prefix 730 -> 478, D256
    # 1009 -> 544, the mixed batch 1038 -> 652; its overlapped consumers took 3-6% more off: NOTES v51). The launch
    # plan still checks the device, dtype and shape.
    hopper_gpu = (not interpret and device_index is not None and not configs.device_is_amd(device_index)
                  and configs.device_identity(device_index)[1] == "9.0")  # fmt: skip
    cfg.setdefault("ws_prefill", hopper_gpu)
    cfg.setdefault("ws_block_n", 128 if head_dim_pad <= 128 else 64)
    cfg.setdefault("ws_stages", 2)
    if not interpret and max_seqlen_q > 1 and group > 32 and 1 < cfg["BLOCK_M"] // group < 8:
        # Tiles of 2-7 tokens of a group over 32 heads (48/1, 64/1 and 128/1 MQA prefill on the 128- and 256-row
        # tiles) took 256-512 KiB of shared memory on sm_90, more than any GPU has (tests/compile_matrix.py): such
        # groups take tiles of one token. (Not timed; such groups are rare.)
        cfg["BLOCK_M"] = group_pad
    if _config_override:
        cfg.update(_config_override)
    if cfg["BLOCK_M"] < group or cfg["BLOCK_M"] < 16 or cfg["BLOCK_N"] < 16:
        raise ValueError(f"attention config {cfg} needs BLOCK_M >= max(16, GQA group={group}) and BLOCK_N >= 16")
    return cfg


def _fit_shared_memory(cfg: dict, head_dim_pad: int, itemsize: int, min_rows: int, limit: int, amd: bool) -> dict:
    """The heuristic's tiles, halved until their buffers fit ``limit`` bytes of shared memory (LDS on AMD; 0: not
    known, nothing changes). The estimate is the q tile plus one K and one V tile; compiled with Triton 3.6/3.7 the
    kernels need up to 9% more on NVIDIA GPUs with 16-bit inputs and up to 50% more with fp32 ones (layout
    conversions), and no more on AMD (``tests/compile_targets.py`` checks every heuristic variant on an MI300, a
    99 KB sm_89 GPU and an A100). KV tiles shrink first (to 32 keys), then rows (to ``min_rows``, a GQA group's),
    then KV tiles to 16. Unfitted, the heuristic needed more than GPUs of 99 KB have (sm_86/89: D256 short
    queries, fp32 from D128) or 64 KB (MI300: D256 short queries, most fp32 tiles)."""
    slack = (1, 1) if amd else (3, 2) if itemsize >= 4 else (9, 8)

    def fits(c: dict) -> bool:
        return (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * head_dim_pad * itemsize * slack[0] <= limit * slack[1]

    while limit > 0 and not fits(cfg):
        if cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        elif cfg["BLOCK_M"] > min_rows:
            cfg["BLOCK_M"] //= 2
            cfg["num_warps"] = min(cfg["num_warps"], 4 if cfg["BLOCK_M"] <= 64 else 8)
        elif cfg["BLOCK_N"] > 16:
            cfg["BLOCK_N"] //= 2
        else:
            break  # the smallest tiles: Triton reports what still does not fit
    return cfg


def override_key() -> tuple:
    """The active override as a hashable key (part of every cached launch plan's key)."""
    return tuple(_config_override.items())
