"""Inputs at the edges of the numbers: large logits through every merge of partial results (split-KV reduce,
batch-invariant folds, ``merge_attn_states``, cascades), huge log-sum-exps, huge logit caps; and what the ops refuse
(no backward, bad types)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import triton_paged_ops as tpa
from triton_paged_ops import reference
from triton_paged_ops.cascade import cascade_attention
from triton_paged_ops.configs.heuristic import attention_config_override
from triton_paged_ops.inputs import random_paged_batch

from .strategies import guarded, poison_unowned_slots
from .test_attention import DEVICE, TOLERANCE, assert_close_to_reference


def _batch(q_lens, kv_lens, *, hq=8, hkv=2, d=64, page_size=16, dtype=torch.float32, q_scale=1.0, seed=0,
           poison=True):  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pb = random_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                            dtype=dtype, device=DEVICE, generator=gen, spare_pages=1)  # fmt: skip
    if poison:
        poison_unowned_slots(pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens)
    pb.q = (pb.q.float() * q_scale).to(dtype)
    return pb


def _attend(pb, **kw):
    t, hq = pb.q.shape[:2]
    out, out_guards = guarded((t, hq, pb.v_cache.shape[-1]), pb.q.dtype, DEVICE)
    lse, lse_guards = guarded((t, hq), torch.float32, DEVICE)
    tpa.paged_attention_out(*pb.args, **kw, out=out, lse=lse)
    out_guards()
    lse_guards()
    return out, lse


# q scaled x40: logits of a few hundred (base 2), far past exp2's fp32 range unless every partial result and merge
# subtracts its running maximum.
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_logits_through_split_merges(num_splits, invariant, dtype):
    pb = _batch([1, 3, 1, 9], [300, 130, 17, 200], dtype=dtype, q_scale=40.0, seed=num_splits)
    cfg = {"num_splits": num_splits} if not invariant else {"BLOCK_N": 16, "invariant_segment": 32}
    with attention_config_override(**cfg):
        out, lse = _attend(pb, batch_invariant=invariant)
    ref_out, ref_lse = reference.paged_attention_with_lse(*pb.args[:9])
    assert ref_lse.abs().max() > 100, "the case must have large logits"
    assert_close_to_reference(out, lse, ref_out, ref_lse, dtype, int(pb.cu_seqlens_q[-1]))


@pytest.mark.parametrize("magnitude", [1e3, 1e5, 2e7, 1e30])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_merge_of_huge_lses_is_exact(magnitude, path):
    """Two parts whose lses are ``magnitude`` plus small offsets: the merge is their weighted mean, with weights
    and lse computed here in float64 from the offsets alone."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    out_a, out_b = (torch.randn(6, 4, 32, generator=gen, device=DEVICE) for _ in range(2))
    da, db = (torch.randn(6, 4, generator=gen, device=DEVICE) * 3 for _ in range(2))
    base = magnitude * torch.tensor([1.0, -1.0, 1.0, -1.0], device=DEVICE).expand(6, 4)
    lse_a, lse_b = base + da, base + db
    # (The lse offsets as fp32 stores them at this magnitude: the merge can only be as exact as its inputs.)
    da, db = (lse_a.double() - base.double()), (lse_b.double() - base.double())
    top = torch.maximum(da, db)
    w_a, w_b = torch.exp(da - top), torch.exp(db - top)
    want = (w_a[..., None] * out_a.double() + w_b[..., None] * out_b.double()) / (w_a + w_b)[..., None]
    want_lse = base.double() + top + torch.log(w_a + w_b)
    merge = tpa.merge_attn_states if path == "kernel" else reference.merge_attn_states
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert (out.double() - want).abs().max() < 1e-5
    assert ((lse.double() - want_lse).abs() / want_lse.abs()).max() < 1e-6


