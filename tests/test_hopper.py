"""The warp-specialized sm_90 prefill kernel (``kernels.hopper``): which launches take it, and (on an sm_90 GPU with
a verified Triton) its outputs against the reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import configs, reference
from triton_paged_ops.configs.heuristic import attention_config_override
from triton_paged_ops.inputs import random_paged_batch
from triton_paged_ops.kernels import hopper
from triton_paged_ops.plan import MAX_SPLIT_Q_LEN, attention_launch_plan
from triton_paged_ops.prepared import PREPARED

from .strategies import poison_unowned_slots
from .test_attention import assert_close_to_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and hopper.available(torch.cuda.current_device())


def _plan(device_index, interpret=False, **kw):
    args = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128, page_size=16, dtype=torch.bfloat16,
                cache_dtype=torch.bfloat16, num_seqs=4, max_seqlen_q=2048, max_seqlen_k=4096, causal=True,
                window_left=-1, softcap=0.0, has_alibi=False, has_sinks=False, has_k_scale=False, has_v_scale=False,
                has_rows=False, want_lse=False, device_index=device_index, interpret=interpret,
                decode_tail=0)  # fmt: skip
    args.update(kw)
    return attention_launch_plan(**args)


def test_shapes_and_layouts_it_takes():
    """``shape_ok``: 16-bit caches of the query's dtype, equal K/V head dims of 64/128/256, groups dividing the
    128-row tile, 64- or 128-key tiles, buffers within the limit, any page size; ``gathers``: pages of under 16 keys
    or that neither divide the tile nor are a multiple of it are gathered key by key, others copied page by page;
    ``layout_ok``: heads adjacent in a slot, slots evenly strided, 16-byte strides and base; ``q_layout_ok``: query
    rows 16 bytes apart, D contiguous, 16-byte base."""
    ok = dict(group=4, head_dim=128, head_dim_v=128, page_size=16, block_n=128, stages=2, dtype=torch.bfloat16,
              cache_dtype=torch.bfloat16, shared_limit=232448)  # fmt: skip
    assert hopper.shape_ok(**ok)
    for bad in (dict(dtype=torch.float32, cache_dtype=torch.float32), dict(cache_dtype=torch.float8_e4m3fn),
                dict(head_dim=96, head_dim_v=96), dict(head_dim_v=64), dict(group=3), dict(block_n=32),
                dict(stages=4), dict(shared_limit=180000)):  # fmt: skip
        assert not hopper.shape_ok(**{**ok, **bad}), bad
    for good in (dict(page_size=64), dict(page_size=256), dict(page_size=32), dict(page_size=1), dict(page_size=8),
                 dict(page_size=48), dict(page_size=3), dict(head_dim=64, head_dim_v=64),
                 dict(head_dim=256, head_dim_v=256, block_n=64), dict(group=1), dict(group=128),
                 dict(dtype=torch.float16, cache_dtype=torch.float16)):  # fmt: skip
        assert hopper.shape_ok(**{**ok, **good}), good
    assert hopper.shared_bytes(128, 128, 2) >= 180312  # ptxas's figure for that variant (Triton 3.6)
    for page_size, block_n, gathered in ((1, 128, True), (8, 128, True), (15, 64, True), (48, 128, True),
                                         (24, 64, True), (16, 128, False), (32, 64, False), (64, 128, False),
                                         (256, 128, False), (128, 64, False)):  # fmt: skip
        assert hopper.gathers(page_size, block_n) == gathered, (page_size, block_n)
        copies = hopper.copy_constexprs(page_size, block_n)
        assert copies == {"COPY": 16 if gathered else min(page_size, block_n), "GATHER": gathered}

    cache = torch.zeros(10, 16, 8, 128, dtype=torch.bfloat16)
    assert hopper.layout_ok(cache, cache)
    combined = torch.zeros(10, 16, 2, 8, 128, dtype=torch.bfloat16)  # K and V of a slot side by side
    assert hopper.layout_ok(combined[:, :, 0], combined[:, :, 1])
    padded = torch.zeros(10, 16, 8, 136, dtype=torch.bfloat16)[..., :128]  # heads not adjacent
    assert not hopper.layout_ok(padded, padded)
    shifted = torch.zeros(10 * 16 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(10, 16, 8, 128)
    assert not hopper.layout_ok(shifted, shifted)
    assert hopper.layout_ok(shifted, shifted, check_address=False)

    q = torch.zeros(7, 8, 128, dtype=torch.bfloat16)
    assert hopper.q_layout_ok(q) and hopper.q_layout_ok(q.transpose(0, 1).contiguous().transpose(0, 1))
    qkv = torch.zeros(7, 12, 128, dtype=torch.bfloat16)  # q as a slice of a fused projection's output
    assert hopper.q_layout_ok(qkv[:, :8])
    assert not hopper.q_layout_ok(torch.zeros(7, 8, 132, dtype=torch.bfloat16)[:, :, :128])  # heads 264 bytes apart
    assert not hopper.q_layout_ok(torch.zeros(7, 128, 8, dtype=torch.bfloat16).transpose(1, 2))  # D not contiguous
    odd = torch.zeros(7 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(7, 8, 128)
    assert not hopper.q_layout_ok(odd) and hopper.q_layout_ok(odd, check_address=False)


def test_interpreter_and_cpu_launches_never_take_it():
    """Without an sm_90 device (the interpreter, CPU tensors) the plan keeps the unified kernel, whatever the
    config says."""
    assert not hopper.available(None)
    with attention_config_override(ws_prefill=True):
        assert _plan(None, interpret=True).ws is None


def test_tune_grids_hold_its_forms_where_the_device_runs_it():
    """Where the device runs the kernel, the prefill and prompts grids add its forms, and the unified kernel's
    forms say ``ws_prefill`` false (a table entry that takes the other kernel must not turn them into it); elsewhere,
    and for other regimes, the grids are the unified kernel's alone."""
    from triton_paged_ops.tune import candidates

    for regime in ("prefill", "prompts"):
        for quick in (True, False):
            plain = candidates(regime, False, quick)
            both = candidates(regime, False, quick, warp_specialized=True)
            ws = [c for c in both if c.get("ws_prefill")]
            assert [dict(c, ws_prefill=False) for c in plain] == both[: len(plain)]
            assert len(both) == len(plain) + len(ws)
            assert any(c["ws_block_n"] == 128 and c["ws_stages"] == 2 for c in ws)
            # The full grid tries both tile widths and stage counts.
            full = {(64, 2), (64, 3), (128, 2), (128, 3)}
            assert {(c["ws_block_n"], c["ws_stages"]) for c in ws} == ({(128, 2)} if quick else full)
            assert all(configs.validate_config(c) is None for c in both)
            assert not any("ws_prefill" in c for c in plain)
    assert candidates("decode", False, True, warp_specialized=True) == candidates("decode", False, True)
    assert candidates("prefill", True, True, warp_specialized=True) == candidates("prefill", True, True)


