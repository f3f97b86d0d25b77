"""The ``tpa`` SGLang backend under SGLang's own attention test kit (real pools, ForwardBatch and reference).

Skipped unless sglang imports (it needs its own environment: see ``.ci/sglang-setup``).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("sglang")

from triton_paged_ops.integrations.sglang import BACKEND_NAME, SUPPORTED_SGLANG, register  # noqa: E402

register()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as graph_kit  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as verify_kit  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's fp16/bf16 matrix products are exercised elsewhere; fp32 on CPU keeps this about SGLang glue.
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32
CASES = kit.make_dense_cases(BACKEND_NAME)


class _Case:
    """The kit reports an unavailable backend through unittest's skipTest."""

    def skipTest(self, reason):  # noqa: N802  (unittest's name)
        pytest.fail(f"the tpa backend did not build: {reason}")


def test_sglang_version_is_the_supported_one():
    import sglang

    assert sglang.__version__ == SUPPORTED_SGLANG


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_dense_case(case):
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device=DEVICE, dtype=DTYPE)


DECODE_CASES = [c for c in CASES if c.forward_mode.is_decode()]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_cuda_graph_metadata_protocol(case):
    """The kit's CUDA-graph decode flow: metadata for a captured batch size, then a replay with other sequence
    lengths and padded entries through the same static buffers, matching eager and the reference."""
    with torch.no_grad():
        graph_kit.run_dense_cuda_graph_decode_case(_Case(), case, device=DEVICE, dtype=DTYPE)


def _graph_replaying_adapter() -> graph_kit.CudaGraphDecodeAdapter:
    """The kit's dense adapter, with its forward run as a real CUDA graph: captured on the kit's capture batch and
    replayed after copying the replay batch into the captured tensors (what SGLang's graph runner does)."""
    state: dict = {}

    def run_forward(fixture, batch, inputs):
        if "graph" not in state:
            kit.run_dense_forward(fixture, batch, inputs)  # compiles every kernel before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fixture.backend.init_forward_metadata_in_graph(batch)
                out = kit.run_dense_forward(fixture, batch, inputs)
            state.update(graph=graph, batch=batch, inputs=inputs, out=out)
            return out
        static = state["batch"]
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            getattr(static, name).copy_(getattr(batch, name))
        state["inputs"]["input_hidden"].copy_(inputs["input_hidden"])
        state["graph"].replay()
        return state["out"].clone()

    return _dense_graph_adapter(run_forward=run_forward)


def _dense_graph_adapter(
    build_fixture=kit.build_dense_attention_fixture,
    run_forward=kit.run_dense_forward,
    tolerance: float | None = None,
) -> graph_kit.CudaGraphDecodeAdapter:
    """The kit's dense CUDA-graph decode adapter, with another fixture builder, forward or tolerance."""
    return graph_kit.CudaGraphDecodeAdapter(
        build_fixture=build_fixture,
        make_case=kit.make_dense_case_with_prefix_lens,
        make_forward_batch=kit._make_forward_batch,
        fixture_inputs=kit.dense_fixture_inputs,
        make_capture_inputs=kit.make_dense_random_inputs,
        make_replay_inputs=kit.make_dense_padded_replay_inputs,
        prepare_inputs=kit.prepare_dense_runner_inputs,
        run_eager=kit.run_dense_fixture_eager,
        run_forward=run_forward,
        expected_output=kit.expected_dense_output_from_inputs,
        atol=kit.DENSE_ATOL if tolerance is None else tolerance,
        rtol=kit.DENSE_RTOL if tolerance is None else tolerance,
    )