@pytest.mark.parametrize("q_scale", [1.0, 1e3])
def test_cascade_with_large_logits_equals_plain_attention(q_scale):
    """The shared prefix and each request's own keys merged: equal to attention over the whole key list, also when
    the logits are ~1e4 (every weight but the largest underflows; an unsubtracted merge returns garbage)."""
    prefix_len, page_size = 48, 16
    own_q, own_k = [1, 4, 1], [20, 9, 33]
    pb = _batch(own_q, [prefix_len + k for k in own_k], page_size=page_size, q_scale=q_scale, seed=2)
    prefix_pages = pb.block_table[0, : prefix_len // page_size].clone()
    # Every request shares request 0's prefix pages; its own pages follow.
    table = pb.block_table.clone()
    table[:, : prefix_len // page_size] = prefix_pages
    own_table = table[:, prefix_len // page_size :].contiguous()
    out = cascade_attention(pb.q, pb.k_cache, pb.v_cache, prefix_pages, prefix_len, own_table, pb.cu_seqlens_q,
                            torch.tensor(own_k, dtype=torch.int32, device=DEVICE), max(own_q), max(own_k),
                            pb.scale)  # fmt: skip
    ref = reference.paged_attention(pb.q, pb.k_cache, pb.v_cache, table, *pb.args[4:9])
    tol = TOLERANCE[torch.float32]
    err = (out - ref).norm() / ref.norm()
    assert err <= tol["rel"], f"relative error {err:.2e}"


@pytest.mark.parametrize("softcap", [30.0, 1e4, 1e7, 1e30])
def test_huge_softcap_is_no_cap(softcap):
    """A cap far above every logit changes nothing: ``cap * tanh(s / cap)`` is ``s`` to fp32 precision (the exp
    form of tanh lost a tenth of each logit at a cap of 1e7)."""
    pb = _batch([3, 1], [40, 70], seed=3)
    out, lse = _attend(pb, softcap=softcap)
    ref_out, ref_lse = reference.paged_attention_with_lse(*pb.args[:9], softcap=softcap)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32, 4)
    if softcap >= 1e7:
        plain_out, plain_lse = reference.paged_attention_with_lse(*pb.args[:9])
        assert_close_to_reference(out, lse, plain_out, plain_lse, torch.float32, 4)


def test_reference_page_ids_and_slots_outside_the_cache_follow_the_kernels():
    """A corrupt table or slot mapping: the reference neither raises nor wraps around. Page ids outside the cache
    read page 0 (as the kernels' ``clamp_pages``), slots outside it are skipped (as the cache kernel drops them)."""
    # (No NaN in unowned slots here: the bad ids read page 0 whole.)
    pb = _batch([2, 1], [40, 30], seed=4, poison=False)
    bad = pb.block_table.clone()
    bad[0, 1] = -3  # a negative id (indexing would wrap to the third page from the end)
    bad[1, 0] = pb.k_cache.shape[0] + 5
    with attention_config_override(clamp_pages=True):
        out, lse = _attend(type(pb)(**{**pb.__dict__, "block_table": bad}))
    ref_out, ref_lse = reference.paged_attention_with_lse(pb.q, pb.k_cache, pb.v_cache, bad, *pb.args[4:9])
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32, 3)
    page0 = pb.block_table.clone()
    page0[0, 1] = page0[1, 0] = 0
    want = reference.paged_attention(pb.q, pb.k_cache, pb.v_cache, page0, *pb.args[4:9])
    assert torch.equal(ref_out, want)

    k_cache, v_cache = pb.k_cache.clone(), pb.v_cache.clone()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    key = torch.randn(4, 2, 64, device=DEVICE)
    slots = torch.tensor([-num_slots - 1, num_slots, num_slots + 17, 5], device=DEVICE)
    reference.reshape_and_cache(key, key, k_cache, v_cache, slots)
    changed = k_cache != pb.k_cache
    assert changed.any(dim=(2, 3)).nonzero().tolist() == [[0, 5]]


def test_ops_refuse_inputs_that_need_a_gradient():
    pb = _batch([2], [9], seed=5)
    q = pb.q.clone().requires_grad_()
    args = (q, *pb.args[1:])
    for call in (lambda: tpa.paged_attention(*args), lambda: torch.ops.tpa.paged_attention(*args)):
        with pytest.raises(RuntimeError, match="q requires grad"):
            call()
    with torch.no_grad():
        assert torch.equal(tpa.paged_attention(*args), tpa.paged_attention(*pb.args))
    # (merge_attn_states is a custom op: PyTorch itself refuses a backward through it.)
    lse = torch.zeros(2, 8, device=DEVICE, requires_grad=True)
    out, _ = tpa.merge_attn_states(torch.zeros(2, 8, 64, device=DEVICE), lse, torch.zeros(2, 8, 64, device=DEVICE),
                                   lse.detach())  # fmt: skip
    with pytest.raises(RuntimeError, match="autograd"):
        out.sum().backward()


def test_bad_types_are_named():
    pb = _batch([2], [9], seed=6)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        tpa.paged_attention(None, *pb.args[1:])
    with pytest.raises(TypeError, match="prefix_pages must be an int32"):
        cascade_attention(pb.q, pb.k_cache, pb.v_cache, torch.tensor([0], dtype=torch.int64, device=DEVICE), 8,
                          pb.block_table, pb.cu_seqlens_q, pb.seq_lens, 2, 9, pb.scale)  # fmt: skip


def test_calls_from_several_threads_match_serial_calls():
    """Launches from threads at once (Triton's interpreter keeps process-wide state: they must take turns) give the
    same bits as the same calls one after another."""
    problems = [_batch([3, 1], [50 + 9 * i, 20 + i], seed=10 + i) for i in range(4)]

    def work(pb):
        out, lse = _attend(pb)
        merged, merged_lse = tpa.merge_attn_states(out, lse, out, lse)
        k_cache, v_cache = pb.k_cache.clone(), pb.v_cache.clone()
        tpa.reshape_and_cache(pb.q[:, :2], pb.q[:, :2], k_cache, v_cache,
                              torch.arange(pb.q.shape[0], device=DEVICE))  # fmt: skip
        return out, lse, merged, merged_lse, k_cache, v_cache

    # (Split launches: the attention kernel, then the reduce. The override is process-wide: set once, around all.)
    with attention_config_override(num_splits=2):
        serial = [work(pb) for pb in problems]
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            threaded = list(pool.map(work, problems * 2))
    for got, want in zip(threaded, serial * 2):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_reference_takes_the_ops_arguments():
    """One signature: a call written for ``tpa.paged_attention_with_lse`` binds the same values in the reference,
    which checks the bounds it is given."""
    import inspect

    import triton_paged_ops as tpa

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(reference.paged_attention_with_lse) == shape(tpa.paged_attention_with_lse)
    assert shape(reference.paged_attention) == shape(tpa.paged_attention)
    pb = _batch([3, 1], [40, 70], seed=6)
    q, k, v, bt, cu, lens, max_q, max_k, scale = pb.args
    with pytest.raises(ValueError, match="max_seqlen_q=2 is below a query length"):
        reference.paged_attention(q, k, v, bt, cu, lens, 2, max_k, scale)
    with pytest.raises(ValueError, match="max_seqlen_k=69 is below a sequence length"):
        reference.paged_attention(q, k, v, bt, cu, lens, max_q, 69, scale)
