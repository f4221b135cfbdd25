"""Ring attention on 8 simulated devices, in a subprocess so the suite keeps one device."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.compile_flags import xla_flags

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/


def run_on_8_devices(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
  return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                        text=True, timeout=900)


def assert_checks_pass(script: str, cases: str, count: int) -> None:
  """Runs tests/multidevice/<script> on 8 devices; every one of its `count` checks passes."""
  result = run_on_8_devices(HERE / "multidevice" / script, cases)
  print(result.stdout)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "FAIL" not in result.stdout
  assert result.stdout.count("ok  ") == count


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 7), pytest.param("all", 12, marks=pytest.mark.thorough)])
def test_ring_attention_matches_single_device_values_and_gradients(cases, count):
  assert_checks_pass("ring_cases.py", cases, count)


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 6), pytest.param("all", 10, marks=pytest.mark.thorough)])
def test_ring_under_jax_make_mesh_explicit_and_auto_axes(cases, count):
  """Meshes from jax.make_mesh (Explicit axes, its default) and Auto axes, inputs
  unsharded or sharded along the sequence, batch or heads, against float64."""
  assert_checks_pass("ring_sharding_cases.py", cases, count)


def test_ring_without_a_mesh_says_how_to_set_one():
  import numpy as np
  import jattn
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(ValueError, match=r"needs a mesh with a 'seq' axis.*jax.set_mesh"):
    jattn.dot_product_attention(q, q, q, implementation="ring")


def test_ring_refuses_what_needs_the_whole_grid():
  import numpy as np
  import jattn
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(ValueError, match=r"'ring' does not support bias, mask: bias: a dense"):
    jattn.dot_product_attention(q, q, q, np.zeros((4, 4), np.float32), np.ones((4, 4), bool),
                                implementation="ring", local_window_size=1)


def test_ring_attention_names_a_missing_mesh_axis():
  import jax
  import numpy as np
  import jattn
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(ValueError, match=r"axis_name 'sequence' is not an axis of the mesh"):
    jattn.ring_attention(q, q, q, mesh=mesh, axis_name="sequence")


@pytest.mark.thorough
def test_ring_in_every_dtype_and_under_vmap_and_jit():
  """float32/bfloat16/float16 against float64 (the twice-naive rule), and
  jax.jit(jax.vmap(ring)): tests/multidevice/ring_dtypes.py (~40 s here)."""
  result = run_on_8_devices(HERE / "multidevice" / "ring_dtypes.py")
  print(result.stdout)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "FAIL" not in result.stdout
  assert result.stdout.count("ok  ") == 5
