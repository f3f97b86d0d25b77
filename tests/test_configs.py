"""Config tables: lookup order (user file, shipped tables, heuristic), bad files, and tune end to end (interpreter,
fake timers)."""

from __future__ import annotations

import io
import json
import types

import pytest
import torch

from triton_paged_ops import configs
from triton_paged_ops.__main__ import main
from triton_paged_ops.checks import decode_tail_of
from triton_paged_ops.configs.heuristic import attention_config_override, select_attention_config
from triton_paged_ops.plan import MAX_SPLIT_Q_LEN
from triton_paged_ops.tune import FINAL_ROUNDS, FINALISTS, accumulator_fits, candidates, shape_grid, short_q_len, tune

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"
DEVICE_INDEX = None if INTERPRET else torch.cuda.current_device()


def _identity() -> tuple[str, str]:
    return configs.device_identity(DEVICE_INDEX)


def _table(entries: list[dict], triton_ver: str | None = None) -> dict:
    """This GPU's table of ``entries`` for ``triton_ver`` (default: the installed Triton)."""
    gpu, cap = _identity()
    return {"gpu": gpu, "capability": cap, "triton": triton_ver or configs.triton_version(), "entries": entries}


def _file(entries: list[dict], triton_ver: str | None = None, schema: int = configs.SCHEMA) -> dict:
    return {"schema": schema, "tables": [_table(entries, triton_ver)]}


def _entry(block_n: int, regime: str = "decode", head_dim: int = 64, dtype: str = "float16", **extra) -> dict:
    return {"dtype": dtype, "head_dim": head_dim, "regime": regime,
            "config": {"BLOCK_N": block_n, "num_warps": 4, **extra}}  # fmt: skip


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Point the user file and the shipped-table directory at fresh temporary places."""
    user = tmp_path / "user" / "configs.json"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("TPA_CONFIG_FILE", str(user))
    monkeypatch.setattr(configs, "SHIPPED_DIR", shipped)
    configs.reload()
    yield user, shipped
    configs.reload()


def _block_n(regime_q: int = 1, head_dim: int = 64, group: int = 2) -> int:
    return select_attention_config(head_dim, group, torch.float16, regime_q, INTERPRET, DEVICE_INDEX)["BLOCK_N"]


def test_user_file_beats_shipped_table_beats_heuristic(tables):
    user, shipped = tables
    heuristic = _block_n()
    assert heuristic != 16
    (shipped / "gpu.json").write_text(json.dumps(_file([_entry(32)])))
    configs.reload()
    assert _block_n() == 32
    user.parent.mkdir()
    user.write_text(json.dumps(_file([_entry(16)])))
    configs.reload()
    assert _block_n() == 16
    # Other regimes and head dims are not covered by those entries: heuristic there.
    assert _block_n(regime_q=300) == select_attention_config(64, 2, torch.float16, 300, INTERPRET, None)["BLOCK_N"]
    assert _block_n(head_dim=128) != 16


def test_table_tile_height_grows_to_hold_a_wide_gqa_group(tables):
    user, _ = tables
    user.parent.mkdir()
    user.write_text(json.dumps(_file([_entry(32, BLOCK_M=16)])))
    configs.reload()
    cfg = select_attention_config(64, 32, torch.float16, 1, INTERPRET, DEVICE_INDEX)
    assert cfg["BLOCK_N"] == 32 and cfg["BLOCK_M"] >= 32


@pytest.mark.parametrize(
    "content,warning",
    [
        ("{not json", "corrupt JSON"),
        (json.dumps({"schema": 99, "tables": []}), "not a schema-1"),
        (json.dumps(_file([_entry(48)])), "BLOCK_N must be a power of two"),
        (json.dumps(_file([{"dtype": "float16", "regime": "decode"}])), "malformed entry"),
        (json.dumps(_file([_entry(32, regime="sometimes")])), "unknown regime"),
        (json.dumps(_file([_entry(32, num_warps=3)])), "num_warps"),
        (json.dumps(_file([_entry(32, maxnreg=300)])), "maxnreg must be 24 to 255"),
    ],
    ids=["corrupt", "schema", "bad-tile", "malformed", "regime", "warps", "registers"],
)
def test_bad_user_file_warns_and_falls_back(tables, content, warning):
    user, shipped = tables
    (shipped / "gpu.json").write_text(json.dumps(_file([_entry(32)])))
    user.parent.mkdir()
    user.write_text(content)
    configs.reload()
    with pytest.warns(RuntimeWarning, match=warning):
        assert _block_n() == 32  # the shipped entry, as if the user file were absent


def test_tables_of_another_triton_major_version_are_not_used(tables):
    user, _ = tables
    user.parent.mkdir()
    user.write_text(json.dumps(_file([_entry(16)], triton_ver="2.0")))
    configs.reload()
    assert _block_n() == select_attention_config(64, 2, torch.float16, 1, INTERPRET, None)["BLOCK_N"] != 16


def _write_tables(path, tables: list[tuple[str, list[dict]]]) -> None:
    """A config file of this GPU's tables: (Triton version, entries) each."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"schema": configs.SCHEMA, "tables": [_table(e, ver) for ver, e in tables]}))
    configs.reload()


