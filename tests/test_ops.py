"""Op registration: opcheck, agreement between the three attention ops, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import triton_paged_ops as tpa
from triton_paged_ops import api, ops, prepared

from .strategies import Spec, build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def spec(**kw) -> Spec:
    base = dict(q_lens=[3, 1, 0, 9], kv_lens=[20, 9, 4, 30], pad_tokens=0, page_size=4, num_kv_heads=2, group=2,
                head_dim=64, head_dim_v=64, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.125, strided=False, spare_pages=1,
                extra_cols=1, tiles=None, seed=0)  # fmt: skip
    base.update(kw)
    return Spec(**base)


OPCHECK_SPECS = [
    spec(),
    spec(dtype=torch.float16, page_size=3, group=4, num_kv_heads=1, use_sinks=True, window_left=5, strided=True),
    spec(causal=False, softcap=10.0, use_alibi=True, use_kv_scale=True, head_dim=80, head_dim_v=80, seed=3),
]


@pytest.mark.parametrize("s", OPCHECK_SPECS, ids=["plain", "sinks-window-strided", "features"])
def test_opcheck_attention_ops(s):
    p = build(s, DEVICE)
    kw = p.kwargs
    torch.library.opcheck(torch.ops.tpa.paged_attention.default, p.args, kw)
    torch.library.opcheck(torch.ops.tpa.paged_attention_with_lse.default, p.args, kw)
    out = torch.empty(p.q.shape[0], p.q.shape[1], s.head_dim_v, dtype=p.q.dtype, device=DEVICE)
    lse = torch.empty(p.q.shape[0], p.q.shape[1], device=DEVICE)
    torch.library.opcheck(torch.ops.tpa.paged_attention_out.default, p.args, {**kw, "out": out, "lse": lse})
    torch.library.opcheck(torch.ops.tpa.paged_attention_out.default, p.args, {**kw, "out": out})


def test_opcheck_with_a_decode_tail_hint():
    """The layout hint as a mixed batch's caller passes it (chunks, then two decodes)."""
    p = build(spec(q_lens=[5, 2, 1, 1], kv_lens=[20, 9, 4, 30], use_sinks=True), DEVICE)
    kw = {**p.kwargs, "decode_tail": tpa.decode_tail_of(p.spec.q_lens)}
    assert kw["decode_tail"] == 2
    torch.library.opcheck(torch.ops.tpa.paged_attention.default, p.args, kw)
    out = torch.empty(p.q.shape[0], p.q.shape[1], p.spec.head_dim_v, dtype=p.q.dtype, device=DEVICE)
    torch.library.opcheck(torch.ops.tpa.paged_attention_out.default, p.args, {**kw, "out": out})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_cache_and_merge(dtype):
    key = torch.randn(5, 2, 64, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(3, 4, 2, 64, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(3, 4, 2, 64, device=DEVICE, dtype=dtype)
    slots = torch.tensor([0, 5, -1, 11, 2], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.tpa.reshape_and_cache.default, (key, key, k_cache, v_cache, slots))
    scale = torch.tensor([0.5], device=DEVICE)
    torch.library.opcheck(torch.ops.tpa.reshape_and_cache.default, (key, key, k_cache, v_cache, slots, scale, scale))
    out = torch.randn(4, 3, 64, device=DEVICE, dtype=dtype)
    lse = torch.randn(4, 3, device=DEVICE)
    torch.library.opcheck(torch.ops.tpa.merge_attn_states.default, (out, lse, out * 2, lse - 1))


def test_three_attention_ops_agree_bitwise():
    p = build(spec(use_sinks=True, softcap=5.0, seed=7), DEVICE)
    out = tpa.paged_attention(*p.args, **p.kwargs)
    out2, lse2 = tpa.paged_attention_with_lse(*p.args, **p.kwargs)
    out3 = torch.full_like(out, float("nan"))
    lse3 = torch.full_like(lse2, float("nan"))
    tpa.paged_attention_out(*p.args, **p.kwargs, out=out3, lse=lse3)
    assert torch.equal(out, out2) and torch.equal(out, out3) and torch.equal(lse2, lse3)


@pytest.mark.skipif(DEVICE != "cpu" or not ops.INTERPRET, reason="compares the CPU path with the interpreted kernels")
def test_cpu_tensors_without_the_interpreter_take_the_reference_path(monkeypatch):
    """CPU tensors outside the interpreter (e.g. an SGLang server on its CPU engine) are served by the reference:
    every op and entry (typed wrappers, torch.ops, reshape_and_cache) agrees with the interpreted kernels, and
    rows past ``cu_seqlens_q[-1]`` stay untouched as the kernels leave them."""
    p = build(spec(use_sinks=True, softcap=5.0, window_left=6, pad_tokens=2, rows_dtype=torch.int64, seed=11),
              DEVICE)  # fmt: skip
    n = p.num_real_tokens

    def run_all():
        out = tpa.paged_attention(*p.args, **p.kwargs)
        out2, lse2 = torch.ops.tpa.paged_attention_with_lse(*p.args, **p.kwargs)
        out3 = torch.full_like(out, float("nan"))
        lse3 = torch.full_like(lse2, float("nan"))
        tpa.paged_attention_out(*p.args, **p.kwargs, out=out3, lse=lse3)
        k_cache, v_cache = p.k_cache.clone(), p.v_cache.clone()
        key = torch.randn(4, *k_cache.shape[2:], generator=torch.Generator().manual_seed(1))
        slots = torch.tensor([0, 5, -1, 7], dtype=torch.int32)
        tpa.reshape_and_cache(key, key * 2, k_cache, v_cache, slots)
        return out[:n], out2[:n], lse2[:n], out3, lse3, k_cache, v_cache

    kernels = run_all()
    monkeypatch.setattr(ops, "INTERPRET", False)
    prepared.PREPARED.clear()  # (the kernels' prepared launches would be repeated)
    served = run_all()
    assert not prepared.PREPARED
    assert served[3][n:].isnan().all() and served[4][n:].isnan().all()
    for want, got in zip(kernels, served):
        got = got[:n] if got.shape[0] > n and got.dim() < 4 else got
        want = want[:n] if want.shape[0] > n and want.dim() < 4 else want
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def _dispatched(monkeypatch) -> list[str]:
    """Spy on the typed wrappers' route through ``torch.ops``: the names of the ops they dispatch, in order."""
    routed = []

    def spy(name, op):
        return lambda *args, **kwargs: routed.append(name) or op(*args, **kwargs)

    for name, op in list(api._DISPATCHED.items()):
        monkeypatch.setitem(api._DISPATCHED, name, spy(name, op))
    return routed


def test_typed_wrappers_skip_the_dispatcher_exactly_in_plain_eager(monkeypatch):
    """The typed wrappers run the op without ``torch.ops`` (a prepared launch or the op body) only when ``torch.ops``
    would do nothing but call the body, and both routes give the same bits, first calls and repeats alike."""
    p = build(spec(use_sinks=True, seed=11), DEVICE)
    want = torch.ops.tpa.paged_attention_with_lse(*p.args, **p.kwargs)
    routed = _dispatched(monkeypatch)

    def run(*args, **kwargs) -> list[str]:
        routed.clear()
        for _ in range(2):  # a first call and a repeat (the prepared launch)
            out, lse = tpa.paged_attention_with_lse(*args, **{**p.kwargs, **kwargs})
            assert torch.equal(out.detach(), want[0]) and torch.equal(lse, want[1])
        return list(routed)

    prepared.PREPARED.clear()
    assert run(*p.args) == []
    out = torch.full_like(want[0], float("nan"))
    tpa.paged_attention_out(*p.args, **p.kwargs, out=out)
    assert routed == [] and torch.equal(out, want[0])
    assert torch.equal(tpa.paged_attention(*p.args, **p.kwargs), want[0]) and routed == []
    # Not plain eager: a tensor that needs a gradient (under grad mode the op refuses it: it has no backward), a
    # tensor subclass, a torch function mode, the profiler (which then records the op). Each goes through torch.ops,
    # also where a plain call with the same metadata prepared a launch.
    q_grad = p.q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="q requires grad"):
        run(q_grad, *p.args[1:])
    assert routed == ["paged_attention_with_lse"]
    with torch.no_grad():
        assert run(q_grad, *p.args[1:]) == ["paged_attention_with_lse"] * 2
    sinks = torch.nn.Parameter(p.kwargs["sinks"], requires_grad=False)
    assert run(*p.args, sinks=sinks) == ["paged_attention_with_lse"] * 2
    with torch.device(DEVICE):
        assert run(*p.args) == ["paged_attention_with_lse"] * 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert run(*p.args) == ["paged_attention_with_lse"] * 2
    assert any("tpa::paged_attention_with_lse" in e.key for e in prof.key_averages())
    # A launch prepared through torch.ops from a non-plain tensor is not one the wrappers may repeat directly.
    prepared.PREPARED.clear()
    with torch.no_grad():
        assert run(q_grad, *p.args[1:]) == ["paged_attention_with_lse"] * 2
    assert run(*p.args) == []
    # Fake tensors: the fake implementation answers through torch.ops.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in p.args]
        routed.clear()
        out, lse = tpa.paged_attention_with_lse(*fake, **p.kwargs)
        assert routed == ["paged_attention_with_lse"] and out.shape == want[0].shape and lse.shape == want[1].shape


def test_scalars_of_other_types_take_the_dispatcher(monkeypatch):
    """An int scale (which the schema converts to float) is the dispatcher's to convert, also where a float scale
    of the same value prepared a launch."""
    p = build(spec(seed=12), DEVICE)
    routed = _dispatched(monkeypatch)
    want = torch.ops.tpa.paged_attention(*p.args[:8], 1.0, **p.kwargs)
    for _ in range(2):
        assert torch.equal(tpa.paged_attention(*p.args[:8], 1, **p.kwargs), want)
        assert routed == ["paged_attention"]
        routed.clear()
        assert torch.equal(tpa.paged_attention(*p.args[:8], 1.0, **p.kwargs), want)
        assert routed == []


def test_compiled_typed_wrapper_keeps_the_op_in_the_graph():
    """Under torch.compile the typed wrapper puts the op itself in the graph (no graph break, no inlined body)."""
    torch._dynamo.reset()
    p = build(spec(seed=13), DEVICE)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda *a: tpa.paged_attention(*a, **p.kwargs) * 2.0, fullgraph=True, backend=backend)
    got = compiled(*p.args)
    assert torch.equal(got, tpa.paged_attention(*p.args, **p.kwargs) * 2.0)
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.tpa.paged_attention.default in targets or torch.ops.tpa.paged_attention in targets, targets


