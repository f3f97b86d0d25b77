"""The short launch path (kernels/launch.py): its cache key separates what Triton specialises on, and on a GPU it
runs exactly the compiled kernel Triton's own launch would pick, with the same results."""

from __future__ import annotations

import types

import pytest
import torch

import triton_paged_ops as tpa
from triton_paged_ops import checks, reference
from triton_paged_ops.kernels import attention, merge
from triton_paged_ops.kernels.launch import Launcher

from .strategies import Spec, build
from .test_attention import assert_close_to_reference


def _stand_in(unspecialised: set[int], n: int):
    params = [types.SimpleNamespace(num=i, do_not_specialize=i in unspecialised, is_constexpr=False) for i in range(n)]
    return types.SimpleNamespace(params=params)


def test_key_separates_what_triton_specialises_on():
    launcher = Launcher(_stand_in({2}, 3), num_tensors=1, num_floats=0)
    base = torch.zeros(64, dtype=torch.float16)

    def key(t, spec_int, dns_int):
        return launcher._key((t, spec_int, dns_int), 0, "v")

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
    assert launcher._key((base, 32, 5), 1, "v") != k  # device
    assert launcher._key((base, 32, 5), 0, "w") != k  # constexprs / options


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
@pytest.mark.parametrize("context", [300, 9000], ids=["one segment", "split + reduce"])
def test_short_path_runs_tritons_kernel_with_same_bits(context):
    spec = Spec(q_lens=[1] * 3, kv_lens=[context, context // 2, 17], pad_tokens=0, page_size=16, num_kv_heads=2,
                group=4, head_dim=128, head_dim_v=128, dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0,
                use_alibi=False, use_sinks=False, use_kv_scale=False, scale=0.1, strided=False, spare_pages=1,
                extra_cols=0, tiles=None, seed=3)  # fmt: skip
    p = build(spec, "cuda")
    ref_out, ref_lse = reference.paged_attention_with_lse(*p.args[:6], spec.scale, **p.kwargs)
    short = attention._launch_attention.short_launches, merge._launch_reduce.short_launches
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
        assert merge._launch_reduce.short_launches >= short[1] + 2 * 3
