"""The kernels compile for an H100/H200 (sm_90) and fit its shared memory, checked without a GPU.

The interpreter runs the kernels' Python, not the compiler: code only the compiler rejects, or a launch config that
needs more shared memory than the GPU has, would otherwise first show on a GPU. ``tests/compile_sm90.py`` compiles
representative variants (decode/split, short, prefill with every feature, fp8 cache, fp32, batch-invariant fold
and split, each with its reduce) and every entry of the shipped H200 config table (tuned tiles, with the decode
tile that prefill launches add for mixed batches) through Triton's own compiler and ptxas, in a process without
the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .compile_sm90 import SM90_SHARED_BYTES


def test_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.compile_sm90"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) >= 12
    for r in results:
        used = [v for k, v in r.items() if k.endswith("shared")]
        assert used and all(0 <= v <= SM90_SHARED_BYTES for v in used), r
    # Every shipped H200 table entry was compiled with its own tuned config.
    shipped = json.loads((root / "triton_paged_ops" / "configs" / "nvidia_h200.json").read_text())
    entries = [(t["gpu"], e) for t in shipped["tables"] for e in t["entries"]]
    names = {r["name"]: r["plan"] for r in results if "plan" in r}
    for gpu, e in entries:
        plan = names[f"{gpu} {e['dtype']} D{e['head_dim']} {e['regime']}"]
        tiles = ("BLOCK_N", "num_stages", "num_warps")
        assert all(f"'{k}': {v}" in plan for k, v in e["config"].items() if k in tiles), plan
    # The block-copy variants were compiled with their descriptors; a D256 prefill tile, whose copies would not fit
    # the shared memory, gathers.
    assert all("block_copies=True" in r["plan"] for r in results if "block copies" in r["name"])
    assert "block_copies=False" in next(r["plan"] for r in results if r["name"] == "prefill D256 page 64 gathers")
    assert "'qk_ahead': 2" in next(r["plan"] for r in results if r["name"] == "prefill scores ahead")
    # The batch-invariant split comes with its sequential reduce, by segment and by leaf (which folds leaves first).
    assert any(r["name"].startswith("invariant decode") and "reduce_shared" in r for r in results)
    leaves = next(r for r in results if r["name"] == "invariant decode leaves")
    assert "splits=16" in leaves["plan"] and leaves["reduce_fold_group"] == 4, leaves
