"""reshape_and_cache writes exactly the slots asked, with the right values, and nothing else."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import reference

from .strategies import guarded

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = (torch.float16,) if DEVICE == "cpu" else (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, *LOW)


@st.composite
def cache_writes(draw):
    page_size = draw(st.sampled_from((1, 2, 3, 7, 16, 32, 64)))
    num_pages = draw(st.integers(1, 12))
    num_slots = num_pages * page_size
    n_write = draw(st.integers(0, min(num_slots, 48)))
    n_pad = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # Padding (-1), and slots outside the cache on either side (dropped, as debug mode would report them).
    stray = [-1, -1, -page_size - 1, -num_slots - 3, num_slots, num_slots + page_size + 2]
    slots = torch.randperm(num_slots, generator=gen)[:n_write].tolist() + stray[: n_pad + 1]
    order = torch.randperm(len(slots), generator=gen).tolist()
    return {
        "page_size": page_size,
        "num_pages": num_pages,
        "slots": [slots[i] for i in order],
        "num_kv_heads": draw(st.sampled_from((1, 2, 3, 8))),
        "dims": draw(st.sampled_from(((64, 64), (80, 80), (96, 64), (128, 128), (192, 128), (256, 256)))),
        "src_dtype": draw(st.sampled_from(FLOATS)),
        "cache_dtype": draw(st.sampled_from(FLOATS)),
        "index_dtype": draw(st.sampled_from((torch.int32, torch.int64))),
        "strided": draw(st.booleans()),
        "scaled": draw(st.booleans()),
        "seed": seed,
    }


@given(case=cache_writes())
def test_writes_exactly_the_given_slots(case):
    gen = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    d, dv = case["dims"]
    h, ps, pages = case["num_kv_heads"], case["page_size"], case["num_pages"]
    n = len(case["slots"])
    key = torch.randn(n, h, d, generator=gen, device=DEVICE).to(case["src_dtype"])
    value = torch.randn(n, h, dv, generator=gen, device=DEVICE).to(case["src_dtype"])
    if case["strided"]:
        # K and V interleaved in one buffer with padded head and dim axes: only the last dim is contiguous.
        buf = torch.randn(pages, ps, 2, h + 1, max(d, dv) + 4, generator=gen, device=DEVICE).to(case["cache_dtype"])
        k_cache, v_cache = buf[:, :, 0, :h, :d], buf[:, :, 1, 1:, :dv]
    else:
        # Guard pages before and after each cache: a write past either end shows.
        k_cache, k_guards = guarded((pages, ps, h, d), case["cache_dtype"], DEVICE)
        v_cache, v_guards = guarded((pages, ps, h, dv), case["cache_dtype"], DEVICE)
        k_cache.copy_(torch.randn(pages, ps, h, d, generator=gen, device=DEVICE))
        v_cache.copy_(torch.randn(pages, ps, h, dv, generator=gen, device=DEVICE))
    scales = {}
    if case["scaled"]:
        scales = {
            "k_scale": torch.tensor([0.25], device=DEVICE),
            "v_scale": torch.tensor([3.0], device=DEVICE),
        }
    slot_mapping = torch.tensor(case["slots"], dtype=case["index_dtype"], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_ref, v_ref, slot_mapping, **scales)
    tpa.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, **scales)
    # Bitwise: the written slots hold the (scaled, cast) inputs, every other slot keeps its old random bits.
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    if not case["strided"]:
        k_guards()
        v_guards()
    # And the reference itself did write the tokens (guards against both sides doing nothing).
    for i, slot in enumerate(case["slots"]):
        if 0 <= slot < pages * ps and not scales:
            assert torch.equal(k_cache[slot // ps, slot % ps], key[i].to(case["cache_dtype"]))


def test_padding_slots_write_nothing():
    k_cache = torch.randn(2, 4, 1, 64, device=DEVICE)
    v_cache = torch.randn(2, 4, 1, 64, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, 1, 64, device=DEVICE)
    tpa.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([-1, -5, -1], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


FP8 = torch.float8_e4m3fn


def _fp8_case(n: int, scale: float, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys/values that are fp8 numbers times a power-of-two scale (exact after the division), and fp8 caches."""
    fp8_values = (torch.randn(n, 2, 64, generator=gen, device=DEVICE) * 100).to(FP8)
    key = fp8_values.float() * scale
    value = fp8_values.flip(0).float() * scale
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE).to(FP8)
    return key, value, k_cache, k_cache.clone()


@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from((0.25, 1.0, 4.0)), src=st.sampled_from(FLOATS))
def test_fp8_cache_holds_the_quantised_values(seed, scale, src):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    key, value, k_cache, v_cache = _fp8_case(20, scale, gen)
    key, value = key.to(src), value.to(src)
    slots = torch.randperm(64, generator=gen, device=DEVICE)[:20]
    scales = torch.tensor([scale], device=DEVICE)
    tpa.reshape_and_cache(key, value, k_cache, v_cache, slots, scales, scales)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots, scales, scales)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    # Dequantised, the cache gives the inputs back exactly (they were fp8 numbers times the scale).
    got = k_cache.view(-1, 2, 64)[slots.long()].float() * scale
    assert torch.equal(got, key.float())


def test_fp8_cache_saturates_instead_of_nan():
    key = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), 448.0, 500.0, -460.0, 3.0], device=DEVICE)
    key = key.view(8, 1, 1).expand(8, 1, 16).contiguous()
    k_cache = torch.zeros(1, 8, 1, 16, device=DEVICE).to(FP8)
    v_cache = k_cache.clone()
    tpa.reshape_and_cache(key, key, k_cache, v_cache, torch.arange(8, device=DEVICE))
    got = k_cache[0, :, 0, 0].float().tolist()
    assert got == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0, -448.0, 3.0]


@pytest.mark.gpu
def test_fp8_rounding_matches_torch():
    """Arbitrary values round to nearest-even like torch's cast (the interpreter's fp8 rounding is not faithful)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    key = torch.randn(64, 2, 64, generator=gen, device=DEVICE) * 300
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE).to(FP8)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    scale = torch.tensor([0.7], device=DEVICE)
    slots = torch.arange(64, device=DEVICE)
    tpa.reshape_and_cache(key, key, k_cache, v_cache, slots, scale, scale)
    reference.reshape_and_cache(key, key, k_ref, v_ref, slots, scale, scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
