"""The command line: the self-check (main job) and the model demo run end to end and report success."""

from __future__ import annotations

import json

import pytest
import torch

from triton_paged_ops.__main__ import main


def test_selfcheck_passes(capsys):
    assert main(["--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "paged_attention" in out and "reshape_and_cache" in out and "merge_attn_states" in out
    assert " 0 failed" in out and "FAIL" not in out


def test_demo_generates_and_verifies(capsys):
    assert main(["demo", "--requests", "3", "--new-tokens", "3", "--max-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "(ok, tolerance" in out
    assert "request 0: prompt" in out


def _result() -> dict:
    """A benchmark result in the suite's JSON layout (values made up: only the presentation is under test)."""
    records = []
    for i, case in enumerate(("B1x32k", "B32x4k")):
        for prov, us in (("tpa", 40.0 + i), ("sdpa_dense", 35.0 + i)):
            records.append({"case": case, "provider": prov, "us": us, "kv_tbps": 3.0 + i / 10, "tflops": 1.5 + i,
                            "frac_of_hbm_read": 0.7, **({"rel_err": 1e-3} if prov == "tpa" else {})})  # fmt: skip
    return {"gpu": "Test GPU", "torch": "x", "triton": "y", "ceilings": {"read_tbps": 4.3, "copy_tbps": 2.7},
            "eager_host_overhead_us": 150.0, "records": records}  # fmt: skip


def test_bench_table_and_chart(tmp_path):
    from triton_paged_ops.bench import format_records, plot_records

    result = _result()
    table = format_records(result).splitlines()
    assert "HBM read 4.30 TB/s" in table[0]
    rows = [line.split() for line in table[2:]]
    assert [(r[0], r[1]) for r in rows] == [(r["case"], r["provider"]) for r in result["records"]]
    png = tmp_path / "chart.png"
    plot_records(result, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_markdown_table_per_suite():
    """``benchmarks.table``: KV TB/s columns for decode, TFLOP/s and the kernel/SDPA ratio for prefill."""
    from benchmarks.table import render

    result = {**_result(), "git_sha": "0123456789abcdef", "date": "2026-01-01T00:00:00+00:00"}
    decode = render(result).splitlines()
    assert "KV TB/s" in decode[2] and decode[4].startswith("| B1x32k | 40.0 | 3.00 | 0.70 | 35.0 | 3.00 |")
    prefill = render({**result, "suite": "prefill"}).splitlines()
    assert "TFLOP/s" in prefill[2] and "tpa / SDPA" in prefill[2]
    cells = [c.strip() for c in prefill[5].strip("|").split("|")]  # B32x4k: tpa 2.5 TFLOP/s, SDPA 2.5
    assert cells[0] == "B32x4k" and float(cells[5]) == round(2.5 / 2.5, 2)
    assert len(prefill) == 6
    # A case without its SDPA record keeps the table's shape: dashes in the SDPA columns.
    alone = {
        **result,
        "records": [r for r in result["records"] if (r["case"], r["provider"]) != ("B1x32k", "sdpa_dense")],
    }
    for suite, dashes in (("decode", 2), ("prefill", 3)):
        row = render({**alone, "suite": suite}).splitlines()[4]
        assert row.count("|") == render({**result, "suite": suite}).splitlines()[4].count("|")
        assert row.endswith(" | ".join("–" * dashes) + " |")


def test_markdown_table_same_size_read_column():
    """Decode results holding a read of each case's bytes get its column; a case without one gets a dash there."""
    from benchmarks.table import render

    result = {**_result(), "git_sha": "0123456789abcdef", "date": "2026-01-01T00:00:00+00:00"}
    result["records"].append({"case": "B1x32k", "provider": "read_same_bytes", "us": 33.0, "kv_tbps": 4.1,
                              "tflops": 0.0, "frac_of_hbm_read": 0.95})  # fmt: skip
    lines = render(result).splitlines()
    assert "read of the same bytes" in lines[2] and lines[3].count("---:") == 6
    assert lines[4].endswith("| 33.0 (4.10) |") and lines[5].endswith("| – |")
    assert all(line.count("|") == lines[2].count("|") for line in lines[3:])


def test_bench_arguments(capsys):
    import pytest

    from triton_paged_ops.bench import parse_config

    assert parse_config("BLOCK_N=64, num_warps=4") == {"BLOCK_N": 64, "num_warps": 4}
    assert parse_config("ids_ahead=true,diag_loop=merged") == {"ids_ahead": True, "diag_loop": "merged"}
    assert parse_config(None) == {}
    for bad in ("BLOCK_N", "BLOCK_N=", "=4"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_config(bad)
    assert main(["bench", "--config", "BLOCK_N=sixty"]) == 2
    assert "BLOCK_N must be a positive integer" in capsys.readouterr().err
    assert main(["bench", "--config", "diag_loop=diagonal"]) == 2
    assert "diag_loop must be one of 'separate', 'merged'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    help_text = capsys.readouterr().out
    flags = ("--out", "--png", "--only", "--no-sdpa", "--config", "--batch-invariant", "--suite")
    assert exc.value.code == 0 and all(f in help_text for f in flags)


def test_benchmark_inputs_match_the_reference():
    """The benchmark's own correctness check (random permuted pages; fp8 cases carry their scales)."""
    import torch

    from triton_paged_ops.bench import Case, build_inputs, check_case

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for cache_dtype in (None, torch.float8_e4m3fn):
        case = Case("small", [40, 300, 7], num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                    cache_dtype=cache_dtype)  # fmt: skip
        inp = build_inputs(case, seed=1, device=device)
        assert inp.kv_bytes == 2 * 347 * 2 * 64 * (1 if cache_dtype else 2)
        assert check_case(inp) < 2e-3
        assert check_case(inp, batch_invariant=True) < 2e-3


def test_short_suite_cases_are_short_queries():
    """The short suite's cases lie in the short-query regime (more than one and at most MAX_SPLIT_Q_LEN new tokens,
    each within its sequence)."""
    from triton_paged_ops.bench import SUITES
    from triton_paged_ops.plan import MAX_SPLIT_Q_LEN

    cases = SUITES["short"]()
    assert cases and len({c.name for c in cases}) == len(cases)
    for c in cases:
        assert all(1 < q <= min(k, MAX_SPLIT_Q_LEN) for q, k in zip(c.queries(), c.kv_lens)), c.name


def test_cases_are_picked_by_part_of_their_name_or_exactly_after_an_equals_sign():
    """``--only``: an entry picks every case whose name contains it; one after ``=`` only the case of that name
    (``prefill 4x2k`` alone is part of five names); suite order kept; nothing picks nothing."""
    from benchmarks import ab
    from triton_paged_ops.bench import SUITES, select_cases

    cases = SUITES["prefill"]()
    names = [c.name for c in cases]
    pick = lambda only: [c.name for c in select_cases(cases, only)]  # noqa: E731
    assert pick(None) == names
    part = pick(["prefill 4x2k"])
    assert part == [n for n in names if n.startswith("prefill 4x2k")] and len(part) == 5
    assert pick(["=prefill 4x2k"]) == ["prefill 4x2k"]
    assert pick(["=prefill 4x2k", "1x8k"]) == [n for n in names if n in ("prefill 4x2k", "prefill 1x8k")]
    assert pick(["=prefill 4x2", "=nothing"]) == []
    assert [c.name for c in ab.select_cases(cases, ["=prefill 4x2k", "D64"], ["D64"])] == ["prefill 4x2k"]


def test_protocol_model_finds_the_deadlock_it_should_and_no_other():
    """The barrier model of the warp-specialized kernel (``benchmarks.ws_protocol_model``): over random items and
    interleavings, the kernel's producer and consumers never stop all waiting, and the form built to deadlock (a
    warpgroup that waits for the next description while holding slots the producer needs) does, with every process
    left waiting, on a batch worked out here by hand."""
    import random

    from benchmarks import ws_protocol_model as model

    found = model.check(trials=1500, seed=0)
    assert set(found) == {"wait-first"}, sorted(found)
    assert "done" not in found["wait-first"][1]
    # The first warpgroup reads none of 4 tiles, the other all of them: the producer cannot copy tile 2 into
    # slot 0 until the first hands tile 0 back, which it does only after the next description, published after
    # that copy. Any interleaving stops there.
    items = [{"n": 4, "my": (0, 4)}, {"n": 1, "my": (1, 1)}]
    for seed in range(10):
        waiting = model.run(items, "wait-first", random.Random(seed))
        assert waiting is not None and "done" not in waiting and any("q_ready[1]" in w for w in waiting), waiting
        assert model.run(items, "main", random.Random(seed)) is None


def test_prefill_suite_cases_and_causal_flops():
    """Prefill cases follow the suite's definition (new tokens fit their keys; the mixed batch is its two parts),
    and the FLOP count is the causal mask's visible pairs, counted here from an explicit mask."""
    import torch

    from triton_paged_ops.bench import SUITES, Case, build_inputs, check_case

    cases = {c.name: c for c in SUITES["prefill"]()}
    for c in cases.values():
        assert all(1 <= q <= k for q, k in zip(c.queries(), c.kv_lens)), c.name
    mixed, chunk, decodes = (cases[n] for n in ("mixed 2k+63 decodes", "mixed: 2k chunk alone",
                                                 "mixed: 63 decodes alone"))  # fmt: skip
    assert mixed.queries() == chunk.queries() + decodes.queries() and mixed.kv_lens == chunk.kv_lens + decodes.kv_lens
    small = Case("mixed small", [9, 5, 30], q_lens=[4, 1, 30], num_q_heads=4, num_kv_heads=2, head_dim=64,
                 dtype=torch.float16)  # fmt: skip
    pairs = 0
    for q, k in zip(small.queries(), small.kv_lens):
        pos = torch.arange(k - q, k)[:, None]  # the new tokens' positions
        pairs += int((torch.arange(k)[None, :] <= pos).sum())
    assert small.visible_pairs() == pairs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inp = build_inputs(small, seed=2, device=device)
    assert inp.flops == 4.0 * pairs * 4 * 64 and inp.out.shape == (35, 4, 64)
    assert check_case(inp) < 2e-3


def test_benchmark_calls_pass_the_batch_layout_hint():
    """Benchmark calls pass each batch's ``decode_tail`` (a prompt's chunk then decodes: 2), as serving does, or
    none (-1) when asked; the result stays correct either way."""
    import torch

    from triton_paged_ops.bench import Case, build_inputs, check_case

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mixed = Case("mixed small", [40, 9, 17], q_lens=[30, 1, 1], num_q_heads=4, num_kv_heads=2, head_dim=64,
                 dtype=torch.float16)  # fmt: skip
    for hints, expect in ((True, 2), (False, -1)):
        inp = build_inputs(mixed, seed=3, device=device, hints=hints)
        assert inp.decode_tail == expect
        assert check_case(inp) < 2e-3


def test_ab_benchmark_arguments_cases_and_table(capsys, monkeypatch):
    """``benchmarks.ab``: configs must be JSON objects of known keys, case filters must match, and the run puts
    every (config, round) in its own column with the SDPA timings and configs listed (run_suite stubbed: no GPU)."""
    from benchmarks import ab

    for bad, msg in ((["--config", "acc_rescale=2"], "JSON objects"), (["--config", "[1]"], "JSON objects"),
                     (["--config", '{"acc_rescale": 2}'], "acc_rescale must be one of 'lazy', 'always'"),
                     (["--config", '{"bogus": 1}'], "unknown key"), (["--only", "B3x7k"], "no case"),
                     (["--config", '{"hints": 0}'], "hints takes true or false"),
                     (["--config", '{"exact": "yes"}'], "exact takes true or false"),
                     (["--rounds", "0"], "--rounds")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            ab.main(bad)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    prefill = ab.SUITES["prefill"]()
    picked = ab.select_cases(prefill, ["4x2k"], ["D64", "D256"])
    assert {c.name for c in picked} == {"prefill 4x2k", "prefill 4x2k page1", "prefill 4x2k page64"}
    if not torch.cuda.is_available():
        assert ab.main(["--suite", "decode", "--only", "B32x4k", "--out", ""]) == 2

    calls = []

    def fake_suite(cases, seed=0, with_sdpa=True, with_invariant=False, hints=True):
        from triton_paged_ops.configs import heuristic

        calls.append((dict(heuristic._config_override), with_sdpa, hints, ab.config_tables._exact_only))
        recs = [{"case": c.name, "provider": "tpa", "us": 10.0 * len(calls), "tflops": 1.0, "kv_tbps": 2.0,
                 "rel_err": 1e-3} for c in cases]  # fmt: skip
        recs += [{"case": c.name, "provider": "sdpa_dense", "us": 7.0, "tflops": 1.0, "kv_tbps": 2.0}
                 for c in cases if with_sdpa]  # fmt: skip
        return {"ceilings": {"read_tbps": 4.0}, "records": recs}

    monkeypatch.setattr(ab, "run_suite", fake_suite)
    monkeypatch.setattr(ab.torch.cuda, "get_device_name", lambda *a: "stub")
    result, text = ab.run(picked[:2], [{}, {"acc_rescale": "always", "hints": False, "exact": True}], rounds=2,
                          sdpa=True)  # fmt: skip
    assert [c[0] for c in calls] == [{}, {"acc_rescale": "always"}, {}, {"acc_rescale": "always"}]
    assert [c[1] for c in calls] == [True, False, False, False]
    assert [c[2] for c in calls] == [True, False, True, False]
    assert [c[3] for c in calls] == [False, True, False, True] and not ab.config_tables._exact_only
    assert text.splitlines()[0].split()[-4:] == ["c0/r0", "c1/r0", "c0/r1", "c1/r1"]
    row = next(line for line in text.splitlines() if line.startswith("prefill 4x2k "))
    assert row.split()[-4:] == ["10.0", "20.0", "30.0", "40.0"]
    assert "sdpa_dense prefill 4x2k: 7.0 µs" in text
    assert 'c1: {"acc_rescale": "always", "hints": false, "exact": true}' in text
    assert len(result["rows"]) == 4 * 2 + 2 and result["rounds"] == 2
    # --dtype float16: fp16 queries everywhere; fp8 caches stay fp8, the others follow the queries.
    decode = ab.SUITES["decode"]()
    halves = [ab.case_in(c, "float16") for c in decode]
    assert {c.dtype for c in halves} == {torch.float16}
    assert [c.cache_dtype for c in halves] == [c.cache_dtype for c in decode]
    assert any(c.cache_dtype == torch.float8_e4m3fn for c in halves)


_STUB_MAIN = """
import json, sys
from pathlib import Path
here = Path(__file__).resolve().parent
count = here / "runs"
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
args = sys.argv[1:]
assert args[:5] == ["bench", "--suite", "prefill", "--no-sdpa", "--out"], args
assert args[6:] == ["--only", "c1", "c2"], args
base, step = {BASE}, {STEP}
recs = [{{"case": "c1", "provider": "tpa", "us": base + step * n, "rel_err": 1e-3}},
        {{"case": "c1", "provider": "sdpa_cudnn", "us": 1.0}},
        {{"case": "c2", "provider": "tpa", "us": 2 * base, "rel_err": 2e-3}}]
Path(args[5]).write_text(json.dumps({{"gpu": "stub", "records": recs}}))
"""


def test_tree_benchmark_alternates_checkouts_each_with_its_own_package(tmp_path, capsys):
    """``benchmarks.trees``: every round runs each checkout in turn, each importing its own package (stub packages
    that count their runs here), ceilings left out; per case each tree's median over its rounds and the ratio to
    the first tree's; a run that fails or outlasts ``--timeout`` is recorded and the others go on (exit status 1).
    Bad ``--tree`` values are usage errors naming them."""
    from benchmarks import trees

    for name, base, step in (("old", 100.0, 10.0), ("new", 90.0, -10.0)):
        pkg = tmp_path / name / "triton_paged_ops"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "__main__.py").write_text(_STUB_MAIN.format(BASE=base, STEP=step))
    for name, body in (("broken", "raise SystemExit(3)"), ("stuck", "import time; time.sleep(60)")):
        (tmp_path / name / "triton_paged_ops").mkdir(parents=True)
        (tmp_path / name / "triton_paged_ops" / "__init__.py").write_text("")
        (tmp_path / name / "triton_paged_ops" / "__main__.py").write_text(body)
    for bad, msg in ((["--tree", "old"], "LABEL=DIR"), (["--tree", f"x={tmp_path}"], "no triton_paged_ops"),
                     (["--tree", f"a={tmp_path / 'old'}"], "at least two"),
                     (["--tree", f"a={tmp_path / 'old'}", "--tree", f"a={tmp_path / 'new'}"], "its own label"),
                     (["--tree", f"a={tmp_path / 'old'}", "--tree", f"b={tmp_path / 'new'}", "--rounds", "0"],
                      "--rounds")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            trees.main(bad)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    out = tmp_path / "ab.json"
    argv = ["--tree", f"main={tmp_path / 'old'}", "--tree", f"cand={tmp_path / 'new'}", "--rounds", "3",
            "--only", "c1", "c2", "--out", str(out)]  # fmt: skip
    assert trees.main(argv) == 0
    result = json.loads(out.read_text())
    # (Each stub's times tell its runs apart: old 100, 110, 120; new 90, 80, 70.)
    assert [(r["tree"], r["round"], r["us"]) for r in result["rows"] if r["case"] == "c1"] == [
        ("main", 0, 100.0), ("cand", 0, 90.0), ("main", 1, 110.0), ("cand", 1, 80.0), ("main", 2, 120.0),
        ("cand", 2, 70.0)]  # fmt: skip
    assert {r["case"] for r in result["rows"]} == {"c1", "c2"}
    c1 = next(s for s in result["summary"] if s["case"] == "c1")
    assert c1["median_us"] == {"main": 110.0, "cand": 80.0}
    assert c1["vs_first"]["cand"] == pytest.approx(80.0 / 110.0)
    assert result["trees"] == ["main", "cand"] and result["command"].startswith("python -m benchmarks.trees")
    assert "80.0 (0.727)" in capsys.readouterr().out and result["failures"] == []

    argv = ["--tree", f"main={tmp_path / 'old'}", "--tree", f"bad={tmp_path / 'broken'}", "--tree",
            f"slow={tmp_path / 'stuck'}", "--rounds", "1", "--only", "c1", "c2", "--timeout", "5",
            "--out", str(out)]  # fmt: skip
    assert trees.main(argv) == 1
    result = json.loads(out.read_text())
    assert result["failures"] == [{"tree": "bad", "round": 0, "why": "exit status 3"},
                                  {"tree": "slow", "round": 0, "why": "no result after 5.0 s"}]  # fmt: skip
    assert {r["tree"] for r in result["rows"]} == {"main"}


def test_overhead_rounds_give_each_timing_its_median_and_keep_every_round():
    """``benchmarks.overhead`` measures the set several times: each timing becomes the median of its rounds (a slow
    first round moves no figure), every round's value is kept beside it, other fields pass through."""
    from benchmarks.overhead import over_rounds

    rounds = [{"call": 30.0, "floor": 9.0, "num_launches": 1}, {"call": 20.0, "floor": 5.0, "num_launches": 1},
              {"call": 21.0, "floor": 5.5, "num_launches": 1}]  # fmt: skip
    res = over_rounds(rounds)
    assert res["call"] == 21.0 and res["floor"] == 5.5 and res["num_launches"] == 1
    assert res["call_rounds"] == [30.0, 20.0, 21.0] and res["floor_rounds"] == [9.0, 5.0, 5.5]
    assert over_rounds(rounds[:1]) == rounds[0]


def test_common_options_go_before_or_after_the_sub_command():
    from triton_paged_ops.__main__ import _parser

    for argv in (["--seed", "5", "demo"], ["demo", "--seed", "5"]):
        args = _parser().parse_args(argv)
        assert args.command == "demo" and args.seed == 5
    args = _parser().parse_args(["bench", "--device", "cuda:1"])
    assert args.device == "cuda:1" and args.seed is None
    assert _parser().parse_args([]).device is None


def test_bad_devices_are_refused_clearly(capsys):
    assert main(["--device", "tpu"]) == 2
    assert "--device tpu" in capsys.readouterr().err
    assert main(["--device", "nonsense:x"]) == 2
    assert "--device nonsense:x" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        assert "sees no CUDA/ROCm GPU" in capsys.readouterr().err


def test_a_crashing_case_fails_its_row_and_the_rest_still_run(monkeypatch, capsys):
    from triton_paged_ops import api, selfcheck

    def crash(*args, **kwargs):
        raise RuntimeError("merge broke\nsecond line")

    cases = selfcheck._attention_cases
    monkeypatch.setattr(selfcheck, "_attention_cases", lambda on_gpu: cases(on_gpu)[1:2])  # (decode: quick)
    monkeypatch.setattr(api, "merge_attn_states", crash)
    assert main(["--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL RuntimeError: merge broke" in out and "second line" not in out
    assert "reshape_and_cache" in out and "decode" in out and "4 passed, 2 failed" in out


def test_dense_ceiling_is_the_fastest_sdpa_backend_that_ran(monkeypatch):
    """Each SDPA backend that takes the shapes gets a record; "sdpa_dense" repeats the fastest, naming it."""
    from triton_paged_ops import bench

    monkeypatch.setattr(bench, "sdpa_dense_us", lambda case, seed: {"flash": 30.0, "efficient": 20.0})
    case = bench.Case("decode", [1024] * 4)
    recs = bench._sdpa_records(case, 0, {"case": "decode"}, {"read_tbps": 4.0})
    assert [r["provider"] for r in recs] == ["sdpa_flash", "sdpa_efficient", "sdpa_dense"]
    assert recs[-1]["us"] == 20.0 and recs[-1]["backend"] == "efficient"
    monkeypatch.setattr(bench, "sdpa_dense_us", lambda case, seed: {})
    assert bench._sdpa_records(case, 0, {"case": "decode"}, {"read_tbps": 4.0}) == []


def test_kernel_times_needs_a_gpu(capsys):
    from benchmarks import kernel_times

    if not torch.cuda.is_available():
        assert kernel_times.main(["--only", "B1x32k"]) == 2 and "CUDA" in capsys.readouterr().err


def test_decode_scaling_fit_separates_fixed_cost_and_rate(capsys):
    """Times built as 7 µs plus the bytes at 3.5 TB/s (with a wobble that averages out) give back both numbers;
    too few points are refused, and without a GPU the tool says so."""
    from benchmarks import decode_scaling

    sizes = [67_108_864 * k for k in (1, 2, 4, 8)]
    wobble = [0.2, -0.2, -0.2, 0.2]
    fit = decode_scaling.fixed_and_rate(sizes, [7.0 + b / 3.5e6 + w for b, w in zip(sizes, wobble)])
    assert fit["fixed_us"] == pytest.approx(7.0, abs=0.3) and fit["rate_tbps"] == pytest.approx(3.5, rel=0.01)
    with pytest.raises(ValueError, match="two"):
        decode_scaling.fit_line([1.0], [2.0])
    with pytest.raises(ValueError, match="distinct"):
        decode_scaling.fit_line([1.0, 1.0], [2.0, 3.0])
    with pytest.raises(SystemExit):
        decode_scaling.main(["--lengths", "4096", "4096"])
    capsys.readouterr()
    if not torch.cuda.is_available():
        assert decode_scaling.main(["--lengths", "4096", "8192"]) == 2 and "CUDA" in capsys.readouterr().err


def test_paged_read_sums_every_owned_row_once(capsys):
    """The paged-read probe's kernel, split into segments that end inside pages and past short sequences, sums each
    sequence's K + V rows through its block table as plain PyTorch does (pages permuted, unowned slots NaN: a
    row read that the sequence does not own shows); without a GPU the tool says so."""
    from benchmarks import paged_read

    from triton_paged_ops.inputs import random_paged_batch

    from .strategies import poison_unowned_slots

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv_lens = [70, 5, 0, 33]
    gen = torch.Generator(device=device).manual_seed(0)
    pb = random_paged_batch([1] * 4, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                            dtype=torch.float16, device=device, generator=gen, extra_cols=3)  # fmt: skip
    poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
    splits, segment = 3, 32
    partial = torch.full((4 * splits, 2, 16), float("nan"), device=device)
    paged_read.paged_read(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens, splits, segment, partial,
                          block_n=16)  # fmt: skip
    got = partial.view(4, splits, 2, 16).sum(1)
    torch.testing.assert_close(got, paged_read.reference_sums(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens))
    assert got[2].eq(0).all() and got[0].abs().sum() > 0
    # The TMA form: whole pages copied (their unowned, NaN rows dropped), two pages a loop step.
    partial.fill_(float("nan"))
    paged_read.paged_read_tma(paged_read.tma_descriptors(pb.k_cache, pb.v_cache), pb.block_table, pb.seq_lens,
                              splits, segment, partial, pages=2)  # fmt: skip
    torch.testing.assert_close(partial.view(4, splits, 2, 16).sum(1), got)
    from triton_paged_ops.kernels import hopper

    if device == "cuda" and hopper.available(torch.cuda.current_device()):
        # The Gluon form (sm_90): its own mbarrier ring of 32-key tiles, a TMA copy per 16-key page.
        pb = random_paged_batch([1] * 4, [200, 5, 0, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.bfloat16, device=device, generator=gen, extra_cols=3)  # fmt: skip
        poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
        partial = torch.full((4 * 4, 2, 64), float("nan"), device=device)
        paged_read.paged_read_gluon(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens, 4, 64, partial,
                                    block_n=32, stages=2)  # fmt: skip
        want = paged_read.reference_sums(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
        torch.testing.assert_close(partial.view(4, 4, 2, 64).sum(1), want)
    if not torch.cuda.is_available():
        assert paged_read.main(["--only", "B1x32k"]) == 2 and "CUDA" in capsys.readouterr().err


@pytest.mark.gpu
def test_decode_scaling_runs_and_fits(tmp_path):
    import json

    from benchmarks import decode_scaling

    out = tmp_path / "scaling.json"
    lengths = (4096, 32768, 65536)
    assert decode_scaling.main(["--batch", "2", "--lengths", *map(str, lengths), "--splits", "8",
                                "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert [r["kv_bytes"] for r in result["rows"]] == [2 * 2 * n * 8 * 128 * 2 for n in lengths]
    # 33.6 MB fits the L2 of the GPUs this runs on: listed, not fitted.
    assert [r["in_fit"] for r in result["rows"]] == [r["kv_bytes"] >= 2 * result["l2_bytes"] for r in result["rows"]]
    assert not result["rows"][0]["in_fit"]
    assert all(r["rel_err"] < 2e-2 for r in result["rows"])
    assert all(f["rate_tbps"] > 0 for f in result["fits"].values())
    assert decode_scaling.main(["--lengths", "1024", "2048"]) == 1  # nothing past twice the L2 to fit


@pytest.mark.gpu
def test_same_size_read_and_kernel_times():
    """The read of a case's bytes runs at a plausible rate (not above twice the large read: a bigger figure would
    mean it missed HBM), and a decode call's kernels take part of its graph time, none of it negative."""
    from benchmarks.kernel_times import kernel_times_us
    from triton_paged_ops import bench

    nbytes = 512 << 20
    tbps = nbytes / bench.same_size_read_us(nbytes) / 1e6
    assert 0.2 * bench.hbm_ceilings(0.5)["read_tbps"] < tbps < 2 * bench.hbm_ceilings(0.5)["read_tbps"]
    inp = bench.build_inputs(bench.Case("B4x8k", [8192] * 4), 0)
    kernels = kernel_times_us(inp.call, 10)
    assert kernels and all(t > 0 for t in kernels.values())
    assert sum(kernels.values()) < 3 * bench.time_graph(inp.call)


@pytest.mark.gpu
def test_sdpa_backends_are_timed_where_they_take_the_shapes():
    from triton_paged_ops import bench

    times = bench.sdpa_dense_us(bench.Case("decode", [1024] * 4), 0)
    assert times and set(times) <= set(bench.SDPA_BACKENDS) and all(t > 0 for t in times.values())


def test_kv_layouts_are_the_same_attention(capsys):
    """The layouts the tool times hold the same keys and values: head-major storage behind an NHD view and pages
    moved into order give the op's output bit for bit; without a GPU the tool says so."""
    from benchmarks import kv_layouts
    from triton_paged_ops import bench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = bench.Case("B2", [100, 37], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16)
    inp = bench.build_inputs(case, seed=3, device=device)
    got = {}
    for form, variant in kv_layouts.forms(inp, 16).items():
        variant.out.fill_(float("nan"))
        variant.call()
        got[form] = variant.out.clone()
    assert set(got) == {"nhd_permuted", "nhd_in_order", "hnd_permuted"}
    hnd = kv_layouts.forms(inp, 16)["hnd_permuted"].args[1]
    assert hnd.shape == inp.args[1].shape and hnd.stride(1) == 32 and hnd.stride(2) == 16 * 32
    assert not got["nhd_permuted"].isnan().any()
    assert bench.check_case(inp) < 2e-3
    for form, out in got.items():
        assert torch.equal(out, got["nhd_permuted"]), form
    if not torch.cuda.is_available():
        assert kv_layouts.main([]) == 2 and "CUDA" in capsys.readouterr().err


@pytest.mark.gpu
def test_kv_layouts_runs(tmp_path):
    import json

    from benchmarks import kv_layouts

    out = tmp_path / "layouts.json"
    assert kv_layouts.main(["--only", "B8x4k", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["form"] for r in records} == {"nhd_permuted", "nhd_in_order", "hnd_permuted", "read_same_bytes"}
    assert all(r["rel_err"] < 2e-2 for r in records if "rel_err" in r)


def test_clocks_parses_nvidia_smi_samples(capsys):
    """nvidia-smi lines become numbers (unreported fields None, reasons a hex mask), a phase's summary takes the
    medians and names every reason seen, and without a GPU the tool says so."""
    from benchmarks import clocks

    a = clocks.parse_sample("1980, 512.25, 45, 0x0000000000000000\n")
    b = clocks.parse_sample("1755, 699.9, 52, 0x0000000000000004")
    c = clocks.parse_sample("1830, [N/A], 50, 0x0000000000000024")
    assert a == {"clocks.sm": 1980.0, "power.draw": 512.25, "temperature.gpu": 45.0, "clocks_event_reasons.active": 0}
    assert c["power.draw"] is None and c["clocks_event_reasons.active"] == 0x24
    assert clocks.parse_sample("clocks.sm, power.draw") is None
    s = clocks.summarize([a, b, c])
    assert s["samples"] == 3 and s["sm_mhz"] == 1830.0 and s["power_w"] == pytest.approx((512.25 + 699.9) / 2)
    assert s["reasons"] == ["sw_power_cap", "sw_thermal"]
    assert clocks.reason_names(0x10000 | 0x1) == ["idle", "0x10000"]
    assert clocks.summarize([])["sm_mhz"] is None
    if not torch.cuda.is_available():
        assert clocks.main([]) == 2 and "CUDA" in capsys.readouterr().err


@pytest.mark.gpu
def test_clocks_runs_both_phases(tmp_path):
    import json

    from benchmarks import clocks

    out = tmp_path / "clocks.json"
    assert clocks.main(["--suite", "decode", "--only", "=B8x4k", "--seconds", "1.5", "--spaced", "3",
                        "--gap-ms", "20", "--out", str(out)]) == 0  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rel_err"] < 2e-2 and "tpa" in row["kernels"]
    for r in row["kernels"].values():
        assert r["sustained"]["replays"] > 10 and r["spaced"]["calls"] == 3
        assert 0.3 < r["steady_tbps"] < 10 and 0.1 < r["spaced_tbps"] < 10


def test_ncu_source_groups_samples_by_reason_and_times_run(tmp_path, capsys):
    from benchmarks import ncu_source

    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
              '"stall_long_sb","stall_barrier (Not Issued)"')
    rows_a = [("0x0", "LDC R1, c[0x0][0x28]", 1, 4, 0, 0), ("0x10", "LDG.E R2, [R4]", 3, 32, 0, 3),
              ("0x20", "IMAD.MOV.U32 R5, RZ, RZ, R2", 12, 32, 2, 10), ("0x30", "BAR.SYNC 0x0", 4, 32, 4, 0)]
    text = '"Kernel Name","kernel_a",\n' + header + "\n"
    text += "\n".join(f'"{a}","      {s}","{n}","{e}","{b}","{lsb}","0"' for a, s, n, e, b, lsb in rows_a)
    text += '\n"Kernel Name","kernel_b",\n' + header + '\n"0x0","NOP","5","8","5","0","0"\n'
    kernels = ncu_source.parse(text)
    assert [name for name, _ in kernels] == ["kernel_a", "kernel_b"]
    a = ncu_source.summarize(kernels[0][1], top=2)
    assert a["samples"] == 20
    assert a["by_reason"] == {"long_sb": 13, "barrier": 6}  # the "(Not Issued)" column is not a reason of its own
    assert a["by_times_run"][0] == {"executed": 32, "instructions": 3, "samples": 19}
    assert a["by_times_run"][1] == {"executed": 4, "instructions": 1, "samples": 1}
    assert [(h["sass"], h["reason"], h["after"]) for h in a["top"]] == [
        ("IMAD.MOV.U32 R5, RZ, RZ, R2", "long_sb", "LDG.E R2, [R4]"),
        ("BAR.SYNC 0x0", "barrier", "IMAD.MOV.U32 R5, RZ, RZ, R2"),
    ]
    path = tmp_path / "src.csv"
    path.write_text(text)
    assert ncu_source.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel_a: 20 samples" in out and "kernel_b: 5 samples" in out and "IMAD.MOV.U32" in out
    (tmp_path / "empty.csv").write_text("nothing here\n")
    with pytest.raises(SystemExit):
        ncu_source.main([str(tmp_path / "empty.csv")])
