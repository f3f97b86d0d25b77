"""Whether two checkouts compile the same attention kernels: ``python -m benchmarks.ptx_ab OLD NEW [--out FILE]``.

No GPU needed. Each checkout (a directory holding ``triton_paged_ops`` and ``tests``) plans a fixed list of calls as
an H200 would (its shipped table; 132 SMs, 227 KiB of shared memory) — decode, short queries, prefill, mixed and
prompt launches, batch-invariant mode, windows, caps, ALiBi, sinks, lse, request-pool rows, pages of 1/16/64, fp8
caches; head dims 64-256, GQA groups 1-16, bf16/fp16/fp32 — compiles the unified kernel for sm_90 in a process of
its own and writes its PTX normalised: the kernel's parameters named instead of numbered, registers numbered in
order of first use, declarations and debug lines dropped. The report puts each call's two kernels in one of
three classes: identical; the same instructions in another order (registers aside); or different, with the
instructions that differ. A refactor that means to change no kernel should show no "different" row.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, batch, max query, max keys, decode_tail hint, batch-invariant)
_CALLS = [("decode 1x32k", 1, 1, 32768, -1, False), ("decode 64x4k", 64, 1, 4096, -1, False),
          ("short 8x4k q4", 8, 4, 4096, -1, False), ("short 8x4k q16", 8, 16, 4096, -1, False),
          ("prefill 4x2k", 4, 2048, 2048, -1, False), ("mixed 64 on 4k", 64, 2048, 4096, 1, False),
          ("prompts 4x2k", 4, 2048, 2048, 0, False), ("invariant decode 8x8k", 8, 1, 8192, -1, True),
          ("invariant prefill 2x512 on 4k", 2, 512, 4096, -1, True)]  # fmt: skip
_FEATURE_CALLS = [("decode 8x8k", 8, 1, 8192, -1, False), ("prefill 4x1k on 4k", 4, 1024, 4096, -1, False),
                  ("mixed 32 on 4k", 32, 1024, 4096, 1, False)]  # fmt: skip
_FEATURES = ("window", "softcap", "alibi", "sinks", "lse", "rows", "page1", "page64", "fp8 scales")


def calls() -> list[dict]:
    """The fixed list of calls (each a dict of plain values)."""
    out = []
    for head_dim, group in ((128, 4), (64, 8), (256, 2), (128, 16), (128, 1)):
        for dtype, cache in (("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"), ("float16", "float16"),
                             ("float32", "float32")):  # fmt: skip
            if dtype == "float32" and head_dim == 256:
                continue
            for name, b, q, k, tail, inv in _CALLS:
                out.append(dict(name=name, head_dim=head_dim, group=group, dtype=dtype, cache=cache, batch=b,
                                max_q=q, max_k=k, tail=tail, invariant=inv, feature="", page_size=16))  # fmt: skip
    for feature in _FEATURES:
        cache = "float8_e4m3fn" if feature == "fp8 scales" else "bfloat16"
        page = {"page1": 1, "page64": 64}.get(feature, 16)
        for name, b, q, k, tail, inv in _FEATURE_CALLS:
            out.append(dict(name=name, head_dim=128, group=4, dtype="bfloat16", cache=cache, batch=b, max_q=q,
                            max_k=k, tail=tail, invariant=inv, feature=feature, page_size=page))  # fmt: skip
    return out


def _pose_as_h200():
    """Plan as an H200 in this process; returns the launch planner (this checkout's API or the one before it)."""
    from triton_paged_ops import configs

    configs.device_identity = lambda device_index: ("NVIDIA H200", "9.0")
    configs.triton_version = lambda: "3.6"
    if hasattr(configs, "CHOICES"):
        from triton_paged_ops import plan as planning

        configs._num_sms = lambda device_index: 132
        configs.max_shared_memory = lambda device_index: 232448
        configs.device_is_amd = lambda device_index: False
        planning.dependent_launch_supported = lambda device_index: True
        launch_plan = planning.attention_launch_plan
    else:  # the layout before the attention family was split (everything in kernels/attention.py)
        from triton_paged_ops import plan as splits
        from triton_paged_ops.kernels import attention

        splits._num_sms = lambda device_index: 132
        attention.max_shared_memory = lambda device_index: 232448
        attention.device_is_amd = lambda device_index: False
        attention.dependent_launch_supported = lambda device_index: True
        attention.tensor_descriptors_supported = lambda device_index, interpret: True
        launch_plan = attention.attention_launch_plan
    configs.reload()
    return launch_plan


def normalised_ptx(compiled, params: list[str]) -> list[str]:
    """The kernel's PTX body: parameters by name, registers renumbered by first use, declarations dropped."""
    name = compiled.metadata.name
    regs: dict[str, dict[str, str]] = collections.defaultdict(dict)

    def param(m):
        i = int(m.group(1))
        return "P:" + (params[i] if i < len(params) else f"extra{i - len(params)}")

    def reg(m):
        seen = regs[m.group(1)]
        return "%" + m.group(1) + seen.setdefault(m.group(2), str(len(seen)))

    lines = []
    for line in compiled.asm["ptx"].splitlines():
        t = line.strip()
        skip = ("//", ".file", ".loc", ".entry", ".param", ".visible", ".version", ".target", ".address_size", ".reg")
        if not t or t.startswith(skip):
            continue
        if t.startswith(".section"):
            break
        t = re.sub(re.escape(name) + r"_param_(\d+)", param, t)
        lines.append(re.sub(r"%(rd|r|p|f|fd|rs|h|hh|b)(\d+)", reg, t))
    return lines


def compile_all(out_dir: str) -> None:
    """In a checkout's process: plan and compile every call, one normalised PTX file each."""
    import inspect

    import torch

    from tests import compile_sm90
    from triton_paged_ops.kernels import attention

    launch_plan = _pose_as_h200()
    kernel = attention._paged_attention_kernel
    for i, c in enumerate(calls()):
        dtype, cache, f = getattr(torch, c["dtype"]), getattr(torch, c["cache"]), c["feature"]
        fp8 = cache.itemsize == 1
        lp = launch_plan(num_q_heads=8 * c["group"], num_kv_heads=8, head_dim=c["head_dim"], head_dim_v=c["head_dim"],
                         page_size=c["page_size"], dtype=dtype, cache_dtype=cache, num_seqs=c["batch"],
                         max_seqlen_q=c["max_q"], max_seqlen_k=c["max_k"], causal=True,
                         window_left=500 if f == "window" else -1, softcap=30.0 if f == "softcap" else 0.0,
                         has_alibi=f == "alibi", has_sinks=f == "sinks", has_k_scale=fp8, has_v_scale=fp8,
                         has_rows=f == "rows", want_lse=f == "lse", device_index=0, interpret=False,
                         batch_invariant=c["invariant"], decode_tail=c["tail"])  # fmt: skip
        f32, i32 = torch.float32, torch.int32
        pointers = {"q_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache, "lse_ptr": f32,
                    "out_ptr": f32 if lp.split.num_splits > 1 else dtype, "alibi_slopes_ptr": f32, "sinks_ptr": f32,
                    "k_scale_ptr": f32, "v_scale_ptr": f32, "block_table_ptr": i32, "block_table_rows_ptr": i32,
                    "cu_seqlens_q_ptr": i32, "seq_lens_ptr": i32,
                    # (parameters of the layout before the split)
                    "merge_count_ptr": i32, "final_out_ptr": dtype, "final_lse_ptr": f32}  # fmt: skip
        compiled = compile_sm90.compiled(kernel, pointers, ("sm_scale", "softcap"), lp.constexprs, lp.options)
        params = [p for p in inspect.signature(kernel.fn).parameters if p not in lp.constexprs]
        Path(out_dir, f"{i:03d}.ptx").write_text("\n".join(normalised_ptx(compiled, params)))
        print(i, c["name"], flush=True)


def _masked(lines: list[str]) -> collections.Counter:
    return collections.Counter(re.sub(r"%[a-z]+\d+", "%", line) for line in lines)


def compare(old_dir: str, new_dir: str) -> dict:
    rows = []
    for i, c in enumerate(calls()):
        a = Path(old_dir, f"{i:03d}.ptx").read_text().splitlines()
        b = Path(new_dir, f"{i:03d}.ptx").read_text().splitlines()
        label = f"{c['name']} D{c['head_dim']} group {c['group']} {c['dtype']}/{c['cache']} {c['feature']}".strip()
        if a == b:
            rows.append({"call": label, "result": "identical", "lines": len(a)})
            continue
        ma, mb = _masked(a), _masked(b)
        differ = {k: [ma[k], mb[k]] for k in set(ma) | set(mb) if ma[k] != mb[k]}
        rows.append({"call": label, "result": "reordered" if not differ else "different", "lines": [len(a), len(b)],
                     "instructions that differ": dict(sorted(differ.items())[:20])})  # fmt: skip
    counts = collections.Counter(r["result"] for r in rows)
    return {"counts": dict(counts), "calls": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ptx_ab", description=__doc__.splitlines()[0])
    p.add_argument("old", help="checkout directory of the old code")
    p.add_argument("new", help="checkout directory of the new code")
    p.add_argument("--out", default=None, help="JSON file to write (default: print the summary only)")
    p.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._compile:
        compile_all(args._compile)
        return 0
    dirs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, checkout in (("old", args.old), ("new", args.new)):
            out_dir = os.path.join(tmp, name)
            os.mkdir(out_dir)
            env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
            env.pop("TRITON_INTERPRET", None)
            here = Path(__file__).resolve()
            done = subprocess.run([sys.executable, str(here), args.old, args.new, "--_compile", out_dir],
                                  cwd=checkout, env=env, capture_output=True, text=True)  # fmt: skip
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            dirs.append(out_dir)
        result = compare(*dirs)
    print(json.dumps(result["counts"]), "of", len(result["calls"]), "calls")
    for row in result["calls"]:
        if row["result"] == "different":
            print(row["call"], row["instructions that differ"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