def test_another_triton_minor_version_serves_where_the_installed_one_has_no_entry(tables, monkeypatch):
    """Without an entry for the installed Triton, the GPU's entry from the nearest other 3.x serves (the older of
    two equally near); an entry for the installed version wins, and so does the user's tuned one (any regime
    fallback included) over a shipped table of another version."""
    user, shipped = tables
    monkeypatch.setattr(configs, "triton_version", lambda: "3.8")
    _write_tables(shipped / "gpu.json", [("3.5", [_entry(16)]), ("3.6", [_entry(32)]), ("3.9", [_entry(64)]),
                                         ("3.10", [_entry(128, regime="prefill")])])  # fmt: skip
    assert _block_n() == 64  # 3.9 (one away) over 3.6 and 3.5
    _write_tables(shipped / "gpu.json", [("3.6", [_entry(32)]), ("3.10", [_entry(64)])])
    assert _block_n() == 32  # 3.6 and 3.10 are both two away: the older
    _write_tables(shipped / "gpu.json", [("3.6", [_entry(32)]), ("3.8", [_entry(16)])])
    assert _block_n() == 16
    # A user entry for the installed version, here a decode one serving decode_large, beats another version's.
    _write_tables(shipped / "gpu.json", [("3.6", [_entry(32, regime="decode_large")])])
    _write_tables(user, [("3.8", [_entry(16)])])
    assert configs.lookup(DEVICE_INDEX, "float16", 64, "decode_large")["BLOCK_N"] == 16
    # Versions that do not parse are skipped, never an error.
    assert configs._version_order("3.8", {"3.8", "x.y", "3", "4.1", "3.7"}) == ["3.8", "3.7"]
    assert configs._version_order("dev", {"3.7"}) == ["dev"]


@pytest.mark.parametrize("query,twin", [(torch.float16, "bfloat16"), (torch.bfloat16, "float16")])
def test_the_other_16_bit_dtype_entry_serves_where_a_dtype_has_none(tables, query, twin):
    """An fp16 launch takes the bf16 entry where the tables have no fp16 one (and back), fp8 caches included
    (``<query>+float8_e4m3fn``); its own entry wins; fp32 has no stand-in, nor do ``short`` launches."""
    user, _ = tables
    name = configs.dtype_name(query)
    fp8 = torch.float8_e4m3fn
    ver = configs.triton_version()

    def block_n(dtype, cache=None):
        return select_attention_config(64, 2, dtype, 1, INTERPRET, DEVICE_INDEX, cache)["BLOCK_N"]

    _write_tables(user, [(ver, [_entry(32, dtype=twin), _entry(16, dtype=twin + "+float8_e4m3fn")])])
    assert block_n(query) == 32 and block_n(query, fp8) == 16
    _write_tables(user, [(ver, [_entry(32, dtype=twin), _entry(64, dtype=name)])])
    assert block_n(query) == 64
    _write_tables(user, [(ver, [_entry(32, dtype=twin)])])
    assert block_n(torch.float32) == select_attention_config(64, 2, torch.float32, 1, INTERPRET, None)["BLOCK_N"]
    # Short queries take no stand-in (its entries' tiles lost to the heuristic's on the other dtype); narrow ones,
    # on the decode tile, do.
    _write_tables(
        user, [(ver, [_entry(32, regime="short", dtype=twin), _entry(64, regime="short_narrow", dtype=twin)])]
    )
    assert configs.lookup(DEVICE_INDEX, twin, 64, "short")["BLOCK_N"] == 32
    assert configs.lookup(DEVICE_INDEX, name, 64, "short") is None
    assert configs.lookup(DEVICE_INDEX, name, 64, "short_narrow")["BLOCK_N"] == 64


def test_unreadable_user_path_does_not_crash(tables, monkeypatch, tmp_path):
    monkeypatch.setenv("TPA_CONFIG_FILE", str(tmp_path))  # a directory, not a file
    configs.reload()
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert _block_n() == select_attention_config(64, 2, torch.float16, 1, INTERPRET, None)["BLOCK_N"]


def _cost(cfg: dict) -> float:
    """A fake timer's rule: cost grows with the KV tile, then with the query tile; the baseline (no forced config,
    ``{}``) costs a fixed 5000."""
    return cfg["BLOCK_N"] * 10 + cfg.get("BLOCK_M", 0) if cfg else 5000.0


class CountingTimer:
    """Runs each candidate for real (so it must compile and run) but reports the fake cost; can stop mid-way."""

    def __init__(self, stop_after: int | None = None):
        self.calls, self.stop_after = 0, stop_after

    def __call__(self, fn, cfg):
        if self.stop_after is not None and self.calls >= self.stop_after:
            raise KeyboardInterrupt
        self.calls += 1
        fn()
        return float(_cost(cfg))


