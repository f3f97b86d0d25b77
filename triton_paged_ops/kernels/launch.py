"""Kernel launches with a short host path.

``kernel[grid](*args, **constexprs)`` makes Triton bind every argument, recompute its specialisation (type, 16-byte
alignment, divisibility, value 1) and hash it on each call: for the attention kernel's ~60 parameters that is tens
of µs of Python per launch, more than a decode step's GPU time. A :class:`Launcher` keeps, per kernel, the compiled
kernels it has already seen under a key of exactly the facts Triton specialises on, computed from the arguments in a
few µs, and calls the compiled kernel's launcher directly. The first call with a new key goes through Triton's own
path (which compiles if needed) and records what it returned, so both paths always run the same binary. If the
launcher interface of the installed Triton is not the expected one, the first failure switches the short path off
for the process and every launch goes through Triton's own path. In debug mode (``checks.set_debug_mode``) every short
launch also asks Triton which compiled kernel it would have chosen and raises if it is another one.

A caller that repeats a planned launch can go shorter still (``Launcher.launch_addresses``): it keeps the key and
the non-tensor arguments from the first launch and passes only the tensors' addresses, each read once even where
one tensor fills several parameters; a launch the recorded kernels cannot serve returns False, launching nothing,
and the caller takes the path above.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import triton
from triton.runtime import driver

from triton_paged_ops import checks

_INT32 = 1 << 31
# Triton's interpreter runs a kernel through process-wide state (the grid, the patched language): launches from two
# threads at once corrupt each other (an InterpreterError, or wrong outputs), so interpreted launches take turns.
_INTERPRETER_TURN = threading.RLock()
_INTERPRETING = bool(triton.knobs.runtime.interpret)
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])


def _interpreter_problem() -> str | None:
    """Why the installed Triton's interpreter cannot run these kernels, if it cannot."""
    import numpy

    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if _TRITON_VERSION < (3, 7) and numpy_version >= (2, 4):
        # 3.6 turns a loop bound into a Python int through a 1-element array, which numpy 2.4 no longer converts.
        return (
            f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1) fails with numpy {numpy.__version__} "
            "on loops with run-time bounds: install numpy<2.4, or Triton 3.7 or newer"
        )
    return None


def _repair_interpreter_comparisons() -> None:
    """Make the interpreter's comparisons typed int1, as compiled code has them.

    Triton's interpreter types a comparison's result as its operands' type; from 3.9 on, a scalar flag broadcast to a
    block (``valid & block_mask``) therefore becomes an integer array, which 3.9's loads and stores reject as a mask
    ("mask has unsupported dtype"). The values are right; only the recorded type is wrong, so it is corrected here.
    """
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_tpa_int1_comparisons", False):
        return
    int1 = triton.language.int1

    def typed(create):
        def create_comparison(self, lhs, rhs):
            out = create(self, lhs, rhs)
            return interpreter.TensorHandle(out.data.astype(bool, copy=False), int1)

        return create_comparison

    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(builder, name, typed(getattr(builder, name)))
    builder._tpa_int1_comparisons = True


if _INTERPRETING and _TRITON_VERSION >= (3, 9):
    _repair_interpreter_comparisons()


def interpreter_turn() -> contextlib.AbstractContextManager:
    """Hold around a kernel launch: one interpreted launch at a time in this process (nothing on GPUs)."""
    if not _INTERPRETING:
        return contextlib.nullcontext()
    global _checked_interpreter
    if not _checked_interpreter:
        problem = _interpreter_problem()
        if problem:
            raise RuntimeError(problem)
        _checked_interpreter = True
    return _INTERPRETER_TURN


_checked_interpreter = False


_enabled = True
_data_ptr = torch.Tensor.data_ptr


def _alignment(ptrs: list[int]) -> tuple[bool, ...] | bool:
    """The addresses' 16-byte alignment as Triton specialises on it: True when all are aligned (the usual case, told
    by one C call: their greatest common divisor is a multiple of 16 exactly then), else one flag per address."""
    if not math.gcd(*ptrs) & 15:
        return True
    return tuple([p % 16 == 0 for p in ptrs])


def _disable(launcher: Launcher) -> None:
    global _enabled
    _enabled = False
    launcher.cache.clear()


class _Entry:
    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled, self.tail = compiled, tail


