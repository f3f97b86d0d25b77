"""Block copies against gathers: ``python -m benchmarks.kv_loads [--out FILE]`` (needs a CUDA GPU).

Prefill cases whose pages hold whole KV tiles (pages of 64 and 128 tokens; bf16, Hq32/Hkv8/D128, pages randomly
permuted, CUDA-graph replay, median), each run with ``kv_loads`` 1 (per-row gathers through the block table) and 2
(one tensor-descriptor copy per K/V tile), in that order and then once more, so that drift within the run shows;
dense causal SDPA on the same shapes and the HBM read ceiling come from the same run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from triton_paged_ops.bench import Case, _git_sha, finish, run_suite
from triton_paged_ops.kernels.attention import attention_config_override

CASES = [
    Case("prefill 4x2k page64", [2048] * 4, q_len=2048, page_size=64),
    Case("prefill 1x8k page64", [8192], q_len=8192, page_size=64),
    Case("4x1k on 3k prefix page64", [4096] * 4, q_len=1024, page_size=64),
    Case("prefill 4x2k page128", [2048] * 4, q_len=2048, page_size=128),
    Case("mixed page64", [4096 + 2048] + [4096] * 63, q_lens=[2048] + [1] * 63, page_size=64),
]


def run(rounds: int = 2, seed: int = 0) -> tuple[dict, str]:
    rows, lines, ceilings = [], [], None
    for round_ in range(rounds):
        for loads in (1, 2):
            with attention_config_override(kv_loads=loads):
                r = run_suite(CASES, seed=seed, with_sdpa=round_ == 0 and loads == 1)
            ceilings = r["ceilings"]
            for rec in r["records"]:
                who = f"kv_loads={loads}" if rec["provider"] == "tpa" else rec["provider"]
                rows.append({"provider": who, "case": rec["case"], "us": rec["us"], "tflops": rec["tflops"],
                             "rel_err": rec.get("rel_err")})  # fmt: skip
                err = f"rel err {rec['rel_err']:.1e}" if rec.get("rel_err") is not None else ""
                lines.append(f"{who:<11} {rec['case']:<26} {rec['us']:>9.1f} µs {rec['tflops']:>7.1f} TFLOP/s  {err}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": _git_sha(),
              "ceilings": ceilings, "rows": rows}  # fmt: skip
    return result, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_loads", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tpa_kv_loads.json", help="JSON file to write")
    p.add_argument("--rounds", type=int, default=2, help="times each kv_loads value runs the cases")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result, text = run(args.rounds)
    finish(result, text, args.out, "benchmarks.kv_loads", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
