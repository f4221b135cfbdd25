"""fma_exp2.exp2 (2**x by a polynomial and exponent bits, for flex_mgpu_ws's softmax) against
NumPy's float64 exp2, compiled by XLA:CPU and eagerly."""

import jax
import numpy as np
import pytest

from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import fma_exp2

# dense over the softmax's range, and the edges: ties (x.5 rounds to even), -125, 0, the
# masked logits (LARGE_NEGATIVE, -inf) and a positive x
X = np.concatenate([np.linspace(-130.0, 8.0, 1_000_001),
                    [-112.5, -0.5, 0.5, -1.5, -125.0, -124.99, -125.01, 0.0, -1e-8, 100.3,
                     LARGE_NEGATIVE, -np.inf]]).astype(np.float32)


@pytest.mark.parametrize("compiled", [True, False], ids=["jit", "eager"])
def test_exp2_within_its_bound_and_zero_below_its_range(compiled):
  got = np.asarray((jax.jit(fma_exp2.exp2) if compiled else fma_exp2.exp2)(X), np.float64)
  want = np.exp2(X.astype(np.float64))
  kept = X >= -125.0
  relative = np.abs(got[kept] / want[kept] - 1.0)
  worst = relative.argmax()
  assert relative[worst] <= fma_exp2.MAX_RELATIVE_ERROR, (relative[worst], X[kept][worst])
  # below 2**-125 (masked logits included): exactly 0 (a weight under 2**-125 of the
  # row's largest is nothing bfloat16 or the row sum keeps)
  assert np.all(got[~kept] == 0.0)


def test_the_bound_is_the_polynomials_and_not_loose():
  """The stated bound is the fit's own error (within 1%), so a worse polynomial fails."""
  f = np.linspace(-0.5, 0.5, 100_001)
  p = fma_exp2.C0 + f * (fma_exp2.C1 + f * (fma_exp2.C2 + f * fma_exp2.C3))
  error = np.max(np.abs(p / np.exp2(f) - 1.0))
  assert 0.99 * fma_exp2.MAX_RELATIVE_ERROR <= error <= fma_exp2.MAX_RELATIVE_ERROR
