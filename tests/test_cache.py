"""reshape_and_cache writes exactly the slots asked, with the right values, and nothing else."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import triton_paged_ops as tpa
from triton_paged_ops import reference

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
    slots = torch.randperm(num_slots, generator=gen)[:n_write].tolist() + [-1] * n_pad
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
        k_cache = torch.randn(pages, ps, h, d, generator=gen, device=DEVICE).to(case["cache_dtype"])
        v_cache = torch.randn(pages, ps, h, dv, generator=gen, device=DEVICE).to(case["cache_dtype"])
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
    # And the reference itself did write the tokens (guards against both sides doing nothing).
    for i, slot in enumerate(case["slots"]):
        if slot >= 0 and not scales:
            assert torch.equal(k_cache[slot // ps, slot % ps], key[i].to(case["cache_dtype"]))


def test_padding_slots_write_nothing():
    k_cache = torch.randn(2, 4, 1, 64, device=DEVICE)
    v_cache = torch.randn(2, 4, 1, 64, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, 1, 64, device=DEVICE)
    tpa.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([-1, -5, -1], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
