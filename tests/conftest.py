"""Test set-up: CPU runs exercise the real Triton kernels through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, i.e. before ``triton_paged_ops`` is
imported, so it is set here, at collection time.
"""

import os

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


def pytest_terminal_summary(terminalreporter):
    import sys

    test_variants = sys.modules.get("tests.test_variants")
    if test_variants is not None and test_variants.COVERAGE:
        terminalreporter.section("launch variants run against the reference (covered/reachable)")
        for name, (covered, reachable) in sorted(test_variants.COVERAGE.items()):
            terminalreporter.write_line(f"{name}: {covered}/{reachable}")
        total = [sum(v) for v in zip(*test_variants.COVERAGE.values())]
        terminalreporter.write_line(f"all: {total[0]}/{total[1]}")
