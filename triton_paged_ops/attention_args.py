"""The attention ops' arguments as one typed record, and the op schema generated from it.

The three attention ops (``paged_attention``, ``paged_attention_with_lse``, ``paged_attention_out``) share these 19
arguments; every layer from the typed wrappers to the launch reads them by name from one :class:`AttentionArgs`.
A ``NamedTuple``: building one costs about as much as the tuple it replaces (the eager host path is timed in
µs), and ``*args`` still gives the schema's positional order where the dispatcher is called.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch


class AttentionArgs(NamedTuple):
    """Arguments of one attention call (layouts, dtypes and units: ``api.paged_attention``)."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, Dv]
    block_table: torch.Tensor  # [B or R, max_pages] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, keys per sequence including the new tokens
    max_seqlen_q: int  # host-side bound of the query lengths
    max_seqlen_k: int  # host-side bound of seq_lens
    scale: float
    causal: bool = True
    window_left: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # [Hq] fp32
    sinks: torch.Tensor | None = None  # [Hq] fp32
    k_scale: torch.Tensor | None = None  # [1] fp32
    v_scale: torch.Tensor | None = None  # [1] fp32
    block_table_rows: torch.Tensor | None = None  # [B] int32/int64
    batch_invariant: bool = False
    decode_tail: int = -1

    def optional(self) -> tuple[torch.Tensor | None, ...]:
        """``(alibi_slopes, sinks, k_scale, v_scale, block_table_rows)``: the optional tensors, in schema order."""
        return self[OPTIONAL]


# The optional tensors' slice of the record (hot paths slice it directly).
OPTIONAL = slice(12, 17)
# A record from a complete tuple of the 19 values, without binding them one by one (the eager host path is timed
# in µs: the generated ``__new__`` costs ~0.5 µs a call).
record = tuple.__new__


# Python annotation -> schema type (ints are SymInt: under torch.compile a bound may be symbolic).
_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "int": "SymInt", "float": "float",
                 "bool": "bool"}  # fmt: skip


def attention_schema() -> str:
    """The 19 arguments as a ``torch.library`` schema fragment, in the record's order with its defaults."""
    parts = []
    for name, annotation in AttentionArgs.__annotations__.items():
        # (Annotations are strings here, which NamedTuple may wrap as forward references.)
        part = f"{_SCHEMA_TYPES[getattr(annotation, '__forward_arg__', annotation)]} {name}"
        if name in AttentionArgs._field_defaults:
            default = AttentionArgs._field_defaults[name]
            part += f"={'None' if default is None else default}"
        parts.append(part)
    return ", ".join(parts)


def bind(fn: str, args: tuple, options: dict) -> AttentionArgs:
    """The record of a call of ``fn`` in the ops' Python form: ``q`` to ``scale`` positional or by keyword, the rest
    by keyword only."""
    if len(args) > 9:
        raise TypeError(f"{fn}() takes at most 9 positional arguments (q to scale), got {len(args)}")
    return AttentionArgs(*args, **options)


def signature(return_annotation: object, extra: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """The Python signature of the calls ``bind`` accepts (for ``help()`` and IDEs): the record's fields, those
    after ``scale`` keyword-only, then ``extra``."""
    params = list(inspect.signature(AttentionArgs).parameters.values())
    params[9:] = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[9:]]
    return inspect.Signature([*params, *extra], return_annotation=return_annotation)