@pytest.mark.skipif(not INTERPRET, reason="tiny interpreter grid; GPU tuning is recorded separately")
def test_tune_end_to_end_is_deterministic_and_resumable(tables):
    user, _ = tables
    regimes = ["decode", "short"]
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "page_size": 16, "device": "cpu", "stream": io.StringIO()}
    # Each candidate over each shape, then final rounds of the finalists and the baseline.
    per_group = {}
    for r in regimes:
        n = len(candidates(r, True, False))
        timed = n + FINAL_ROUNDS * (1 + min(n, FINALISTS))
        per_group[r] = timed * len(shape_grid(r, 64, 4, 2, 16, torch.float16, True, False))
    # Interrupted during the second group: the first is already written.
    timer = CountingTimer(stop_after=per_group["decode"] + 1)
    with pytest.raises(KeyboardInterrupt):
        tune([torch.float16], [64], regimes, timer=timer, **kw)
    written = configs.read_file(user)
    assert {k[5] for k in written} == {"decode"}
    # The rerun measures only the missing group, and reports the winner against the baseline.
    timer = CountingTimer()
    kw["stream"] = io.StringIO()
    records = tune([torch.float16], [64], regimes, timer=timer, **kw)
    assert timer.calls == per_group["short"]
    shapes = len(shape_grid("short", 64, 4, 2, 16, torch.float16, True, False))
    assert records[1]["baseline_us"] == 5000.0 * shapes
    assert records[1]["total_us"] == _cost(records[1]["winner"]) * shapes
    assert "shipped/heuristic config" in kw["stream"].getvalue()
    for regime in regimes:
        want = min(candidates(regime, True, False), key=_cost)  # first minimum: the tie-break rule
        gpu, cap = _identity()
        key = configs.entry_key(gpu, cap, configs.triton_version(), "float16", 64, regime)
        assert configs.read_file(user)[key] == want
        assert configs.lookup(None, "float16", 64, regime) == want
    # A third run has nothing left to do; --fresh measures everything again.
    timer = CountingTimer()
    tune([torch.float16], [64], regimes, timer=timer, **kw)
    assert timer.calls == 0
    tune([torch.float16], [64], regimes, timer=timer, fresh=True, **kw)
    assert timer.calls == sum(per_group.values())


@pytest.mark.skipif(not INTERPRET, reason="tiny interpreter grid; GPU tuning is recorded separately")
@pytest.mark.parametrize("shipped_entry", [False, True])
def test_tune_keeps_the_baseline_when_nothing_beats_it(tables, shipped_entry):
    """The baseline written: its tiles and split policy plus the shipped entry's own keys, not the launch options
    every config gets by default; lookups then give the very config that was measured."""
    _, shipped = tables
    if shipped_entry:
        (shipped / "gpu.json").write_text(json.dumps(_file([_entry(32, clamp_pages=False, max_segment=1024)])))
        configs.reload()
    baseline = select_attention_config(64, 2, torch.float16, 1, INTERPRET, None)
    records = tune([torch.float16], [64], ["decode"], num_q_heads=4, num_kv_heads=2, page_size=16, device="cpu",
                   stream=io.StringIO(), timer=lambda fn, cfg: (fn(), 1.0 if not cfg else 2.0)[1])  # fmt: skip
    assert records[0]["total_us"] == records[0]["baseline_us"]
    written = configs.read_file(configs.user_config_path())
    (entry,) = written.values()
    keys = {*configs.TILE_KEYS, *configs.SPLIT_KEYS} | ({"clamp_pages"} if shipped_entry else set())
    assert entry == {k: v for k, v in baseline.items() if k in keys}
    assert ("clamp_pages" in entry) == shipped_entry and "acc_rescale" not in entry
    assert select_attention_config(64, 2, torch.float16, 1, INTERPRET, None) == baseline


@pytest.mark.skipif(not INTERPRET, reason="tiny interpreter grid; GPU tuning is recorded separately")
def test_tune_writes_the_table_options_its_winner_ran_with(tables):
    """Candidates set tiles only and run over the table entry's other keys (here a shipped ``clamp_pages`` false and a
    split bound): the entry written for the winner must hold them too, or lookups would give another config than
    the one measured."""
    _, shipped = tables
    (shipped / "gpu.json").write_text(json.dumps(_file([_entry(32, clamp_pages=False, max_segment=1024)])))
    configs.reload()
    seen = []

    def timer(fn, cfg):
        fn()
        seen.append((cfg, select_attention_config(64, 2, torch.float16, 1, INTERPRET, None)))
        return float(_cost(cfg))

    records = tune([torch.float16], [64], ["decode"], num_q_heads=4, num_kv_heads=2, page_size=16, device="cpu",
                   stream=io.StringIO(), timer=timer)  # fmt: skip
    want = min(candidates("decode", True, False), key=_cost)
    written = configs.lookup(None, "float16", 64, "decode")
    assert written == {"BLOCK_N": 32, "num_warps": 4, "clamp_pages": False, "max_segment": 1024, **want}
    assert records[0]["winner"] == written
    # The candidates did run with the shipped options, and lookups now give exactly the config the winner ran as.
    assert all(run["clamp_pages"] is False and run["max_segment"] == 1024 for cfg, run in seen if cfg)
    ran = [run for cfg, run in seen if cfg == want]
    assert ran and all(run == select_attention_config(64, 2, torch.float16, 1, INTERPRET, None) for run in ran)


