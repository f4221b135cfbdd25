"""jattn's flex kernels (flex_tpu, flex_gpu; interpret mode) under grouped heads with a
score_mod that depends on the query head: d key and d value sum over the G query heads of
each kv head, and each head's tile must be scored with its own mods.

The dk/dv kernels loop over the query heads of a kv head (flex_gpu: a loop in the
program; flex_tpu: a grid axis); evaluating the mods for the wrong head in that pass
changes only d key and d value, which the other interpret tests never paired with a
head-dependent score_mod and G > 1. Against the float64 VJP written out in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret
from tests.reference_grads import reference_mods_vjp

B, T, S, N, K, H = 1, 40, 48, 4, 2, 16  # G = 2 query heads per kv head; several tiles
SLOPES = np.array([0.9, 0.05, 0.6, 0.2], np.float32)  # far apart: a wrong head shows


@pytest.mark.interpret
@pytest.mark.parametrize("implementation", ["flex_gpu", "flex_tpu"])
def test_key_and_value_gradients_with_per_head_alibi_and_grouped_heads(implementation):
  rng = np.random.default_rng(11)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in "kv")
  cot = rng.standard_normal((B, T, N, H))
  kw = dict(is_causal=True, score_mod=mods.alibi(jnp.asarray(SLOPES)))

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation=implementation, **kw)
    return jnp.sum(out * cot)

  with pallas_interpret():
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  _, want_dq, want_dk, want_dv = reference_mods_vjp(
      q, k, v, cot, allowed=(s <= t)[None, None],
      score=lambda x: x + SLOPES[None, :, None, None] * (s - t), d_score=np.ones_like)
  for name, got, want in (("d_query", dq, want_dq), ("d_key", dk, want_dk),
                          ("d_value", dv, want_dv)):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=name)
