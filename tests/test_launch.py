"""The short launch path (kernels/launch.py): its cache key separates what Triton specialises on, and on a GPU it
runs exactly the compiled kernel Triton's own launch would pick, with the same results."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import triton_paged_ops as tpa
from benchmarks import standin
from triton_paged_ops import checks, prepared, reference
from triton_paged_ops import plan as planning
from triton_paged_ops.configs import heuristic
from triton_paged_ops.kernels import attention
from triton_paged_ops.kernels import merge as merge_kernels
from triton_paged_ops.kernels.launch import Launcher
from triton_paged_ops.plan import key_bound

from .strategies import Spec, build
from .test_attention import assert_close_to_reference


def _stand_in(unspecialised: set[int], n: int):
    params = [types.SimpleNamespace(num=i, do_not_specialize=i in unspecialised, is_constexpr=False) for i in range(n)]
    return types.SimpleNamespace(params=params)


def test_key_separates_what_triton_specialises_on():
    launcher = Launcher(_stand_in({2}, 3), num_tensors=1, num_floats=0)
    base = torch.zeros(64, dtype=torch.float16)

    def key(t, spec_int, dns_int):
        return launcher.key((t, spec_int, dns_int), 0, "v")

    k = key(base, 32, 5)
    # Same class: another 16-aligned tensor, another multiple of 16, another small unspecialised value.
    assert key(base[8:], 48, 7) == k
    assert key(base[1:], 32, 5) != k  # 2-byte offset: not 16-byte aligned
    assert key(base.float(), 32, 5) != k  # pointer type
    assert key(base, 33, 5) != k  # not a multiple of 16
    assert key(base, 1, 5) != k  # value 1 is a constant to Triton
    # A 64-bit int, specialised or not: no key (Triton's own path takes it).
    assert key(base, 32 << 31, 5) is None and key(base, 32, -5 << 31) is None
    assert key(base, 32, 1) == k  # an unspecialised 1 is just an int
    assert key(base, 0, 5) == k  # 0 is divisible by 16
    assert launcher.key((base, 32, 5), 1, "v") != k  # device
    assert launcher.key((base, 32, 5), 0, "w") != k  # constexprs / options


@pytest.mark.parametrize("context", [200, 4096], ids=["one launch", "split + reduce"])
def test_address_path_hands_the_compiled_launcher_the_full_paths_arguments(context):
    """Repeats of a prepared launch read the tensors' addresses themselves and call the compiled launchers
    directly: the arguments (grid, stream, every address, scalar and constexpr, in order) must be exactly those of
    the full path, for new output buffers and for another alignment (which first takes the full path again)."""
    spec = Spec(q_lens=[1] * 2, kv_lens=[context, 17], pad_tokens=1, page_size=16, num_kv_heads=2, group=4,
                head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=True, use_sinks=True, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=1, rows_dtype=torch.int32)  # fmt: skip
    p = build(spec, "cpu")
    flat = torch.empty(p.q.numel() + 1, dtype=p.q.dtype)
    unaligned = flat[1:].view(p.q.shape)
    outs = []
    stream = 0x5EED
    with standin.recording_launches(stream) as (attention_kernel, reduce_kernel):
        for q in (p.q, p.q, unaligned, unaligned, p.q):
            out = torch.empty(p.q.shape[0], p.q.shape[1], 64, dtype=p.q.dtype)
            lse = torch.empty(p.q.shape[:2])
            tpa.paged_attention_out(q, *p.args[1:], out=out, lse=lse, **p.kwargs)
            outs.append((out, lse))
        (launch,) = prepared.PREPARED.values()
    split = launch.reduce is not None
    assert split == (context > 1024)
    # Triton's own path ran once per alignment (q's changes the attention kernel's, not the reduce's); the short
    # paths ran every other launch: (own launch it repeats, calls it ran for).
    plans = [(attention_kernel, [0, 1, 0], (1, 3, 4))]
    if split:
        plans.append((reduce_kernel, [0, 0, 0, 0], (1, 2, 3, 4)))
    else:
        assert not reduce_kernel.own and not reduce_kernel.runs
    for kernel, repeats, calls in plans:
        assert len(kernel.own) == max(repeats) + 1 and len(kernel.runs) == len(repeats)
        for i, (grid, run_stream, run_args) in zip(repeats, kernel.runs):
            own = kernel.own[i]
            want_grid, want = kernel.expected_run(own)
            assert grid == want_grid and run_stream == stream
            # Each call had new output buffers: the rest must be the same arguments exactly.
            fresh = {t.data_ptr() for call in outs for t in call}
            assert [a for a, w in zip(run_args, want) if w not in fresh] == [w for w in want if w not in fresh]
        # The output addresses are each call's own: the final output and lse of the last kernel of the call.
        out_arg = 2 if kernel is reduce_kernel else 3
        if kernel is plans[-1][0]:
            assert [run[2][out_arg] for run in kernel.runs] == [outs[c][0].data_ptr() for c in calls]
            assert [run[2][out_arg + 1] for run in kernel.runs] == [outs[c][1].data_ptr() for c in calls]


def _layouts(p):
    """The same problem in layouts Triton compiles differently: aligned, q 2 bytes off alignment, strides not
    multiples of 16 (q and the caches padded in the head dim)."""
    yield "aligned", p.q, p.k_cache, p.v_cache
    flat = torch.empty(p.q.numel() + 1, dtype=p.q.dtype, device=p.q.device)
    yield "q unaligned", flat[1:].view(p.q.shape).copy_(p.q), p.k_cache, p.v_cache
    d = p.q.shape[-1]
    wide_q = torch.empty(*p.q.shape[:2], d + 8, dtype=p.q.dtype, device=p.q.device)[..., :d].copy_(p.q)
    wide_k = torch.empty(*p.k_cache.shape[:3], d + 8, dtype=p.k_cache.dtype, device=p.q.device)[..., :d]
    wide_v = torch.empty(*p.v_cache.shape[:3], d + 8, dtype=p.v_cache.dtype, device=p.q.device)[..., :d]
    yield "strides not 16-divisible", wide_q, wide_k.copy_(p.k_cache), wide_v.copy_(p.v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [300, 9000], ids=["one segment", "split + reduce kernel"])
def test_short_path_runs_tritons_kernel_with_same_bits(context):
    spec = Spec(q_lens=[1] * 3, kv_lens=[context, context // 2, 17], pad_tokens=0, page_size=16, num_kv_heads=2,
                group=4, head_dim=128, head_dim_v=128, dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=3)  # fmt: skip
    p = build(spec, "cuda")
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    short = attention._launch_attention.short_launches, merge_kernels._launch_reduce.short_launches
    was = checks.debug_mode()
    checks.set_debug_mode(True)  # each short launch also checks Triton's own choice of compiled kernel
    try:
        for name, q, k, v in _layouts(p):
            runs = []
            for _ in range(3):  # the first call goes through Triton's path and records; the rest take the short one
                out, lse = tpa.paged_attention_with_lse(q, k, v, *p.args[3:], **p.kwargs)
                runs.append((out, lse))
            assert_close_to_reference(runs[0][0], runs[0][1], ref_out, ref_lse, spec.dtype, p.num_real_tokens)
            for out, lse in runs[1:]:
                assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), name
    finally:
        checks.set_debug_mode(was)
    assert attention._launch_attention.short_launches >= short[0] + 2 * 3  # at least two per layout took it
    if context > 1024:
        assert merge_kernels._launch_reduce.short_launches >= short[1] + 2 * 3


@pytest.mark.gpu
@pytest.mark.parametrize("context", [300, 9000], ids=["one launch", "split + reduce"])
def test_repeated_calls_launch_from_addresses_with_the_full_paths_bits(context, monkeypatch):
    """A repeat of a prepared launch reads each tensor's address once and launches the recorded kernels directly
    (``Launcher.launch_addresses``); a new alignment, a side stream and debug mode still get the right kernel and
    the same bits as Triton's own path."""
    spec = Spec(q_lens=[1] * 3, kv_lens=[context, context // 2, 17], pad_tokens=1, page_size=16, num_kv_heads=2,
                group=4, head_dim=128, head_dim_v=128, dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=4)  # fmt: skip
    p = build(spec, "cuda")
    n = p.num_real_tokens
    taken = {"attention": 0, "reduce": 0}
    for name, launcher in (("attention", attention._launch_attention), ("reduce", merge_kernels._launch_reduce)):

        def counting(*args, _launch=launcher.launch_addresses, _name=name):
            ok = _launch(*args)
            taken[_name] += ok
            return ok

        monkeypatch.setattr(launcher, "launch_addresses", counting)
    flat = torch.empty(p.q.numel() + 1, dtype=p.q.dtype, device="cuda")
    unaligned = flat[1:].view(p.q.shape).copy_(p.q)
    out = torch.empty(p.q.shape[0], p.q.shape[1], 128, dtype=p.q.dtype, device="cuda")
    lse = torch.empty(p.q.shape[:2], device="cuda")

    def call(q):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        tpa.paged_attention_out(q, *p.args[1:], out=out, lse=lse, **p.kwargs)
        return out[:n].clone(), lse[:n].clone()

    was = checks.debug_mode()
    checks.set_debug_mode(True)  # Triton's own launch path, every call
    try:
        want = {"aligned": call(p.q), "unaligned": call(unaligned)}
    finally:
        checks.set_debug_mode(was)
    assert taken == {"attention": 0, "reduce": 0}
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(want["aligned"][0], want["aligned"][1], ref_out, ref_lse, spec.dtype, n)
    prepared.PREPARED.clear()
    side = torch.cuda.Stream()
    for i in range(3):
        for name, q in (("aligned", p.q), ("unaligned", unaligned)):
            got = call(q)
            assert torch.equal(got[0], want[name][0]) and torch.equal(got[1], want[name][1]), (i, name)
        side.wait_stream(torch.cuda.current_stream())  # the buffers' last uses on the default stream come first
        with torch.cuda.stream(side):  # a fresh workspace per call off the default stream
            got = call(p.q)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got[0], want["aligned"][0]) and torch.equal(got[1], want["aligned"][1]), (i, "side")
    (launch,) = [v for v in prepared.PREPARED.values() if v is not None]
    split = launch.reduce is not None
    assert split == (context > 1024)
    # Every call but the first (which prepares the launch) launches from addresses: the kernels for both alignments
    # were recorded by the debug-mode calls.
    assert taken == {"attention": 8, "reduce": 8 if split else 0}


