"""The ``tpa`` SGLang backend under SGLang's own attention test kit (real pools, ForwardBatch and reference).

Skipped unless sglang imports (it needs its own environment: see ``.ci/sglang-setup``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from integrations.sglang import BACKEND_NAME, SUPPORTED_SGLANG, register  # noqa: E402

register()

from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's fp16/bf16 matrix products are exercised elsewhere; fp32 on CPU keeps this about SGLang glue.
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32
CASES = kit.make_dense_cases(BACKEND_NAME)


class _Case:
    """The kit reports an unavailable backend through unittest's skipTest."""

    def skipTest(self, reason):  # noqa: N802  (unittest's name)
        pytest.fail(f"the tpa backend did not build: {reason}")


def test_sglang_version_is_the_supported_one():
    import sglang

    assert sglang.__version__ == SUPPORTED_SGLANG


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_dense_case(case):
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device=DEVICE, dtype=DTYPE)


def test_cases_cover_page_sizes_and_head_layouts():
    assert {c.page_size for c in CASES} >= {1, 16, 32}
    layouts = {(c.num_heads, c.num_kv_heads) for c in CASES}
    assert any(h == kv for h, kv in layouts) and any(kv == 1 for _, kv in layouts)
    assert any(1 < kv < h for h, kv in layouts)
    assert any(c.forward_mode.is_decode() for c in CASES) and any(max(c.prefix_lens) > 0 for c in CASES)


def test_server_args_accept_tpa():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "unused", "--attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME


def test_plugin_entry_point_registers_the_backend():
    """In a fresh process, SGLang's own plugin loader finds our entry point; its argparse then accepts tpa."""
    import subprocess
    import sys

    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "a = prepare_server_args(['--model-path', 'unused', '--attention-backend', 'tpa'])\n"
        "print('backend=' + a.attention_backend)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend=tpa" in done.stdout
