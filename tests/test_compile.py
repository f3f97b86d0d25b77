"""The kernels compile for an H100/H200 (sm_90) and other GPUs within their shared memory, checked without a GPU.

The interpreter runs the kernels' Python, not the compiler: code only the compiler rejects, or a launch config that
needs more shared memory than the GPU has, would otherwise first show on a GPU. ``tests/compile_sm90.py`` compiles
representative variants (decode/split, short, prefill with every feature, fp8 cache, fp32, batch-invariant fold
and split, each with its reduce) and every entry of the shipped H200 config table (tuned tiles, with the decode
tile that prefill launches add for mixed batches) through Triton's own compiler and ptxas, in a process without
the interpreter. ``tests/compile_targets.py`` does the same for GPUs no table names (an AMD MI300, an sm_89 GPU
of 99 KiB, an A100), whose launches take the heuristic fitted to their shared memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from .compile_matrix import TARGETS
from .compile_sm90 import SM90_SHARED_BYTES

ROOT = Path(__file__).resolve().parent.parent


def _compiled(*command: str):
    """The JSON that ``python -m <command>`` prints, run without the interpreter (which compiles nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_kernels_compile_for_sm90_within_shared_memory():
    results = _compiled("tests.compile_sm90")
    assert len(results) >= 12
    for r in results:
        used = [v for k, v in r.items() if k.endswith("shared")]
        assert used and all(0 <= v <= SM90_SHARED_BYTES for v in used), r
    # Every shipped H200 table entry was compiled with its own tuned config.
    shipped = json.loads((ROOT / "triton_paged_ops" / "configs" / "nvidia_h200.json").read_text())
    entries = [(t["gpu"], e) for t in shipped["tables"] for e in t["entries"]]
    names = {r["name"]: r["plan"] for r in results if "plan" in r}
    for gpu, e in entries:
        plan = names[f"{gpu} {e['dtype']} D{e['head_dim']} {e['regime']}"]
        tiles = ("BLOCK_N", "num_stages", "num_warps", "maxnreg")
        assert all(f"'{k}': {v}" in plan for k, v in e["config"].items() if k in tiles), plan
    # Page ids a tile ahead where their third K/V stage fits over pages of 16+ keys: the H200 table's D64/D128
    # prefill and prompts entries (and the launches planned as on an H200 with them), not D256, page 1 or the
    # heuristic.
    ahead = {r["name"]: r["ids_ahead"] for r in results if r["name"].startswith("prefill page ids ahead")}
    assert ahead == {"prefill page ids ahead": True, "prefill page ids ahead page 1": False,
                     "prefill page ids ahead D256": False}, ahead  # fmt: skip
    table = {r["name"]: r["ids_ahead"] for r in results if r["name"].startswith("NVIDIA H200 bfloat16 D")}
    assert {n: a for n, a in table.items() if a} == {"NVIDIA H200 bfloat16 D64 prefill": True,
                                                     "NVIDIA H200 bfloat16 D64 prompts": True,
                                                     "NVIDIA H200 bfloat16 D128 prefill": True,
                                                     "NVIDIA H200 bfloat16 D128 prompts": True}, table  # fmt: skip
    assert not any(r.get("ids_ahead") for r in results if r["name"] in ("prefill D256", "prefill all features"))
    # The batch-invariant split comes with its sequential reduce, by segment and by leaf (which folds leaves first).
    assert any(r["name"].startswith("invariant decode") and "reduce_shared" in r for r in results)
    leaves = next(r for r in results if r["name"] == "invariant decode leaves")
    assert "splits=16" in leaves["plan"] and leaves["reduce_fold_group"] == 4, leaves


def test_loop_statistics_count_each_backward_branch_body():
    """``benchmarks.sass.loop_stats`` on a hand-written disassembly: a loop is the range from a backward branch's
    target to the branch; its opcodes are counted with or without a predicate; forward branches and short loops
    are not loops."""
    from benchmarks.sass import loop_stats

    lines = ["/*0000*/ MOV R1, c[0x0][0x28] ;", "/*0010*/ @P0 BRA 0x0040 ;"]  # a forward branch
    body = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "MUFU.EX2 R2, R3", "@!P1 LDL R4, [R1]",
            "BAR.SYNC.DEFER_BLOCKING 0x0", "LDGSTS.E.BYPASS.128 [R5], desc[UR6][R8.64]", "DEPBAR.LE SB0, 0x1",
            "LDSM.16.M88.4 R8, [R9]", "STL [R1], R4"]  # fmt: skip
    addr = 0x20
    for text in body:
        lines.append(f"/*{addr:04x}*/ {text} ;")
        addr += 0x10
    lines.append(f"/*{addr:04x}*/ @P2 BRA 0x0020 ;")
    rows = loop_stats("\n".join(lines), min_instructions=2)
    assert rows == [{"start": "0x20", "instructions": 9, "mma": 1, "barriers": 1, "copies": 1, "waits": 1,
                     "shared_loads": 1, "spills": 2, "exp2": 1}]  # fmt: skip
    assert loop_stats("\n".join(lines), min_instructions=10) == []