@pytest.mark.skipif(not INTERPRET, reason="tiny interpreter grid; GPU tuning is recorded separately")
def test_tune_measures_prompts_with_their_layout_hint(tables, monkeypatch):
    """The ``prompts`` group's timed and checked calls pass the batches' ``decode_tail`` hint (0: no one-token rows),
    so they are prompts launches over the table's ``prompts`` entry; every other group's calls pass none (-1), so
    a prefill group is timed and checked as the launches its entry serves. The winner is written under its regime
    with the entry's other keys."""
    from triton_paged_ops import api

    _, shipped = tables
    entries = [_entry(32, regime="prefill", BLOCK_M=32, acc_rescale="lazy"),
               _entry(32, regime="prompts", BLOCK_M=32, acc_rescale="always")]  # fmt: skip
    (shipped / "gpu.json").write_text(json.dumps(_file(entries)))
    configs.reload()
    real, hints = api.paged_attention_out, []

    def spy(*args, **kwargs):
        hints.append(kwargs.get("decode_tail", -1))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "paged_attention_out", spy)
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "page_size": 16, "device": "cpu", "stream": io.StringIO()}
    for regime, hint, rescale in (("prompts", 0, "always"), ("prefill", -1, "lazy")):
        hints.clear()
        records = tune([torch.float16], [64], [regime], timer=CountingTimer(), **kw)
        assert hints and set(hints) == {hint}, (regime, set(hints))
        want = min(candidates(regime, True, False), key=_cost)
        assert records[0]["winner"] == configs.lookup(None, "float16", 64, regime) == {**want, "acc_rescale": rescale}


def test_candidates_whose_accumulator_takes_every_register_are_not_tried():
    """A tall tile whose fp32 output accumulator alone takes a thread's whole register budget is never compiled
    (ptxas refuses it: H200, D256 prompts at 16 warps or under a 128-register cap); the forms that fit stay, and
    one-token candidates (no query tile) always do."""
    cands = candidates("prompts", False, False)
    d256 = [c for c in cands if accumulator_fits(c, 256)]
    assert not any(c["num_warps"] == 16 or "maxnreg" in c or c["BLOCK_M"] == 256 for c in d256)
    assert any(c["BLOCK_M"] == 128 and c["num_warps"] == 8 for c in d256)
    assert not accumulator_fits({"BLOCK_M": 256, "num_warps": 16}, 256)
    assert not accumulator_fits({"BLOCK_M": 128, "num_warps": 8, "maxnreg": 128}, 256)
    assert accumulator_fits({"BLOCK_M": 128, "num_warps": 8}, 256)  # the shipped D256 prefill tile
    d128 = [c for c in cands if accumulator_fits(c, 128)]  # D128: the H200's forms fit, 256 rows at 4 warps not
    assert {"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 16, "num_stages": 3} in d128
    capped = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128}
    assert {**capped, "diag_loop": "separate"} in d128
    assert not any(c["BLOCK_M"] == 256 and c["num_warps"] == 4 for c in d128)
    assert accumulator_fits({"BLOCK_N": 64, "num_warps": 1}, 256)


def test_tune_lets_candidates_that_ptxas_refuses_lose(monkeypatch):
    """A candidate that does not fit the device (shared memory, or ptxas out of registers) costs infinity and loses;
    any other compile error is raised."""
    from triton_paged_ops import tune as tune_mod

    class PTXASError(Exception):  # the name Triton's error has (triton.runtime.errors)
        pass

    def timer_raising(exc):
        def timer(fn, cfg):
            raise exc

        return timer

    inputs = [types.SimpleNamespace(call=lambda: None)]
    refused = PTXASError("ptxas fatal   : (C7602) Insufficient registers (128) to compile instruction")
    assert tune_mod._measure({}, inputs, timer_raising(refused)) == float("inf")
    with pytest.raises(PTXASError):
        tune_mod._measure({}, inputs, timer_raising(PTXASError("ptxas fatal: some codegen bug")))
    with pytest.raises(ValueError):
        tune_mod._measure({}, inputs, timer_raising(ValueError("a bug")))


