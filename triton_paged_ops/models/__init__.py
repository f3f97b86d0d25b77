"""A small Llama-style model, paged KV-cache manager and continuous-batching generation loop built on the tpa ops."""

from triton_paged_ops.models.generate import PagePool, Request, StepStats, build_batch, generate
from triton_paged_ops.models.llama import PRESETS, Batch, Llama, LlamaConfig

__all__ = [
    "PRESETS",
    "Batch",
    "Llama",
    "LlamaConfig",
    "PagePool",
    "Request",
    "StepStats",
    "build_batch",
    "generate",
]
