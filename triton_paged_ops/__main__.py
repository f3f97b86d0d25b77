"""Command line: ``python -m triton_paged_ops`` runs the self-check of every op against the reference;
sub-commands ``demo`` (the model demo), ``tune`` (measure launch configs for this GPU), ``warmup`` (compile every
kernel variant serving will use) and ``bench`` (the decode and prefill benchmark suites)."""

from __future__ import annotations

import argparse
import os
import sys
import time

# The regimes `tune` measures: configs.REGIMES (spelled out: no torch import here).
_REGIMES = ("decode", "decode_large", "short", "short_narrow", "prefill", "prompts")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m triton_paged_ops",
        description="Check every tpa op against the PyTorch reference on this machine's device and print a table "
        "of cases, error and time. Uses the GPU when there is one; otherwise runs the same Triton kernels on the "
        "CPU through Triton's interpreter, on small shapes.",
    )
    # --device and --seed may come before or after the sub-command (a sub-command's own copy, default unset, wins).
    common = argparse.ArgumentParser(add_help=False)
    for parser, default in ((p, None), (common, argparse.SUPPRESS)):
        parser.add_argument("--device", default=default,
                            help="torch device to use (default: cuda if available, else cpu)")  # fmt: skip
        parser.add_argument("--seed", type=int, default=default,
                            help="random seed for the inputs (default: from the clock; demo and bench: 0)")  # fmt: skip
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="generate with a small Llama-style model through the tpa ops, compiled, checked against the reference",
        description="Prefill random prompts and decode with continuous batching using a Llama-style model with "
        "random weights whose attention runs through torch.ops.tpa, under torch.compile(fullgraph=True); every "
        "step's logits are checked against an eager copy using the PyTorch reference attention.",
    )
    demo.add_argument(
        "--preset", choices=("tiny", "1b"), default=None, help="model size (default: 1b on a GPU, tiny on CPU)"
    )
    demo.add_argument("--requests", type=int, default=6, help="number of requests (default 6)")
    demo.add_argument("--new-tokens", type=int, default=16, help="tokens to generate per request, at most (default 16)")
    demo.add_argument("--max-batch", type=int, default=4, help="requests decoded together, at most (default 4)")
    demo.add_argument("--no-compile", action="store_true", help="run the model eagerly")
    tune = sub.add_parser(
        "tune",
        parents=[common],
        help="measure launch configs on this GPU and write the best to the user config file",
        description="For each (dtype, head dim, regime) group, time every candidate config over representative "
        "shapes, check the winner against the reference, and write it to the user config file (which overrides "
        "the shipped tables). Resumes an interrupted run: groups already tuned with the same candidates are "
        "skipped. Without a GPU it runs under Triton's interpreter on tiny shapes (useful only for testing).",
    )
    tune.add_argument("--dtype", nargs="+", choices=sorted(_DTYPES), default=["bf16"], help="dtypes (default bf16)")
    tune.add_argument("--head-dim", nargs="+", type=int, default=[128], help="head dims (default 128)")
    tune.add_argument("--cache-dtype", choices=("same", "fp8"), default="same",
                      help="KV cache dtype: as the queries, or float8_e4m3fn (default same)")  # fmt: skip
    tune.add_argument(
        "--regime", nargs="+", choices=_REGIMES, default=list(_REGIMES),
        help="query regimes: decode (1 token), decode_large (1 token, a (sequence, KV head) pair per SM), short "
        "(<= 16 tokens, more than 16 packed rows: tokens x GQA group), short_narrow (<= 16 rows), prefill, "
        "prompts (prefill launches whose caller says the batch holds no one-token sequence) (default: all six)",
    )  # fmt: skip
    tune.add_argument("--num-heads", type=int, default=32, help="query heads of the tuning shapes (default 32)")
    tune.add_argument("--num-kv-heads", type=int, default=8, help="KV heads of the tuning shapes (default 8)")
    tune.add_argument("--page-size", type=int, default=16, help="page size of the tuning shapes (default 16)")
    tune.add_argument("--quick", action="store_true", help="fewer candidates and shapes (minutes, not an hour)")
    tune.add_argument("--out", default=None, help="config file to write (default: $TPA_CONFIG_FILE or the user cache)")
    tune.add_argument("--fresh", action="store_true", help="re-tune groups already in the file")
    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="the decode, short or prefill benchmark suite: table, JSON and chart (needs a CUDA GPU)",
        description="Time paged attention on a suite's cases (--suite decode, short or prefill; bf16, random data, "
        "pages randomly permuted, CUDA-graph replay, median) beside dense contiguous SDPA on the same shapes and the "
        "measured HBM read bandwidth, all from the same run. Prints a table and writes JSON and a bar chart (KV TB/s "
        "and TFLOP/s per case against the ceiling).",
    )
    from triton_paged_ops.bench import add_bench_arguments

    add_bench_arguments(bench, out_default="tpa_bench.json", png_default="tpa_bench.png", seed=False)
    wu = sub.add_parser(
        "warmup",
        parents=[common],
        help="compile every kernel variant that serving with the given settings can use, before serving",
        description="Enumerate the attention and cache-write kernel variants that batches within the given limits "
        "can launch (from the launch planner itself) and compile each once on tiny tensors, so that serving never "
        "waits for Triton to compile. Prints how many variants and how long it took.",
    )
    wu.add_argument("--head-dim", type=int, required=True, help="query/key head dim")
    wu.add_argument("--head-dim-v", type=int, default=None, help="value head dim (default: --head-dim)")
    wu.add_argument("--num-heads", type=int, required=True, help="query heads (per GPU)")
    wu.add_argument("--num-kv-heads", type=int, required=True, help="KV heads (per GPU)")
    wu.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="query/cache dtype (default bf16)")
    wu.add_argument("--page-size", type=int, default=16, help="KV cache page size (default 16)")
    wu.add_argument("--cache-dtype", choices=("same", "fp8"), default="same",
                    help="KV cache dtype: as --dtype, or float8_e4m3fn (default same)")  # fmt: skip
    wu.add_argument("--max-batch", type=int, default=256, help="sequences per batch, at most (default 256)")
    wu.add_argument("--max-context", type=int, default=32768, help="keys per sequence, at most (default 32768)")
    wu.add_argument("--max-query", type=int, default=8192, help="new tokens per sequence, at most (default 8192)")
    wu.add_argument("--window", type=int, default=-1, help="sliding window (window_left), -1 for none")
    wu.add_argument("--softcap", type=float, default=0.0, help="logit soft cap, 0 for none")
    wu.add_argument("--non-causal", action="store_true", help="serving calls the ops with causal=False")
    for flag, what in (("alibi", "ALiBi slopes"), ("sinks", "attention sinks"), ("kv-scale", "k/v cache scales"),
                       ("lse", "the LSE output"), ("block-table-rows", "block_table_rows"),
                       ("batch-invariant", "batch_invariant=True (deterministic mode)"),
                       ("decode-tail", "each batch's decode_tail layout hint")):  # fmt: skip
        wu.add_argument(f"--{flag}", action="store_true", help=f"serving passes {what}")
    return p


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        print(f"--device {device}: {e}", file=sys.stderr)
        return 2
    if kind not in ("cpu", "cuda"):
        print(f"--device {device}: the ops run on CUDA (NVIDIA or ROCm) GPUs or, interpreted, on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    if kind == "cuda" and not torch.cuda.is_available():
        print(f"--device {device}: this machine's torch sees no CUDA/ROCm GPU (torch {torch.__version__}); "
              "leave --device out to run on the CPU", file=sys.stderr)  # fmt: skip
        return 2
    if args.command == "warmup" and kind == "cpu":
        # (Triton's interpreter compiles nothing: on a CPU this only runs every variant, slowly.)
        print("warmup compiles GPU kernels ahead of serving; without a GPU it only runs each variant through "
              "Triton's interpreter (minutes for serving-sized limits), compiling nothing",
              file=sys.stderr)  # fmt: skip
    if kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Kernels read TRITON_INTERPRET when they are defined, which already happened on import of this package:
        # start again with it set so the CPU check exercises the kernels rather than the reference.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "triton_paged_ops", *(argv or sys.argv[1:])])

    if args.command == "demo":
        from triton_paged_ops.models.demo import run_demo

        preset = args.preset or ("1b" if device != "cpu" else "tiny")
        seed = args.seed if args.seed is not None else 0
        return run_demo(preset, args.requests, args.new_tokens, args.max_batch, not args.no_compile, device, seed)

    if args.command == "tune":
        from pathlib import Path

        from triton_paged_ops.tune import tune

        for name, vals in (("--head-dim", args.head_dim), ("--num-heads", [args.num_heads]),
                           ("--num-kv-heads", [args.num_kv_heads]), ("--page-size", [args.page_size])):  # fmt: skip
            if any(v < 1 for v in vals):
                print(f"{name} must be positive, got {vals}", file=sys.stderr)
                return 2
        if args.num_heads % args.num_kv_heads:
            print("--num-heads must be a multiple of --num-kv-heads", file=sys.stderr)
            return 2
        tune(
            [getattr(torch, _DTYPES[d]) for d in args.dtype], args.head_dim, args.regime,
            num_q_heads=args.num_heads, num_kv_heads=args.num_kv_heads, page_size=args.page_size, device=device,
            quick=args.quick, out=Path(args.out) if args.out else None, fresh=args.fresh,
            cache_dtype=torch.float8_e4m3fn if args.cache_dtype == "fp8" else None,
        )  # fmt: skip
        return 0

    if args.command == "bench":
        from triton_paged_ops.bench import bench_command

        return bench_command(args, "triton_paged_ops", argv)

    if args.command == "warmup":
        from triton_paged_ops.warmup import ServingSettings, warmup

        dims = (args.head_dim, args.num_heads, args.num_kv_heads, args.page_size, args.max_batch, args.max_context,
                args.max_query)  # fmt: skip
        if min(dims) < 1 or args.num_heads % args.num_kv_heads:
            print("sizes must be positive and --num-heads a multiple of --num-kv-heads", file=sys.stderr)
            return 2
        settings = ServingSettings(
            num_q_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
            head_dim_v=args.head_dim_v, page_size=args.page_size, dtype=getattr(torch, _DTYPES[args.dtype]),
            cache_dtype=torch.float8_e4m3fn if args.cache_dtype == "fp8" else None,
            max_batch=args.max_batch, max_context=args.max_context, max_query=args.max_query,
            causal=not args.non_causal, window_left=args.window, softcap=args.softcap, alibi=args.alibi,
            sinks=args.sinks, kv_scale=args.kv_scale, block_table_rows=args.block_table_rows, lse=args.lse,
            batch_invariant=args.batch_invariant, decode_tail=args.decode_tail,
        )  # fmt: skip
        print(f"warm-up: enumerating the variants of {settings}", flush=True)
        last = [time.perf_counter()]

        def progress(done: int, total: int) -> None:
            if done == total or time.perf_counter() - last[0] > 10:
                last[0] = time.perf_counter()
                print(f"  {done}/{total} variants compiled", flush=True)

        report = warmup(settings, device, progress)
        print(f"warm-up: {report.variants} attention variants ({report.calls} op calls) in {report.seconds:.1f} s")
        return 0

    import triton

    from triton_paged_ops.selfcheck import format_table, run_selfcheck

    name = torch.cuda.get_device_name() if device != "cpu" else "CPU (Triton interpreter)"
    print(f"triton_paged_ops self-check on {name}; torch {torch.__version__}, triton {triton.__version__}")
    rows = run_selfcheck(device, args.seed)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
