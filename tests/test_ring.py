"""Ring attention on 8 simulated devices, in a subprocess so the suite keeps one device."""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


def run_on_8_devices(script: pathlib.Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
  return subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                        text=True, timeout=900)


@pytest.mark.slow
def test_ring_attention_matches_single_device_values_and_gradients():
  result = run_on_8_devices(HERE / "multidevice" / "ring_cases.py")
  print(result.stdout)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "FAIL" not in result.stdout
  assert result.stdout.count("ok  ") == 12
