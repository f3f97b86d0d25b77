"""Test set-up: CPU runs exercise the real Triton kernels through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, i.e. before ``triton_paged_ops`` is
imported, so it is set here, at collection time.
"""

import json
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests must not pick up configs a user tuned on this machine; tests of the lookup set their own file.
os.environ["TPA_CONFIG_FILE"] = os.path.join(os.path.dirname(__file__), "no-such-dir", "configs.json")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# "ci": few, small examples for the 2-core interpreter run. "gpu": many larger ones for a GPU run.
_COMMON = {
    "deadline": None,  # the first call of each kernel variant compiles
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=30, **_COMMON)
settings.register_profile("gpu", max_examples=300, **_COMMON)
settings.register_profile("smoke", max_examples=5, **_COMMON)  # a quick GPU pass over every property
# Only the hand-written @example cases (no generation): the quickest GPU check of a property test.
settings.register_profile("explicit", phases=[Phase.explicit], **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # Where the variant coverage check records what it ran (one JSON line per check; pytest-xdist workers inherit
    # the variable and append to the same file), for the summary below.
    if "TPA_VARIANT_COVERAGE" not in os.environ:
        fd, path = tempfile.mkstemp(prefix="tpa-variant-coverage-", suffix=".jsonl")
        os.close(fd)
        os.environ["TPA_VARIANT_COVERAGE"] = path
        config.add_cleanup(lambda: os.path.exists(path) and os.remove(path))


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("TPA_VARIANT_COVERAGE")
    if not path or not os.path.exists(path) or hasattr(terminalreporter.config, "workerinput"):
        return
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if rows:
        terminalreporter.section("launch variants run against the reference (covered/reachable)")
        for name, covered, reachable in sorted(rows):
            terminalreporter.write_line(f"{name}: {covered}/{reachable}")
        terminalreporter.write_line(f"all: {sum(r[1] for r in rows)}/{sum(r[2] for r in rows)}")