def _run_graph_decode_case(case, adapter: graph_kit.CudaGraphDecodeAdapter) -> None:
    with torch.no_grad():
        graph_kit._run_cuda_graph_decode_case(
            _Case(), case, adapter=adapter,
            build_kwargs=dict(head_dim=kit.DEFAULT_HEAD_DIM, hidden_size=kit.DEFAULT_HIDDEN_SIZE,
                              max_context_len=kit.DEFAULT_MAX_CONTEXT_LEN, dtype=DTYPE, device=DEVICE),
            capture_batch_size=graph_kit.DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE,
            max_context_len=kit.DEFAULT_MAX_CONTEXT_LEN, dtype=DTYPE, device=DEVICE,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_decode_under_a_captured_cuda_graph(case):
    _run_graph_decode_case(case, _graph_replaying_adapter())


def test_cases_cover_page_sizes_and_head_layouts():
    assert {c.page_size for c in CASES} >= {1, 16, 32}
    layouts = {(c.num_heads, c.num_kv_heads) for c in CASES}
    assert any(h == kv for h, kv in layouts) and any(kv == 1 for _, kv in layouts)
    assert any(1 < kv < h for h, kv in layouts)
    assert any(c.forward_mode.is_decode() for c in CASES) and any(max(c.prefix_lens) > 0 for c in CASES)


def test_server_args_accept_tpa():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "unused", "--attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME


def test_deterministic_inference_accepts_tpa_and_keeps_the_radix_cache():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "unused", "--attention-backend", BACKEND_NAME,
                                "--enable-deterministic-inference"])  # fmt: skip
    assert args.enable_deterministic_inference and not args.disable_radix_cache


DETERMINISTIC_CASES = [c for c in CASES if c.forward_mode.is_decode()][:1] + [
    c for c in CASES if not c.forward_mode.is_decode() and max(c.prefix_lens) > 0
][:2]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[c.name for c in DETERMINISTIC_CASES])
def test_dense_case_in_deterministic_mode(case, monkeypatch):
    """With deterministic inference on, the backend calls the ops in batch-invariant mode; results still match
    the kit's reference (the bitwise property itself is tested on the ops)."""
    from triton_paged_ops.integrations.sglang import backend as tpa_backend

    calls = []
    real = tpa_backend.tpa.paged_attention_out

    def spy(*args, **kwargs):
        calls.append(kwargs["batch_invariant"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tpa_backend, "deterministic_inference", lambda runner: True)
    monkeypatch.setattr(tpa_backend.tpa, "paged_attention_out", spy)
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device=DEVICE, dtype=DTYPE)
    assert calls and all(calls)


FP8_CASES = DETERMINISTIC_CASES[:2]


