"""Shared pytest setup for the jattn tests.

Strict dtype promotion catches silent float32 -> float64 (or bf16 -> f32)
promotions inside the library. Matmuls run at full float32 precision so
float32 comparisons stay meaningful on accelerators with TF32 defaults.
"""

import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from tests.compile_flags import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags()  # before jax is imported and makes its CPU backend

# libtpu (the compile tier's compile-only TPU devices, tests/compile) takes a host-wide
# lock when loaded; there is no TPU to guard here, and both xdist workers load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _share_compiled_programs():
  """One XLA compilation cache for this run: its xdist workers and the tests' subprocesses
  (which inherit the environment) reuse a program another test already compiled. Many
  tests compile the same call at the same small shapes; a hit is the same executable.
  A fresh folder per run, removed at exit; a JAX_COMPILATION_CACHE_DIR already set wins.
  JATTN_TEST_COMPILE_CACHE=0 turns it off: the compile tier's programs are compiled for
  compile-only TPU and GPU devices, whose executables jax cannot read back (it warns)."""
  if ("JAX_COMPILATION_CACHE_DIR" in os.environ or "PYTEST_XDIST_WORKER" in os.environ
      or os.environ.get("JATTN_TEST_COMPILE_CACHE") == "0"):
    return  # set by the user, or by this run's controller (the workers inherit it), or off
  import atexit
  import shutil
  import tempfile
  folder = tempfile.mkdtemp(prefix="jattn-test-xla-cache-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # default: only >= 1 s


_share_compiled_programs()

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")


# Property tests (tests/impl/test_properties.py) run under two hypothesis profiles:
# "ci", a few derandomized examples in the default tier, and "thorough",
# hundreds of random ones in the slow tier (`pytest -m thorough`).
import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=5, derandomize=True, deadline=None, print_blob=True)
hypothesis.settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])


# JATTN_TEST_GPU_CAPABILITY=9.0: the CUDA plans as on a host whose GPU has that compute
# capability (9.x: flex_mgpu_ws first for bfloat16 at H = 128), with no GPU here, so that
# the docs' examples and the tests without `host_without_cuda` are checked for a Hopper
# host too (docs/testing.md)
_as_gpu = os.environ.get("JATTN_TEST_GPU_CAPABILITY")
if _as_gpu:
  if not re.fullmatch(r"\d+\.\d+", _as_gpu):
    raise ValueError(f"JATTN_TEST_GPU_CAPABILITY must be a compute capability such as 9.0, "
                     f"got {_as_gpu!r}")
  from jattn._src.kernels import flex_mgpu as _flex_mgpu  # noqa: E402
  _capability = tuple(int(x) for x in _as_gpu.split("."))
  _flex_mgpu.gpu_capability = lambda: _capability


# Tests marked `tpu` or `gpu` need that accelerator and run only where jax has
# one (never in CI); `interpret` and `multidevice` tests run everywhere.
import pytest  # noqa: E402

_PLATFORM_OF_MARK = {"tpu": "tpu", "gpu": "gpu"}


# JATTN_GPU_REHEARSAL=1 (tools/gpu_check.py --smoke) runs tests/kernels/test_gpu.py's subset on a
# CPU, interpreted and exported: the rehearsal of the GPU check.
_REHEARSED = {"gpu": "test_gpu.py"} if os.environ.get("JATTN_GPU_REHEARSAL") == "1" else {}


def pytest_collection_modifyitems(config, items):
  present = {d.platform for d in jax.devices()}
  for item in items:
    for mark, platform in _PLATFORM_OF_MARK.items():
      if _REHEARSED.get(mark) == item.path.name:
        continue
      if mark in item.keywords and platform not in present:
        item.add_marker(pytest.mark.skip(reason=f"needs a {mark.upper()}; jax sees {present}"))
  # The long tests first (stable order otherwise): under xdist a worker that draws a
  # 60-second test last keeps the whole run waiting on it alone.
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def host_without_cuda(monkeypatch):
  """A host without jax's CUDA plugin, as CI's: jax finds no cuDNN (its own check raises
  what it raises there) and sees no GPU, so the CUDA plan is the portable one. With the
  plugin installed cuDNN is found even without a GPU, and on a Hopper GPU flex_mgpu_ws
  comes first: tests whose CUDA expectations are those of a plain CPU host take this."""
  from jattn._src import compat
  from jattn._src.kernels import flex_mgpu

  def no_cudnn(*args, **kwargs):
    raise RuntimeError("cuDNN is not detected.")

  check = compat.APIS["cudnn_check"][0]
  monkeypatch.setattr(f"{check.module}.{check.names[-1]}", no_cudnn)
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: None)
  compat.refresh()  # cuDNN's answer too (compat.derived)
  yield
  monkeypatch.undo()  # before the answers are refreshed, so they read jax's own check again
  compat.refresh()
