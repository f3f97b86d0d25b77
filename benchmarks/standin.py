"""Stand-ins for compiled kernels, to exercise and time the eager host path where no GPU is.

Inside :func:`recording_launches`, the attention and reduce launchers wrap stand-ins that have the real kernels'
parameters (read from their signatures, so the launch planning, keys and argument lists are the real ones) and
record every launch instead of running it: Triton's own launches as ``(grid, args, constexprs)``, short-path launches
as the arguments the compiled launcher would get. Tests compare the two paths' arguments with it; ``python -m
benchmarks.host_path`` times the host path with it. Nothing here runs a kernel: outputs are left unwritten.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator

import torch

from triton_paged_ops import ops, prepared
from triton_paged_ops.kernels import attention, merge
from triton_paged_ops.kernels.launch import Launcher


class _CompiledStandIn:
    """What ``kernel[grid](...)`` returns on a GPU, reduced to a ``run`` that records its arguments."""

    function, packed_metadata = 0, None

    def __init__(self, runs: list):
        self.runs = runs

    def run(self, gx, gy, gz, stream, function, packed, meta, enter, exit_hook, *args):
        self.runs.append(((gx, gy, gz), stream, args))


class KernelStandIn:
    """A compiled ``@triton.jit`` kernel as a :class:`Launcher` sees it: the real kernel's parameters, and
    ``kernel[grid](*args, **constexprs)``, which records one of Triton's own launches in ``own`` and returns a
    compiled stand-in whose launches go to ``runs``."""

    def __init__(self, real, do_not_specialize: tuple[str, ...]):
        names = inspect.signature(real.fn).parameters.values()
        self.params = [types.SimpleNamespace(num=i, name=p.name, do_not_specialize=p.name in do_not_specialize,
                                             is_constexpr="constexpr" in str(p.annotation))
                       for i, p in enumerate(names)]  # fmt: skip
        self.fn = real.fn
        self.own: list[tuple] = []  # (grid of 3, args, constexprs) per launch through Triton's own path
        self.runs: list[tuple] = []  # (grid of 3, stream, arguments) per short-path launch

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.own.append((tuple(grid) + (1,) * (3 - len(grid)), args, kwargs))
            return _CompiledStandIn(self.runs)

        return launch

    def expected_run(self, own: tuple) -> tuple:
        """(grid, arguments) the compiled launcher gets for a repeat of an own launch: addresses, then the rest."""
        grid, args, kwargs = own
        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        values += [kwargs[p.name] for p in self.params[len(args) :]]
        return grid, tuple(values)


@contextlib.contextmanager
def recording_launches(stream: int = 0x5EED) -> Iterator[tuple[KernelStandIn, KernelStandIn]]:
    """Within the block, attention ops on any device (CPU included) plan and launch as on a GPU whose current
    (and default) stream has the raw handle ``stream``, into the yielded (attention, reduce) stand-ins. Prepared
    launches are dropped on entry and exit (they would keep the stand-ins' keys)."""
    attention_kernel = KernelStandIn(attention._paged_attention_kernel, attention._PER_BATCH_ARGS)
    reduce_kernel = KernelStandIn(merge._reduce_splits_kernel, merge._REDUCE_UNSPECIALISED)
    attention_launcher = Launcher(attention_kernel, num_tensors=13, num_floats=2)
    reduce_launcher = Launcher(reduce_kernel, num_tensors=5, num_floats=0)
    saved = [(prepared, "_launch_attention"), (prepared, "_launch_reduce"), (merge, "_launch_reduce"),
             (prepared, "current_stream"), (prepared, "_default_stream"), (ops, "_use_kernels")]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    prepared._launch_attention = attention_launcher
    prepared._launch_reduce = merge._launch_reduce = reduce_launcher
    prepared.current_stream = prepared._default_stream = lambda device_index: stream
    ops._use_kernels = lambda t: True
    prepared.PREPARED.clear()
    try:
        yield attention_kernel, reduce_kernel
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        prepared.PREPARED.clear()