def _with_fp8_pool(fixture, scales: tuple[float, float] | None):
    """The fixture's pool replaced by an fp8 one holding its prefix as SGLang stores it (K/V divided by the layer's
    scales, then cast), the layer given those scales as SGLang's quantization config does (none: unscaled), and
    a backend built for the new pool."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    runner, layer = fixture.runner, fixture.actual_module.attn
    old = runner.token_to_kv_pool
    pool = MHATokenToKVPool(size=old.size, page_size=old.page_size, dtype=torch.float8_e4m3fn, head_num=old.head_num,
                            head_dim=old.head_dim, layer_num=1, device=DEVICE, enable_memory_saver=False,
                            enable_alt_stream=False)  # fmt: skip
    k_scale, v_scale = scales or (1.0, 1.0)
    pool.get_key_buffer(0).copy_((old.get_key_buffer(0) / k_scale).to(torch.float8_e4m3fn))
    pool.get_value_buffer(0).copy_((old.get_value_buffer(0) / v_scale).to(torch.float8_e4m3fn))
    if scales is not None:
        layer.k_scale = torch.nn.Parameter(torch.tensor(k_scale, device=DEVICE), requires_grad=False)
        layer.v_scale = torch.nn.Parameter(torch.tensor(v_scale, device=DEVICE), requires_grad=False)
        layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    runner.token_to_kv_pool, runner.kv_cache_dtype = pool, torch.float8_e4m3fn
    return kit.replace_backend(fixture, TpaAttnBackend(runner))


@pytest.mark.parametrize("scales", [None, (0.04, 0.02)], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c.name for c in FP8_CASES])
def test_fp8_kv_cache(case, scales, monkeypatch):
    """``--kv-cache-dtype fp8_e4m3``: the ops read SGLang's fp8 pool with the layer's scales (1 without any), and
    the result matches the kit's full-precision reference within fp8's rounding (3 mantissa bits)."""
    from triton_paged_ops.integrations.sglang import backend as tpa_backend

    seen = []
    real = tpa_backend.tpa.paged_attention_out

    def spy(*args, **kwargs):
        seen.append((args[1].dtype, args[2].dtype, float(kwargs["k_scale"]), float(kwargs["v_scale"])))
        return real(*args, **kwargs)

    monkeypatch.setattr(tpa_backend.tpa, "paged_attention_out", spy)
    with torch.no_grad():
        fixture = _with_fp8_pool(kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE), scales)
        actual = kit.run_dense_fixture_eager(fixture).float()
        expected = kit.expected_dense_fixture_output(fixture).float()
    fp8 = torch.float8_e4m3fn
    k_scale, v_scale = scales or (1.0, 1.0)
    assert seen and all(s == (fp8, fp8, pytest.approx(k_scale), pytest.approx(v_scale)) for s in seen)
    rel = ((actual - expected).norm() / expected.norm()).item()
    assert rel < 0.05, rel


def test_cuda_graph_metadata_protocol_on_an_fp8_pool():
    """The kit's CUDA-graph decode flow (capture batch, then replays with other lengths and padded entries) on an
    fp8 pool. Unscaled: the kit writes prefixes without the layer's scales (SGLang's own writes pass them)."""

    def build_fp8(*args, **kwargs):
        return _with_fp8_pool(kit.build_dense_attention_fixture(*args, **kwargs), None)

    # fp8 rounding (3 mantissa bits) on top of the kit's tolerance.
    _run_graph_decode_case(DECODE_CASES[0], _dense_graph_adapter(build_fixture=build_fp8, tolerance=0.1))


def test_unsupported_kv_cache_dtype_is_refused_clearly():
    from types import SimpleNamespace

    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    backend = TpaAttnBackend.__new__(TpaAttnBackend)
    backend._kv_scales, backend._unit_scale = {}, torch.ones(1)
    layer = SimpleNamespace(layer_id=0, k_scale=None, v_scale=None)
    with pytest.raises(NotImplementedError, match="float8_e5m2"):
        backend._scales(layer, torch.empty(2, 1, 1, 8, dtype=torch.float8_e5m2))


def _mixed_case(name: str, page_size: int, extend_lens: tuple, prefix_lens: tuple):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return kit.DenseAttentionCase(
        name=name, backend=BACKEND_NAME, forward_mode=ForwardMode.MIXED, num_heads=8, num_kv_heads=2,
        page_size=page_size, prefix_lens=prefix_lens, extend_lens=extend_lens,
    )  # fmt: skip


# Mixed batches (chunked prefill beside running decodes): SGLang lists the extend requests first, then the decodes.
MIXED_CASES = [
    _mixed_case("mixed_chunk_then_decodes", 1, (37, 1, 1, 1), (20, 9, 33, 1)),
    _mixed_case("mixed_two_chunks_then_decodes_page_16", 16, (5, 18, 1, 1), (0, 16, 40, 3)),
    _mixed_case("mixed_one_token_chunk_first", 16, (1, 12, 1), (7, 4, 30)),  # no tail hint (-1)
]


@pytest.mark.parametrize("case", MIXED_CASES, ids=[c.name for c in MIXED_CASES])
def test_mixed_batch_passes_its_decode_tail(case, monkeypatch):
    """A MIXED batch matches the kit's reference, and every layer call carries the batch's ``decode_tail`` hint
    (how many requests at its end decode), from SGLang's host-side extend lengths."""
    import triton_paged_ops as tpa

    hints = []
    real = tpa.paged_attention_out

    def spy(*args, **kwargs):
        hints.append(kwargs.get("decode_tail"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tpa, "paged_attention_out", spy)
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device=DEVICE, dtype=DTYPE)
    lens = list(case.extend_lens)
    expect = len(lens) - next(i for i in range(len(lens), 0, -1) if lens[i - 1] != 1) if lens[0] != 1 else -1
    assert hints and set(hints) == {expect}


