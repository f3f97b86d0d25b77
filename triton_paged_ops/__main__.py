"""Command line: ``python -m triton_paged_ops`` runs the self-check of every op against the reference."""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m triton_paged_ops",
        description="Check every tpa op against the PyTorch reference on this machine's device and print a table "
        "of cases, error and time. Uses the GPU when there is one; otherwise runs the same Triton kernels on the "
        "CPU through Triton's interpreter, on small shapes.",
    )
    p.add_argument("--device", default=None, help="torch device to check (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=None, help="random seed for the inputs (default: from the clock)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Kernels read TRITON_INTERPRET when they are defined, which already happened on import of this package:
        # start again with it set so the CPU check exercises the kernels rather than the reference.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "triton_paged_ops", *(argv or sys.argv[1:])])

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
