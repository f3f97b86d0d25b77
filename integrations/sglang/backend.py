"""SGLang ``AttentionBackend`` over the ``tpa`` ops: a translation table from SGLang's batch to ours.

SGLang keeps K/V in a token-slot pool (``[slots, Hkv, D]`` per layer) and maps each request's positions to slots
through ``req_to_token``. Two views of it, neither copying the pool:

* **tokens** (SGLang's page size 1): one-token pages, ``k_cache [slots, 1, Hkv, D]``, and ``req_to_token`` itself is
  the block table, a request's row picked by ``req_pool_indices`` (the ops' ``block_table_rows``).
* **pages** (page size P > 1): SGLang's allocator gives each request whole pages (slot = page * P + offset, the
  offsets in order), so ``k_cache [slots / P, P, Hkv, D]`` and a page table ``req_to_token[rows, ::P] // P`` built
  on the device once per batch. The kernels then read pages of P tokens (the tiles and prefill kernels that need
  pages of 16 or more become reachable).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

import triton_paged_ops as tpa
from triton_paged_ops import checks, ops
from triton_paged_ops.checks import FLOAT_DTYPES, FP8_DTYPES

logger = logging.getLogger(__name__)
# Speculative verification of draft chains is a causal extend (see _draft_chain); draft trees, draft extend (the
# draft model's own backend) and diffusion modes need masks/metadata this backend lacks.
_EAGER_MODES = ("EXTEND", "MIXED", "DECODE", "IDLE", "TARGET_VERIFY")


def _draft_chain(forward_batch) -> int:
    """Draft tokens per request of a TARGET_VERIFY batch whose drafts form a chain (EAGLE/MTP with topk 1, DFlash):
    draft ``i`` sees the request's cached keys and drafts ``0..i``, the ops' bottom-right causal mask over
    ``seq_lens + n`` keys. Trees (topk > 1, n-gram) are refused: they need a per-request custom mask."""
    spec = forward_batch.spec_info
    topk = getattr(spec, "topk", None)
    if topk is None:
        topk = getattr(spec, "tree_topk", None)
    num = getattr(spec, "draft_token_num", None)
    if topk != 1 or not num:
        raise NotImplementedError(
            f"tpa backend: target verify of draft trees is not supported, only of draft chains (topk 1, e.g. "
            f"--speculative-eagle-topk 1); got {type(spec).__name__} with topk {topk}, draft_token_num {num}"
        )
    if getattr(spec, "ragged_verify_layout", None) is not None:
        raise NotImplementedError("tpa backend: ragged target verify (SGLANG_RAGGED_VERIFY_MODE) is not supported")
    return int(num)


def _refuse_extras(kwargs: dict) -> None:
    """SGLang hands layer features the ops lack to the backend as keyword arguments (``score_mod``, ``aux_tensors``,
    MLA's ``q_rope``/``k_rope``, fp8 query descales, ``return_lse`` ...): one that is set is refused, not ignored."""
    used = sorted(name for name, value in kwargs.items() if value is not None and value is not False)
    if used:
        raise NotImplementedError(f"tpa backend: layer arguments not supported: {', '.join(used)}")


def bidirectional_extend_allowed() -> bool:
    """Whether SGLang lets a bidirectional decoder layer (``AttentionType.DECODER_BIDIRECTIONAL``) see its whole
    prompt in an extend: only when a prompt arrives whole (chunked prefill off) and no prefill CUDA graph splits or
    pads requests, the rule of SGLang's Triton backend. False when SGLang's config is not published."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import (
            Backend,
            Phase,
            check_cuda_graph_backend,
            cuda_graph_fully_disabled,
        )
        from sglang.srt.runtime_context import get_schedule

        graphs_ok = cuda_graph_fully_disabled() or check_cuda_graph_backend(Phase.PREFILL, Backend.BREAKABLE)
        return bool(graphs_ok and get_schedule().chunked_prefill_size == -1)
    except (ImportError, AttributeError, ValueError):
        return False


@dataclasses.dataclass
class TpaMetadata:
    """Per-batch metadata shared by all layers (the ops' page-table vocabulary).

    ``block_table`` is SGLang's ``req_to_token`` itself and ``rows`` picks each request's row of it, so no per-step
    copy of the token map is made.
    """

    # Token view: req_to_token [req_pool_size, max_context_len] int32 (token slots = ids of one-token pages).
    # Page view: [B, pages] int32, this batch's page ids (SGLang's page size).
    block_table: torch.Tensor
    rows: torch.Tensor | None  # [B] req_pool_indices (token view); None (page view: the table has the batch's rows)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, prefix + new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    in_graph: bool = False  # rows/seq_lens are static buffers refilled by init_forward_metadata_in_graph
    # What SGLang's seq_lens lack of the keys (target verify: the drafts, whose keys are written by the same step).
    added_keys: int = 0
    # The ops' decode_tail hint: a mixed batch lists its extend requests first, then its decodes (-1: not known).
    decode_tail: int = -1


def deterministic_inference(model_runner) -> bool:
    """SGLang's ``--enable-deterministic-inference`` as this runner sees it."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().deterministic.enable_deterministic_inference)
    except (ImportError, AttributeError, ValueError):  # config not published (e.g. a bare runner)
        server_args = getattr(model_runner, "server_args", None)
        return bool(getattr(server_args, "enable_deterministic_inference", False))


class TpaAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        # Deterministic inference: every call in batch-invariant mode (a request's outputs do not depend on what it
        # is batched with, nor on prefill chunking).
        self.batch_invariant = deterministic_inference(model_runner)
        self.bidirectional_extend = bidirectional_extend_allowed()
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        if self.req_to_token.dtype != torch.int32:
            raise NotImplementedError(f"tpa backend: req_to_token must be int32, got {self.req_to_token.dtype}")
        self.max_context_len = self.req_to_token.shape[1]
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        chunk = getattr(model_runner, "attention_chunk_size", None)
        if chunk is not None:
            # Chunked local attention (Llama 4): keys only inside the query's chunk, a mask the ops lack.
            raise NotImplementedError(f"tpa backend: chunked local attention (attention_chunk_size {chunk}) is not "
                                      "supported")  # fmt: skip
        if getattr(getattr(model_runner, "server_args", None), "enable_unified_memory", False):
            # req_to_token then holds virtual slot ids, translated per sub-pool by SGLang's own readers.
            raise NotImplementedError("tpa backend: --enable-unified-memory is not supported")
        if isinstance(self.token_to_kv_pool, BaseSWAKVPool):
            # Its window layers' slots are another id space (and evicted past the window): req_to_token does not
            # address them.
            raise NotImplementedError(
                "tpa backend: hybrid sliding-window KV pools are not supported; start SGLang with "
                "--disable-hybrid-swa-memory (one pool for all layers; the window is still applied)"
            )
        self.page_size = int(getattr(self.token_to_kv_pool, "page_size", None) or getattr(model_runner, "page_size", 1))
        layout = getattr(self.token_to_kv_pool, "kv_cache_layout", "nhd")
        if layout not in ("nhd", "hnd"):
            raise NotImplementedError(f"tpa backend: KV cache layout {layout!r} is not supported (only 'nhd', or "
                                      "'hnd' from SGLANG_USE_HND_KVCACHE)")  # fmt: skip
        self.hnd = layout == "hnd"  # pool buffers [pages, Hkv, P, D]
        # The page view wherever SGLang's pages have more than one token (or its buffers are per page).
        self.paged = self.page_size > 1 or self.hnd
        self.forward_metadata: TpaMetadata | None = None
        on_cpu = torch.device(self.device).type == "cpu"
        served_by = "the PyTorch reference" if on_cpu and not ops.INTERPRET else "the Triton kernels"
        logger.info("tpa backend: %s view of the KV pool (page size %d), served by %s%s",
                    "page" if self.paged else "token", self.page_size, served_by,
                    " under Triton's interpreter" if on_cpu and ops.INTERPRET else "")  # fmt: skip
        # fp8 caches: each layer's dequantisation scales as the ops take them (see _scales). The unit scale is made
        # here, not on first use, which may fall inside a CUDA-graph capture.
        self._kv_scales: dict[int, tuple] = {}
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        self._arange = torch.arange(257, dtype=torch.int32, device=self.device)  # see _decode_offsets
        self._graph_metadata: dict[tuple[int, int], TpaMetadata] = {}  # by (batch size, drafts per request)
        if torch.device(self.device).type == "cuda" and os.environ.get("TPA_WARMUP", "1") != "0":
            try:
                self._warmup(model_runner)
            except Exception as exc:  # serving still works without it: kernels then compile on first use
                logger.warning("tpa warm-up failed (%s: %s); kernels will compile on first use",
                               type(exc).__name__, exc)  # fmt: skip

    def _warmup(self, model_runner) -> None:
        """Compile the kernels serving will use now, not in the middle of serving (``TPA_WARMUP=0`` skips it).

        Covers the plain variants (no window, sinks or soft cap, which vary per layer and are compiled on first
        use); batch, query and context limits come from the runner's request pool and chunked-prefill size.
        """
        from triton_paged_ops.warmup import ServingSettings, warmup

        cfg = model_runner.model_config
        tp = getattr(model_runner, "tp_size", 1) or 1
        max_batch = getattr(model_runner, "max_running_requests", None) or self.req_to_token.shape[0]
        server_args = getattr(model_runner, "server_args", None)
        chunk = getattr(server_args, "chunked_prefill_size", None)
        if not chunk or chunk <= 0:  # chunked prefill off (-1): a prompt may be as long as the context
            chunk = self.max_context_len
        # An fp8 pool is always read with scales (the layer's, or 1): see _scales.
        cache_dtype = self._cache_dtype(model_runner)
        settings = ServingSettings(
            num_q_heads=cfg.get_num_attention_heads(tp), num_kv_heads=cfg.get_num_kv_heads(tp),
            head_dim=cfg.head_dim, head_dim_v=getattr(cfg, "v_head_dim", None) or cfg.head_dim,
            page_size=self.page_size if self.paged else 1,
            dtype=model_runner.dtype, cache_dtype=cache_dtype, kv_scale=cache_dtype is not None,
            max_batch=max_batch, max_context=self.max_context_len, max_query=max(1, min(chunk, self.max_context_len)),
            block_table_rows=not self.paged, batch_invariant=self.batch_invariant, decode_tail=True,
        )  # fmt: skip
        report = warmup(settings, self.device)
        logger.info("tpa warm-up: %d attention variants in %.1f s", report.variants, report.seconds)

    def _cache_dtype(self, model_runner) -> torch.dtype | None:
        """The K/V pool's element dtype when it is not the model's (an fp8 cache), else None."""
        dtype = getattr(model_runner, "kv_cache_dtype", None)
        return dtype if isinstance(dtype, torch.dtype) and dtype != model_runner.dtype else None

    def _scales(self, layer, k_buf: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` for the ops: None for a 16/32-bit cache; for an fp8 cache the layer's checkpoint
        scales (SGLang divides K/V by them before the cast to fp8), or 1 where the checkpoint has none (SGLang then
        casts unscaled)."""
        if k_buf.dtype in FLOAT_DTYPES:
            return None, None
        if k_buf.dtype not in FP8_DTYPES:
            raise NotImplementedError(
                f"tpa backend: KV cache dtype {k_buf.dtype} is not supported (fp8 caches must be float8_e4m3fn, or "
                "float8_e4m3fnuz on ROCm; use --kv-cache-dtype fp8_e4m3 or auto)"
            )
        k_param, v_param = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
        kept = self._kv_scales.get(layer.layer_id)
        if kept is None or kept[0] is not k_param or kept[1] is not v_param:
            # Plain-tensor aliases of the parameters (same storage, so later in-place updates show): the ops' eager
            # fast path takes plain tensors only.
            kept = (k_param, v_param, self._as_scale(k_param, k_buf.device), self._as_scale(v_param, k_buf.device))
            self._kv_scales[layer.layer_id] = kept
        return kept[2], kept[3]

    def _as_scale(self, param, device) -> torch.Tensor:
        if param is None:
            return self._unit_scale
        if not isinstance(param, torch.Tensor):  # a Python number
            return torch.full((1,), float(param), dtype=torch.float32, device=device)
        return param.detach().reshape(1).to(device=device, dtype=torch.float32)

    def init_forward_metadata(self, forward_batch):
        """Eager batches (extend, decode, mixed, chain verify): metadata from the batch's own tensors."""
        mode = forward_batch.forward_mode
        if mode.name not in _EAGER_MODES:
            raise NotImplementedError(f"tpa backend: forward mode {mode.name} is not supported (only {_EAGER_MODES})")
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise NotImplementedError("tpa backend: encoder-decoder batches (encoder_lens) are not supported")
        bs = forward_batch.batch_size
        added = _draft_chain(forward_batch) if mode.is_target_verify() else 0
        decode_tail = -1
        seq_lens = (forward_batch.seq_lens + added if added else forward_batch.seq_lens).to(torch.int32)
        if forward_batch.forward_mode.is_decode_or_idle():
            cu = self._decode_offsets(bs)
            max_q = 1
        elif added:
            cu = torch.arange(0, bs * added + 1, added, dtype=torch.int32, device=self.device)
            max_q = added
        else:
            cu = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            cu[1:] = torch.cumsum(forward_batch.extend_seq_lens, 0)
            lens_cpu = forward_batch.extend_seq_lens_cpu
            max_q = max(lens_cpu) if lens_cpu is not None and len(lens_cpu) else int(cu.diff().max())
            if lens_cpu is not None:
                decode_tail = tpa.decode_tail_of(list(lens_cpu))
        seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        # A host bound of the context lengths; without one, the pool's width (always a bound).
        if seq_lens_cpu is not None and len(seq_lens_cpu):
            max_k = int(seq_lens_cpu.max()) + added
        else:
            max_k = self.max_context_len
        max_k = min(max(1, max_k), self.max_context_len)
        if self.paged:
            table, rows = self._page_table(forward_batch.req_pool_indices, max_k), None
            if checks.debug_mode():
                self._check_whole_pages(forward_batch.req_pool_indices, seq_lens, table)
        else:
            table, rows = self.req_to_token, forward_batch.req_pool_indices
        self.forward_metadata = TpaMetadata(
            table, rows, cu, seq_lens, max_q, max_k, added_keys=added, decode_tail=decode_tail
        )  # fmt: skip

    def _decode_offsets(self, bs: int) -> torch.Tensor:
        """``[0, 1, ..., bs]`` (one query row per request), a view of a kept tensor: no kernel per decode step."""
        if self._arange.shape[0] <= bs:
            self._arange = torch.arange(max(2 * bs, 256) + 1, dtype=torch.int32, device=self.device)
        return self._arange[: bs + 1]

    def _page_columns(self, max_k: int) -> torch.Tensor:
        """``req_to_token``'s first slot of each page, for contexts of up to ``max_k`` keys (a strided view)."""
        p = self.page_size
        return self.req_to_token[:, : -(-max_k // p) * p : p]

    def _page_table(self, rows: torch.Tensor, max_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's page table on the device, no host sync: each row's page-start slots divided by the page
        size (``out``: a static buffer of the graph path, filled in place)."""
        cols = self._page_columns(max_k)
        if out is None:
            return torch.index_select(cols, 0, rows).floor_divide_(self.page_size)
        torch.index_select(cols, 0, rows, out=out)
        return out.floor_divide_(self.page_size)

    def _check_whole_pages(self, rows: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor) -> None:
        """Debug mode (``TPA_DEBUG=1``; synchronises): the page view's premise, that position ``i`` of a request
        sits in slot ``table[i // P] * P + i % P``, holds for every key of the batch."""
        p, width = self.page_size, table.shape[1] * self.page_size
        tokens = self.req_to_token[rows.long(), :width]
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        expected = table.repeat_interleave(p, dim=1)[:, : tokens.shape[1]] * p + pos % p
        bad = ((tokens != expected) & (pos < seq_lens[:, None])).nonzero()
        if bad.numel():
            b, i = bad[0].tolist()
            raise ValueError(
                f"tpa backend: req_to_token row {int(rows[b])} position {i} holds slot {int(tokens[b, i])}, not "
                f"{int(expected[b, i])}: the request's slots are not whole pages of {p} in order"
            )

    def _cache_view(self, buf: torch.Tensor) -> torch.Tensor:
        """A layer's K or V pool buffer as the ops' paged cache ``[pages, page_size, Hkv, D]``, without a copy."""
        if self.hnd:  # [pages, Hkv, P, D]
            return buf.transpose(1, 2)
        if not self.paged:  # token slots as one-token pages
            return buf.unsqueeze(1)
        # Slot s is token s % P of page s // P; a last, partial page (SGLang pads the buffer by one page and never
        # hands out its tail) is left out.
        p = self.page_size
        n = buf.shape[0] // p
        return buf[: n * p].unflatten(0, (n, p))

    # CUDA graphs (decode and chain verify). The captured kernels read static buffers: rows and lengths are copied
    # into them inside the graph, the query offsets (one row, or one draft chain, per request) never change, and the
    # context bound is the pool's width, so the split-KV plan (grid and workspace) is the same at capture and every
    # replay.

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self._cg_rows = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        # Page view: the batch's page table, refilled inside the graph (as wide as the pool's rows).
        if self.paged:
            cols = self._page_columns(self.max_context_len).shape[1]
            self._cg_table = torch.zeros(max_bs, cols, dtype=torch.int32, device=self.device)
        self._cg_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._cg_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_metadata = {}

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded entries see one key (slot req_to_token[row, 0], always a valid pool slot); their output is dropped.
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            drafts = _draft_chain(forward_batch)
        elif mode.is_decode_or_idle():
            drafts = 0
        else:
            raise NotImplementedError(
                f"tpa backend: CUDA graphs are supported for decode and chain-verify batches only, got {mode}"
            )
        bs = forward_batch.batch_size
        if bs > self._cg_rows.shape[0]:
            raise ValueError(
                f"tpa backend: graph batch size {bs} exceeds init_cuda_graph_state's {self._cg_rows.shape[0]}"
            )
        md = self._graph_metadata.get((bs, drafts))
        if md is None:
            if drafts:
                # Made outside the capture (this method never runs inside one), kept for every replay.
                cu = torch.arange(0, bs * drafts + 1, drafts, dtype=torch.int32, device=self.device)
            else:
                cu = self._cg_cu[: bs + 1]
            if self.paged:
                table, rows = self._cg_table[:bs], None
            else:
                table, rows = self.req_to_token, self._cg_rows[:bs]
            md = TpaMetadata(
                table, rows, cu, self._cg_seq_lens[:bs], max(1, drafts), self.max_context_len, in_graph=True,
                added_keys=drafts,
            )  # fmt: skip
            self._graph_metadata[(bs, drafts)] = md
        self.forward_metadata = md

    def init_forward_metadata_in_graph(self, forward_batch):
        md = self.forward_metadata
        if md is None or not md.in_graph:
            return
        bs = forward_batch.batch_size
        if self.paged:
            self._page_table(forward_batch.req_pool_indices[:bs], self.max_context_len, out=md.block_table)
        else:
            md.rows.copy_(forward_batch.req_pool_indices[:bs])
        torch.add(forward_batch.seq_lens[:bs], md.added_keys, out=md.seq_lens)

    def _mask(self, layer, extend: bool) -> tuple[bool, int]:
        """``(causal, window_left)`` of a layer's call, read from the layer as SGLang's Triton backend reads it:
        decoder layers are causal with their sliding window (keys ``pos - window ... pos``); encoder-only layers see
        their whole sequence; bidirectional decoder layers too, in an extend SGLang allows it (see
        ``bidirectional_extend_allowed``), without their window. What the ops cannot express is refused."""
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("tpa backend: cross attention (encoder-decoder models) is not supported")
        temperature = getattr(layer, "xai_temperature_len", None)
        if temperature is not None and temperature > 0:
            # Grok's query scaling by position, which SGLang's Triton backend applies inside its kernels.
            raise NotImplementedError(f"tpa backend: attention temperature (xai_temperature_len {temperature}) is "
                                      "not supported")  # fmt: skip
        if getattr(layer, "pos_encoding_mode", "NONE") != "NONE":
            raise NotImplementedError(f"tpa backend: rotary embedding inside attention (pos_encoding_mode "
                                      f"{layer.pos_encoding_mode!r}) is not supported")  # fmt: skip
        window = layer.sliding_window_size
        window = -1 if window is None or window < 0 else int(window)
        kind = getattr(layer, "attn_type", AttentionType.DECODER)
        if kind == AttentionType.ENCODER_ONLY:
            if window >= 0:
                # SGLang's non-causal window is two-sided (|pos - key| <= window); the ops' is one-sided.
                raise NotImplementedError(
                    f"tpa backend: encoder-only layers with a sliding window ({window}) are not supported"
                )
            # (A decode row sees every key either way; the causal variant is the one warmed up and captured.)
            return not extend, -1
        if kind == AttentionType.DECODER_BIDIRECTIONAL and extend:
            if not self.bidirectional_extend:
                raise NotImplementedError(
                    "tpa backend: bidirectional decoder layers need whole prompts (--chunked-prefill-size -1) and "
                    "no prefill CUDA graphs other than breakable ones, as with SGLang's Triton backend"
                )
            return False, -1
        return True, window

    def _attend(self, q, layer, forward_batch, extend: bool, sinks) -> torch.Tensor:
        md = self.forward_metadata
        causal, window = self._mask(layer, extend)
        if getattr(forward_batch, "mha_return_lse", False):
            raise NotImplementedError("tpa backend: returning the log-sum-exp (mha_return_lse) is not supported")
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if k_buf.dtype == torch.uint8 and getattr(self.token_to_kv_pool, "dtype", None) in FP8_DTYPES:
            # An fp8 pool's storage as bytes (SGLang stores fp8 as uint8): its elements are the pool's fp8 dtype.
            k_buf, v_buf = k_buf.view(self.token_to_kv_pool.dtype), v_buf.view(self.token_to_kv_pool.dtype)
        k_scale, v_scale = self._scales(layer, k_buf)
        if layer.logit_cap and layer.logit_cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise NotImplementedError(f"tpa backend: logit capping {layer.logit_capping_method!r} is not supported")
        num_q_heads, head_dim, head_dim_v = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, num_q_heads, head_dim)
        o = q.new_empty(q3.shape[0], num_q_heads * head_dim_v)
        k_cache, v_cache = self._cache_view(k_buf), self._cache_view(v_buf)
        # The typed wrapper: in eager mode it skips the dispatcher (~5 µs per layer), under torch.compile it puts
        # torch.ops.tpa.paged_attention_out itself in the graph.
        tpa.paged_attention_out(
            q3, k_cache, v_cache, md.block_table, md.cu_seqlens_q, md.seq_lens, md.max_seqlen_q, md.max_seqlen_k,
            float(layer.scaling), causal=causal, window_left=window, softcap=float(layer.logit_cap or 0.0),
            sinks=sinks.float() if sinks is not None else None, k_scale=k_scale, v_scale=v_scale,
            block_table_rows=md.rows, batch_invariant=self.batch_invariant, decode_tail=md.decode_tail,
            out=o.view(-1, num_q_heads, head_dim_v),
        )  # fmt: skip
        return o

    def _save(self, k, v, layer, forward_batch, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        _refuse_extras(kwargs)
        if k is not None and not save_kv_cache:
            # SGLang's own backends then attend to these k/v without storing them; the ops read keys from the pool.
            raise NotImplementedError("tpa backend: an extend's new keys must be saved to the KV pool "
                                      "(save_kv_cache=False with k/v given is not supported)")  # fmt: skip
        self._save(k, v, layer, forward_batch, save_kv_cache)
        return self._attend(q, layer, forward_batch, True, sinks)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        _refuse_extras(kwargs)
        self._save(k, v, layer, forward_batch, save_kv_cache)
        return self._attend(q, layer, forward_batch, False, sinks)