def test_prompts_candidates_hold_the_measured_forms():
    """``prompts`` candidates (GPU): valid configs whose warps each get 16 of the tile's rows, holding the forms
    that won on the H200 (D128: 256x64 tiles at 16 warps; D64: 128x64 tiles, two 8-warp programs per SM under a
    128-register cap, diagonal tiles in the unmasked loop) and the capped form with two loops, quick and full; the
    ``prefill`` candidates hold no capped or 16-warp form (mixed launches' one-token rows run on the same warps)."""
    capped = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128}
    won = [{"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 16, "num_stages": 3}, {**capped, "diag_loop": "merged"},
           {**capped, "diag_loop": "separate"}]  # fmt: skip
    for quick in (True, False):
        cands = candidates("prompts", False, quick)
        assert all(configs.validate_config(c) is None and c["BLOCK_M"] >= 16 * c["num_warps"] for c in cands)
        assert all(w in cands for w in won) and len(cands) == len({json.dumps(c, sort_keys=True) for c in cands})
        assert not any("maxnreg" in c or c["num_warps"] > 8 for c in candidates("prefill", False, quick))


def test_tune_command_line_arguments(tables, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--dtype", "int8"])
    assert exc.value.code == 2
    assert main(["tune", "--num-heads", "6", "--num-kv-heads", "4"]) == 2
    assert "multiple of --num-kv-heads" in capsys.readouterr().err
    assert main(["tune", "--head-dim", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--help"])
    assert exc.value.code == 0 and "--quick" in capsys.readouterr().out


def test_fp8_caches_have_their_own_entries(tables):
    user, _ = tables
    fp8 = torch.float8_e4m3fn
    key = configs.dtype_name(torch.float16, fp8)
    assert key == "float16+float8_e4m3fn" and configs.dtype_name(torch.float16, torch.float16) == "float16"
    entry = {"dtype": key, "head_dim": 64, "regime": "decode", "config": {"BLOCK_N": 32, "num_warps": 4}}
    user.parent.mkdir()
    user.write_text(json.dumps(_file([entry])))
    configs.reload()

    def block_n(cache_dtype):
        cfg = select_attention_config(64, 2, torch.float16, 1, INTERPRET, DEVICE_INDEX, cache_dtype)
        return cfg["BLOCK_N"]

    assert block_n(fp8) == 32
    assert block_n(None) == block_n(torch.float16) != 32


def test_clamp_pages_defaults():
    """Every launch but 16-bit decode reads bad page ids from page 0 (``clamp_pages``, measured faster: fp8 decode,
    short queries, prefill); 16-bit decode drops them (1), and an override still decides."""
    fp8 = torch.float8_e4m3fn

    def guard(cache_dtype, max_q):
        cfg = select_attention_config(128, 4, torch.float16, max_q, INTERPRET, DEVICE_INDEX, cache_dtype)
        return cfg["clamp_pages"]

    assert guard(fp8, 1) is guard(fp8, 8) is guard(None, 2) is guard(None, MAX_SPLIT_Q_LEN + 1) is True
    assert guard(torch.float16, 300) is True
    assert guard(None, 1) is guard(torch.float16, 1) is False
    with attention_config_override(clamp_pages=False):
        assert guard(fp8, 1) is guard(None, 300) is False


def test_fp8_decode_split_policy_defaults(tables):
    """fp8 decode bounds segments in bytes (4096 one-byte keys), fills 90% of the program slots before splitting and
    dispatches the longest work first; 16-bit decode and fp8 launches of taller tiles keep the planner's defaults,
    and an override still decides (no tables: the heuristic's defaults)."""
    fp8 = torch.float8_e4m3fn

    def cfg(cache_dtype, max_q):
        return select_attention_config(128, 4, torch.float16, max_q, INTERPRET, DEVICE_INDEX, cache_dtype)

    fp8_decode = cfg(fp8, 1)
    split = (fp8_decode["max_segment"], fp8_decode["fill_percent"], fp8_decode["decode_order"])
    assert split == (4096, 90, "tails_last")
    for other in (cfg(None, 1), cfg(fp8, 8), cfg(fp8, MAX_SPLIT_Q_LEN + 1)):
        assert "max_segment" not in other and "fill_percent" not in other
    assert cfg(None, 1)["decode_order"] == "tails_last" and cfg(fp8, 8)["decode_order"] == "sequences"
    with attention_config_override(max_segment=2048, fill_percent=100):
        assert (cfg(fp8, 1)["max_segment"], cfg(fp8, 1)["fill_percent"]) == (2048, 100)


def test_fp8_decode_candidates_include_wider_tiles():
    """fp8 tiles are half the bytes: the GPU search for fp8 decode tries 256-key tiles, the bf16 search does not."""
    from triton_paged_ops.tune import candidates

    for quick in (True, False):
        fp8 = candidates("decode", False, quick, torch.float8_e4m3fn)
        bf16 = candidates("decode", False, quick)
        assert any(c["BLOCK_N"] == 256 for c in fp8) and not any(c["BLOCK_N"] == 256 for c in bf16)
        assert len({tuple(sorted(c.items())) for c in fp8}) == len(fp8)  # no duplicates


@pytest.mark.parametrize(
    ("cfg", "names"),
    [({"fill_segment": 0}, "fill_segment"), ({"min_segment": -5}, "min_segment"), ({"BLOCK_N": 48}, "BLOCK_N"),
     ({"num_splits": 0}, "num_splits"), ({"min_segment": 4096, "max_segment": 1024}, "min_segment"),
     ({"invariant_leaves": 3}, "invariant_leaves"), ({"kv_offsets": 2}, "unknown attention config keys"),
     ({"fill_percent": 101}, "fill_percent"), ({"fill_percent": 0}, "fill_percent"),
     ({"acc_rescale": 2}, "acc_rescale must be one of 'lazy', 'always'"), ({"ids_ahead": 1}, "ids_ahead must be true"),
     ({"decode_order": "heads_first"}, "decode_order"), ({"clamp_pages": "yes"}, "clamp_pages"),
     ({"BLOCK_M": True}, "BLOCK_M must be a positive integer")],
)  # fmt: skip
def test_config_override_names_a_bad_value(cfg, names):
    with pytest.raises(ValueError, match=names), attention_config_override(**cfg):
        pass


def _plan(num_seqs: int, max_q: int = 1, invariant: bool = False, num_kv_heads: int = 2, decode_tail: int = -1):
    from triton_paged_ops.plan import attention_launch_plan

    return attention_launch_plan(
        num_q_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=64, head_dim_v=64, page_size=16,
        dtype=torch.float16, cache_dtype=torch.float16, num_seqs=num_seqs, max_seqlen_q=max_q, max_seqlen_k=4096,
        causal=True, window_left=-1, softcap=0.0, has_alibi=False, has_sinks=False, has_k_scale=False,
        has_v_scale=False, has_rows=False, want_lse=False, device_index=DEVICE_INDEX, interpret=INTERPRET,
        batch_invariant=invariant, decode_tail=decode_tail,
    )  # fmt: skip


def test_decode_large_entry_serves_batches_with_a_pair_per_sm(tables):
    """One-token batches with at least one (sequence, KV head) pair per SM take the ``decode_large`` entry, smaller
    ones the ``decode`` entry; a table without ``decode_large`` gives its ``decode`` entry to both; other regimes
    are untouched. Batch-invariant mode takes the large batches' tile at every batch size and query length."""
    from triton_paged_ops.configs import num_sms_of

    user, _ = tables
    sms = num_sms_of(torch.device(DEVICE))
    assert configs.regime_of(1, MAX_SPLIT_Q_LEN, sms, sms) == "decode_large"
    assert (
        configs.regime_of(1, MAX_SPLIT_Q_LEN, sms - 1, sms) == configs.regime_of(1, MAX_SPLIT_Q_LEN, 10**6) == "decode"
    )
    assert configs.regime_of(2, MAX_SPLIT_Q_LEN, 10**6, sms, group=16) == "short"
    user.parent.mkdir()
    user.write_text(json.dumps(_file([_entry(32)])))
    configs.reload()
    small, large = -(-sms // 2) - 1, -(-sms // 2)  # sequences; 2 KV heads each
    assert _plan(small).config["BLOCK_N"] == _plan(large).config["BLOCK_N"] == 32
    large_entry = _entry(64, regime="decode_large", invariant_segment=1024)
    large_entry["config"]["num_warps"] = 1
    user.write_text(json.dumps(_file([_entry(32, invariant_segment=2048), large_entry])))
    configs.reload()
    tile = lambda lp: (lp.config["BLOCK_N"], lp.config["num_warps"])  # noqa: E731
    assert tile(_plan(small)) == (32, 4) and tile(_plan(large)) == tile(_plan(4 * large)) == (64, 1)
    # Forced: tuning's baseline of each group.
    assert select_attention_config(64, 2, torch.float16, 1, INTERPRET, DEVICE_INDEX, regime="decode_large")[
        "BLOCK_N"] == 64  # fmt: skip
    assert _plan(large, max_q=8).config["BLOCK_N"] != 64 and _plan(small, max_q=8).config["BLOCK_N"] != 64
    invariant = [_plan(b, max_q=q, invariant=True) for b in (1, small, large) for q in (1, 8, 300)]
    assert {tile(lp) for lp in invariant} == {(64, 1)}
    assert {lp.config["invariant_segment"] for lp in invariant} == {1024}


def test_decode_large_tuning_groups():
    """The decode_large group tunes on batches with a pair per SM (and tries one-warp programs), the decode group on
    batches short of that."""
    for sms, kv_heads in ((132, 8), (304, 8), (132, 2)):
        for quick in (True, False):
            full = -(-sms // kv_heads)
            large = shape_grid("decode_large", 128, 4 * kv_heads, kv_heads, 16, torch.bfloat16, False, quick,
                               None, sms)  # fmt: skip
            small = shape_grid("decode", 128, 4 * kv_heads, kv_heads, 16, torch.bfloat16, False, quick, None, sms)
            assert large and all(len(c.kv_lens) >= full and c.q_len == 1 for c in large)
            assert small and all(len(c.kv_lens) < full and c.q_len == 1 for c in small)
    cpu = shape_grid("decode_large", 64, 4, 2, 16, torch.float16, True, False, None, 132)
    assert all(len(c.kv_lens) >= 66 for c in cpu)
    for cache_dtype in (None, torch.float8_e4m3fn):
        for quick in (True, False):
            cands = candidates("decode_large", False, quick, cache_dtype)
            assert any(c["num_warps"] == 1 for c in cands) and any(c["num_warps"] == 4 for c in cands)
            assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)


@pytest.mark.parametrize("amd", [False, True])
@pytest.mark.parametrize(
    "head_dim,itemsize,limit", [(256, 2, 65536), (128, 4, 101376), (256, 4, 65536), (64, 2, 65536)]
)
def test_heuristic_tiles_are_fitted_to_the_shared_memory(head_dim, itemsize, limit, amd):
    """``_fit_shared_memory`` halves KV tiles (to 32 keys), then rows (never below the GQA group's), then KV tiles
    to 16, until the q tile and a K and a V tile, with the backend's slack (NVIDIA: 9/8 for 16-bit inputs, 3/2 for
    fp32; AMD: none), fit the limit; tiles that fit are left alone, as is everything when the limit is unknown."""
    from triton_paged_ops.configs.heuristic import _fit_shared_memory

    num, den = (1, 1) if amd else (3, 2) if itemsize == 4 else (9, 8)

    def fits(c):
        return (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * head_dim * itemsize * num <= limit * den

    for block_m, block_n, warps in ((16, 128, 4), (64, 64, 4), (128, 64, 8)):
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": 2}
        assert _fit_shared_memory(dict(cfg), head_dim, itemsize, 16, 0, amd) == cfg
        fitted = _fit_shared_memory(dict(cfg), head_dim, itemsize, 16, limit, amd)
        if fits(cfg):
            assert fitted == cfg
            continue
        assert fits(fitted) or (fitted["BLOCK_M"], fitted["BLOCK_N"]) == (16, 16)
        assert fitted["BLOCK_M"] >= 16 and fitted["BLOCK_N"] >= 16 and fitted["num_stages"] == 2
        assert fitted["BLOCK_N"] <= block_n and fitted["BLOCK_M"] <= block_m
        assert fitted["num_warps"] == (4 if fitted["BLOCK_M"] <= 64 else warps)
        # Rows shrink only once the KV tile is down to 32 keys.
        assert fitted["BLOCK_M"] == block_m or fitted["BLOCK_N"] <= 32
    # A GQA group of 32 heads keeps its rows in one tile.
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    assert _fit_shared_memory(cfg, 256, 4, 32, 65536, amd)["BLOCK_M"] >= 32


def test_prompts_entry_serves_prefill_launches_said_to_hold_no_decodes(tables):
    """A prefill launch whose caller says the batch holds no one-token sequence (``decode_tail`` 0) takes the
    ``prompts`` entry; unknown or a decode tail, short queries and batch-invariant mode keep theirs; a table without
    it gives its ``prefill`` entry. The launch computes the right result with the entry's tiles (poisoned output)."""
    from triton_paged_ops.bench import Case, build_inputs, check_case

    user, _ = tables
    user.parent.mkdir()
    prefill = {"dtype": "float16", "head_dim": 64, "regime": "prefill",
               "config": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}}  # fmt: skip
    user.write_text(json.dumps(_file([prefill])))
    configs.reload()
    tile = lambda lp: (lp.config["BLOCK_M"], lp.config["BLOCK_N"])  # noqa: E731
    assert {tile(_plan(3, max_q=300, decode_tail=hint)) for hint in (-1, 0, 1)} == {(32, 16)}
    prompts = {**prefill, "regime": "prompts", "config": {**prefill["config"], "BLOCK_M": 64, "BLOCK_N": 32}}
    user.write_text(json.dumps(_file([prefill, prompts])))
    configs.reload()
    assert tile(_plan(3, max_q=300, decode_tail=0)) == (64, 32)
    assert tile(_plan(3, max_q=300, decode_tail=-1)) == tile(_plan(3, max_q=300, decode_tail=2)) == (32, 16)
    assert tile(_plan(3, max_q=MAX_SPLIT_Q_LEN, decode_tail=0)) == tile(_plan(3, max_q=MAX_SPLIT_Q_LEN))
    assert tile(_plan(3, max_q=300, invariant=True, decode_tail=0)) == tile(_plan(3, max_q=300, invariant=True))
    case = Case("prompts", [70, 45, 33], q_lens=[70, 20, 33], num_q_heads=4, num_kv_heads=2, head_dim=64,
                dtype=torch.float16)  # fmt: skip
    inp = build_inputs(case, seed=3, device=DEVICE)
    assert inp.decode_tail == 0
    assert check_case(inp) < 2e-3


def test_short_launches_whose_rows_fit_one_narrow_tile_are_their_own_regime(tables):
    """Queries of 2-16 tokens whose packed rows (tokens x GQA group) fit ``NARROW_ROWS`` are ``short_narrow``: they
    take that regime's entry, never the ``short`` one (tuned for taller tiles), and without an entry the heuristic's
    decode-style tile; wider short launches keep the ``short`` entry."""
    narrow = configs.NARROW_ROWS
    for group in (1, 2, 4, 8, 16):
        for q in range(2, MAX_SPLIT_Q_LEN + 1):
            want = "short_narrow" if q * group <= narrow else "short"
            assert configs.regime_of(q, MAX_SPLIT_Q_LEN, group=group) == want, (q, group)
        assert configs.regime_of(1, MAX_SPLIT_Q_LEN, group=group) == "decode"
        assert configs.regime_of(MAX_SPLIT_Q_LEN + 1, MAX_SPLIT_Q_LEN, group=group) == "prefill"
    user, _ = tables
    user.parent.mkdir()
    short = _entry(32, regime="short", head_dim=128, BLOCK_M=64)
    user.write_text(json.dumps(_file([short])))
    configs.reload()

    def cfg(q: int, group: int = 4) -> dict:
        return select_attention_config(128, group, torch.float16, q, INTERPRET, DEVICE_INDEX)

    assert cfg(8)["BLOCK_N"] == 32 and cfg(5)["BLOCK_N"] == 32
    assert cfg(4)["BLOCK_N"] != 32 and cfg(2, group=8)["BLOCK_N"] != 32
    narrow_entry = _entry(64, regime="short_narrow", head_dim=128, programs_per_sm=3)
    user.write_text(json.dumps(_file([short, narrow_entry])))
    configs.reload()
    assert cfg(4)["BLOCK_N"] == 64 and cfg(4)["programs_per_sm"] == 3
    assert cfg(8)["BLOCK_N"] == 32 and "programs_per_sm" not in cfg(8) and cfg(1)["BLOCK_N"] != 64
    # The heuristic (any GPU without entries): a narrow launch gets the decode tile's 16 rows, a wider one 64.
    configs.reload()
    with configs.without_user_file():
        tile = lambda q: select_attention_config(128, 4, torch.bfloat16, q, False, None)["BLOCK_M"]  # noqa: E731
        assert tile(1) == tile(4) == narrow and tile(5) == tile(16) == 64


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_tuning_shapes_of_each_regime_lie_in_it(group):
    """Every tuning shape a regime's group measures is a launch of that regime (so a short entry is never tuned on
    narrow launches or the reverse); a group no launch of the regime can have is refused by name."""
    from triton_paged_ops.configs import num_sms_of

    sms = num_sms_of(torch.device(DEVICE))
    for regime in ("decode", "decode_large", "short", "short_narrow", "prefill", "prompts"):
        for quick in (True, False):
            args = (regime, 128, 8 * group, 8, 16, torch.bfloat16, False, quick)
            narrow = configs.NARROW_ROWS
            if (regime == "short" and group * MAX_SPLIT_Q_LEN <= narrow) or (
                regime == "short_narrow" and 2 * group > narrow
            ):
                with pytest.raises(ValueError, match=f"group {group}"):
                    shape_grid(*args, num_sms=sms)
                continue
            cases = shape_grid(*args, num_sms=sms)
            if regime in ("prefill", "prompts"):
                # A long whole prompt in every grid, quick too (NOTES v44: a quick winner lost on 1x8k).
                assert any(c.queries() == c.kv_lens and max(c.kv_lens) >= 8192 for c in cases), (regime, quick)
            for c in cases:
                # The hint the tuning calls pass (prompts only; ``tune.build_inputs`` with ``hints``).
                no_decodes = regime == "prompts" and decode_tail_of(c.queries()) == 0
                got = configs.regime_of(max(c.queries()), MAX_SPLIT_Q_LEN, len(c.kv_lens) * 8, sms, no_decodes, group)
                assert got == regime, (regime, group, c.name)
    assert short_q_len("short_narrow", 4) == 4 and short_q_len("short", 4) == 8


def test_kernels_compare_named_values_only_with_their_choices():
    """The kernels test the named forms as strings (``ACC_RESCALE == "lazy"``): every string a kernel compares a
    table-named constexpr with must be one of that key's choices, or a form would silently never be taken."""
    import re
    from pathlib import Path

    import triton_paged_ops.kernels as kernels

    seen = set()
    for path in Path(kernels.__file__).parent.glob("*.py"):
        for name, value in re.findall(r"\b([A-Z_]+) [!=]= \"(\w+)\"", path.read_text()):
            key = name.lower()
            if key in configs.CHOICES:
                assert value in configs.CHOICES[key], (path.name, name, value)
                seen.add((key, value))
    # Each key's non-default form is tested by name somewhere in the kernels.
    assert {k for k, _ in seen} == set(configs.CHOICES), seen
