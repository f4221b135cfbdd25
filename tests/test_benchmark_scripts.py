"""The accelerator benchmark scripts run (--smoke: tiny shapes, Pallas interpret mode on
this CPU): nobody here can run them for real, so this is what keeps them from rotting
until a TPU or GPU owner does. Slow tier: each script compiles a dozen programs."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.thorough
@pytest.mark.parametrize("script", ["tpu_kernels.py", "gpu_kernels.py"])
def test_kernel_benchmark_runs_in_smoke_mode(script):
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                        capture_output=True, text=True, timeout=600, cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "fwd+bwd" in done.stdout