def _verify_case(name: str, num_heads: int, num_kv_heads: int, page_size: int, prefix_lens: tuple, drafts: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return kit.DenseAttentionCase(
        name=name, backend=BACKEND_NAME, forward_mode=ForwardMode.TARGET_VERIFY, num_heads=num_heads,
        num_kv_heads=num_kv_heads, page_size=page_size, prefix_lens=prefix_lens,
        extend_lens=(drafts,) * len(prefix_lens),
    )  # fmt: skip


# Speculative verification: each request's draft tokens (a chain) on top of its cached prefix; GQA, MHA and MQA,
# pages of 1 and 16 tokens, prefixes from 1 token to past a page.
VERIFY_CASES = [
    _verify_case("gqa_verify_4_drafts", 8, 2, 16, (5, 17, 33), 4),
    _verify_case("mha_verify_page_1", 4, 4, 1, (1, 9), 3),
    _verify_case("mqa_verify_1_draft", 4, 1, 16, (16, 2), 1),
]


@pytest.mark.parametrize("spec_kind", ["eagle", "dflash", "frozen_kv_mtp"])
@pytest.mark.parametrize("case", VERIFY_CASES, ids=[c.name for c in VERIFY_CASES])
def test_chain_target_verify(case, spec_kind):
    """Target verify of draft chains (EAGLE/MTP topk 1, DFlash) against the kit's reference with its mask."""
    with torch.no_grad():
        verify_kit.run_dense_spec_verify_case(_Case(), case, topk=1, spec_kind=spec_kind, device=DEVICE,
                                              dtype=DTYPE)  # fmt: skip


@pytest.mark.parametrize("case", VERIFY_CASES, ids=[c.name for c in VERIFY_CASES])
def test_chain_target_verify_cuda_graph_metadata_protocol(case, monkeypatch):
    """The kit's CUDA-graph verify flow: metadata for a captured batch size, a replay with other prefixes and
    padded requests through the same static buffers, matching the reference and the eager run.

    The flow rewrites prefixes at the kit's contiguous slots, so its fixture takes a layout whose prefixes lie
    there (with shuffled prefix pages the rewrite would clobber them): with one-token pages the drafts scattered
    out of order; with larger pages the plain contiguous one, as SGLang's allocator gives whole pages in order."""
    layout = "non_monotonic_extend" if case.page_size == 1 else "contiguous"
    build = functools.partial(kit.build_dense_attention_fixture, loc_layout=layout)
    monkeypatch.setattr(verify_kit, "build_dense_attention_fixture", build)
    with torch.no_grad():
        verify_kit.run_dense_spec_verify_cuda_graph_case(_Case(), case, topk=1, device=DEVICE, dtype=DTYPE)


def test_draft_tree_verify_is_refused():
    """EAGLE trees (topk 2) need a custom mask: the backend refuses them rather than attending causally."""
    with torch.no_grad(), pytest.raises(NotImplementedError, match="draft trees"):
        verify_kit.run_dense_spec_verify_case(_Case(), _verify_case("tree", 4, 2, 16, (4, 8), 3), topk=2,
                                              device=DEVICE, dtype=DTYPE)  # fmt: skip


def test_plugin_entry_point_registers_the_backend():
    """In a fresh process, SGLang's own plugin loader finds our entry point; its argparse then accepts tpa."""
    import subprocess
    import sys

    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "a = prepare_server_args(['--model-path', 'unused', '--attention-backend', 'tpa'])\n"
        "print('backend=' + a.attention_backend)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend=tpa" in done.stdout


def test_unsupported_forward_modes_are_refused_clearly():
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    backend = TpaAttnBackend.__new__(TpaAttnBackend)
    backend._cg_rows = torch.zeros(4, dtype=torch.int64)
    batch = SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=2)
    with pytest.raises(NotImplementedError, match="not supported"):
        backend.init_forward_metadata(batch)
    with pytest.raises(NotImplementedError, match="decode and chain-verify batches only"):
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
    # Verification of draft trees (EAGLE topk > 1; n-gram trees, whose branching is irregular: tree_topk -1).
    for spec in (SimpleNamespace(topk=2, draft_token_num=3), SimpleNamespace(tree_topk=-1, draft_token_num=3)):
        batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, spec_info=spec)
        for init in (backend.init_forward_metadata, backend.init_forward_metadata_out_graph):
            with pytest.raises(NotImplementedError, match="draft trees"):
                init(batch)


WARMUP_CASES = [next(c for c in CASES if c.page_size == 1), next(c for c in DECODE_CASES if c.page_size > 1)]


