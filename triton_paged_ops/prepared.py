"""Prepared launches, found again from a call's metadata in about a microsecond.

An eager attention call's checks and launch planning read metadata only: host values (bounds, scale, flags) and each
tensor's type, shape, strides, dtype, device and ``requires_grad``. A later call with the same metadata can skip
both and launch what the first one prepared. :class:`PreparedLaunches` files prepared launches under a dict key of
host values and compares the tensors' metadata with a *matcher* built from the first call's tensors: PyTorch's
C++ tensor guards (the check ``torch.compile`` runs before reusing a compiled graph; ~1.3 µs for an attention call's
6 to 13 tensors where building and hashing a tuple of the same facts in Python takes ~5 µs), or, where the
installed PyTorch lacks them or they behave otherwise than expected, the same comparison in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _facts(t: torch.Tensor) -> tuple:
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad


class PythonMatcher:
    """Whether tensors have the metadata of the ones it was built from (type, shape, strides, dtype, device,
    ``requires_grad``), compared in Python."""

    __slots__ = ("facts",)

    def __init__(self, *tensors: torch.Tensor):
        self.facts = tuple(map(_facts, tensors))

    def check(self, *tensors) -> bool:
        try:
            return tuple(map(_facts, tensors)) == self.facts
        except (AttributeError, TypeError):  # not a tensor
            return False


def _tensor_guards() -> Callable[..., object] | None:
    """A factory of C++ tensor-guard matchers, or None when this PyTorch has none that passes a probe of what the
    cache relies on: same metadata matches; another shape, stride, dtype, type, ``requires_grad`` or a non-tensor
    does not."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(*tensors: torch.Tensor):
            return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

        a, b = torch.empty(2, 3), torch.empty(4)
        guard = make(a, b)
        same = guard.check(torch.empty(2, 3), torch.empty(4))
        others = (
            (torch.empty(3, 2), b), (torch.empty(3, 2).t(), b), (a.half(), b), (a, torch.empty(5)), (a, b.int()),
            (torch.empty(2, 3, requires_grad=True), b), (torch.nn.Parameter(a), b), (a, None), (a, 1),
        )  # fmt: skip
        if same and not any(guard.check(*o) for o in others):
            return make
    except Exception:  # absent or another interface: the Python matcher serves
        pass
    return None


_GUARDS = _tensor_guards()


def make_matcher(tensors: Sequence[torch.Tensor], python: bool = False):
    """A matcher (``.check(*tensors) -> bool``) for ``tensors``' metadata: C++ guards unless ``python`` or one
    tensor fills two slots (the guards never match such calls: they take each tensor object once)."""
    if _GUARDS is None or python or len(set(map(id, tensors))) < len(tensors):
        return PythonMatcher(*tensors)
    return _GUARDS(*tensors)


class Entry:
    """One prepared launch with what a hit must still verify."""

    __slots__ = ("matcher", "value", "capacity", "direct")

    def __init__(self, matcher, value, capacity: int, direct: bool):
        self.matcher = matcher
        self.value = value
        # Largest max_seqlen_k the block table admits (the one check whose value is not in the host key).
        self.capacity = capacity
        # Built from plain tensors needing no gradient: a typed wrapper may launch it without the dispatcher.
        self.direct = direct


class PreparedLaunches:
    """Prepared launches by host values, then tensor metadata.

    ``chains[host]`` lists the entries under one host key, newest first, at most ``chain_limit`` (a continuous
    batching loop keeps few metadata variants per host key, as the host key holds the query's shape); past
    ``limit`` entries in all, everything is dropped (plans are cheap to redo, unbounded growth is not)."""

    def __init__(self, limit: int = 4096, chain_limit: int = 8):
        self.chains: dict[tuple, list[Entry]] = {}
        self.limit, self.chain_limit = limit, chain_limit
        self._count = 0

    def find(self, host: tuple, tensors: tuple) -> Entry | None:
        chain = self.chains.get(host)
        if chain is not None:
            for entry in chain:
                if entry.matcher.check(*tensors):
                    return entry
        return None

    def add(self, host: tuple, tensors: tuple, value, capacity: int, direct: bool) -> None:
        if self._count >= self.limit:
            self.clear()
        chain = self.chains.setdefault(host, [])
        chain.insert(0, Entry(make_matcher(tensors), value, capacity, direct))
        self._count += 1
        if len(chain) > self.chain_limit:
            chain.pop()
            self._count -= 1

    def clear(self) -> None:
        self.chains.clear()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def values(self) -> list:
        """The prepared launches, oldest first within each host key."""
        return [e.value for chain in self.chains.values() for e in reversed(chain)]
