"""Shared pytest setup for the jattn tests.

Strict dtype promotion catches silent float32 -> float64 (or bf16 -> f32)
promotions inside the library. Matmuls run at full float32 precision so
float32 comparisons stay meaningful on accelerators with TF32 defaults.
"""

import pathlib
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")


# Property tests (tests/test_properties.py) run under two hypothesis profiles:
# "ci", a few derandomized examples in the default tier, and "thorough",
# hundreds of random ones in the slow tier (`pytest -m thorough`).
import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=5, derandomize=True, deadline=None, print_blob=True)
hypothesis.settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
