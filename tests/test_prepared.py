"""Prepared launches found again from a call's metadata (prepared.py, ops._repeat): a launch is repeated exactly when
every fact its checks and plan read is the same, whichever matcher compares the tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import triton_paged_ops as tpa
from benchmarks import standin
from triton_paged_ops import prepared, reference

from .strategies import Spec, build
from .test_attention import assert_close_to_reference

_DTYPES = (torch.float16, torch.float32, torch.int32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def _tensor(draw) -> torch.Tensor:
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    t = torch.zeros(shape, dtype=draw(st.sampled_from(_DTYPES)))
    if len(shape) > 1 and draw(st.booleans()):
        t = t.transpose(0, 1)  # other strides (and maybe another shape)
    if t.is_floating_point() and draw(st.booleans()):
        t = t.requires_grad_() if draw(st.booleans()) else torch.nn.Parameter(t, requires_grad=False)
    return t


def _facts(t: torch.Tensor) -> tuple:
    return type(t), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad


@given(st.lists(_tensor(), min_size=1, max_size=5), st.data())
def test_both_matchers_match_exactly_the_calls_with_the_same_metadata(first, data):
    """Each matcher accepts tensors exactly when type, shape, strides, dtype, device and ``requires_grad`` of every
    slot equal those it was built from (new tensor objects, the same ones, or a slot's metadata changed)."""
    fresh = [data.draw(st.sampled_from([t, t.detach().clone().requires_grad_(t.requires_grad)])) for t in first]
    fresh = [f if type(f) is type(t) else torch.nn.Parameter(f, requires_grad=t.requires_grad)
             for f, t in zip(fresh, first)]  # fmt: skip
    changed = list(fresh)
    i = data.draw(st.integers(0, len(first) - 1))
    changed[i] = data.draw(_tensor())
    for python in (False, True):
        matcher = prepared.make_matcher(first, python=python)
        assert matcher.check(*fresh) is True, python
        want = all(_facts(a) == _facts(b) for a, b in zip(changed, first))
        assert matcher.check(*changed) is want, (python, [_facts(t) for t in changed], [_facts(t) for t in first])
        assert matcher.check(*first[:-1], None) is False and matcher.check(*first[:-1], 1) is False


def test_the_cache_keeps_a_few_variants_per_host_key_and_a_bounded_total():
    cache = prepared.PreparedLaunches(limit=5, chain_limit=2)
    tensors = [(torch.zeros(n),) for n in range(1, 8)]
    for n in range(3):
        cache.add("h", tensors[n], n, capacity=10, direct=True)
    # Newest first; the oldest variant dropped past the chain limit.
    assert len(cache) == 2 and cache.find("h", tensors[0]) is None
    assert cache.find("h", tensors[2]).value == 2 and cache.find("h", tensors[1]).value == 1
    assert cache.find("other", tensors[1]) is None
    for n in range(3, 6):
        cache.add(f"h{n}", tensors[n], n, capacity=10, direct=False)
    assert len(cache) == 5 and cache.values() == [1, 2, 3, 4, 5]
    cache.add("h6", tensors[6], 6, capacity=10, direct=True)  # past the limit: a clean slate, then the new one
    assert len(cache) == 1 and cache.values() == [6] and cache.find("h", tensors[2]) is None


def _spec(**kw) -> Spec:
    base = dict(q_lens=[1, 1], kv_lens=[40, 21], pad_tokens=0, page_size=16, num_kv_heads=2, group=2, head_dim=32,
                head_dim_v=32, dtype=torch.float16, causal=True, window_left=-1, softcap=0.0, use_alibi=False,
                use_sinks=False, use_kv_scale=False, scale=0.2, strided=False, spare_pages=1, extra_cols=0,
                tiles=None, seed=3)  # fmt: skip
    return Spec(**{**base, **kw})


def test_one_tensor_in_two_slots_repeats_its_prepared_launch():
    """The C++ guards take each tensor object once per check; a call passing one tensor as both K and V cache must
    still find its prepared launch (a Python matcher serves it) instead of planning again every call."""
    p = build(_spec(), "cpu")
    q, k, _, bt, cu, lens, max_q, max_k, scale = p.args
    with standin.recording_launches() as (kernel, _):
        for _ in range(3):
            tpa.paged_attention(q, k, k, bt, cu, lens, max_q, max_k, scale, **p.kwargs)
        assert len(prepared.PREPARED) == 1 and len(kernel.own) == 1 and len(kernel.runs) == 2


def test_optional_tensors_in_other_slots_get_their_own_launch():
    """ALiBi slopes and sinks have the same metadata ([Hq] float32): a launch prepared with one must not serve a
    call with the other."""
    p = build(_spec(use_alibi=True, use_sinks=True), DEVICE)
    extra = torch.rand(p.q.shape[1], device=DEVICE) - 0.5
    prepared.PREPARED.clear()
    for kw in ({"alibi_slopes": extra}, {"sinks": extra}, {"alibi_slopes": extra}):
        kwargs = {**p.kwargs, "alibi_slopes": None, "sinks": None, **kw}
        got = tpa.paged_attention(*p.args, **kwargs)
        want = reference.paged_attention(*p.args[:9], **kwargs)
        assert_close_to_reference(got, None, want, None, torch.float16, p.num_real_tokens)
    assert len(prepared.PREPARED) == 2


@pytest.mark.parametrize("op", ["paged_attention", "paged_attention_with_lse", "paged_attention_out"])
@pytest.mark.parametrize("python", [False, True])
def test_repeats_match_the_full_path_with_either_matcher(monkeypatch, python, op):
    """With the C++ guards or the Python matcher, each op's repeats on new tensors (and new outputs) launch what the
    first call prepared, with the bits of that first (full-path) call; a call whose metadata differs in one tensor
    is planned and checked again."""
    if python:
        monkeypatch.setattr(prepared, "_GUARDS", None)
    p = build(_spec(), DEVICE)
    rows = p.num_real_tokens

    def call(q, *args) -> tuple:
        if op != "paged_attention_out":
            got = getattr(tpa, op)(q, *args, **p.kwargs)
            return got if isinstance(got, tuple) else (got,)
        out = torch.full((*q.shape[:2], p.v_cache.shape[3]), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:2], float("nan"), device=q.device)
        tpa.paged_attention_out(q, *args, **p.kwargs, out=out, lse=lse)
        return out, lse

    prepared.PREPARED.clear()
    first = call(*p.args)
    for _ in range(2):
        again = call(p.q.clone(), *p.args[1:])
        assert all(torch.equal(a[:rows], b[:rows]) for a, b in zip(first, again, strict=True))
    assert len(prepared.PREPARED) == 1
    matcher = prepared.PREPARED.chains[next(iter(prepared.PREPARED.chains))][0].matcher
    assert isinstance(matcher, prepared.PythonMatcher) is (python or prepared._GUARDS is None)
    with pytest.raises(TypeError, match="seq_lens"):
        call(*p.args[:5], p.args[5].long(), *p.args[6:])
    assert len(prepared.PREPARED) == 1
