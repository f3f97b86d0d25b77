"""Compile the kernels for an H100/H200 (sm_90) without a GPU and report each variant's shared memory as JSON.

Run as a script without ``TRITON_INTERPRET`` (the test suite runs it in a subprocess): the interpreter never
compiles, so it cannot catch code that only the compiler rejects, nor configs that need more shared memory than
the GPU has. Launch choices come from the same planner as real calls: heuristic configs for the representative
variants, then every entry of the shipped H200 table with the plan an H200 would get.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_paged_ops import configs
from triton_paged_ops import plan as planning
from triton_paged_ops.configs import heuristic
from triton_paged_ops.kernels import attention, cache, merge

TARGET = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232448  # largest shared memory one program may use on sm_90 (227 KiB)
# Every kernel compiled here, in order (``benchmarks.sass`` reads their PTX and cubins).
COMPILED: list = []
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
        torch.float8_e4m3fnuz: "*fp8e4b8", torch.int32: "*i32", torch.int64: "*i64"}  # fmt: skip


def compiled(kernel, pointers: dict, floats: tuple, constexprs: dict, options: dict):
    """Compile ``kernel`` for ``TARGET`` (pointer params typed by ``pointers``, ``floats`` fp32, other params i32)."""
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for p in params:
        if p in constexprs:
            sig[p] = "constexpr"
        elif p in pointers:
            sig[p] = _PTR[pointers[p]]
        else:
            sig[p] = "fp32" if p in floats else "i32"
    # As a real launch specialises them: pointers 16-byte aligned, and integer arguments the kernel lets Triton
    # specialise (strides of contiguous tensors) divisible by 16.
    unspecialised = set(getattr(kernel, "do_not_specialize", ()) or ())
    unspecialised |= {params[i] for i in unspecialised if isinstance(i, int)}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p in pointers or (sig[p] == "i32" and p not in unspecialised and p.startswith("stride"))}  # fmt: skip
    src = ASTSource(kernel, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return compile_source(src, options)


def compile_source(src, options: dict):
    """``triton.compile`` for ``TARGET``, recorded in ``COMPILED``."""
    compiled = triton.compile(src, target=TARGET, options=options)
    COMPILED.append(compiled)
    return compiled


def _compile(kernel, pointers: dict, floats: tuple, constexprs: dict, options: dict) -> int:
    """``compiled``; the kernel's shared bytes."""
    return int(compiled(kernel, pointers, floats, constexprs, options).metadata.shared)


def attention_variant(name, *, dtype=torch.bfloat16, cache_dtype=None, head_dim=128, group=4, num_seqs=4, max_q=1,
                      max_k=8192, window=-1, softcap=0.0, alibi=False, sinks=False, scales=False, rows=False,
                      lse=False, invariant=False, device_index=None, page_size=16,
                      decode_tail=-1) -> dict:  # fmt: skip
    cache_dtype = cache_dtype or dtype
    lp = planning.attention_launch_plan(
        num_q_heads=8 * group, num_kv_heads=8, head_dim=head_dim, head_dim_v=head_dim, page_size=page_size, dtype=dtype,
        cache_dtype=cache_dtype, num_seqs=num_seqs, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True,
        window_left=window, softcap=softcap, has_alibi=alibi, has_sinks=sinks, has_k_scale=scales,
        has_v_scale=scales, has_rows=rows, want_lse=lse, device_index=device_index, interpret=False,
        batch_invariant=invariant, decode_tail=decode_tail,
    )  # fmt: skip
    split = lp.split.num_splits > 1
    f32 = torch.float32
    pointers = {"q_ptr": dtype, "k_cache_ptr": cache_dtype, "v_cache_ptr": cache_dtype,
                "out_ptr": f32 if split else dtype, "lse_ptr": f32, "alibi_slopes_ptr": f32, "sinks_ptr": f32,
                "k_scale_ptr": f32, "v_scale_ptr": f32}  # fmt: skip
    index_ptrs = ("block_table_ptr", "block_table_rows_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr")
    pointers |= {p: torch.int32 for p in index_ptrs}
    out = {"name": name, "plan": f"{lp.config} splits={lp.split.num_splits}", "ids_ahead": lp.constexprs["IDS_AHEAD"]}
    out["attention_shared"] = _compile(attention._paged_attention_kernel, pointers, ("sm_scale", "softcap"),
                                       lp.constexprs, lp.options)  # fmt: skip
    if split:
        # (Batch-invariant leaf programs: the reduce folds each segment's leaves first.)
        leaves = lp.config["invariant_segment"] // lp.split.segment_len if invariant else 1
        rp = merge.reduce_plan(lp.split.num_splits, 4, 8 * group, head_dim, (0, 0, 0), (0, 0, 0), num_seqs, (0, 0),
                               (0, 0) if lse else None, invariant, lp.constexprs["LAUNCH_DEPENDENTS"],
                               leaves)  # fmt: skip
        reduce_ptrs = {"part_out_ptr": f32, "part_lse_ptr": f32, "out_ptr": dtype, "lse_ptr": f32,
                       "cu_seqlens_q_ptr": torch.int32}  # fmt: skip
        out["reduce_shared"] = _compile(merge._reduce_splits_kernel, reduce_ptrs, (), rp.constexprs, rp.options)
        out["reduce_fold_group"] = rp.constexprs["FOLD_GROUP"]
    return out


