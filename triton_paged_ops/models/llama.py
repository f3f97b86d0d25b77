"""A small Llama-style decoder whose attention runs through ``torch.ops.tpa``: the proof that the ops compose.

RMSNorm, rotary embeddings, GQA attention over a paged KV cache, SwiGLU MLP. Weights are random (seeded), sized by
a named preset from ``tiny`` (CPU, interpreter) to ``1b`` (GPU). One ``forward`` serves prefill, decode and mixed
batches: the batch layout is the ops' own (tokens back to back, ``cu_seqlens_q``, ``seq_lens``, ``block_table``,
``slot_mapping``), so the same compiled graph handles any mix of requests.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from triton_paged_ops import reference


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


PRESETS = {
    # Small enough for Triton's interpreter on a CPU.
    "tiny": LlamaConfig(vocab_size=512, hidden=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate=256),
    # Llama-3.2-1B's shape.
    "1b": LlamaConfig(vocab_size=128256, hidden=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      intermediate=8192),
}  # fmt: skip


@dataclasses.dataclass
class Batch:
    """One forward step's tokens and their place in the paged cache (the layout of ``tpa.paged_attention``).

    ``tokens``, ``positions``, ``slot_mapping``: ``[T]`` int (token ids, absolute positions, cache slots; a negative
    slot marks a padding token). ``block_table [B, max_pages]``, ``cu_seqlens_q [B+1]``, ``seq_lens [B]``: int32.
    ``max_seqlen_q``, ``max_seqlen_k``: host-side bounds.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: LlamaConfig, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim // 2]`` in fp32."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by per-token ``cos``/``sin`` ``[T, D/2]`` (half-split layout, as in Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: str):
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        # The op called for attention; swappable so that registrations can be compared on one model.
        self.attention_op = torch.ops.tpa.paged_attention
        self.qkv = nn.Linear(cfg.hidden, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, batch: Batch, k_cache, v_cache, cos, sin) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv(x).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1
        )
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        args = (batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
        scale = cfg.head_dim**-0.5
        if self.attention == "tpa":
            torch.ops.tpa.reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            out = self.attention_op(q, k_cache, v_cache, *args, batch.max_seqlen_q, batch.max_seqlen_k, scale)
        else:  # the PyTorch reference: eager only (it reads lengths back to the host)
            reference.reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            out = reference.paged_attention(q, k_cache, v_cache, *args, batch.max_seqlen_q, batch.max_seqlen_k, scale)
        return self.o(out.reshape(-1, cfg.num_heads * cfg.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: str):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, attention)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x, batch, k_cache, v_cache, cos, sin):
        x = x + self.attn(self.attn_norm(x), batch, k_cache, v_cache, cos, sin)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Llama(nn.Module):
    """The decoder. ``forward(batch)`` returns the logits ``[B, vocab]`` of each sequence's last token.

    The paged K/V caches are buffers of the model (``setup_cache``), written in place by every forward: fixed
    addresses and shapes, so a compiled model can be replayed as a CUDA graph (as in gpt-fast).
    """

    def __init__(self, cfg: LlamaConfig, attention: str = "tpa", max_positions: int = 8192):
        super().__init__()
        if attention not in ("tpa", "reference"):
            raise ValueError(f"attention must be 'tpa' or 'reference', got {attention!r}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, max_positions, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def setup_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> None:
        """Allocate each layer's K and V page pools ``[num_pages, page_size, Hkv, D]`` (zeros) on the model's device."""
        cfg = self.cfg
        dtype = dtype or self.embed.weight.dtype
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        for i in range(cfg.num_layers):
            for kind in ("k", "v"):
                # Separate tensors per layer and kind, not views of one buffer: torch.compile (2.13) mis-handled
                # in-place writes to several views of one base across a dynamic-shape recompile.
                buf = torch.zeros(shape, dtype=dtype, device=self.embed.weight.device)
                self.register_buffer(f"{kind}_cache_{i}", buf, persistent=False)
                # Fixed shape: dynamic compilation must not tie a cache dim to an equal-valued batch dim.
                torch._dynamo.mark_static(buf)

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) for i in range(self.cfg.num_layers)]

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> Llama:
        """Seeded random weights, scaled so activations stay O(1) through the layers."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".attn_norm." in name or ".mlp_norm." in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        return self

    def forward(self, batch: Batch) -> torch.Tensor:
        if not hasattr(self, "k_cache_0"):
            raise RuntimeError("call setup_cache(num_pages, page_size) before the first forward")
        cos = self.rope_cos[batch.positions]
        sin = self.rope_sin[batch.positions]
        x = self.embed(batch.tokens)
        for block, (k_cache, v_cache) in zip(self.blocks, self.kv_caches(), strict=True):
            x = block(x, batch, k_cache, v_cache, cos, sin)
        last = (batch.cu_seqlens_q[1:] - 1).clamp_min(0).long()  # each sequence's last new token
        return self.lm_head(self.norm(x[last])).float()