def _small_problem(device, seed=5):
    spec = Spec(q_lens=[1, 3], kv_lens=[40, 21], pad_tokens=2, page_size=16, num_kv_heads=2, group=2, head_dim=32,
                head_dim_v=32, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0, use_alibi=False,
                use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1, extra_cols=0,
                tiles=None, seed=seed)  # fmt: skip
    return spec, build(spec, device)


def test_repeated_metadata_reuses_the_prepared_launch_and_new_metadata_is_checked_again():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec, p = _small_problem(device)
    ref = reference.paged_attention(*p.args[:9], **p.kwargs)
    rows = p.num_real_tokens
    prepared.PREPARED.clear()
    first = tpa.paged_attention(*p.args, **p.kwargs)
    assert len(prepared.PREPARED) == 1
    again = tpa.paged_attention(*p.args, **p.kwargs)
    assert len(prepared.PREPARED) == 1, "same metadata must reuse the prepared launch"
    assert again.data_ptr() != first.data_ptr(), "each call of paged_attention returns a new tensor"
    assert torch.equal(again[:rows], first[:rows])
    assert_close_to_reference(again, None, ref, None, spec.dtype, rows)

    # Other tensors with the same metadata: the prepared launch applies to their contents.
    q2 = torch.randn_like(p.q)
    got = tpa.paged_attention(q2, *p.args[1:], **p.kwargs)
    assert len(prepared.PREPARED) == 1
    want = reference.paged_attention(q2, *p.args[1:9], **p.kwargs)
    assert_close_to_reference(got, None, want, None, spec.dtype, rows)

    # A host value that changes the result (scale) is part of the key: a second entry, the right answer.
    q, k, v, bt, cu, lens, max_q, max_k, _ = p.args
    got = tpa.paged_attention(q, k, v, bt, cu, lens, max_q, max_k, 0.05, **p.kwargs)
    assert len(prepared.PREPARED) == 2
    want = reference.paged_attention(q, k, v, bt, cu, lens, max_q, max_k, 0.05, **p.kwargs)
    assert_close_to_reference(got, None, want, None, spec.dtype, rows)

    # After hits, invalid metadata still meets the checks (and adds no entry).
    with pytest.raises(TypeError, match="block_table"):
        tpa.paged_attention(q, k, v, bt.long(), cu, lens, max_q, max_k, spec.scale, **p.kwargs)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        tpa.paged_attention(q, k, v, bt, cu, lens, max_q, bt.shape[1] * 16 + 1, spec.scale, **p.kwargs)
    with pytest.raises(ValueError, match="scale"):
        tpa.paged_attention(q, k, v, bt, cu, lens, max_q, max_k, float("nan"), **p.kwargs)
    with pytest.raises(ValueError, match="out must have shape"):
        tpa.paged_attention_out(q, k, v, bt, cu, lens, max_q, max_k, spec.scale, out=first[:1])
    assert len(prepared.PREPARED) == 2

    # A config override (another plan for the same metadata) starts from a clean slate and leaves one behind.
    with heuristic.attention_config_override(BLOCK_N=16, num_splits=2):
        assert not prepared.PREPARED
        got = tpa.paged_attention(*p.args, **p.kwargs)
        assert prepared.PREPARED and next(iter(prepared.PREPARED.values())).plan.split.num_splits == 2
        assert_close_to_reference(got, None, ref, None, spec.dtype, rows)
    assert not prepared.PREPARED


