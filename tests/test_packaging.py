"""The wheel: one top-level package (the SGLang adapter inside it), the plugin entry point pointing there, and the
runtime needs declared."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_the_package_and_points_sglang_inside_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"triton_paged_ops", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "triton_paged_ops/integrations/sglang/backend.py" in names
    assert "triton_paged_ops/configs/nvidia_h200.json" in names
    dist = next(n for n in tops if n.endswith(".dist-info"))
    archive = zipfile.ZipFile(wheel)
    entry_points = archive.read(f"{dist}/entry_points.txt").decode()
    assert "tpa = triton_paged_ops.integrations.sglang:register" in entry_points
    requires = [line for line in archive.read(f"{dist}/METADATA").decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]  # fmt: skip
    assert {r.split()[1].split(">")[0] for r in requires} == {"torch", "triton", "numpy"}, requires
