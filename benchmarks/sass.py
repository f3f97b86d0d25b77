"""Instruction statistics of an attention variant's loops, compiled for sm_90 without a GPU:
``python -m benchmarks.sass [--regime REGIME] [--head-dim D] [--page-size P] [--config JSON] [--json]``.

Compiles the kernel variant a launch would get on an H200 (the planner with the shipped H200 table; ``--config``
overrides launch options as ``attention_config_override`` does) with the installed Triton, assembles its PTX with
Triton's bundled ptxas (registers, spills, performance warnings) and disassembles the cubin. For each loop (a
backward branch) it counts, per thread and iteration (one KV tile): all instructions, tensor-core MMAs, CTA
barriers, async copies and their waits, shared-memory loads, spill loads/stores and exp2. Static counts, not a
profile: for comparing variants before spending GPU time (the NOTES quote them as "SASS per tile").
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

import torch
import triton

from tests import compile_sm90
from triton_paged_ops.configs import heuristic

# prompts: prefill said to hold no decodes.
MAX_Q = compile_sm90.MAX_Q_OF_REGIME
# Column: opcode prefixes counted in it.
COLUMNS = {
    "mma": ("HGMMA", "HMMA"),
    "barriers": ("BAR.SYNC",),
    "copies": ("LDGSTS", "UTMALDG", "UBLKCP"),
    "waits": ("DEPBAR", "SYNCS"),
    "shared_loads": ("LDS",),
    "spills": ("LDL", "STL"),
    "exp2": ("MUFU.EX2",),
}
_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_stats(sass: str, min_instructions: int = 50) -> list[dict]:
    """Per backward branch of the disassembly (a loop): its address range, instruction count and ``COLUMNS``."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    loops = []
    for i, (addr, text) in enumerate(code):
        branch = _BRANCH.search(text)
        target = int(branch.group(1), 16) if branch else None
        if target is None or target >= addr or target not in index or i + 1 - index[target] < min_instructions:
            continue
        body = code[index[target] : i + 1]
        # The opcode: the first word after an optional predicate (@P0, @!PT).
        ops = collections.Counter(t.split()[1] if t.startswith("@") else t.split()[0] for _, t in body)
        row = {"start": hex(target), "instructions": len(body)}
        row |= {col: sum(n for op, n in ops.items() if op.startswith(prefixes)) for col, prefixes in COLUMNS.items()}
        loops.append(row)
    return loops


_SERIALIZED = re.compile(
    r"\((C\d+)\)[^\n]*wgmma\.mma_async instructions are serialized due to (.*?)"
    r"(?: (?:for|in) the function\b[^\n]*)?$",
    re.MULTILINE,
)


def wgmma_serialization(report: str) -> str | None:
    """ptxas's reason for serializing the kernel's wgmmas (each waited for before the next is issued), as "code:
    reason" (C7512 register pressure, C7515 other instructions writing accumulator registers mid-pipeline), or
    None where its report has no such warning."""
    found = _SERIALIZED.search(report)
    return f"{found[1]}: {found[2]}" if found else None


def variant_stats(regime: str, head_dim: int, page_size: int, config: dict) -> dict:
    """Compile the variant (H200 identity and table, 132 SMs) and read its ptxas report and loops."""
    compile_sm90.pose_as("NVIDIA H200", "9.0", "3.6")
    compile_sm90.COMPILED.clear()
    with heuristic.attention_config_override(**config):
        variant = compile_sm90.attention_variant(regime, head_dim=head_dim, max_q=MAX_Q[regime], max_k=8192,
                                                 page_size=page_size, device_index=0,
                                                 decode_tail=0 if regime == "prompts" else -1)  # fmt: skip
    kernel = compile_sm90.COMPILED[0]
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        # (The ptxas Triton compiles sm_90 with: Triton 3.8+ bring a newer one beside the old.)
        from triton.backends.nvidia.compiler import get_ptxas

        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"variant": variant["plan"], "triton": triton.__version__, "shared_bytes": variant["attention_shared"],
            "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": [int(spills.group(1)), int(spills.group(2))] if spills else None,
            "serialized_wgmma": wgmma_serialization(report),
            "loops": loop_stats(sass)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--regime", choices=sorted(set(MAX_Q) - {"decode_large"}), default="prefill")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--config", default="{}",
                   help="launch option overrides as JSON, e.g. '{\"acc_rescale\": \"always\"}'")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as exc:
        p.error(f"--config takes a JSON object, got {args.config!r}: {exc}")
    if not isinstance(config, dict):
        p.error(f"--config takes a JSON object, got {args.config!r}")
    try:
        with heuristic.attention_config_override(**config):  # (checks the keys and values, names the bad one)
            pass
    except ValueError as exc:
        p.error(f"--config: {exc}")
    stats = variant_stats(args.regime, args.head_dim, args.page_size, config)
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"{stats['variant']}\nTriton {stats['triton']}, shared {stats['shared_bytes']} B, "
          f"{stats['registers']} registers, spill bytes (stores, loads) {stats['spill_bytes']}, "
          f"wgmma serialized: {stats['serialized_wgmma']}")  # fmt: skip
    cols = ["start", "instructions", *COLUMNS]
    print("".join(f"{c:>14}" for c in cols))
    for row in stats["loops"]:
        print("".join(f"{row[c]!s:>14}" for c in cols))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
