"""The ragged-batch schedule model of ``benchmarks.schedule_model`` against cases with a closed form."""

from __future__ import annotations

import pytest

from benchmarks.schedule_model import dispatch, main, makespan


def test_bandwidth_bound_and_latency_bound_limits():
    # Everything resident at once, no fixed cost, no per-program cap: the bytes at the bandwidth.
    assert makespan([1000] * 8, 512, 8, 1e12, 1e30, 0.0, 0.0) == pytest.approx(8 * 1000 * 512 / 1e12, rel=1e-6)
    # One program alone: its fixed cost, then its bytes at the lone rate.
    assert makespan([2048], 512, 4, 1e12, 32e9, 2e-6, 0.0) == pytest.approx(2e-6 + 2048 * 512 / 32e9, rel=1e-6)
    # Two waves through one slot: the programs run one after the other.
    assert makespan([100, 300], 512, 1, 1e12, 1e30, 1e-6, 0.0) == pytest.approx(2e-6 + 400 * 512 / 1e12, rel=1e-6)


def test_dispatch_covers_every_key_once():
    lengths = [100, 2048, 2049, 5000, 8192]
    for balanced in (False, True):
        keys = dispatch(lengths, heads=2, segment=2048, splits=4, balanced=balanced, sort_groups=False)
        assert len(keys) == 4 * len(lengths) * 2 and sum(keys) == 2 * sum(lengths)
    # Order 4: the first group holds only full segments of the longest sequences (others are empty there).
    first = dispatch(lengths, heads=1, segment=2048, splits=4, balanced=False, sort_groups=False)[: len(lengths)]
    assert first == [0, 0, 0, 0, 2048]


def test_the_model_runs_as_a_command(capsys):
    assert main(["--slots", "396"]) == 0
    assert "decode order 4 (shipped)" in capsys.readouterr().out
