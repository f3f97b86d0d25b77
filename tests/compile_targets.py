"""Compile the kernels for GPUs no shipped table names, without a GPU, and report each variant's shared memory (LDS
on AMD) against the GPU's limit as JSON.

Their launches take the planner's heuristic, fitted to the device's shared memory. This script (run without
``TRITON_INTERPRET``, as ``tests/compile_sm90.py`` is; the test suite runs it in a subprocess) poses as each GPU and
compiles the heuristic's variants (head dims 64/128/256, 16- and 32-bit inputs, decode, short queries, prefill)
through Triton's backend for it: an AMD Instinct MI300 (gfx942, 64 KiB of LDS; plus its fp8 format, the other
kernels and the batch-invariant and mixed-batch variants), a 99 KiB sm_89 GPU (L4, RTX 4090; sm_86 has the same)
and an A100 (sm_80). Code a backend rejects, or a tile whose buffers exceed the GPU's memory, shows here.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.backends.compiler import GPUTarget

from tests import compile_sm90
from tests.compile_sm90 import attention_variant, other_kernels
from triton_paged_ops import configs
from triton_paged_ops import plan as planning

# name: (compile target, device name and capability, shared memory one program may use, SMs / CUs)
GPUS = {
    "MI300X": (GPUTarget("hip", "gfx942", 64), ("AMD Instinct MI300X", "9.4"), 65536, 304),
    "L4": (GPUTarget("cuda", 89, 32), ("NVIDIA L4", "8.9"), 101376, 58),
    "A100": (GPUTarget("cuda", 80, 32), ("NVIDIA A100-SXM4-80GB", "8.0"), 166912, 108),
}


def pose_as(gpu: str) -> int:
    """Plan launches (device_index 0) and compile as on ``gpu`` (no dependent launches: the planner enables those
    on sm_90+ only); returns its shared-memory limit."""
    target, identity, limit, units = GPUS[gpu]
    compile_sm90.TARGET = target
    configs.device_identity = lambda device_index: identity
    configs._num_sms = lambda device_index: units
    configs.max_shared_memory = lambda device_index: limit
    planning.dependent_launch_supported = lambda device_index: False
    configs.device_is_amd = lambda device_index: target.backend == "hip"
    configs.reload()
    return limit


def heuristic_variants(gpu: str) -> list[dict]:
    """The heuristic's variants on ``gpu``, each with the GPU's limit (``limit``)."""
    limit = pose_as(gpu)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128, 256):
            for regime, max_q in (("decode", 1), ("short", 8), ("prefill", 512)):
                name = f"{gpu} {str(dtype).removeprefix('torch.')} D{head_dim} {regime}"
                r = attention_variant(name, dtype=dtype, head_dim=head_dim, max_q=max_q, sinks=True, device_index=0)
                results.append(r | {"limit": limit})
    return results


def mi300_extras() -> list[dict]:
    """What else an MI300 runs: its fp8 format (e4m3fnuz) in the cache and its writes, every feature at once, a
    mixed batch, the batch-invariant fold and split, and the merge kernel."""
    limit = pose_as("MI300X")
    fp8 = torch.float8_e4m3fnuz
    every_feature = dict(alibi=True, sinks=True, scales=True, rows=True)
    results = [
        attention_variant("MI300X decode fp8 cache", cache_dtype=fp8, scales=True, max_k=16384, device_index=0),
        attention_variant(
            "MI300X prefill all features",
            max_q=512,
            window=256,
            softcap=30.0,
            lse=True,
            device_index=0,
            **every_feature,
        ),  # fmt: skip
        attention_variant("MI300X prefill mixed batch", max_q=512, sinks=True, device_index=0, decode_tail=1),
        attention_variant("MI300X invariant decode split", max_k=32768, lse=True, invariant=True, device_index=0),
        attention_variant("MI300X invariant prefill fold", max_q=512, sinks=True, invariant=True, device_index=0),
    ]
    results += other_kernels("MI300X ", fp8)
    return [r | {"limit": limit} for r in results]


def main() -> int:
    results = [r for gpu in GPUS for r in heuristic_variants(gpu)] + mi300_extras()
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