def other_kernels(prefix: str, fp8: torch.dtype) -> list[dict]:
    """The merge kernel and the cache write into an ``fp8`` cache (with scales, saturating at its largest finite
    value), named with ``prefix``."""
    merge_ptrs = {p: torch.float32 for p in ("lse_a_ptr", "lse_b_ptr", "lse_ptr")}
    merge_ptrs |= {p: torch.bfloat16 for p in ("out_a_ptr", "out_b_ptr", "out_ptr")}
    merge_consts = {"HEAD_DIM": 128, "BLOCK_D": 128}
    bf16, f32 = torch.bfloat16, torch.float32
    cache_ptrs = {"key_ptr": bf16, "value_ptr": bf16, "k_cache_ptr": fp8, "v_cache_ptr": fp8,
                  "slot_mapping_ptr": torch.int64, "k_scale_ptr": f32, "v_scale_ptr": f32}  # fmt: skip
    top = torch.finfo(fp8).max
    cache_consts = dict(PAGE_SIZE=16, HEAD_DIM=128, HEAD_DIM_V=128, BLOCK_H=8, BLOCK_D=128, BLOCK_DV=128,
                        HAS_K_SCALE=True, HAS_V_SCALE=True, K_SATURATE=top, V_SATURATE=top)  # fmt: skip
    return [
        {"name": f"{prefix}merge_attn_states", "shared": _compile(
            merge._merge_attn_states_kernel, merge_ptrs, (), merge_consts, {"num_warps": 1})},
        {"name": f"{prefix}reshape_and_cache fp8", "shared": _compile(
            cache._reshape_and_cache_kernel, cache_ptrs, (), cache_consts, {"num_warps": 4})},
    ]  # fmt: skip


def pose_as(gpu: str, capability: str, triton_version: str, num_sms: int = 132) -> None:
    """Plan launches (device_index 0) as on that GPU with that Triton: its shipped table applies, ``num_sms`` SMs."""
    configs.device_identity = lambda device_index: (gpu, capability)
    configs.triton_version = lambda: triton_version
    configs._num_sms = lambda device_index: num_sms
    # (What sm_90 lets one program opt into; launch options gated on their buffers fitting read it.)
    configs.max_shared_memory = lambda device_index: SM90_SHARED_BYTES
    # An sm_90 device: the reduce is a dependent launch (the attention kernel signals it, the reduce waits).
    planning.dependent_launch_supported = lambda device_index: device_index is not None
    configs.reload()


# Query bound of each regime's variant (group 4: 4 tokens fill a short_narrow tile's 16 rows, 8 a short one's 32).
MAX_Q_OF_REGIME = {"decode": 1, "decode_large": 1, "short": 8, "short_narrow": 4, "prefill": 512, "prompts": 512}