def test_sass_statistics_of_the_h200_prefill_variant():
    """``python -m benchmarks.sass`` compiles the H200 prefill variant and reports its loops: the KV-tile loops
    hold tensor-core MMAs and exp2s, the kernel fits the register file and the shared memory."""
    stats = _compiled("benchmarks.sass", "--regime", "prefill", "--json")
    assert "'BLOCK_M': 256" in stats["variant"] and 0 < stats["registers"] <= 255
    assert 0 < stats["shared_bytes"] <= SM90_SHARED_BYTES
    assert any(row["mma"] > 0 and row["exp2"] >= 64 for row in stats["loops"]), stats["loops"]


def test_kernels_compile_for_other_gpus_within_their_shared_memory():
    """GPUs no shipped table names (AMD MI300 with 64 KiB of LDS, a 99 KiB sm_89 GPU, an A100) take the heuristic
    fitted to their shared memory: every variant compiles through Triton's backend for that GPU and fits it, and
    the 16-bit tiles that already fitted were left as they were."""
    results = _compiled("tests.compile_targets")
    assert len(results) == 3 * 18 + 7
    for r in results:
        used = [v for k, v in r.items() if k.endswith("shared")]
        assert used and all(0 <= v <= r["limit"] for v in used), r
    plans = {r["name"]: r["plan"] for r in results if "plan" in r}
    for gpu in ("MI300X", "L4", "A100"):
        assert "'BLOCK_M': 128, 'BLOCK_N': 64" in plans[f"{gpu} bfloat16 D128 prefill"]
    for gpu in ("L4", "A100"):  # (the estimate of q, K and V takes 68 KB there: MI300's decode tiles hold 64 keys)
        assert "'BLOCK_M': 16, 'BLOCK_N': 128" in plans[f"{gpu} bfloat16 D128 decode"]
    # Fitted where the heuristic's own tiles did not fit (D256 short queries: 64x64 needed 104 KB on sm_89, 72 KB
    # of LDS on gfx942).
    assert "'BLOCK_N': 32" in plans["L4 bfloat16 D256 short"] and "'BLOCK_N': 32" in plans["MI300X bfloat16 D256 short"]


def test_register_cap_reaches_the_compiler_and_two_programs_fit_an_sm():
    """``maxnreg`` goes to the compiler as a launch option: a 128-row, 8-warp prompt tile capped at 128 registers per
    thread compiles within them, and with 2 stages two such programs fit an SM's registers and shared memory."""
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ids_ahead": False, "maxnreg": 128}
    stats = _compiled("benchmarks.sass", "--regime", "prompts", "--config", json.dumps(cfg), "--json")
    assert "'maxnreg': 128" in stats["variant"]
    assert 0 < stats["registers"] <= 128
    # Two programs' registers (8 warps of 32 threads each) in the SM's 64K, their shared memory in its 228 KiB.
    assert 2 * stats["registers"] * 8 * 32 <= 65536 and 2 * stats["shared_bytes"] <= SM90_SHARED_BYTES


def test_sass_reads_ptxas_serialization_warnings():
    """``benchmarks.sass.wgmma_serialization`` finds either reason ptxas gives for serializing wgmmas, and none in a
    report without one."""
    from benchmarks.sass import wgmma_serialization

    head = "ptxas info    : 11 bytes gmem\n"
    tail = "\nptxas info    : Used 128 registers, used 1 barriers, 72 bytes cumulative stack size\n"
    regs = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the function '_paged_attention_kernel'")  # fmt: skip
    acc = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline "
           "stage in the function '_paged_attention_kernel'")  # fmt: skip
    assert wgmma_serialization(head + regs + tail) == "C7512: insufficient register resources"
    assert wgmma_serialization(head + acc + tail) == (
        "C7515: non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
        "pipeline stage"
    )
    assert wgmma_serialization(head + tail) is None