@pytest.mark.parametrize("case", WARMUP_CASES, ids=[c.name for c in WARMUP_CASES])
@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_pool", "fp8_pool"])
def test_start_up_warmup_reads_the_runner_settings(monkeypatch, fp8, case):
    """The warm-up the backend runs at start-up on a GPU (here called directly): model dims, limits and the pool's
    dtype come from SGLang's runner, and it compiles the variants a serving loop with those limits reaches."""
    from triton_paged_ops import warmup as wu

    seen = {}
    real = wu.warmup

    def spy(settings, device):
        seen.update(vars(settings))
        return real(settings, device)

    monkeypatch.setattr(wu, "warmup", spy)
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE)
        if fp8:
            fixture = _with_fp8_pool(fixture, None)
        fixture.backend._warmup(fixture.runner)
    assert seen["num_q_heads"] == case.num_heads and seen["num_kv_heads"] == case.num_kv_heads
    assert seen["head_dim"] == kit.DEFAULT_HEAD_DIM
    # SGLang's pages as the ops' pages; one-token pages read through req_to_token's rows.
    assert seen["page_size"] == case.page_size and seen["block_table_rows"] == (case.page_size == 1)
    assert seen["max_context"] == fixture.runner.req_to_token_pool.req_to_token.shape[1]
    # An fp8 pool is read with scales (1 here): the warm-up compiles that variant.
    assert (seen["cache_dtype"], seen["kv_scale"]) == ((torch.float8_e4m3fn, True) if fp8 else (None, False))


# Layers that see their whole sequence: SGLang's encoder-only layers (BERT-style embedding models) and, where SGLang
# allows it, bidirectional decoder layers. Extends with prefixes (keys from the pool) and a decode batch.
WHOLE_SEQUENCE_CASES = [
    kit.DenseAttentionCase(
        name="gqa_extend_prefix_page_16", backend=BACKEND_NAME, forward_mode=ForwardMode.EXTEND, num_heads=8,
        num_kv_heads=2, page_size=16, prefix_lens=(5, 17, 0), extend_lens=(7, 3, 12),
    ),
    kit.DenseAttentionCase(
        name="mha_extend_prefix_page_1", backend=BACKEND_NAME, forward_mode=ForwardMode.EXTEND, num_heads=4,
        num_kv_heads=4, page_size=1, prefix_lens=(0, 9), extend_lens=(6, 5),
    ),
    kit.DenseAttentionCase(
        name="gqa_decode_page_16", backend=BACKEND_NAME, forward_mode=ForwardMode.DECODE, num_heads=8,
        num_kv_heads=2, page_size=16, prefix_lens=(4, 19, 33),
    ),
]  # fmt: skip