def test_config_keys_are_validated():
    ok = {"ws_prefill": True, "ws_block_n": 128, "ws_stages": 2}
    assert configs.validate_config(ok) is None
    assert "unknown key 'ws_schedule'" in configs.validate_config({"ws_schedule": "overlap"})
    assert "unknown key 'ws_mixed_order'" in configs.validate_config({"ws_mixed_order": 2})
    assert "ws_prefill" in configs.validate_config({"ws_prefill": 2})
    assert "ws_block_n" in configs.validate_config({"ws_block_n": 96})
    assert "ws_stages" in configs.validate_config({"ws_stages": 9})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon API this kernel was verified on")
def test_plan_takes_it_only_where_it_fits():
    """On sm_90 a prefill launch takes the kernel when its config says so and nothing it lacks is asked for (lse,
    window, cap, ALiBi, sinks, scales, split, batch-invariant mode, decode launches)."""
    dev = torch.cuda.current_device()
    with attention_config_override(ws_prefill=True):
        assert _plan(dev).ws == (128, 2)
        assert _plan(dev, decode_tail=5, num_seqs=6).ws == (128, 2)
        assert _plan(dev, page_size=1).ws == (128, 2)  # gathered key by key
    with attention_config_override(ws_prefill=True, ws_block_n=64, ws_stages=3):
        assert _plan(dev, decode_tail=5, num_seqs=6).ws == (64, 3)
    with attention_config_override(ws_prefill=True):
        for bad in (dict(want_lse=True), dict(window_left=100), dict(softcap=30.0), dict(has_alibi=True),
                    dict(has_sinks=True), dict(has_k_scale=True), dict(max_seqlen_q=1), dict(batch_invariant=True),
                    dict(dtype=torch.float32, cache_dtype=torch.float32)):  # fmt: skip
            assert _plan(dev, **bad).ws is None, bad
    with attention_config_override(ws_prefill=False):
        assert _plan(dev).ws is None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon API this kernel was verified on")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