def test_key_bound_rounds_up_by_at_most_a_sixteenth():
    bounds = [key_bound(m) for m in range(-2, 20000)]
    for m, b in zip(range(-2, 20000), bounds):
        assert m <= b <= m + max(255, m // 16) and key_bound(b) == b
    assert bounds == sorted(bounds) and len(set(bounds)) < 100  # monotone, and few distinct plans


def test_a_growing_max_seqlen_k_reuses_one_prepared_launch_and_still_meets_its_check():
    """A decode loop's ``max_seqlen_k`` grows by one per step: calls plan for its rounded-up bound, so a run of
    steps reuses one prepared launch with the same bits; the exact value still meets the block-table check, also
    where it shares its bound with values that passed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = Spec(q_lens=[1, 1], kv_lens=[250, 21], pad_tokens=0, page_size=4, num_kv_heads=2, group=2, head_dim=32,
                head_dim_v=32, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0, use_alibi=False,
                use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1, extra_cols=3,
                tiles=None, seed=7)  # fmt: skip
    p = build(spec, device)
    q, k, v, bt, cu, lens, max_q, max_k, scale = p.args
    capacity = bt.shape[1] * spec.page_size
    assert max_k == 250 and capacity == 264 and key_bound(capacity + 1) == key_bound(capacity - 3) > capacity
    ref = reference.paged_attention(*p.args, **p.kwargs)
    prepared.PREPARED.clear()
    first = tpa.paged_attention(*p.args, **p.kwargs)
    assert_close_to_reference(first, None, ref, None, spec.dtype, 2)
    for m in range(max_k + 1, capacity + 1):
        got = tpa.paged_attention(q, k, v, bt, cu, lens, max_q, m, scale, **p.kwargs)
        assert_close_to_reference(got, None, ref, None, spec.dtype, 2)
        if key_bound(m) == key_bound(max_k):
            assert torch.equal(got, first), f"max_seqlen_k={m}: same bound, same plan, same bits"
    assert len(prepared.PREPARED) == len({key_bound(m) for m in range(max_k, capacity + 1)}) == 2
    with pytest.raises(ValueError, match="max_seqlen_k"):
        tpa.paged_attention(q, k, v, bt, cu, lens, max_q, capacity + 1, scale, **p.kwargs)
    assert len(prepared.PREPARED) == 2


@pytest.mark.gpu
def test_prepared_launches_follow_each_calls_alignment_with_same_bits():
    """Same metadata, addresses of different 16-byte alignment: each call must run the variant Triton picks for it."""
    spec, p = _small_problem("cuda", seed=6)
    flat = torch.empty(p.q.numel() + 1, dtype=p.q.dtype, device="cuda")
    unaligned = flat[1:].view(p.q.shape).copy_(p.q)
    want, was = {}, checks.debug_mode()
    checks.set_debug_mode(True)  # Triton's own choice on every launch, no prepared launches
    try:
        for name, q in (("aligned", p.q), ("unaligned", unaligned)):
            want[name] = tpa.paged_attention_with_lse(q, *p.args[1:], **p.kwargs)
    finally:
        checks.set_debug_mode(was)
    prepared.PREPARED.clear()
    for _ in range(3):
        for name, q in (("aligned", p.q), ("unaligned", unaligned)):
            out, lse = tpa.paged_attention_with_lse(q, *p.args[1:], **p.kwargs)
            rows = p.num_real_tokens
            assert torch.equal(out[:rows], want[name][0][:rows]) and torch.equal(lse[:rows], want[name][1][:rows])
    assert len(prepared.PREPARED) == 1


def _workspaces() -> dict:
    """This thread's kept split-KV workspaces by device index."""
    return {k: v[0] for k, v in getattr(prepared._LOCAL, "buffers", {}).items()}


def test_split_workspace_is_reused_grown_and_fresh_where_it_must_be():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec, p = _small_problem(device, seed=7)
    rows = p.num_real_tokens
    getattr(prepared._LOCAL, "buffers", {}).clear()
    with heuristic.attention_config_override(BLOCK_N=16, num_splits=2):
        got = tpa.paged_attention(*p.args, **p.kwargs)
        assert_close_to_reference(got, None, reference.paged_attention(*p.args[:9], **p.kwargs), None,
                                  spec.dtype, rows)  # fmt: skip
        (buf,) = _workspaces().values()
        # Other contents, same metadata: the same buffer again, the right answer for the new query.
        q2 = torch.randn_like(p.q)
        got = tpa.paged_attention(q2, *p.args[1:], **p.kwargs)
        assert_close_to_reference(got, None, reference.paged_attention(q2, *p.args[1:9], **p.kwargs),
                                  None, spec.dtype, rows)  # fmt: skip
        assert list(_workspaces().values()) == [buf]
        # A call needing more than the buffer holds replaces it; the first shape then runs on the new one.
        big_spec = Spec(q_lens=[1] * 8, kv_lens=[300, 7, 150, 299, 1, 64, 200, 33], pad_tokens=2, page_size=16,
                        num_kv_heads=2, group=4, head_dim=64, head_dim_v=64, dtype=torch.float32, causal=True,
                        window_left=-1, softcap=0.0, use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1,
                        strided=False, spare_pages=1, extra_cols=0, tiles=None, seed=9)  # fmt: skip
        big = build(big_spec, device)
        with heuristic.attention_config_override(BLOCK_N=16, num_splits=8):
            got_big = tpa.paged_attention(*big.args, **big.kwargs)
        (grown,) = _workspaces().values()
        assert grown.numel() > buf.numel()
        want_big = reference.paged_attention(*big.args[:9], **big.kwargs)
        assert_close_to_reference(got_big, None, want_big, None, big_spec.dtype, big.num_real_tokens)
        got = tpa.paged_attention(q2, *p.args[1:], **p.kwargs)
        assert_close_to_reference(got, None, reference.paged_attention(q2, *p.args[1:9], **p.kwargs),
                                  None, spec.dtype, rows)  # fmt: skip
    # Launches on other streams than the default one get their own buffer, and so does another thread (its launches
    # may interleave with this one's on the same stream).
    t = p.q
    shared = prepared._workspace(t, 4, 12, None)[1]
    assert prepared._workspace(t, 4, 12, None)[1] is shared
    seen = []
    worker = threading.Thread(target=lambda: seen.append(prepared._workspace(t, 4, 12, None)[1]))
    worker.start()
    worker.join()
    assert seen and seen[0] is not shared
    if device == "cuda":
        default = prepared.current_stream(t.device.index)
        assert prepared._workspace(t, 4, 12, default)[1] is shared
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            other = prepared.current_stream(t.device.index)
            assert other != default
            assert prepared._workspace(t, 4, 12, other)[1] is not shared
            # A split call on the side stream: right answer, nothing kept for it.
            before = {k: id(v) for k, v in _workspaces().items()}
            with heuristic.attention_config_override(BLOCK_N=16, num_splits=2):
                got = tpa.paged_attention(q2, *p.args[1:], **p.kwargs)
        torch.cuda.synchronize()
        assert before == {k: id(v) for k, v in _workspaces().items()}
        assert_close_to_reference(got, None, reference.paged_attention(q2, *p.args[1:9], **p.kwargs),
                                  None, spec.dtype, rows)  # fmt: skip


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_segments_past_a_sequence_end_leave_their_outputs_unread(invariant):
    """A split batch where short sequences own empty segments: those programs store only lse = -inf, and the
    reduce must not read their (stale) partial outputs: a NaN-poisoned workspace changes nothing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = Spec(q_lens=[1, 1, 1], kv_lens=[300, 20, 1], pad_tokens=1, page_size=16, num_kv_heads=2, group=4,
                head_dim=32, head_dim_v=32, dtype=torch.float32, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=13)  # fmt: skip
    p = build(spec, device)
    want, want_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    cfg = dict(BLOCK_N=16, invariant_segment=64) if invariant else dict(BLOCK_N=16, num_splits=4)
    with heuristic.attention_config_override(**cfg):
        first = tpa.paged_attention_with_lse(*p.args, **p.kwargs, batch_invariant=invariant)
        (plan,) = prepared.PREPARED.values()
        assert plan.plan.split.num_splits >= 4 and plan.reduce is not None
        _workspaces()[p.q.get_device()].fill_(float("nan"))
        again = tpa.paged_attention_with_lse(*p.args, **p.kwargs, batch_invariant=invariant)
    rows = p.num_real_tokens
    for out, lse in (first, again):
        assert_close_to_reference(out, lse, want, want_lse, spec.dtype, rows)
    assert torch.equal(first[0][:rows], again[0][:rows]) and torch.equal(first[1][:rows], again[1][:rows])


def test_reduce_plan_dependent_launch_options():
    """A dependent reduce asks Triton for a programmatic dependent launch and waits for its producer in the kernel;
    interpreter plans never ask for it."""
    args = (4, 3, 8, 64, (1536, 512, 64), (24, 8, 1), 3, (512, 64), None)
    plain, dependent = merge_kernels.reduce_plan(*args), merge_kernels.reduce_plan(*args, dependent=True)
    assert "launch_pdl" not in plain.options and not plain.constexprs["WAIT_PRIOR"]
    assert dependent.options.get("launch_pdl") is True and dependent.constexprs["WAIT_PRIOR"]
    assert dependent.static != plain.static
    assert not merge_kernels.dependent_launch_supported(None)


def test_attention_plan_dependent_launch():
    """On a device with dependent launches every attention launch is one (and waits for its predecessor at its
    start), split or not; without them, and in the interpreter, none is."""
    from tests import posing

    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128, page_size=16, dtype=torch.bfloat16,
              cache_dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0, has_alibi=False, has_sinks=False,
              has_k_scale=False, has_v_scale=False, has_rows=False, want_lse=False, batch_invariant=False)  # fmt: skip
    shapes = ((1, 1, 32768), (64, 1, 4096), (4, 2048, 2048))  # split decode, unsplit decode, prefill
    # (planned_as restores the planner's functions on leaving, those set inside included.)
    with posing.planned_as(posing.H100):
        for supported in (True, False):
            planning.dependent_launch_supported = lambda index, _s=supported: _s
            posing._PLAN.cache_clear()
            splits = []
            for num_seqs, max_q, max_k in shapes:
                lp = planning.attention_launch_plan(**kw, num_seqs=num_seqs, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                                    device_index=0, interpret=False)  # fmt: skip
                assert lp.constexprs["WAIT_PRIOR"] == supported
                assert lp.options.get("launch_pdl", False) == supported
                splits.append(lp.split.num_splits)
            assert splits[0] > 1 and splits[2] == 1
    planning._cached_launch_plan.cache_clear()
    lp = planning.attention_launch_plan(**kw, num_seqs=1, max_seqlen_q=1, max_seqlen_k=32768, device_index=None,
                                        interpret=True)  # fmt: skip
    assert not lp.constexprs["WAIT_PRIOR"] and "launch_pdl" not in lp.options


@pytest.mark.gpu
def test_dependent_reduce_launch_gives_the_plain_launchs_bits(monkeypatch):
    """The reduce as a programmatic dependent launch (sm_90+) must wait for every partial, and the attention kernel
    (a dependent launch as well) for the writes into its inputs just before it: eager calls and CUDA-graph replays
    with new lengths and contents give the plain launches' bits, call after call."""
    spec = Spec(q_lens=[1] * 6, kv_lens=[9000, 4500, 17, 1, 2100, 800], pad_tokens=1, page_size=16, num_kv_heads=2,
                group=4, head_dim=128, head_dim_v=128, dtype=torch.bfloat16, causal=True, window_left=-1,
                softcap=0.0, use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False,
                spare_pages=1, extra_cols=0, tiles=None, seed=11)  # fmt: skip
    p = build(spec, "cuda")
    n = p.num_real_tokens
    supported = merge_kernels.dependent_launch_supported(p.q.device.index)
    out = torch.full((p.q.shape[0], p.q.shape[1], 128), float("nan"), dtype=p.q.dtype, device="cuda")
    lse = torch.full(p.q.shape[:2], float("nan"), device="cuda")
    max_k = p.block_table.shape[1] * spec.page_size

    def call():
        tpa.paged_attention_out(p.q, p.k_cache, p.v_cache, p.block_table, p.cu_seqlens_q, p.seq_lens, 1, max_k,
                                spec.scale, out=out, lse=lse)  # fmt: skip

    gen = torch.Generator(device="cuda").manual_seed(2)
    inputs = []
    built = torch.tensor(spec.kv_lens, device="cuda")
    for _ in range(4):
        # New lengths within each sequence's built pages (the reference reads the same block table).
        lens = (torch.rand(6, generator=gen, device="cuda") * built).to(torch.int32) + 1
        inputs.append((lens, torch.randn(p.q.shape, generator=gen, device="cuda").to(p.q.dtype)))
    results = {}
    for mode in (1, 2):
        prepared.PREPARED.clear()
        planning._cached_launch_plan.cache_clear()
        # 1: a plain launch (what devices without dependent launches get), 2: a dependent one where the device has it.
        monkeypatch.setattr(planning, "dependent_launch_supported", lambda index, _mode=mode: _mode == 2 and supported)
        call()  # compile outside the capture
        (plan,) = [v for v in prepared.PREPARED.values() if v is not None]
        assert plan.plan.split.num_splits > 1 and plan.reduce is not None
        assert plan.plan.constexprs["LAUNCH_DEPENDENTS"] == (mode == 2 and supported)
        # The attention kernel is then a dependent launch too: it must wait for the copies into q just before it.
        assert plan.plan.constexprs["WAIT_PRIOR"] == (mode == 2 and supported)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        runs = []
        for lens, q in inputs:
            p.seq_lens.copy_(lens)
            p.q.copy_(q)
            for replay in (False, True):
                out.fill_(float("nan"))
                if replay:
                    graph.replay()
                else:
                    call()
                runs.append((out[:n].clone(), lse[:n].clone()))
        results[mode] = runs
    want, want_lse = reference.paged_attention_with_lse(*p.args[:9], **p.kwargs)
    assert_close_to_reference(results[2][-1][0], results[2][-1][1], want, want_lse, spec.dtype, n)
    for (a, a_lse), (b, b_lse) in zip(results[1], results[2]):
        assert torch.equal(a, b) and torch.equal(a_lse, b_lse)


def test_host_path_benchmark_times_repeats_on_the_short_path():
    """``benchmarks.host_path`` times repeated calls that all take the short launch path (it checks that itself)."""
    from benchmarks import host_path

    res = host_path.measure([4096], calls=3)
    assert res["launches_per_call"] == 2
    assert all(res[k] > 0 for k in ("api_wrapper_us", "torch_ops_call_us", "op_body_us"))


def test_reduce_taking_the_full_path_reads_the_workspace_the_attention_kernel_wrote():
    """Off the default stream every call gets a new workspace: when the attention kernel launched from addresses but
    the reduce needs the full path (its output's alignment is new), the reduce must read the partials the attention
    kernel just wrote, not another new buffer."""
    spec = Spec(q_lens=[1] * 2, kv_lens=[4096, 17], pad_tokens=0, page_size=16, num_kv_heads=2, group=4,
                head_dim=64, head_dim_v=64, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=2)  # fmt: skip
    p = build(spec, "cpu")
    shape = (p.q.shape[0], p.q.shape[1], 64)
    flat = torch.empty(torch.Size(shape).numel() + 1, dtype=p.q.dtype)
    with standin.recording_launches(stream=0x5EED) as (attention_kernel, reduce_kernel):
        # The current stream is not the default one: fresh buffers per call. (``recording_launches`` restores it.)
        prepared._default_stream = lambda device_index: 0xD3F
        for out in (torch.empty(shape, dtype=p.q.dtype), flat[1:].view(shape)):
            tpa.paged_attention_out(*p.args, out=out, **p.kwargs)
        (launch,) = prepared.PREPARED.values()
    assert launch.reduce is not None
    # The second call: attention from addresses, the reduce through Triton's own path (a new alignment of ``out``).
    assert len(attention_kernel.runs) == 1 and len(reduce_kernel.own) == 2
    written_out, written_lse = attention_kernel.runs[0][2][3:5]
    _, reduce_args, _ = reduce_kernel.own[1]
    assert (reduce_args[0].data_ptr(), reduce_args[1].data_ptr()) == (written_out, written_lse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches")
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_every_launch_names_its_fp_fusion(invariant, monkeypatch):
    """Triton's default for FP fusion changes (off from 3.10): every kernel launch names it, so the compiled code,
    and the bits the tests pin, stay the same across Triton versions. Batch-invariant mode with a logit cap turns
    it off; everything else asks for it."""
    from triton.runtime import interpreter

    launches = []
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        launches.append((self.fn.__name__, kwargs.get("enable_fp_fusion")))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    spec = Spec(q_lens=[1, 1, 5], kv_lens=[200, 40, 30], pad_tokens=1, page_size=16, num_kv_heads=2, group=2,
                head_dim=32, head_dim_v=32, dtype=torch.float32, causal=True, window_left=-1, softcap=20.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=5)  # fmt: skip
    p = build(spec, "cpu")
    split = dict(BLOCK_N=16, invariant_segment=64) if invariant else dict(BLOCK_N=16, num_splits=2)
    with heuristic.attention_config_override(**split):
        tpa.paged_attention_with_lse(*p.args, **p.kwargs, batch_invariant=invariant)
    out, lse = tpa.paged_attention_with_lse(*p.args, **p.kwargs, batch_invariant=invariant)
    tpa.merge_attn_states(out, lse, out, lse)
    key = torch.randn(3, 2, 32)
    tpa.reshape_and_cache(key, key, p.args[1], p.args[2], torch.tensor([0, 5, 17]))
    names = {name for name, _ in launches}
    assert {"_paged_attention_kernel", "_reduce_splits_kernel", "_merge_attn_states_kernel",
            "_reshape_and_cache_kernel"} <= names, names  # fmt: skip
    for name, fusion in launches:
        want = not (invariant and name == "_paged_attention_kernel")
        assert fusion is want, (name, fusion)
