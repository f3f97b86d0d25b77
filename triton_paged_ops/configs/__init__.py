"""Launch-config tables: measured configs per (GPU, compute capability, triton version, dtype, head dim, regime).

A config fixes the attention kernel's tiles and launch options for one regime — ``decode`` (one query token per
sequence), ``decode_large`` (one token per sequence in a batch with at least one (sequence, KV head) pair per SM:
a grid that fills the GPU unsplit; a table without this entry uses its ``decode`` entry), ``short`` (2 to 16
tokens, e.g. speculative verification, whose packed rows, tokens times GQA group, exceed ``NARROW_ROWS``),
``short_narrow`` (2 to 16 tokens whose packed rows fit one decode-style tile of ``NARROW_ROWS``), ``prefill`` or
``prompts`` (prefill launches whose caller says the batch holds no one-token sequence: a ``decode_tail`` hint of 0;
a table without this entry uses its ``prefill`` entry) — and, for the first four, the split-KV policy. Lookup
order: the user file (``$TPA_CONFIG_FILE``, else ``~/.cache/triton_paged_ops/configs.json``, written by ``python -m
triton_paged_ops tune``), then the tables shipped in ``triton_paged_ops/configs/``; where neither has the installed
Triton's entry, this GPU's entry measured with another Triton 3.x (nearest first), then the same for the other
16-bit query dtype (bf16 entries serve fp16 and back, ``DTYPE_TWINS``; not for ``short`` launches); then the
built-in heuristic (``configs.heuristic.select_attention_config``), which covers any GPU, AMD included.

File format (JSON)::

    {"schema": 1,
     "tables": [{"gpu": "NVIDIA H200", "capability": "9.0", "triton": "3.6",
                 "entries": [{"dtype": "bfloat16", "head_dim": 128, "regime": "decode",
                              "config": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, ...}}]}]}

``head_dim`` is the padded head dim (the next power of two, at least 16); ``dtype`` is the query dtype, with
``+<cache dtype>`` appended when the caches have another (``"bfloat16+float8_e4m3fn"``). A file that cannot be
read or has another schema is skipped with a warning, as is any entry whose config is not valid; nothing here
raises on bad files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from pathlib import Path

import torch
import triton

SCHEMA = 1
REGIMES = ("decode", "decode_large", "short", "short_narrow", "prefill", "prompts")
# Packed query rows (tokens x GQA group) that one decode-style tile holds: launches up to this take the decode tile
# and, with more than one token per sequence, the ``short_narrow`` regime.
NARROW_ROWS = 16
# Regimes whose table entry, where missing, is another's.
FALLBACK = {"decode_large": "decode", "prompts": "prefill"}
# Tiles and the compiler's options: tile height and width, warps, pipeline stages, and a cap on registers per thread
# (``maxnreg``; NVIDIA only, unset: the compiler's choice), which with the shared memory decides how many CTAs an SM
# holds at once.
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg")
# Split policy of decode and short queries (plan.plan_splits): program slots per SM, segment bounds in keys, the
# shortest segment of a grid that leaves SMs idle, and the share (%) of the slots a grid must fill without splitting.
SPLIT_KEYS = ("programs_per_sm", "min_segment", "max_segment", "fill_segment", "fill_percent")
# Batch-invariant mode: keys per fixed KV segment (a multiple of the decode KV tile); leaves per segment (a power of
# two: each leaf its own online softmax, a segment the in-order fold of its leaves, a row the in-order fold of its
# segments; small batches run one program per leaf).
INVARIANT_KEYS = ("invariant_segment", "invariant_leaves")
# Named values of the keys that choose between forms (the kernel's constexprs of the same names take them as is).
CHOICES = {
    # Dispatch order of decode programs: sequences outermost with a sequence's segments adjacent; KV heads fastest,
    # then segments, then sequences; or KV heads fastest and segments slowest, each sequence's segments in the last
    # segment groups (long sequences' work first, last pieces last).
    "decode_order": ("sequences", "heads", "tails_last"),
    # Online softmax: the accumulator's multiply skipped in tiles where no row's max moved (a CTA-wide test and
    # branch), or done every tile.
    "acc_rescale": ("lazy", "always"),
    # Page ids of taller tiles over pages of 16+ keys that divide the tile: one load per key or one per page.
    "page_ids": ("per_key", "per_page"),
    # Causal taller tiles' diagonal tiles (those the causal mask cuts): in a masked loop of their own after the
    # unmasked one, or merged into the unmasked loop with a run-time mask.
    "diag_loop": ("separate", "merged"),
}
# Yes/no keys: a key whose page id lies outside the cache (a corrupt block table; debug mode reports it) is read
# from page 0 instead of dropped (the key mask then depends on the key index alone, and whole tiles below the
# sequence length run unguarded); taller tiles' unmasked gathers over pages of 16+ keys load a tile's page ids one
# tile ahead; sm_90 prefill launches that fit it run the warp-specialized Gluon kernel (``kernels.hopper``; its KV
# tile width and pipeline stages: ``ws_block_n``, ``ws_stages``; the entry's other keys still configure the unified
# kernel for the launches that fall back to it).
FLAG_KEYS = ("clamp_pages", "ids_ahead", "ws_prefill")
# The KV tile width of one-token rows in a launch of taller tiles (a mixed batch) that splits no sequence (default:
# the decode tile's width, at most the launch's own BLOCK_N); the warp-specialized kernel's KV tile width and stages.
WIDTH_KEYS = ("small_block_n", "ws_block_n", "ws_stages")
CONFIG_KEYS = TILE_KEYS + SPLIT_KEYS + INVARIANT_KEYS + tuple(CHOICES) + FLAG_KEYS + WIDTH_KEYS
# Queries up to this long per sequence (decode, speculative verification) are the short-query regime; longer ones
# split only when their query blocks cannot fill the GPU once (e.g. a small chunk or a cascade's queries over a long
# prefix).
MAX_SPLIT_Q_LEN = 16
SHIPPED_DIR = Path(__file__).parent


def user_config_path() -> Path:
    """Where ``tune`` writes and lookups read the user's configs: ``$TPA_CONFIG_FILE`` or the user cache dir."""
    env = os.environ.get("TPA_CONFIG_FILE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "triton_paged_ops" / "configs.json"


def triton_version() -> str:
    return ".".join(triton.__version__.split(".")[:2])


def dtype_name(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> str:
    """The table's dtype key: the query dtype, plus ``+<cache dtype>`` when the caches differ (e.g. fp8)."""
    name = str(dtype).removeprefix("torch.")
    if cache_dtype is not None and cache_dtype != dtype:
        name += "+" + str(cache_dtype).removeprefix("torch.")
    return name


@functools.lru_cache(maxsize=16)
def device_identity(device_index: int | None) -> tuple[str, str]:
    """(GPU name, compute capability) of a CUDA/ROCm device; ``("interpreter", "0.0")`` for ``None`` (CPU runs)."""
    if device_index is None:
        return "interpreter", "0.0"
    major, minor = torch.cuda.get_device_capability(device_index)
    return torch.cuda.get_device_name(device_index), f"{major}.{minor}"


def padded_head_dim(head_dim: int) -> int:
    """Head dim as the kernels tile it (next power of two, at least 16): also the tables' ``head_dim`` key."""
    return max(16, triton.next_power_of_2(head_dim))


def regime_of(
    max_seqlen_q: int, short_limit: int, pairs: int = 0, num_sms: int = 0, no_decodes: bool = False, group: int = 1
) -> str:
    """The regime of a launch with query bound ``max_seqlen_q`` and ``pairs`` (sequence, KV head) pairs on a GPU of
    ``num_sms`` SMs (0: unknown, never ``decode_large``); ``no_decodes``: the caller says the batch holds no
    one-token sequence (a ``decode_tail`` hint of 0), which makes a prefill launch ``prompts``; ``group``: query
    heads per KV head (a short launch whose ``max_seqlen_q * group`` rows fit ``NARROW_ROWS`` is ``short_narrow``)."""
    if max_seqlen_q <= 1:
        return "decode_large" if 0 < num_sms <= pairs else "decode"
    if max_seqlen_q <= short_limit:
        return "short_narrow" if max_seqlen_q * group <= NARROW_ROWS else "short"
    return "prompts" if no_decodes else "prefill"


def validate_config(cfg: object) -> str | None:
    """Why ``cfg`` is not a usable config, or None if it is."""
    if not isinstance(cfg, dict) or not cfg:
        return "config must be a non-empty object"
    for key, val in cfg.items():
        if key not in CONFIG_KEYS:
            return f"unknown key {key!r}"
        if key in CHOICES:
            if val not in CHOICES[key]:
                return f"{key} must be one of {', '.join(map(repr, CHOICES[key]))}, got {val!r}"
        elif key in FLAG_KEYS:
            if not isinstance(val, bool):
                return f"{key} must be true or false, got {val!r}"
        elif not isinstance(val, int) or isinstance(val, bool) or val < 1:
            return f"{key} must be a positive integer, got {val!r}"
    for key in ("BLOCK_M", "BLOCK_N", "small_block_n", "ws_block_n"):
        if key in cfg and (cfg[key] < 16 or cfg[key] & (cfg[key] - 1)):
            return f"{key} must be a power of two >= 16, got {cfg[key]}"
    if cfg.get("num_warps", 4) not in (1, 2, 4, 8, 16):
        return f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']}"
    if not 24 <= cfg.get("maxnreg", 255) <= 255:
        return f"maxnreg must be 24 to 255 registers, got {cfg['maxnreg']}"
    for key in ("num_stages", "ws_stages"):
        if cfg.get(key, 2) > 8:
            return f"{key} must be <= 8, got {cfg[key]}"
    if cfg.get("fill_percent", 100) > 100:
        return f"fill_percent must be <= 100, got {cfg['fill_percent']}"
    if cfg.get("min_segment", 1) > cfg.get("max_segment", 1 << 30):
        return "min_segment must not exceed max_segment"
    if cfg.get("invariant_leaves", 1) & (cfg.get("invariant_leaves", 1) - 1):
        return f"invariant_leaves must be a power of two, got {cfg['invariant_leaves']}"
    return None


def entry_key(gpu: str, capability: str, triton_ver: str, dtype: str, head_dim: int, regime: str) -> tuple:
    return (gpu, capability, triton_ver, dtype, int(head_dim), regime)


def parse_tables(data: object, source: str) -> dict[tuple, dict]:
    """Entries of a parsed config file by ``entry_key``; invalid parts are skipped with a warning."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("tables"), list):
        warnings.warn(f"{source}: not a schema-{SCHEMA} tpa config file; ignored", RuntimeWarning, stacklevel=3)
        return {}
    out: dict[tuple, dict] = {}
    for table in data["tables"]:
        try:
            head = (str(table["gpu"]), str(table["capability"]), str(table["triton"]))
            entries = list(table["entries"])
        except (KeyError, TypeError):
            warnings.warn(f"{source}: a table lacks gpu/capability/triton/entries; skipped", RuntimeWarning, 3)
            continue
        for e in entries:
            try:
                key = entry_key(*head, str(e["dtype"]), int(e["head_dim"]), str(e["regime"]))
                cfg = e["config"]
            except (KeyError, TypeError, ValueError):
                warnings.warn(f"{source}: malformed entry {e!r}; skipped", RuntimeWarning, stacklevel=3)
                continue
            why = validate_config(cfg) or (None if key[5] in REGIMES else f"unknown regime {key[5]!r}")
            if why:
                warnings.warn(f"{source}: entry {key[3:]} for {head[0]}: {why}; skipped", RuntimeWarning, 3)
                continue
            out[key] = dict(cfg)
    return out


def read_file(path: Path) -> dict[tuple, dict]:
    """Entries of one file; a missing file is empty, an unreadable or corrupt one is empty with a warning."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"{path}: cannot be read ({exc}); using the shipped tables", RuntimeWarning, stacklevel=2)
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        warnings.warn(f"{path}: corrupt JSON ({exc}); using the shipped tables", RuntimeWarning, stacklevel=2)
        return {}
    return parse_tables(data, str(path))


_ignore_user_file = False


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[tuple, dict], dict[tuple, dict]]:
    shipped: dict[tuple, dict] = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        shipped.update(read_file(path))
    return {} if _ignore_user_file else read_file(user_config_path()), shipped


_reload_hooks: list = []


def on_reload(hook) -> None:
    """Call ``hook()`` whenever the tables are reloaded (for caches of decisions derived from them)."""
    _reload_hooks.append(hook)


def reload() -> None:
    """Forget the loaded tables (after the user file or ``$TPA_CONFIG_FILE`` changed)."""
    _tables.cache_clear()
    lookup.cache_clear()
    changed()


def changed() -> None:
    """Tell the caches of decisions derived from configs (``on_reload`` hooks) that they may be stale: the tables
    were reloaded, or an override entered or left."""
    for hook in _reload_hooks:
        hook()


_exact_only = False


@contextlib.contextmanager
def _lookup_mode(flag: str):
    """The module flag ``flag`` set for the block, the tables and lookups reloaded on entry and on exit."""
    globals()[flag] = True
    reload()
    try:
        yield
    finally:
        globals()[flag] = False
        reload()


def exact_entries_only() -> contextlib.AbstractContextManager:
    """Lookups in this block take only entries for the installed Triton and the launch's own dtype (no stand-ins
    from another Triton or the 16-bit twin dtype): to measure what the stand-ins give."""
    return _lookup_mode("_exact_only")


def without_user_file() -> contextlib.AbstractContextManager:
    """Lookups in this block see only the shipped tables and the heuristic (``tune``'s baseline)."""
    return _lookup_mode("_ignore_user_file")


# 16-bit query dtypes that stand in for each other where a table has entries for one only: the same element size,
# tensor-core rate and tiles (an fp8 cache under an fp16 query is read as under a bf16 one, through fp16). H200,
# fp16 on the bf16 entries against the heuristic: prefill -21..-35% (D64 +1%), decode equal or better (D64 -21%);
# the short entry's 64-row tiles lose 5-10% to the heuristic's 16-row ones on 4-token queries (bf16 too), so the
# ``short`` regime took no stand-in. Those 4-token launches are ``short_narrow`` now (the decode-style
# tile), which does: on the bf16 entries within 1%, D64 10% faster; ``short`` (8-16 tokens at GQA 4)
# with the stand-in is not measured, so it stays without.
DTYPE_TWINS = {"float16": "bfloat16", "bfloat16": "float16"}
TWIN_REGIMES = ("decode", "decode_large", "short_narrow", "prefill", "prompts")


def _twin(dtype: str) -> str | None:
    """The table dtype key with the query dtype's twin (``DTYPE_TWINS``), the cache part kept; None without one."""
    query, plus, cache = dtype.partition("+")
    twin = DTYPE_TWINS.get(query)
    return None if twin is None else twin + plus + cache


def _major_minor(ver: str) -> tuple[int, int] | None:
    parts = ver.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _version_order(installed: str, available: set[str]) -> list[str]:
    """Triton versions whose tables may serve: the installed one, then the others of its major version, nearest
    minor first (the older of two equally near). Another major version's code generation is another compiler's;
    versions that do not read as major.minor serve only themselves."""
    mine = _major_minor(installed)
    others = []
    for ver in available - {installed}:
        theirs = _major_minor(ver)
        if mine is not None and theirs is not None and theirs[0] == mine[0]:
            others.append((abs(theirs[1] - mine[1]), theirs[1], ver))
    return [installed] + [ver for *_, ver in sorted(others)]


@functools.lru_cache(maxsize=256)
def lookup(device_index: int | None, dtype: str, head_dim_pad: int, regime: str) -> dict | None:
    """The tuned config for this device and problem class (``dtype`` as ``dtype_name`` gives it), else None. In
    order: the user's entry, the shipped one; where neither exists for the installed Triton, this GPU's entries
    measured with another Triton of the same major version (nearest first: the tiles are the GPU's more than the
    compiler's); then the same for the 16-bit twin dtype (``DTYPE_TWINS``: bf16 entries serve fp16 and back; not
    for ``short``, see ``TWIN_REGIMES``). At each step a regime without an entry takes its ``FALLBACK`` regime's
    (``decode_large`` the ``decode`` one, ``prompts`` the ``prefill`` one), so an entry tuned for this dtype and
    Triton beats any stand-in."""
    gpu, cap = device_identity(device_index)
    user, shipped = _tables()
    # (Exact entries only: no other version's table, no twin dtype.)
    versions = set() if _exact_only else {key[2] for key in (*user, *shipped) if key[:2] == (gpu, cap)}
    regimes = (regime, FALLBACK[regime]) if regime in FALLBACK else (regime,)
    twin = None if _exact_only or regime not in TWIN_REGIMES else _twin(dtype)
    for name in (dtype, twin):
        for ver in _version_order(triton_version(), versions) if name is not None else ():
            for reg in regimes:
                key = entry_key(gpu, cap, ver, name, head_dim_pad, reg)
                cfg = user.get(key) or shipped.get(key)
                if cfg:
                    return dict(cfg)
    return None


def write_entry(path: Path, gpu: str, capability: str, dtype: str, head_dim: int, regime: str, config: dict,
                extra: dict | None = None) -> None:  # fmt: skip
    """Add or replace one entry in a config file (created if needed; a corrupt file is replaced), atomically."""
    data: dict = {"schema": SCHEMA, "tables": []}
    if path.exists():
        try:
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict) and loaded.get("schema") == SCHEMA and isinstance(loaded.get("tables"), list):
                data = loaded
        except (OSError, ValueError):
            pass
    head = {"gpu": gpu, "capability": capability, "triton": triton_version()}
    table = next((t for t in data["tables"] if isinstance(t, dict) and all(t.get(k) == v for k, v in head.items())),
                 None)  # fmt: skip
    if table is None:
        table = {**head, "entries": []}
        data["tables"].append(table)
    same = (dtype, head_dim, regime)
    table["entries"] = [
        e for e in table.get("entries", [])
        if not (isinstance(e, dict) and (e.get("dtype"), e.get("head_dim"), e.get("regime")) == same)
    ]  # fmt: skip
    table["entries"].append({"dtype": dtype, "head_dim": head_dim, "regime": regime, "config": config, **(extra or {})})
    table["entries"].sort(key=lambda e: (str(e.get("dtype")), int(e.get("head_dim", 0)), str(e.get("regime"))))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def device_is_amd(device_index: int) -> bool:
    """Whether GPU ``device_index`` is an AMD one (a ROCm build of PyTorch)."""
    return torch.version.hip is not None


@functools.lru_cache(maxsize=16)
def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may use on CUDA device ``device_index`` (the driver's opt-in limit; 0 if
    this Triton cannot tell, so that nothing is planned on a guess)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except (AttributeError, KeyError, TypeError, RuntimeError):
        return 0


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    """Streaming multiprocessors (or compute units) of ``device``; a nominal 132 elsewhere (interpreter runs)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


def num_sms_at(device_index: int | None) -> int:
    """``num_sms_of`` the CUDA device ``device_index``; None: the nominal count (CPU tensors, interpreter runs)."""
    return num_sms_of(torch.device("cuda", device_index) if device_index is not None else torch.device("cpu"))