def _spy_masks(monkeypatch) -> list:
    """Records ``(causal, window_left)`` of each op call the backend makes."""
    import triton_paged_ops as tpa

    calls = []
    real = tpa.paged_attention_out

    def spy(*args, **kwargs):
        calls.append((kwargs["causal"], kwargs["window_left"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tpa, "paged_attention_out", spy)
    return calls


@pytest.mark.parametrize("kind", ["ENCODER_ONLY", "DECODER_BIDIRECTIONAL"])
@pytest.mark.parametrize("case", WHOLE_SEQUENCE_CASES, ids=[c.name for c in WHOLE_SEQUENCE_CASES])
def test_whole_sequence_layers_attend_to_every_key(case, kind, monkeypatch):
    """Encoder-only layers, and bidirectional decoder layers where SGLang lets them see their whole prompt, match
    the kit's reference with an all-keys mask (which differs from the causal one here, so the mask is not a no-op);
    a bidirectional layer's sliding window is dropped in an extend, as SGLang's Triton backend drops it."""
    from sglang.srt.layers.radix_attention import AttentionType

    extend = not case.forward_mode.is_decode()
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE)
    layer = fixture.actual_module.attn
    layer.attn_type = getattr(AttentionType, kind)
    if kind == "DECODER_BIDIRECTIONAL":
        fixture.backend.bidirectional_extend = True
        if extend:
            layer.sliding_window_size = 2
    calls = _spy_masks(monkeypatch)
    with torch.no_grad():
        actual = kit.run_dense_fixture_eager(fixture)
        masks = [torch.ones(n, p + n, dtype=torch.bool) for p, n in zip(case.prefix_lens, case.input_lens)]
        expected = kit.dense_attention_reference_with_custom_mask(
            fixture.reference_module, case, fixture.prefix_hidden, fixture.input_hidden, masks
        )
        causal = kit.expected_dense_fixture_output(fixture)
    torch.testing.assert_close(actual, expected, atol=kit.DENSE_ATOL, rtol=kit.DENSE_RTOL)
    if extend:
        assert (causal - expected).abs().max() > 10 * kit.DENSE_ATOL
        assert calls == [(False, -1)]
    else:  # a decode row sees every key either way: the causal variant, the one warmed up and captured
        torch.testing.assert_close(causal, expected, atol=kit.DENSE_ATOL, rtol=kit.DENSE_RTOL)
        assert calls == [(True, -1)]


def _no_window_for_encoders(backend, layer, batch, call):
    layer.attn_type, layer.sliding_window_size = _attention_type("ENCODER_ONLY"), 4


def _bidirectional_with_chunked_prefill(backend, layer, batch, call):
    layer.attn_type = _attention_type("DECODER_BIDIRECTIONAL")
    backend.bidirectional_extend = False  # (what SGLang's config says with chunked prefill on)


def _cross_attention(backend, layer, batch, call):
    layer.is_cross_attention = True


def _score_mod(backend, layer, batch, call):
    call["score_mod"] = lambda score, *index: score


def _keys_not_saved(backend, layer, batch, call):
    call["save_kv_cache"] = False


def _lse_requested(backend, layer, batch, call):
    batch.mha_return_lse = True


def _attention_temperature(backend, layer, batch, call):
    layer.xai_temperature_len = 1024


def _rope_in_attention(backend, layer, batch, call):
    layer.pos_encoding_mode = "ROPE_LLAMA"


def _attention_type(name: str):
    from sglang.srt.layers.radix_attention import AttentionType

    return getattr(AttentionType, name)


REFUSED = {
    "encoder_only_window": (_no_window_for_encoders, "sliding window"),
    "bidirectional_chunked": (_bidirectional_with_chunked_prefill, "chunked-prefill-size -1"),
    "cross_attention": (_cross_attention, "cross attention"),
    "score_mod": (_score_mod, "not supported: score_mod"),
    "keys_not_saved": (_keys_not_saved, "save_kv_cache=False"),
    "return_lse": (_lse_requested, "mha_return_lse"),
    "attention_temperature": (_attention_temperature, "xai_temperature_len"),
    "rope_in_attention": (_rope_in_attention, "pos_encoding_mode"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_layer_features_the_ops_lack_are_refused_clearly(name, monkeypatch):
    """What the ops cannot compute raises NotImplementedError naming it, instead of a silent causal (or otherwise
    wrong) answer; the same extend runs once the feature is taken away."""
    setup, message = REFUSED[name]
    case = WHOLE_SEQUENCE_CASES[0]
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE)
        backend, batch, layer = fixture.backend, fixture.forward_batch, fixture.actual_module.attn
        backend.init_forward_metadata(batch)
        q, k, v = fixture.actual_module.project_qkv(fixture.input_hidden)
        k, v = (t.view(-1, case.num_kv_heads, kit.DEFAULT_HEAD_DIM) for t in (k, v))
        call = {"save_kv_cache": True}
        monkeypatch.setattr(batch, "mha_return_lse", False, raising=False)
        plain = backend.forward_extend(q, k, v, layer, batch, **call)
        setup(backend, layer, batch, call)
        with pytest.raises(NotImplementedError, match=message):
            backend.forward_extend(q, k, v, layer, batch, **call)
    assert plain.shape == (q.shape[0], case.num_heads * kit.DEFAULT_HEAD_DIM)


def test_encoder_decoder_batches_are_refused():
    from types import SimpleNamespace

    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    backend = TpaAttnBackend.__new__(TpaAttnBackend)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1, encoder_lens=torch.tensor([3]))
    with pytest.raises(NotImplementedError, match="encoder_lens"):
        backend.init_forward_metadata(batch)


@pytest.mark.parametrize("graphs_off", [True, False])
@pytest.mark.parametrize("chunk", [-1, 8192])
def test_bidirectional_extends_follow_sglangs_rule(graphs_off, chunk, monkeypatch):
    """Whole prompts only: chunked prefill off, and no prefill graphs (or only breakable ones)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context
    from sglang.srt.model_executor import cuda_graph_config
    from triton_paged_ops.integrations.sglang.backend import bidirectional_extend_allowed

    monkeypatch.setattr(cuda_graph_config, "cuda_graph_fully_disabled", lambda: graphs_off)
    monkeypatch.setattr(cuda_graph_config, "check_cuda_graph_backend", lambda phase, backend: False)
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: SimpleNamespace(chunked_prefill_size=chunk))
    assert bidirectional_extend_allowed() == (graphs_off and chunk == -1)

    def unpublished():
        raise ValueError("config not published")

    monkeypatch.setattr(runtime_context, "get_schedule", unpublished)
    assert not bidirectional_extend_allowed()


def test_layouts_and_masks_the_backend_cannot_read_are_refused_at_start_up():
    """A hybrid pool keeps window layers' K/V in slots of their own, unified memory puts virtual ids in
    req_to_token, and chunked local attention needs a mask the ops lack: the backend refuses each at start-up
    (naming the server flag where there is one) instead of reading wrong slots or attending too widely."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    runner = SimpleNamespace(
        device="cpu", server_args=SimpleNamespace(enable_deterministic_inference=False),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)),
        token_to_kv_pool=SWAKVPool.__new__(SWAKVPool),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="--disable-hybrid-swa-memory"):
        TpaAttnBackend(runner)
    runner.token_to_kv_pool = None  # anything else passes this check
    assert TpaAttnBackend(runner).token_to_kv_pool is None
    # Unified memory: req_to_token holds virtual slot ids.
    runner.server_args.enable_unified_memory = True
    with pytest.raises(NotImplementedError, match="--enable-unified-memory"):
        TpaAttnBackend(runner)
    # Chunked local attention (Llama 4): a mask the ops lack.
    runner.server_args.enable_unified_memory, runner.attention_chunk_size = False, 8192
    with pytest.raises(NotImplementedError, match="chunked local attention"):
        TpaAttnBackend(runner)


