"""Compile every kernel variant the planner can reach, for each GPU family, without a GPU; report JSON.

For each target the launch planner is posed as that GPU (its name, capability, SMs and shared memory; the shipped
table applies where one names it, the heuristic elsewhere) and ``warmup.reachable_variants`` enumerates what serving
the models of ``tests.test_variants.MODELS`` can launch (bf16; pages of 16; up to 256 sequences, 32k keys, 8k-token
chunks; default mode, and batch-invariant mode with the lse output). Each distinct compiled kernel among them
(attention kernel and, for split launches, the reduce kernel) is compiled through Triton's backend for that target.
On sm_90 the warp-specialized Gluon prefill kernel is compiled too, for each shape the planner sends it. Reported per
compiled kernel: its shared memory (LDS on AMD) against the target's limit and, for NVIDIA targets with a shipped
table, the register spills ptxas reports.

Run without ``TRITON_INTERPRET`` (the test suite runs it in a subprocess): ``python -m tests.compile_matrix
[TARGET ...] [--models NAME ...] [--out FILE]`` (default: every target and model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
from triton.backends.compiler import GPUTarget

from tests import compile_sm90, posing
from tests.test_variants import MODELS
from triton_paged_ops import checks, warmup
from triton_paged_ops import plan as planning
from triton_paged_ops.kernels import attention, hopper, merge

# name: (the GPU as the planner sees it, compile target). Shared memory: what one program may use (A100 163 KiB,
# L40S 99 KiB, Hopper and B200 227 KiB, MI300X 64 KiB of LDS, MI355X 160 KiB).
TARGETS = {
    "A100": (posing.Gpu("NVIDIA A100-SXM4-80GB", "8.0", "3.6", 166912, 108), GPUTarget("cuda", 80, 32)),
    "L40S": (posing.Gpu("NVIDIA L40S", "8.9", "3.6", 101376, 142), GPUTarget("cuda", 89, 32)),
    "H100": (posing.H100, GPUTarget("cuda", 90, 32)),
    "H200": (posing.H200, GPUTarget("cuda", 90, 32)),
    "B200": (posing.Gpu("NVIDIA B200", "10.0", "3.6", 232448, 148), GPUTarget("cuda", 100, 32)),
    "MI300X": (posing.MI300X, GPUTarget("hip", "gfx942", 64)),
    "MI355X": (posing.Gpu("AMD Instinct MI355X", "9.5", "3.6", 163840, 256, amd=True), GPUTarget("hip", "gfx950", 64)),
}
# (The lse output in batch-invariant mode only: its code path is compiled there, and the default mode's prefill then
# reaches the Gluon kernel, which does not write an lse.)
SERVING = dict(dtype=torch.bfloat16, decode_tail=True, page_size=16)


def _settings(model: dict, invariant: bool) -> warmup.ServingSettings:
    features = {k: model[k] for k in ("softcap", "window_left", "sinks", "cache_dtype") if k in model}
    return warmup.ServingSettings(num_q_heads=model["num_q_heads"], num_kv_heads=model["num_kv_heads"],
                                  head_dim=model["head_dim"], batch_invariant=invariant, lse=invariant,
                                  kv_scale="cache_dtype" in model, **SERVING, **features)  # fmt: skip


def _launch_plans(gpu: posing.Gpu, models: list[str]) -> list[tuple[str, planning.LaunchPlan]]:
    """One launch plan of each distinct compiled attention kernel reachable on the posed ``gpu`` serving ``models``
    (those whose cache dtype it can hold: the ops refuse the others), named by where."""
    plans: dict[tuple, tuple[str, planning.LaunchPlan]] = {}
    capability = tuple(int(p) for p in gpu.capability.split("."))
    for invariant in (False, True):
        for name in models:
            model = MODELS[name]
            if not checks.cache_dtype_supported(model.get("cache_dtype", SERVING["dtype"]), capability, gpu.amd):
                continue
            st = _settings(model, invariant)
            fixed = dict(num_q_heads=st.num_q_heads, num_kv_heads=st.num_kv_heads, head_dim=st.head_dim,
                         head_dim_v=st.head_dim, page_size=st.page_size, dtype=st.dtype,
                         cache_dtype=st.cache_dtype or st.dtype, causal=True, window_left=st.window_left,
                         softcap=st.softcap, has_alibi=False, has_sinks=st.sinks, has_k_scale=st.kv_scale,
                         has_v_scale=st.kv_scale, has_rows=False, want_lse=st.lse, device_index=0, interpret=False,
                         batch_invariant=invariant)  # fmt: skip
            for variant, (batch, q, k, hint) in sorted(warmup.reachable_variants(st, 0, False).items(),
                                                       key=lambda kv: kv[1]):  # fmt: skip
                lp = planning.attention_launch_plan(num_seqs=batch, max_seqlen_q=q, max_seqlen_k=k,
                                                     decode_tail=hint, **fixed)  # fmt: skip
                mode = "invariant" if invariant else "default"
                # (The attention kernel's compile key; reduce kernels are told apart in compile_target.)
                plans.setdefault(variant[:2] + variant[3:], (f"{name} {mode} B{batch} q{q} k{k} hint{hint}", lp))
    return list(plans.values())


def _spills(compiled) -> int | None:
    """Bytes of spill stores ptxas reports for a compiled CUDA kernel (None elsewhere)."""
    ptx = compiled.asm.get("ptx")
    if ptx is None:
        return None
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"\.target (sm_(\d+)\w*)", ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        # (The ptxas Triton itself compiles this target with.)
        ptxas = get_ptxas(int(arch.group(2))).path
        report = subprocess.run([ptxas, f"-arch={arch.group(1)}", "-v", path, "-o", os.path.join(tmp, "k.o")],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def _attention(name: str, lp: planning.LaunchPlan, dtype: torch.dtype, check_spills: bool) -> dict:
    f32, cache_dtype = torch.float32, lp.cache_dtype
    split = lp.split.num_splits > 1
    pointers = {"q_ptr": dtype, "k_cache_ptr": cache_dtype, "v_cache_ptr": cache_dtype,
                "out_ptr": f32 if split else dtype, "lse_ptr": f32, "alibi_slopes_ptr": f32, "sinks_ptr": f32,
                "k_scale_ptr": f32, "v_scale_ptr": f32}  # fmt: skip
    pointers |= {p: torch.int32 for p in ("block_table_ptr", "block_table_rows_ptr", "cu_seqlens_q_ptr",
                                          "seq_lens_ptr")}  # fmt: skip
    compiled = compile_sm90.compiled(attention._paged_attention_kernel, pointers, ("sm_scale", "softcap"),
                                     lp.constexprs, lp.options)  # fmt: skip
    out = {"kernel": "attention", "name": name, "config": str(lp.config), "shared": int(compiled.metadata.shared)}
    if check_spills:
        out["spills"] = _spills(compiled)
    return out


def _reduce(name: str, lp: planning.LaunchPlan, dtype: torch.dtype, head_dim: int, num_q_heads: int) -> dict:
    f32 = torch.float32
    invariant = lp.batch_invariant
    leaves = lp.config["invariant_segment"] // lp.split.segment_len if invariant else 1
    rp = merge.reduce_plan(lp.split.num_splits, 4, num_q_heads, head_dim, (0, 0, 0), (0, 0, 0), 4, (0, 0), (0, 0),
                           invariant, lp.constexprs["LAUNCH_DEPENDENTS"], leaves)  # fmt: skip
    pointers = {"part_out_ptr": f32, "part_lse_ptr": f32, "out_ptr": dtype, "lse_ptr": f32,
                "cu_seqlens_q_ptr": torch.int32}  # fmt: skip
    compiled = compile_sm90.compiled(merge._reduce_splits_kernel, pointers, (), rp.constexprs, rp.options)
    return {"kernel": "reduce", "name": name, "shared": int(compiled.metadata.shared)}


def compile_gluon(constexprs: dict):
    """The warp-specialized prefill kernel compiled for sm_90 with ``constexprs`` (bf16 queries and caches)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = hopper._ws_prefill_kernel
    params = kernel.arg_names
    rows, head_dim = constexprs["COPY"], constexprs["HEAD_DIM"]
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"
    typed = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "k_ptr": "*bf16", "v_ptr": "*bf16",
             "qk_scale": "fp32"}  # fmt: skip
    sig = {p: "constexpr" if p in constexprs else typed.get(p) or ("*i32" if p.endswith("_ptr") else "i32")
           for p in params}  # fmt: skip
    # (Pointers 16-byte aligned, as launches on real tensors are specialized.)
    aligned = {(params.index(p),): [["tt.divisibility", 16]] for p, t in sig.items() if t.startswith("*")}
    src = GluonASTSource(kernel, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    return compile_sm90.compile_source(src, {"num_warps": 4, "enable_fp_fusion": True})


def gluon_forms() -> list[dict]:
    """The warp-specialized kernel at each head dim it takes (the heuristic's KV tile width), with TMA copies of
    pages (16 keys, 32 at D256) and with gathers (pages of 1): shared memory, spill bytes, the ``wgmma.wait_group``
    depths its PTX waits at, its ``cp.async`` instructions, their barrier arrivals and waits."""
    rows = []
    forms = [(64, 128, 16), (128, 128, 16), (256, 64, 32), (64, 128, 1), (128, 128, 1), (256, 64, 1)]
    for head_dim, block_n, page_size in forms:
        q_bufs, producer_q = hopper.program_form(head_dim, block_n, 2, posing.H100.shared, page_size == 1)
        compiled = compile_gluon(dict(GROUP=4, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=block_n,
                                      **hopper.copy_constexprs(page_size, block_n), STAGES=2, Q_BUFS=q_bufs,
                                      PRODUCER_Q=producer_q, IS_CAUSAL=True, HAS_BT_ROWS=False))  # fmt: skip
        waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", compiled.asm["ptx"])))
        rows.append({"head_dim": head_dim, "block_n": block_n, "page_size": page_size, "producer_q": producer_q,
                     "shared": int(compiled.metadata.shared), "spills": _spills(compiled), "waits": waits,
                     "cp_async": compiled.asm["ptx"].count("cp.async.cg"),
                     "arrives": compiled.asm["ptx"].count("cp.async.mbarrier.arrive"),
                     "waits_for_copies": compiled.asm["ptx"].count("cp.async.wait_group")})  # fmt: skip
    return rows


def _gluon(lps: list[tuple[str, planning.LaunchPlan]], shared: int) -> list[dict]:
    """The warp-specialized prefill kernel, compiled for each (shape, tiles) the posed sm_90 GPU (``shared`` bytes
    of shared memory a program) launches it with."""
    if hopper.gluon is None:
        return []
    done, results = set(), []
    for name, lp in lps:
        if lp.ws is None:
            continue
        model = MODELS[name.split()[0]]
        block_n, stages = lp.ws
        head_dim, page_size = model["head_dim"], SERVING["page_size"]
        copies = hopper.copy_constexprs(page_size, block_n)
        q_bufs, per_sm = hopper.program_form(head_dim, block_n, stages, shared, copies["GATHER"])
        constexprs = dict(GROUP=model["num_q_heads"] // model["num_kv_heads"], HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                          BLOCK_N=block_n, **copies, STAGES=stages, Q_BUFS=q_bufs, PRODUCER_Q=per_sm, IS_CAUSAL=True,
                          HAS_BT_ROWS=False)  # fmt: skip
        key = tuple(constexprs.items())
        if key in done:
            continue
        done.add(key)
        compiled = compile_gluon(constexprs)
        results.append({"kernel": "gluon prefill", "name": name, "config": str(constexprs),
                        "shared": int(compiled.metadata.shared), "spills": _spills(compiled)})  # fmt: skip
    return results


def compile_target(target: str, models: list[str]) -> list[dict]:
    """Every distinct kernel reachable on ``target`` serving ``models``, compiled: one row each."""
    gpu, compile_target_ = TARGETS[target]
    compile_sm90.TARGET = compile_target_
    results = []
    nvidia_sm90 = not gpu.amd and float(gpu.capability) >= 9
    with posing.planned_as(gpu):
        # (Posed as planned for real launches: sm_90+ NVIDIA GPUs chain the reduce as a dependent launch.)
        planning.dependent_launch_supported = lambda device_index: nvidia_sm90
        lps = _launch_plans(gpu, models)
        table = gpu is posing.H200
        reduces = set()
        for name, lp in lps:
            model = MODELS[name.split()[0]]
            refusal = planning.compiler_refusal(lp.config, 0)
            if refusal:  # (the ops refuse this launch with the installed Triton: nothing to compile)
                results.append({"kernel": "attention", "name": name, "config": str(lp.config), "shared": 0,
                                "refused": refusal})  # fmt: skip
                continue
            try:
                results.append(_attention(name, lp, SERVING["dtype"], check_spills=table))
            except Exception as e:  # a kernel the compiler rejects is a row of the report, not the end of it
                results.append({"kernel": "attention", "name": name, "config": str(lp.config), "shared": 0,
                                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"})  # fmt: skip
            if lp.split.num_splits > 1:
                key = lp.variant()[2:] + (lp.batch_invariant, model["head_dim"], lp.constexprs["LAUNCH_DEPENDENTS"])
                if key not in reduces:
                    reduces.add(key)
                    results.append(_reduce(name, lp, SERVING["dtype"], model["head_dim"], model["num_q_heads"]))
        if gpu.capability == "9.0":
            results += _gluon(lps, gpu.shared)
    limit = gpu.shared
    return [r | {"target": target, "limit": limit} for r in results]


def markdown(results: list[dict]) -> str:
    """Per target: kernels compiled (attention variants, reduce variants, Gluon), the most shared memory one takes
    against the limit, and the kernels with register spills (where reported)."""
    lines = ["| GPU family (target) | attention variants | reduce | Gluon prefill | most shared memory / limit (KiB) "
             "| kernels with spills |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for target, (gpu, tgt) in TARGETS.items():
        rows = [r for r in results if r["target"] == target]
        if not rows:
            continue
        refused = sum("refused" in r for r in rows)
        rows = [r for r in rows if "refused" not in r]
        count = {k: sum(r["kernel"] == k for r in rows) for k in ("attention", "reduce", "gluon prefill")}
        checked = [r for r in rows if r.get("spills") is not None]
        spills = f"{sum(1 for r in checked if r['spills'])} of {len(checked)}" if checked else "not read"
        most = max(r["shared"] for r in rows)
        arch = tgt.arch if tgt.backend == "hip" else f"sm_{tgt.arch}"
        attention_count = f"{count['attention']}" + (f" (+{refused} refused: Triton < 3.8)" if refused else "")
        lines.append(f"| {target} ({arch}) | {attention_count} | {count['reduce']} "
                     f"| {count['gluon prefill'] or '-'} | {most / 1024:.0f} / {gpu.shared / 1024:.0f} "
                     f"| {spills} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compile_matrix", description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], help="default: all")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out", help="write the JSON here (default: stdout)")
    parser.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    parser.add_argument("--gluon-forms", action="store_true",
                        help="compile the warp-specialized kernel at each head dim it takes and exit")  # fmt: skip
    args = parser.parse_args(argv)
    if args.gluon_forms:
        sys.stdout.write(json.dumps(gluon_forms()))
        return 0
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return 0
    results = []
    for target in args.targets or list(TARGETS):
        results += compile_target(target, args.models)
    text = json.dumps(results)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
