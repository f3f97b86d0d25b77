"""Bad input raises a clear error that names the offending argument; debug mode catches index errors."""

from __future__ import annotations

import pytest
import torch

import triton_paged_ops as tpa
from triton_paged_ops import reference
from triton_paged_ops.configs.heuristic import attention_config_override

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32


def good_args() -> dict:
    return {
        "q": torch.randn(5, 8, 64, device=DEVICE),
        "k_cache": torch.randn(6, 16, 2, 64, device=DEVICE),
        "v_cache": torch.randn(6, 16, 2, 64, device=DEVICE),
        "block_table": torch.tensor([[3, 5], [0, 1]], dtype=I32, device=DEVICE),
        "cu_seqlens_q": torch.tensor([0, 4, 5], dtype=I32, device=DEVICE),
        "seq_lens": torch.tensor([20, 9], dtype=I32, device=DEVICE),
        "max_seqlen_q": 4,
        "max_seqlen_k": 20,
        "scale": 0.125,
    }


def call(args: dict, **kw):
    return tpa.paged_attention(**args, **kw)


BAD = [
    ("q", lambda a: a.update(q=a["q"][0]), "q must have 3 dims"),
    ("q", lambda a: a.update(q=a["q"].to(torch.int32)), "q must have dtype"),
    ("q", lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q must be contiguous"),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache must have 4 dims"),
    ("v_cache", lambda a: a.update(v_cache=a["v_cache"].half()), "dtypes differ"),
    ("v_cache", lambda a: a.update(v_cache=a["v_cache"][:, :8]), "v_cache must be"),
    ("Hq", lambda a: a.update(q=torch.randn(5, 7, 64, device=DEVICE)), "divisible"),
    ("head dim", lambda a: a.update(q=torch.randn(5, 8, 80, device=DEVICE)), "head-dim mismatch"),
    ("block_table", lambda a: a.update(block_table=a["block_table"].long()), "block_table must have dtype"),
    ("block_table", lambda a: a.update(block_table=a["block_table"][:, :1]), "block_table too narrow"),
    ("block_table", lambda a: a.update(block_table=a["block_table"][:1]), "block_table must have B=2 rows"),
    (
        "cu_seqlens_q",
        lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]),
        r"cu_seqlens_q must have B\+1=3",
    ),
    (
        "cu_seqlens_q",
        lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()),
        "cu_seqlens_q must have dtype",
    ),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens must have dtype"),
    (
        "block_table_rows",
        lambda a: a.update(block_table_rows=torch.tensor([1.0, 0.0], device=DEVICE)),
        "block_table_rows must have dtype",
    ),
    (
        "block_table_rows",
        lambda a: a.update(block_table_rows=torch.tensor([1], dtype=I32, device=DEVICE)),
        "block_table_rows must have B=2 entries",
    ),
    # The kernels read 1-D index tensors with unit stride: strided views must be refused.
    (
        "cu_seqlens_q",
        lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].repeat_interleave(2)[::2]),
        "cu_seqlens_q must be contiguous",
    ),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].repeat_interleave(2)[::2]), "seq_lens must be contiguous"),
    (
        "block_table_rows",
        lambda a: a.update(block_table_rows=torch.tensor([0, 9, 1, 9], dtype=I32, device=DEVICE)[::2]),
        "block_table_rows must be contiguous",
    ),
    ("max_seqlen_k", lambda a: a.update(max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
    ("scale", lambda a: a.update(scale=float("nan")), "scale must be finite and > 0"),
    ("scale", lambda a: a.update(scale=0.0), "scale must be finite and > 0"),
    ("scale", lambda a: a.update(scale=-0.1), "scale must be finite and > 0"),
]

if torch.version.hip is None:  # the AMD fp8 format is accepted on ROCm builds only
    BAD.append(
        (
            "k_cache",
            lambda a: a.update(
                k_cache=a["k_cache"].to(torch.float8_e4m3fnuz), v_cache=a["v_cache"].to(torch.float8_e4m3fnuz)
            ),
            "float8_e4m3fnuz caches are for AMD",
        )
    )


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[f"{b[0]}:{b[2]}" for b in BAD])
def test_bad_argument_is_named(name, mutate, message):
    args = good_args()
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=message):
        call(args)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"window_left": -2}, "window_left"),
        ({"softcap": -1.0}, "softcap"),
        ({"alibi_slopes": lambda d: torch.ones(4, device=d)}, "alibi_slopes must have shape"),
        ({"alibi_slopes": lambda d: torch.ones(8, dtype=torch.float16, device=d)}, "alibi_slopes must have dtype"),
        ({"sinks": lambda d: torch.ones(2, 4, device=d)}, "sinks must have 1 dims"),
        ({"sinks": lambda d: torch.ones(16, device=d)[::2]}, "sinks must be contiguous"),
        ({"alibi_slopes": lambda d: torch.ones(16, device=d)[::2]}, "alibi_slopes must be contiguous"),
        ({"k_scale": lambda d: torch.ones(2, device=d)}, "k_scale must have exactly 1 element"),
        ({"v_scale": lambda d: torch.ones(1, dtype=torch.float64, device=d)}, "v_scale must be float32"),
        ({"decode_tail": -2}, r"decode_tail must be -1 \(not known\) or a count of sequences in \[0, B=2\]"),
        ({"decode_tail": 3}, "decode_tail must be"),
    ],
)
def test_bad_feature_argument_is_named(kw, message):
    # Tensors are made on the device itself: moving a strided view there would give a contiguous copy.
    kw = {k: v(DEVICE) if callable(v) else v for k, v in kw.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        call(good_args(), **kw)


def test_bad_out_buffers_are_named():
    args = good_args()
    with pytest.raises(ValueError, match=r"out must have shape"):
        tpa.paged_attention_out(**args, out=torch.empty(5, 8, 32, device=DEVICE))
    with pytest.raises(TypeError, match=r"out must have dtype"):
        tpa.paged_attention_out(**args, out=torch.empty(5, 8, 64, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"lse must have shape"):
        tpa.paged_attention_out(**args, out=torch.empty(5, 8, 64, device=DEVICE), lse=torch.empty(5, 7, device=DEVICE))


@pytest.mark.gpu  # needs two devices: the CPU and a GPU
def test_device_mismatch_is_named():
    args = good_args()
    args["seq_lens"] = args["seq_lens"].cpu()
    with pytest.raises(ValueError, match="seq_lens is on cpu"):
        call(args)


def test_cache_write_checks():
    key = torch.randn(3, 2, 64, device=DEVICE)
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2], dtype=I32, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache must be"):
        tpa.reshape_and_cache(key, key, torch.zeros(4, 16, 3, 64, device=DEVICE), k_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must have N=3"):
        tpa.reshape_and_cache(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        tpa.reshape_and_cache(key, key, k_cache, k_cache.clone(), slots.float())
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        tpa.reshape_and_cache(key, key, k_cache, k_cache.clone(), slots.repeat_interleave(2)[::2])


def test_merge_checks():
    out = torch.randn(3, 2, 64, device=DEVICE)
    lse = torch.randn(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        tpa.merge_attn_states(out, lse, out, lse[:, :1])
    with pytest.raises(TypeError, match="lse_a must have dtype"):
        tpa.merge_attn_states(out, lse.half(), out, lse)


class TestDebugMode:
    """Index checks need a device-to-host sync, so they run only when asked for."""

    @pytest.fixture(autouse=True)
    def debug_on(self):
        tpa.set_debug_mode(True)
        yield
        tpa.set_debug_mode(False)

    def test_page_id_out_of_range(self):
        args = good_args()
        args["block_table"][0, 1] = 6
        with pytest.raises(ValueError, match="block_table row 0 references a page outside"):
            call(args)

    def test_block_table_row_out_of_range(self):
        args = good_args()
        args["block_table_rows"] = torch.tensor([1, 2], dtype=I32, device=DEVICE)
        with pytest.raises(ValueError, match=r"block_table_rows\[1\]=2 is outside"):
            call(args)

    def test_q_len_longer_than_seq_len(self):
        args = good_args()
        args["seq_lens"][1] = 0
        with pytest.raises(ValueError, match="q_len > seq_len"):
            call(args)

    def test_seq_len_over_bound(self):
        args = good_args()
        args["max_seqlen_k"] = 19
        with pytest.raises(ValueError, match="exceeds max_seqlen_k"):
            call(args)

    def test_decreasing_cu_seqlens(self):
        args = good_args()
        args["cu_seqlens_q"] = torch.tensor([0, 4, 3], dtype=I32, device=DEVICE)
        with pytest.raises(ValueError, match="non-decreasing"):
            call(args)

    def test_slot_out_of_cache(self):
        key = torch.randn(1, 2, 64, device=DEVICE)
        cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
        with pytest.raises(ValueError, match="slot_mapping has a slot"):
            tpa.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([64], dtype=I32, device=DEVICE))

    def test_wrong_decode_tail_hint(self):
        # good_args: a 4-token chunk, then one decode.
        with pytest.raises(ValueError, match=r"decode_tail=0 does not describe the batch: .*\[4, 1\]"):
            call(good_args(), decode_tail=0)
        with pytest.raises(ValueError, match="decode_tail=2 does not describe"):
            call(good_args(), decode_tail=2)

    def test_valid_input_passes(self):
        args = good_args()
        out = call(args)
        assert out.shape == (5, 8, 64)
        for hint in (-1, 1):
            assert torch.equal(call(args, decode_tail=hint), out)


@pytest.mark.parametrize("q_lens,hint", [
    ([], 0), ([5, 3], 0), ([1], 1), ([1, 1], 2), ([5, 1, 1], 2), ([0, 7, 1], 1), ([1, 5], -1), ([4, 1, 6, 1], -1),
])  # fmt: skip
def test_decode_tail_of_host_lengths(q_lens, hint):
    assert tpa.decode_tail_of(q_lens) == hint


@pytest.mark.parametrize("bad_id", [10_000_000, -3])
@pytest.mark.parametrize("block_n", [None, 16], ids=["tile-of-pages", "tile-in-a-page"])
@pytest.mark.parametrize("guard", [False, True], ids=["dropped", "page 0"])
def test_out_of_range_page_ids_do_not_fault_without_debug(guard, block_n, bad_id):
    """Without debug mode a bad page id (past the cache or negative) must not read out of bounds: its keys are
    dropped (the 16-bit decode default) or read from page 0 (``clamp_pages``); the other
    sequences are untouched. Both with tiles spanning pages (one page id per key) and with tiles inside one page
    (one id per tile)."""
    args = good_args()
    good_table = args["block_table"].clone()
    args["block_table"][0, 1] = bad_id  # keys 16..19 of sequence 0 (its 4 queries sit at positions 16..19)
    with attention_config_override(clamp_pages=guard, **({"BLOCK_N": block_n} if block_n else {})):
        out = call(args)
    q, k, v = args["q"], args["k_cache"], args["v_cache"]
    cu1 = torch.tensor([0, 4], dtype=I32, device=DEVICE)
    if not guard:
        # Each query saw keys 0..15 and its own page is gone: all four see exactly keys 0..15.
        want0 = reference.paged_attention(q[:4], k, v, good_table[:1], cu1, torch.tensor([16], dtype=I32,
                                          device=DEVICE), 4, 16, args["scale"], causal=False)  # fmt: skip
    else:
        table = good_table[:1].clone()
        table[0, 1] = 0
        want0 = reference.paged_attention(q[:4], k, v, table, cu1, args["seq_lens"][:1], 4, args["max_seqlen_k"],
                                          args["scale"])  # fmt: skip
    want1 = reference.paged_attention(q[4:], k, v, good_table[1:], torch.tensor([0, 1], dtype=I32, device=DEVICE),
                                      args["seq_lens"][1:], 1, args["max_seqlen_k"], args["scale"])  # fmt: skip
    torch.testing.assert_close(out[:4], want0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[4:], want1, rtol=1e-4, atol=1e-4)


def test_out_of_range_table_rows_do_not_fault_without_debug():
    """A row index outside block_table leaves its sequence with no keys (output 0) and the others intact."""
    args = good_args()
    want = call(args)
    args["block_table"] = args["block_table"].flip(0).contiguous()
    args["block_table_rows"] = torch.tensor([1, 1 << 40], dtype=torch.int64, device=DEVICE)
    out = call(args)
    assert torch.equal(out[:4], want[:4])
    assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_e4m3_caches_need_an_sm89_gpu(capability, refused, monkeypatch):
    """Triton compiles no e4m3 (``float8_e4m3fn``) for NVIDIA GPUs before sm_89 (an A100 would fail inside the
    compiler): such a cache is refused by name; AMD's backend reads both fp8 formats."""
    from triton_paged_ops import checks

    assert checks.cache_dtype_supported(torch.float8_e4m3fn, capability, amd=False) is not refused
    assert checks.cache_dtype_supported(torch.float8_e4m3fn, capability, amd=True)
    assert checks.cache_dtype_supported(torch.bfloat16, capability, amd=False)
    monkeypatch.setattr(checks, "device_capability", lambda device: capability)
    args = good_args()
    args.update(k_cache=args["k_cache"].to(torch.float8_e4m3fn), v_cache=args["v_cache"].to(torch.float8_e4m3fn))
    kw = {"k_scale": torch.ones(1, device=DEVICE), "v_scale": torch.ones(1, device=DEVICE)}
    if refused:
        with pytest.raises(
            TypeError, match=rf"k_cache: torch.float8_e4m3fn caches need .* sm_89 .* sm_{capability[0]}"
        ):
            call(args, **kw)
    else:
        call(args, **kw)