# The models whose reachable variants CI compiles for every target (``python -m tests.compile_matrix`` without
# --models compiles all of tests.test_variants.MODELS: benchmarks/results/compile_matrix.json).
CI_MATRIX_MODELS = ("llama-3-8b",)
H200_TABLE_TRITON = json.loads((ROOT / "triton_paged_ops" / "configs" / "nvidia_h200.json").read_text())["tables"][0][
    "triton"
]


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_reachable_variant_compiles_for_each_gpu_family(target):
    """Posed as each GPU family (A100, L40S, H100 and H200 with its table, B200, MI300X, MI355X), every kernel that
    serving the models can launch (``warmup.reachable_variants``, default and batch-invariant mode) compiles through
    Triton's backend for it, within its shared memory (LDS); the shipped table's kernels compile without register
    spills; on sm_90 the warp-specialized Gluon prefill kernel compiles for each shape the planner sends it."""
    rows = _compiled("tests.compile_matrix", target, "--models", *CI_MATRIX_MODELS)
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    # Launches the ops refuse with a clear error (Triton < 3.8 on Blackwell) are the only ones left uncompiled.
    refused = [r for r in rows if "refused" in r]
    old_triton = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8)
    assert (target == "B200" and old_triton) if refused else True, refused
    rows = [r for r in rows if "refused" not in r]
    kinds = {r["kernel"] for r in rows}
    assert {"attention", "reduce"} <= kinds, kinds
    assert sum(r["kernel"] == "attention" for r in rows) >= 10
    for r in rows:
        assert 0 <= r["shared"] <= r["limit"], r
    if target == "H200" and triton.__version__.startswith(H200_TABLE_TRITON + "."):
        # With the Triton its table was measured on, the decode and short-query tiles (bandwidth-bound: a spill
        # there is lost read rate) spill nothing. The 256-row prefill tiles were measured fastest with their spills
        # (up to ~500 bytes; the report shows them), so they are not held to it.
        tuned = [r for r in rows if " default " in r["name"] and int(re.search(r" q(\d+) ", r["name"])[1]) <= 16]
        assert tuned and not [r for r in tuned if r.get("spills")], tuned
    if target == "H200" and hopper_compiles():  # (the table enables it: the heuristic does not)
        assert "gluon prefill" in kinds, kinds


def hopper_compiles() -> bool:
    """Whether the installed Triton has the Gluon Hopper API the warp-specialized kernel is written in."""
    from triton_paged_ops.kernels import hopper

    return hopper.gluon is not None


def test_blackwell_tiles_the_installed_triton_cannot_compile_are_refused_clearly(monkeypatch):
    """Triton 3.6/3.7 crash compiling 64+-row tiles for sm_100+ (the compile matrix found it; 3.8 and 3.9 compile
    them): those launches raise a RuntimeError naming the fix instead of a compiler crash; other tiles, GPUs and
    Tritons pass."""
    from triton_paged_ops import configs
    from triton_paged_ops import plan as planning

    identity = {"gpu": ("NVIDIA B200", "10.0")}
    monkeypatch.setattr(configs, "device_identity", lambda device_index: identity["gpu"])
    monkeypatch.setattr(configs, "device_is_amd", lambda device_index: False)
    for version, block_m, gpu, refused in [("3.7.1", 128, ("NVIDIA B200", "10.0"), True),
                                           ("3.6.0", 64, ("NVIDIA B200", "10.0"), True),
                                           ("3.7.1", 16, ("NVIDIA B200", "10.0"), False),
                                           ("3.8.0", 128, ("NVIDIA B200", "10.0"), False),
                                           ("3.7.1", 128, ("NVIDIA H200", "9.0"), False)]:  # fmt: skip
        monkeypatch.setattr(triton, "__version__", version)
        identity["gpu"] = gpu
        why = planning.compiler_refusal({"BLOCK_M": block_m}, 0)
        assert (why is not None) == refused, (version, block_m, gpu)
        assert why is None or "install triton>=3.8" in why
    assert planning.compiler_refusal({"BLOCK_M": 128}, None) is None  # (the interpreter compiles nothing)