def test_torch_compile_fullgraph_no_recompile_across_token_counts():
    """Write new tokens into the cache and attend, compiled with fullgraph=True and a dynamic token count; the
    batch's ``decode_tail`` hint (2 when both sequences decode, else 1) changes with it."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    num_pages, page_size, hkv, hq, d = 16, 4, 2, 4, 64
    k_cache = torch.zeros(num_pages, page_size, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)

    def step(q, k, v, k_cache, v_cache, slots, block_table, cu, seq_lens, max_q: int, max_k: int, tail: int):
        torch.ops.tpa.reshape_and_cache(k, v, k_cache, v_cache, slots)
        out = torch.ops.tpa.paged_attention(q, k_cache, v_cache, block_table, cu, seq_lens, max_q, max_k, 0.125,
                                            decode_tail=tail)  # fmt: skip
        return out.sum(-1) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    block_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(2, 8)
    for n in (1, 2, 5, 7):
        # Two sequences: the first prefills n tokens, the second decodes one token after a context of 5.
        q = torch.randn(n + 1, hq, d, device=DEVICE)
        k = torch.randn(n + 1, hkv, d, device=DEVICE)
        v = torch.randn(n + 1, hkv, d, device=DEVICE)
        pos = torch.cat([torch.arange(n), torch.tensor([5])]).to(DEVICE)
        seq = torch.tensor([0] * n + [1], device=DEVICE)
        slots = (block_table[seq, pos // page_size] * page_size + pos % page_size).to(torch.int32)
        cu = torch.tensor([0, n, n + 1], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([n, 6], dtype=torch.int32, device=DEVICE)
        kc_e, vc_e = k_cache.clone(), v_cache.clone()
        tail = tpa.decode_tail_of([n, 1])
        got = compiled(q, k, v, k_cache, v_cache, slots, block_table, cu, seq_lens, n, 6, tail)
        want = step(q, k, v, kc_e, vc_e, slots, block_table, cu, seq_lens, n, 6, tail)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(k_cache, kc_e) and torch.equal(v_cache, vc_e)
    assert counters["graph_break"] == {} or sum(counters["graph_break"].values()) == 0
    frames = counters["stats"]["unique_graphs"]
    assert frames >= 1, "nothing was compiled"
    assert frames <= 2, f"compiled {frames} graphs for 4 token counts (at most one recompile allowed)"


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_with_new_lengths():
    """Capture paged_attention_out once, then replay after changing lengths, block tables and cache contents."""
    s = spec(q_lens=[1] * 8, kv_lens=[50] * 8, dtype=torch.bfloat16, page_size=16, group=4, head_dim=128,
             head_dim_v=128, extra_cols=6)  # fmt: skip
    p = build(s, DEVICE)
    out = torch.empty(8, p.q.shape[1], 128, dtype=p.q.dtype, device=DEVICE)
    lse = torch.empty(8, p.q.shape[1], device=DEVICE)
    max_k = p.block_table.shape[1] * s.page_size

    def run():
        tpa.paged_attention_out(p.q, p.k_cache, p.v_cache, p.block_table, p.cu_seqlens_q, p.seq_lens, 1, max_k,
                                s.scale, out=out, lse=lse)  # fmt: skip

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for _ in range(3):
        p.seq_lens.copy_(torch.randint(1, max_k + 1, (8,), generator=gen, device=DEVICE, dtype=torch.int32))
        p.seq_lens[7] = 1  # a padded-style entry
        p.q.copy_(torch.randn(p.q.shape, generator=gen, device=DEVICE))
        # New keys and values everywhere: the longer sequences now own slots that build() filled with NaN.
        p.k_cache.copy_(torch.randn(p.k_cache.shape, generator=gen, device=DEVICE))
        p.v_cache.copy_(torch.randn(p.v_cache.shape, generator=gen, device=DEVICE))
        graph.replay()
        replayed = (out.clone(), lse.clone())
        assert replayed[0].isfinite().all() and replayed[1].isfinite().all()
        run()
        assert torch.equal(replayed[0], out) and torch.equal(replayed[1], lse)


class _DeviceContextRecorder:
    """Stands in for ``torch.cuda.device``: records which device each entered context names, and how many kernel
    launches (from ``launches()``) happened inside it."""

    def __init__(self, launches):
        self.launches, self.entered, self.inside, self.current = launches, [], [], 0

    def foreign(self, t: torch.Tensor) -> int | None:
        """``ops._foreign_device`` on a host whose tensors all live on GPU 3."""
        return None if self.current == 3 else 3

    def __call__(self, index):
        recorder = self

        class _Context:
            def __enter__(self):
                recorder.entered.append(index)
                self.before, self.was, recorder.current = recorder.launches(), recorder.current, index

            def __exit__(self, *exc):
                recorder.inside.append(recorder.launches() - self.before)
                recorder.current = self.was

        return _Context()


def test_kernels_launch_on_the_tensors_device_when_it_is_not_the_current_one(monkeypatch):
    """Triton launches on the current device: each op switches to its tensors' GPU first when that is another one
    (the switch simulated here: every tensor reads as living on GPU 3, and the device context is recorded)."""
    from benchmarks import standin

    s = spec(dtype=torch.float16)
    p = build(s, "cpu")
    with standin.recording_launches() as (attention_kernel, _):
        recorder = _DeviceContextRecorder(lambda: len(attention_kernel.own) + len(attention_kernel.runs))
        monkeypatch.setattr(torch.cuda, "device", recorder)
        monkeypatch.setattr(ops, "_foreign_device", recorder.foreign)
        for _ in range(2):  # the full path, then the prepared launch
            tpa.paged_attention(*p.args, **p.kwargs)
        assert recorder.entered == [3, 3] and recorder.inside == [1, 1]
    if not ops.INTERPRET:
        return  # the cache write and the merge below run the reference on CPU tensors without the interpreter
    recorder.entered.clear()
    n, hkv, d = 5, p.k_cache.shape[2], p.k_cache.shape[3]
    key, value = torch.randn(n, hkv, d).half(), torch.randn(n, hkv, d).half()
    slots = torch.arange(n, dtype=torch.int64)
    k_cache, v_cache = p.k_cache.clone(), p.v_cache.clone()
    tpa.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1)[:n], key) and torch.equal(v_cache.flatten(0, 1)[:n], value)
    out_a, out_b = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    lse_a, lse_b = torch.randn(4, 2), torch.randn(4, 2)
    out, lse = tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(lse, torch.logaddexp(lse_a, lse_b), atol=1e-5)
    assert recorder.entered == [3, 3]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ops_on_a_gpu_that_is_not_the_current_device():
    """Tensors on the second GPU while the first is current: every op runs there and matches the reference."""
    from triton_paged_ops import reference

    s = spec(dtype=torch.bfloat16, q_lens=[1] * 3, kv_lens=[3000, 40, 1], page_size=16, head_dim=128,
             head_dim_v=128, group=4)  # fmt: skip
    p = build(s, "cuda:1")
    torch.cuda.set_device(0)
    want = reference.paged_attention(*p.args[:9], **p.kwargs)
    for _ in range(2):
        got = tpa.paged_attention(*p.args, **p.kwargs)
        assert got.device == p.q.device and torch.cuda.current_device() == 0
        rows = p.num_real_tokens
        assert (got[:rows].float() - want[:rows].float()).norm() / want[:rows].float().norm() < 1e-2
    k_cache = p.k_cache.clone()
    key = torch.randn(2, *k_cache.shape[2:], device="cuda:1", dtype=k_cache.dtype)
    tpa.reshape_and_cache(key, key, k_cache, k_cache.clone(), torch.tensor([0, 1], device="cuda:1"))
    assert torch.equal(k_cache.flatten(0, 1)[:2], key)
    out_a, out_b = torch.randn(2, 4, 3, 64, device="cuda:1").unbind(0)
    lse_a, lse_b = torch.randn(2, 4, 3, device="cuda:1").unbind(0)
    _, lse = tpa.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(lse, torch.logaddexp(lse_a, lse_b), atol=1e-5)
    torch.cuda.synchronize(1)