@example(data=None)
def test_matches_reference(data):
    """Prompts, chunks on a cached prefix and mixed batches (decodes at the end, with the layout hint), ragged
    lengths, pages of 1-128 keys (those under 16, and 24, gathered key by key), GQA groups 1/4/8/16, head dims
    64/128/256, bf16 and fp16, causal or not, a request-pool block table (rows picked by index), padding rows:
    against the reference, with outputs NaN-poisoned and NaN in every cache slot no sequence owns (stale slots of
    the last page must not leak)."""
    if data is None:  # a fixed case: a mixed batch with pages of 16 and a ragged last page
        q_lens, prefix = [300, 77, 1, 1, 1], [0, 500, 900, 33, 17]
        page_size, head_dim, group, dtype, causal, rows, block_n, seed = 16, 128, 4, torch.bfloat16, True, False, 128, 0
    else:
        batch = data.draw(st.integers(1, 6))
        q_lens = data.draw(st.lists(st.integers(1, 700), min_size=batch, max_size=batch))
        q_lens[0] = max(q_lens[0], MAX_SPLIT_Q_LEN + 1)  # a prefill launch (shorter ones split their keys)
        decodes = data.draw(st.integers(0, 4))
        q_lens += [1] * decodes
        prefix = data.draw(st.lists(st.integers(0, 1500), min_size=len(q_lens), max_size=len(q_lens)))
        page_size = data.draw(st.sampled_from((1, 2, 8, 16, 24, 32, 64, 128)))
        head_dim = data.draw(st.sampled_from((64, 128, 256)))
        group = data.draw(st.sampled_from((1, 4, 8, 16)))
        dtype = data.draw(st.sampled_from((torch.bfloat16, torch.float16)))
        causal = data.draw(st.booleans())
        rows = data.draw(st.booleans())
        block_n = 64 if head_dim == 256 else data.draw(st.sampled_from((64, 128)))
        seed = data.draw(st.integers(0, 2**31 - 1))
        programs = data.draw(st.sampled_from((None, 1, 3, 8)))
    _check_against_reference(q_lens, prefix, page_size, head_dim, group, dtype, causal, rows, block_n, seed,
                             programs if data is not None else None)  # fmt: skip


