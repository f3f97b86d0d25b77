"""A small Llama-style model, paged KV-cache manager and continuous-batching generation loop built on the tpa ops."""

from triton_paged_ops.models.generate import PagedKVCache, Request, StepStats, build_batch, generate
from triton_paged_ops.models.llama import PRESETS, Batch, Llama, LlamaConfig

__all__ = [
    "PRESETS",
    "Batch",
    "Llama",
    "LlamaConfig",
    "PagedKVCache",
    "Request",
    "StepStats",
    "build_batch",
    "generate",
]
