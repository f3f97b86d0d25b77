"""Interpreted launches planned as on a GPU: the tiles, splits and flags a GPU's table or the heuristic picks, run
by Triton's interpreter on CPU tensors.

Without this the interpreter plans its own few large tiles, so the tiles GPUs run (the shipped H200 table's, the
heuristic's) would meet the reference only on a GPU. Inside :func:`planned_as` every interpreted launch is planned
for device 0 posing as the given GPU (its name, compute capability, Triton version, SM count and shared memory), as
the offline compile scripts pose; what only a GPU can run is then left out of the plan: the warp-specialized
sm_90 prefill kernel (the launch runs the unified kernel it falls back to) and programmatic dependent launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

from triton_paged_ops import configs, prepared
from triton_paged_ops import plan as planning


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    capability: str
    triton: str  # the Triton version the planner is told (a table entry is per Triton version)
    shared: int  # bytes of shared memory (LDS) one program may use
    units: int  # SMs / CUs
    amd: bool = False


# The GPU of the shipped table, and GPUs no table names (their launches take the heuristic).
H200 = Gpu("NVIDIA H200", "9.0", "3.6", 232448, 132)
H100 = Gpu("NVIDIA H100 80GB HBM3", "9.0", "3.6", 232448, 132)
MI300X = Gpu("AMD Instinct MI300X", "9.4", "3.6", 65536, 304, amd=True)
POSES = {"h200-table": H200, "heuristic": H100, "heuristic-mi300x": MI300X}

# Variants (``LaunchPlan.variant()``, as planned for the GPU) that interpreted launches ran inside ``planned_as``.
LAUNCHED: set[tuple] = set()

_PLAN = planning._cached_launch_plan
_PARAMS = inspect.signature(_PLAN.__wrapped__)


def _posed_plan(*args):
    bound = _PARAMS.bind(*args)
    if not bound.arguments["interpret"]:
        return _PLAN(*args)
    bound.arguments["interpret"], bound.arguments["device_index"] = False, 0
    lp = _PLAN(*bound.args)
    LAUNCHED.add(lp.variant())
    # (The interpreter ignores ``maxnreg``; the Gluon kernel does not run there: its launches take the unified one.)
    return dataclasses.replace(lp, ws=None)


@contextlib.contextmanager
def planned_as(gpu: Gpu) -> Iterator[None]:
    """Plan interpreted launches (and ``attention_launch_plan`` for device 0) as on ``gpu`` inside the block."""
    patches = [
        (configs, "device_identity", lambda device_index: (gpu.name, gpu.capability)),
        (configs, "triton_version", lambda: gpu.triton),
        (configs, "_num_sms", lambda device_index: gpu.units),
        (configs, "max_shared_memory", lambda device_index: gpu.shared),
        (configs, "device_is_amd", lambda device_index: gpu.amd),
        # The interpreter cannot run a dependent launch's grid-dependency control.
        (planning, "dependent_launch_supported", lambda device_index: False),
        (planning, "_cached_launch_plan", _posed_plan),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    configs.reload()
    prepared.PREPARED.clear()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        configs.reload()
        prepared.PREPARED.clear()
