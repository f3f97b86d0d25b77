"""triton_paged_ops: paged attention for LLM inference, written in Triton only.

Importing the package registers the ``torch.ops.tpa.*`` custom ops; the functions below are their typed faces.
"""

from triton_paged_ops.api import (
    merge_attn_states,
    paged_attention,
    paged_attention_out,
    paged_attention_with_lse,
    reshape_and_cache,
)
from triton_paged_ops.cascade import cascade_attention
from triton_paged_ops.checks import debug_mode, decode_tail_of, set_debug_mode

__version__ = "0.1.0"

__all__ = [
    "cascade_attention",
    "debug_mode",
    "decode_tail_of",
    "merge_attn_states",
    "paged_attention",
    "paged_attention_out",
    "paged_attention_with_lse",
    "reshape_and_cache",
    "set_debug_mode",
]