def shipped_table_variants(path: Path, num_sms: int = 132) -> list[dict]:
    """Each entry of a shipped config table, compiled with the launch plan its GPU would get (the table's identity
    and Triton version, ``num_sms`` SMs): tuned tiles plus every branch the kernel adds to them (the decode tile of
    mixed batches) must fit the shared memory."""
    data = json.loads(path.read_text())
    results = []
    for table in data["tables"]:
        pose_as(table["gpu"], table["capability"], table["triton"], num_sms)
        for e in table["entries"]:
            dtype, _, cache = e["dtype"].partition("+")
            cache_dtype = getattr(torch, cache) if cache else None
            max_q = MAX_Q_OF_REGIME[e["regime"]]
            # decode_large: a batch with one (sequence, KV head) pair per SM (the variants take 8 KV heads); prompts:
            # a prefill launch said to hold no one-token sequence.
            num_seqs = -(-num_sms // 8) if e["regime"] == "decode_large" else 4
            name = f"{table['gpu']} {e['dtype']} D{e['head_dim']} {e['regime']}"
            results.append(attention_variant(name, dtype=getattr(torch, dtype), cache_dtype=cache_dtype,
                                             head_dim=e["head_dim"], max_q=max_q, scales=cache_dtype is not None,
                                             device_index=0, num_seqs=num_seqs,
                                             decode_tail=0 if e["regime"] == "prompts" else -1))  # fmt: skip
    return results


def main() -> int:
    fp8 = torch.float8_e4m3fn
    every_feature = dict(alibi=True, sinks=True, scales=True, rows=True)
    results = [
        attention_variant("decode split", max_k=16384),
        attention_variant("decode D64 fp16", dtype=torch.float16, head_dim=64),
        attention_variant("decode fp8 cache", cache_dtype=fp8, scales=True, max_k=16384),
        attention_variant("short D256", head_dim=256, max_q=8, max_k=4096),
        attention_variant("prefill all features", max_q=512, window=256, softcap=30.0, lse=True, **every_feature),
        attention_variant("prefill D256", head_dim=256, max_q=512, max_k=4096),
        attention_variant("prefill fp32", dtype=torch.float32, max_q=64, max_k=1024),
        attention_variant("invariant prefill fold", max_q=512, sinks=True, window=300, invariant=True),
        attention_variant("invariant decode split", max_k=32768, lse=True, invariant=True),
        attention_variant("invariant decode leaves", num_seqs=1, max_k=4096, sinks=True, invariant=True),
        attention_variant("invariant fp32 short", dtype=torch.float32, max_q=8, max_k=4096, invariant=True),
        attention_variant("invariant decode alibi softcap", max_k=8192, alibi=True, softcap=30.0, invariant=True),
    ]
    results += other_kernels("", fp8)
    results += shipped_table_variants(configs.SHIPPED_DIR / "nvidia_h200.json")
    # MQA-style groups over 32 heads on the H200 table's prefill tiles (posed as above): 256-512 KiB of shared memory
    # before they took tiles of one token.
    results += [attention_variant(f"prefill MQA {g} on the H200 table", group=g, max_q=512, device_index=0)
                for g in (48, 128)]  # fmt: skip
    # One-token rows of a mixed launch in runs of keys per warp, on the H200 prefill tiles (D128 with 128-key decode
    # tiles: runs of 16 keys; D64), page 16 (an id per run) and page 1 (an id per key).
    results.append(attention_variant("mixed one-token runs per warp", max_q=512, device_index=0, sinks=True))
    results.append(attention_variant("mixed one-token runs per warp D64 page 1", head_dim=64, max_q=512,
                                     device_index=0, page_size=1))  # fmt: skip
    # Taller tiles' page ids at page 16 in the form the H200 default does not take there: one load per key at D128
    # ("per_key"), one per page at D64 ("per_page").
    with heuristic.attention_config_override(page_ids="per_key"):
        results.append(attention_variant("prefill page ids per key", max_q=512, device_index=0))
    with heuristic.attention_config_override(page_ids="per_page"):
        results.append(attention_variant("prefill D64 page ids per page", head_dim=64, max_q=512, device_index=0))
    # A one-token tail's blocks alternating with the chunks' (a caller's ``decode_tail`` hint).
    results.append(attention_variant("mixed batch interleaved order", max_q=512, device_index=0, decode_tail=1))
    # Taller tiles' page ids a tile ahead (``ids_ahead``, the H200 table's D64/D128 prefill form): where the third
    # K/V stage fits (D128, a mixed launch with its one-token rows), not at D256, where it would not, nor at page 1
    # (those launches keep the ids in the iteration).
    with heuristic.attention_config_override(ids_ahead=True):
        results.append(attention_variant("prefill page ids ahead", max_q=512, device_index=0, sinks=True))
        results.append(attention_variant("prefill page ids ahead page 1", max_q=512, device_index=0, page_size=1))
        results.append(attention_variant("prefill page ids ahead D256", head_dim=256, max_q=512, device_index=0))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