def _check_against_reference(q_lens, prefix, page_size, head_dim, group, dtype, causal, rows, block_n, seed,
                             programs=None):  # fmt: skip
    """One batch through the warp-specialized kernel (asserted taken) against the reference; ``programs``: where
    the launch runs a program per SM, that many programs instead (each then runs many work items: the ring's
    slots, the q buffers and the tail fix-ups' phases carried across items, items without rows among them)."""
    if programs is not None:
        sms, shared = hopper._device_limits(torch.device(DEVICE))
        with mock.patch.object(hopper, "_device_limits", lambda device: (programs, shared)):
            PREPARED.clear()
            try:
                return _check_against_reference(q_lens, prefix, page_size, head_dim, group, dtype, causal, rows,
                                                block_n, seed)  # fmt: skip
            finally:
                PREPARED.clear()
    kv_lens = [q + p for q, p in zip(q_lens, prefix)]
    num_kv_heads = 2
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    p = random_paged_batch(q_lens, kv_lens, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, page_size=page_size, dtype=dtype, device=DEVICE, generator=gen,
                           pad_tokens=3, spare_pages=2, extra_cols=1,
                           rows_dtype=torch.int32 if rows else None)  # fmt: skip
    poison_unowned_slots(p.k_cache, p.v_cache, p.block_table, p.seq_lens, p.block_table_rows)
    hint = tpa.decode_tail_of(q_lens)
    extra = {"block_table_rows": p.block_table_rows} if rows else {}
    with attention_config_override(ws_prefill=True, ws_block_n=block_n, ws_stages=2):
        lp = _plan(torch.cuda.current_device(), num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, head_dim_v=head_dim, page_size=page_size, dtype=dtype, cache_dtype=dtype,
                   num_seqs=len(q_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens), causal=causal,
                   has_rows=rows, decode_tail=hint)  # fmt: skip
        assert lp.ws is not None, "the launch should take the warp-specialized kernel"
        out = torch.full((p.q.shape[0], group * num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        tpa.paged_attention_out(*p.args, causal=causal, decode_tail=hint, out=out, **extra)
    ref = reference.paged_attention(*p.args[:9], causal=causal, **extra)
    assert_close_to_reference(out, None, ref, None, dtype, sum(q_lens))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon API this kernel was verified on")
@pytest.mark.parametrize("head_dim, block_n, group, page_size, causal, rows, programs", [
    (128, 128, 4, 16, True, False, None), (256, 64, 8, 32, False, True, 3), (64, 128, 1, 64, True, True, None),
    (128, 64, 16, 128, True, False, 2), (128, 128, 4, 1, True, False, 3), (256, 64, 8, 4, True, True, None),
    (64, 128, 1, 8, False, False, 1), (128, 128, 8, 24, True, True, 5),
])  # fmt: skip
def test_fixed_ragged_batches_match_the_reference(head_dim, block_n, group, page_size, causal, rows, programs):
    """Fixed ragged batches with decodes, one-tile and many-tile sequences (the overlapped loop's first and last
    tiles are peeled; under causal masks and with padding rows the two warpgroups have unequal tile counts), pages
    copied whole and gathered key by key (a ring slot handed over by 128 threads' copies landing, tails zero-filled),
    a program per SM and a few programs running many items each."""
    q_lens, prefix = [517, 129, 64, 1, 1], [0, 1000, 3, 250, 0]
    _check_against_reference(q_lens, prefix, page_size, head_dim, group, torch.bfloat16, causal, rows, block_n,
                             seed=head_dim + group, programs=programs)  # fmt: skip


@pytest.mark.skipif(hopper.gluon is None, reason="the installed Triton has no Gluon Hopper API")
def test_each_head_dim_compiles_for_sm90_with_the_overlap():
    """Offline (no GPU): the kernel compiles for sm_90 at D64/128/256, with TMA copies of pages and with gathers
    (pages of 1), within the shared memory ``shape_ok`` counts on (two q buffers with a program per SM, else one),
    leaving one product in flight (``wgmma.wait_group 1``: the PV beside the softmax); with a program per SM (D64
    and D128, pages by TMA) the producer copies the query rows with 16-byte ``cp.async`` whose completion arrives on
    the q buffer's barrier (with a program per item the consumers load them), a gathering one a tile's K and V
    (2 x BLOCK_N x D x 2 bytes / 16 per thread of its warpgroup) arriving on the K and V barriers (no waits for
    copies anywhere); no spills at D64 and D128, at most a few bytes at D256 (its accumulators take 128 registers a
    thread)."""
    from .test_compile import _compiled

    rows = _compiled("tests.compile_matrix", "--gluon-forms")
    forms = sorted((d, g, d != 256 and not g) for d in hopper.HEAD_DIMS for g in (False, True))
    assert sorted((r["head_dim"], r["page_size"] == 1, r["producer_q"]) for r in rows) == forms
    for r in rows:
        head_dim, block_n = r["head_dim"], r["block_n"]
        assert hopper.q_buffers(head_dim, block_n, 2, 227 * 1024) == (1 if head_dim == 256 else 2)
        q_bufs = 2 if r["producer_q"] else 1
        assert 0 < r["shared"] <= hopper.shared_bytes(head_dim, block_n, 2, q_bufs) <= 227 * 1024, r
        assert r["waits"] == ["0", "1"], r
        assert r["spills"] <= (64 if head_dim == 256 else 0), r
        gathered = r["page_size"] == 1
        # The query rows (128 x D) by the producer's threads where it copies them; a gathering one adds a tile's K
        # and V.
        threads = 32 * (hopper.GATHER_WARPS if gathered else 1)
        q_rows = hopper.TILE_ROWS if r["producer_q"] else 0
        copies = (q_rows + (2 * block_n if gathered else 0)) * head_dim * 2 // 16
        assert r["cp_async"] == copies // threads, r
        assert r["arrives"] == 2 * gathered + r["producer_q"] and r["waits_for_copies"] == 0, r


def test_prepared_launch_binds_the_kernel_arguments(monkeypatch):
    """The host side without a GPU: a launch prepared from metadata passes the kernel, by its own parameter names,
    the grid (from shapes and the SM count), the caches as [slots, heads x D] descriptors copied a page at a time
    and as tensors with their slot strides (for gathers), and the scalars and constexprs of that metadata; pages of
    1 are gathered into the ring in the layout of 16-row copies (a stand-in kernel records the calls)."""
    params = hopper._ws_prefill_kernel.arg_names
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    monkeypatch.setattr(hopper, "_ws_prefill_kernel", Recorder())
    monkeypatch.setattr(hopper, "_device_limits", lambda device: (132, 232448))
    q = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    combined = torch.zeros(20, 16, 2, 2, 128, dtype=torch.bfloat16)  # K and V of a slot side by side
    k_cache, v_cache = combined[:, :, 0], combined[:, :, 1]
    block_table = torch.zeros(3, 10, dtype=torch.int32)
    out = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    cu, seq_lens = torch.tensor([0, 60, 99, 100], dtype=torch.int32), torch.tensor([60, 99, 100], dtype=torch.int32)
    p = hopper.prepare(q, k_cache, block_table, out, has_rows=False, num_seqs=3, scale=0.5, causal=True,
                       block_n=128, stages=2)  # fmt: skip
    p.run(q, k_cache, v_cache, block_table, None, cu, seq_lens, out)
    grid, args, kw = calls[0]
    names = [n for n in params if n not in kw]
    got = dict(zip(names, args, strict=True))
    assert grid == ((100 // 32 + 3) * 2,)  # fewer items than SMs: a program each
    assert got["q_ptr"] is q and got["out_ptr"] is out and got["block_table_rows_ptr"] is block_table
    for name, cache in (("k_desc", k_cache), ("v_desc", v_cache)):
        desc = got[name]
        assert desc.base is cache and list(desc.shape) == [320, 256] and list(desc.strides) == [512, 1]
        assert list(desc.block_shape) == [16, 128]
    assert got["qk_scale"] == pytest.approx(0.5 * hopper.LOG2E)
    counts = ("num_seqs", "num_tokens", "max_pages", "num_bt_rows", "num_items", "num_kv_heads")
    assert [got[n] for n in counts] == [3, 100, 10, 3, (100 // 32 + 3) * 2, 2]
    strides = ("stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_bt_b")
    assert [got[n] for n in strides] == [1024, 128, 1024, 128, 10]
    assert got["k_ptr"] is k_cache and got["v_ptr"] is v_cache
    assert got["stride_k_slot"] == got["stride_v_slot"] == 512
    assert kw == dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, COPY=16, STAGES=2, Q_BUFS=2,
                      PRODUCER_Q=True, IS_CAUSAL=True, HAS_BT_ROWS=False, GATHER=False, num_warps=4,
                      enable_fp_fusion=True)  # fmt: skip

    one = combined.view(320, 1, 2, 2, 128)  # the same slots as pages of 1
    p = hopper.prepare(q, one[:, :, 0], block_table, out, has_rows=False, num_seqs=3, scale=0.5, causal=True,
                       block_n=128, stages=2)  # fmt: skip
    p.run(q, one[:, :, 0], one[:, :, 1], block_table, None, cu, seq_lens, out)
    grid, args, kw = calls[1]
    got = dict(zip([n for n in params if n not in kw], args, strict=True))
    assert list(got["k_desc"].block_shape) == [16, 128] and got["stride_v_slot"] == 512
    assert kw["GATHER"] is True and kw["COPY"] == 16 and kw["PAGE_SIZE"] == 1

    # More items than SMs: a program per SM where the q tile has a second buffer (its producer copying the q rows)
    # and pages come by TMA, else (pages gathered key by key, D256) a program per item, whose consumers load their
    # own.
    monkeypatch.setattr(hopper, "_device_limits", lambda device: (4, 232448))
    items = (100 // 32 + 3) * 2
    assert hopper.prepare(q, k_cache, block_table, out, has_rows=False, num_seqs=3, scale=0.5, causal=True,
                          block_n=128, stages=2).grid == (4,)  # fmt: skip
    gathered = hopper.prepare(q, one[:, :, 0], block_table, out, has_rows=False, num_seqs=3, scale=0.5,
                              causal=True, block_n=128, stages=2)  # fmt: skip
    assert (gathered.grid, gathered.constexprs["Q_BUFS"], gathered.constexprs["PRODUCER_Q"]) == ((items,), 1, False)
    q256 = torch.zeros(100, 8, 256, dtype=torch.bfloat16)
    cache256 = torch.zeros(20, 32, 2, 256, dtype=torch.bfloat16)
    wide = hopper.prepare(q256, cache256, block_table, q256, has_rows=False, num_seqs=3, scale=0.5, causal=True,
                          block_n=64, stages=2)  # fmt: skip
    assert (wide.grid, wide.constexprs["Q_BUFS"], wide.constexprs["PRODUCER_Q"]) == ((items,), 1, False)
