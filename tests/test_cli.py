"""The command line: the self-check (main job) and the model demo run end to end and report success."""

from __future__ import annotations

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