# SGLang's pages as the ops' pages: the kit's other slot layouts (pages of a request interleaved with another's,
# or all in order), beyond its default of shuffled pages per request. With one-token pages also slots out of order
# within an extend (which a paged allocator never gives: it hands out whole pages).
LAYOUT_CASES = [(c, layout) for c in CASES for layout in ("interleaved_pages", "contiguous")]
LAYOUT_CASES += [(c, "non_monotonic_extend") for c in CASES if c.page_size == 1]


@pytest.mark.parametrize(("case", "layout"), LAYOUT_CASES, ids=[f"{c.name}-{lay}" for c, lay in LAYOUT_CASES])
def test_dense_case_over_slot_layouts(case, layout, monkeypatch):
    seen = _spy_caches(monkeypatch)
    build = functools.partial(kit.build_dense_attention_fixture, loc_layout=layout)
    monkeypatch.setattr(kit, "build_dense_attention_fixture", build)
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device=DEVICE, dtype=DTYPE)
    # The page view for pages of more than one token (a page table of the batch's rows), the token view otherwise.
    assert seen and all(s == (case.page_size, case.page_size == 1) for s in seen)


def _spy_caches(monkeypatch) -> list:
    """Records ``(cache page size, rows given)`` of each op call the backend makes."""
    from triton_paged_ops.integrations.sglang import backend as tpa_backend

    seen = []
    real = tpa_backend.tpa.paged_attention_out

    def spy(*args, **kwargs):
        seen.append((args[1].shape[1], kwargs["block_table_rows"] is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(tpa_backend.tpa, "paged_attention_out", spy)
    return seen


PAGED_CASES = [c for c in CASES if c.page_size > 1][:3]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c.name for c in PAGED_CASES])
def test_hnd_pool_layout(case, monkeypatch):
    """``SGLANG_USE_HND_KVCACHE=1`` pools (``[pages, Hkv, P, D]``) are read as pages, through a strided view."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    seen = _spy_caches(monkeypatch)
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE)
        assert fixture.runner.token_to_kv_pool.kv_cache_layout == "hnd"
        actual = kit.run_dense_fixture_eager(fixture).float()
        expected = kit.expected_dense_fixture_output(fixture).float()
    assert seen and all(s == (case.page_size, False) for s in seen)
    torch.testing.assert_close(actual, expected, rtol=2e-3, atol=2e-3)


def test_pool_layouts_the_ops_cannot_read_are_refused():
    from types import SimpleNamespace

    from triton_paged_ops.integrations.sglang.backend import TpaAttnBackend

    runner = SimpleNamespace(
        device="cpu", server_args=SimpleNamespace(enable_deterministic_inference=False),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)),
        token_to_kv_pool=SimpleNamespace(page_size=16, kv_cache_layout="vectorized_5d"),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="vectorized_5d"):
        TpaAttnBackend(runner)


def test_debug_mode_refuses_slots_that_are_not_whole_pages(monkeypatch):
    """The page view reads slot ``page * P + i % P`` for position ``i``: a token map breaking that (which SGLang's
    paged allocator never writes) is reported in debug mode instead of read as pages."""
    from triton_paged_ops import checks

    case = next(c for c in CASES if c.page_size > 1 and max(c.extend_lens) > 1)
    monkeypatch.setattr(checks, "_debug", True)
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE,
                                                    loc_layout="non_monotonic_extend")  # fmt: skip
        with pytest.raises(ValueError, match="not whole pages"):
            kit.run_dense_fixture_eager(fixture)
        # The kit's default layout (whole pages, shuffled) passes the same check.
        fixture = kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE)
        kit.run_dense_fixture_eager(fixture)


LAYER_BENCH_CASES = [
    dict(name="decode", mode="DECODE", prefix=[37, 5, 70], new=[1, 1, 1]),
    dict(name="extend", mode="EXTEND", prefix=[20, 0], new=[9, 17]),
    dict(name="mixed", mode="MIXED", prefix=[33, 40, 18], new=[12, 1, 1]),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", LAYER_BENCH_CASES, ids=[c["name"] for c in LAYER_BENCH_CASES])
def test_layer_benchmark_batches_are_served_alike(case, page_size):
    """``benchmarks.sglang_layer``'s batches (pages placed at random, kit runner) at small sizes: tpa and SGLang's
    triton backend give the same output, eager and through the decode-graph metadata protocol (run eagerly)."""
    from benchmarks import sglang_layer as bench

    b = bench.Batch(case, page_size, seed=0, device=DEVICE, dtype=DTYPE)
    tolerance = 1e-4 if DTYPE is torch.float32 else 1e-2  # (fp32 on the CPU, fp16 on GPUs)
    with torch.no_grad():
        outs = {name: bench.first_call(b, name)[1] for name in bench.BACKENDS}
        assert bench.rel_diff(outs) < tolerance
        if b.decode:
            for name in bench.BACKENDS:
                step = bench.graph_step(b, b.backend(name))
                torch.testing.assert_close(step().float(), outs[name], rtol=1e-4, atol=1e-4)


def test_fp8_pool_storage_bytes_are_read_as_fp8(monkeypatch):
    """SGLang stores fp8 pools as uint8: a pool handing out that storage (not the fp8 view) is read as its fp8
    dtype, with the same result as the fp8 view."""
    case = FP8_CASES[0]
    with torch.no_grad():
        fixture = _with_fp8_pool(kit.build_dense_attention_fixture(_Case(), case, device=DEVICE, dtype=DTYPE), None)
        pool = fixture.runner.token_to_kv_pool
        assert pool.k_buffer[0].dtype == torch.uint8
        as_fp8 = kit.run_dense_fixture_eager(fixture)
        monkeypatch.setattr(pool, "get_key_buffer", lambda layer_id: pool.k_buffer[layer_id])
        monkeypatch.setattr(pool, "get_value_buffer", lambda layer_id: pool.v_buffer[layer_id])
        as_bytes = kit.run_dense_fixture_eager(fixture)
    assert torch.equal(as_bytes, as_fp8)