class Launcher:
    """The short launch path of one ``@triton.jit`` kernel whose runtime parameters are ``num_tensors`` tensors,
    then ``num_floats`` Python floats, then Python ints, and whose constexpr parameters all come after them. Call
    sites must pass exactly those types (``float(x)``, ``int(x)``): the key does not re-check them."""

    def __init__(self, kernel, num_tensors: int, num_floats: int):
        self.kernel = kernel
        # The interpreter's kernels have no params (and no compiled launcher): they always take Triton's path.
        params = getattr(kernel, "params", None)
        self.interpreted = params is None
        ints = [p for p in (params or ())[num_tensors + num_floats :] if not p.is_constexpr]
        self.tensors = slice(0, num_tensors)
        self.spec_ints = [p.num for p in ints if not p.do_not_specialize]
        self.other_ints = [p.num for p in ints if p.do_not_specialize]
        self.cache: dict[tuple, _Entry] = {}
        self.fixed_ids: dict[tuple, int] = {}
        self.short_launches = 0  # how many launches took the short path (for tests and benchmarks)

    def fixed_key(self, args: tuple, device: int, static) -> tuple | None:
        """The part of the key that does not depend on tensor addresses: tensor dtypes, and for ints their width and
        (unless ``do_not_specialize``) value 1 or divisibility by 16. None: an int needs 64 bits (rare; Triton's own
        path handles it). Calls whose tensors have the same dtypes and whose ints are the same may reuse it."""
        spec = [args[i] for i in self.spec_ints]
        ints = spec + [args[i] for i in self.other_ints]
        if ints and (max(ints) >= _INT32 or min(ints) < -_INT32):
            return None
        dtypes = tuple([t.dtype for t in args[self.tensors]])
        full = (device, static, dtypes, tuple([v == 1 or (v % 16 == 0 and 2) for v in spec]))
        # Interned as a small int (hashed per call with the alignments) beside the device (for the stream).
        return self.fixed_ids.setdefault(full, len(self.fixed_ids)), device

    def key(self, args: tuple, device: int, static) -> tuple | None:
        """The whole cache key of a launch with these arguments: the fixed part and the tensors' 16-byte alignment."""
        fixed = self.fixed_key(args, device, static)
        return None if fixed is None else (fixed, _alignment(list(map(_data_ptr, args[self.tensors]))))

    def rest(self, scalars: tuple, constexprs: dict) -> tuple | None:
        """What follows the tensors' addresses in a compiled launch with these non-tensor arguments and constexprs
        (None: not a compiled kernel, or a constexpr it lacks): a launch plan can keep it for ``launch_addresses``."""
        if self.interpreted:
            return None
        tail = self._constexpr_tail(self.tensors.stop + len(scalars), constexprs)
        return None if tail is None else (*scalars, *tail)

    def _constexpr_tail(self, num_args: int, constexprs: dict) -> tuple | None:
        rest = self.kernel.params[num_args:]
        if all(p.is_constexpr and p.name in constexprs for p in rest):
            return tuple(constexprs[p.name] for p in rest)
        return None

    def launch_addresses(self, grid: tuple[int, int], ptrs: list[int], rest: tuple, fixed, stream: int) -> bool:
        """The shortest path, for a caller that planned the launch (``rest``: what ``rest`` returned; ``fixed``: the
        key an earlier launch with the same dtypes and non-tensor arguments returned) and read the tensors'
        addresses itself (``ptrs``, in argument order; a tensor passed twice is read once). False, having launched
        nothing: this needs the full path (first launch with this alignment, a launch hook set, debug mode, short
        path off)."""
        if fixed is None or not _enabled or checks.debug_mode():
            return False
        entry = self.cache.get((fixed, _alignment(ptrs)))
        if entry is None:
            return False
        runtime = triton.knobs.runtime
        enter = runtime.launch_enter_hook
        if enter is not None and getattr(enter, "calls", True):
            return False
        return self._run(entry.compiled, grid, stream, None, enter, ptrs, rest)

    def _run(self, compiled, grid: tuple, stream: int, meta, enter, head, rest: tuple) -> bool:
        """Call the compiled launcher with arguments ``*head, *rest``; False (and the short path off for good) if
        its interface is another one."""
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        try:
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter,
                         triton.knobs.runtime.launch_exit_hook, *head, *rest)  # fmt: skip
        except (AttributeError, TypeError):
            # Another Triton's launcher interface: take Triton's own path from now on.
            _disable(self)
            return False
        self.short_launches += 1
        return True

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, options: dict, static, fixed=None,
                 stream: int | None = None):  # fmt: skip
        """Launch ``kernel[grid](*args, **constexprs, **options)``; returns the fixed key it used (or None).

        ``static`` must identify ``constexprs`` and ``options`` (e.g. a launch plan's variant key): it is part of
        the cache key in their place, so they are not hashed per call. ``fixed``: what ``fixed_key`` returned for
        an earlier call with the same dtypes and non-tensor arguments (saves recomputing it). ``stream``: the raw
        handle of the device's current stream, if the caller has it (else looked up).
        """
        if self.interpreted or not _enabled:
            with interpreter_turn():
                self.kernel[grid](*args, **constexprs, **options)
            return None
        tensors = args[self.tensors]
        if fixed is None:
            fixed = self.fixed_key(args, tensors[0].device.index, static)
            if fixed is None:
                self.kernel[grid](*args, **constexprs, **options)
                return None
        # Addresses, read once: their 16-byte alignment completes the key, and the compiled launcher takes them as
        # ints (a tensor there costs a method call and a driver query each).
        ptrs = list(map(_data_ptr, tensors))
        key = (fixed, _alignment(ptrs))
        entry = self.cache.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            tail = self._constexpr_tail(len(args), constexprs)
            if tail is not None:
                self.cache[key] = _Entry(compiled, tail)
            return fixed
        compiled = entry.compiled
        if checks.debug_mode():
            chosen = self.kernel.warmup(*args, grid=grid, **constexprs, **options)
            if chosen is not compiled:
                raise RuntimeError(f"{self.kernel.fn.__name__}: the short launch path picked another compiled kernel "
                                   "than Triton would; report this with the call's shapes and strides")  # fmt: skip
        enter = triton.knobs.runtime.launch_enter_hook
        try:
            if stream is None:
                stream = driver.active.get_current_stream(fixed[1])
            # No hook set: None, or (Triton >= 3.7) an empty hook chain.
            if enter is None or not getattr(enter, "calls", True):
                head, meta = (*ptrs, *args[self.tensors.stop :]), None
            else:
                # Launch metadata feeds the enter hook (profilers), which may read the tensors themselves.
                head = args
                meta = compiled.launch_metadata(grid, stream, *args, *entry.tail)
        except (AttributeError, TypeError):
            stream = None
        if stream is None or not self._run(compiled, grid, stream, meta, enter, head, entry.tail):
            # Another Triton's launcher interface: Triton's own path (from now on: ``_run`` turned the short one off).
            _disable(self)
            self.kernel[grid](*args, **constexprs, **options)
            return None
        return fixed
