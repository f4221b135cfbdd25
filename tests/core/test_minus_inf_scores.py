"""A score_mod that returns -inf for every key of a row: zeros, finite gradients, and
the empty row's lse, on every implementation (API.md section 2: "A query row that may
attend to no key returns zeros ... in every implementation", however it loses its keys).

The reference is the float64 NumPy attention of tests/reference.py with the -inf
entries as a mask (a -inf logit is a key with weight exactly 0), and its gradient
written out in tests/reference_grads.py. Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.reference_grads import reference_vjp

B, T, S, N, K, H, D = 1, 5, 6, 2, 1, 4, 3
# jattn's lse of a row that sees no key (blockwise's, ring's, the kernels'): finite
EMPTY_LSE = np.float32(-0.7 * np.finfo(np.float32).max)

_rng = np.random.default_rng(21)
Q = _rng.standard_normal((B, T, N, H)).astype(np.float32)
KEY = _rng.standard_normal((B, S, K, H)).astype(np.float32)
V = _rng.standard_normal((B, S, K, D)).astype(np.float32)
COTANGENT = _rng.standard_normal((B, T, N, D)).astype(np.float32)
# A learned [N, T, S] table added to the logits: head 0's query 1 and every head's
# query 4 get -inf for all keys (empty rows), query 3 for the even keys only.
TABLE = _rng.standard_normal((N, T, S)).astype(np.float32)
TABLE[0, 1, :] = -np.inf
TABLE[:, 4, :] = -np.inf
TABLE[:, 3, ::2] = -np.inf
VISIBLE = np.isfinite(TABLE)[None]  # [1, N, T, S]
EMPTY = ~VISIBLE.any(-1)  # [1, N, T]


def _table_mod(table):
  return lambda x, b, n, t, s: x + table[n, t, s]


def _where_mod(x, b, n, t, s):
  """The same -inf entries without a captured array (what flex_tpu's tiles take)."""
  drop = ((n == 0) & (t == 1)) | (t == 4) | ((t == 3) & (s % 2 == 0))
  return jnp.where(drop, -jnp.inf, x)


def _reference(with_table):
  """float64 (out, dq, dk, dv, d table [N, T, S], lse [B, T, N])."""
  bias = np.where(VISIBLE, TABLE, 0.0) if with_table else np.zeros(VISIBLE.shape)
  out, dq, dk, dv, dl = reference_vjp(Q, KEY, V, COTANGENT, bias, mask=VISIBLE)
  logits = np.einsum("BTNH,BSNH->BNTS", np.float64(Q), np.repeat(np.float64(KEY), N // K, 2))
  logits = np.where(VISIBLE, logits / np.sqrt(H) + bias, -np.inf)
  with np.errstate(divide="ignore"):
    lse = np.log(np.exp(logits).sum(-1))  # -inf on the empty rows, not compared
  return out, dq, dk, dv, dl.sum(0), np.einsum("BNT->BTN", lse)


# (implementation, layout, score_mod reads TABLE): "vmap" in BNHT runs the single-head
# columns path; flex_tpu and flex_gpu (interpreted) take no [N, T, S] table, so the same entries
# without one. The CI tier runs the dense path the fix is in; the rest is thorough.
CASES = [("xla", "BTNH", True),
         pytest.param("vmap", "BTNH", True, marks=pytest.mark.thorough),
         pytest.param("vmap", "BNHT", True, marks=pytest.mark.thorough),
         pytest.param("blockwise", "BTNH", True, marks=pytest.mark.thorough),
         pytest.param("flex_tpu", "BTNH", False, marks=(pytest.mark.thorough,
                                                       pytest.mark.interpret)),
         pytest.param("flex_gpu", "BTNH", False, marks=(pytest.mark.thorough,
                                                       pytest.mark.interpret)),
         # ring_attention on a one-device mesh: the ring's own loop and custom VJP
         pytest.param("ring", "BTNH", True, marks=pytest.mark.thorough)]


@pytest.mark.parametrize("impl, layout, with_table", CASES)
def test_rows_of_minus_inf_scores_give_zeros_lse_and_finite_gradients(impl, layout, with_table):
  def loss(q, k, v, table):
    args = [jnp.einsum(f"BTNH->{layout}", x) for x in (q, k, v)]
    score_mod = _table_mod(table) if with_table else _where_mod
    if impl == "ring":
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
      out, lse = jattn.ring_attention(*args, mesh=mesh, axis_name="seq", layout=layout,
                                      score_mod=score_mod, return_residual=True,
                                      block_sizes=jattn.BlockSizes(q=2, kv=4))
    else:
      out, lse = jattn.dot_product_attention(
          *args, implementation=impl, layout=layout, score_mod=score_mod,
          return_residual=True,
          block_sizes=jattn.BlockSizes(q=2, kv=4) if impl == "blockwise" else None)
    out = jnp.einsum(f"{layout}->BTNH", out)
    return jnp.sum(out * COTANGENT), (out, lse)

  grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  with pallas_interpret(impl in ("flex_tpu", "flex_gpu")):
    grads, (out, lse) = grad(*(jnp.asarray(x) for x in (Q, KEY, V, TABLE)))
  ref_out, *ref_grads, ref_lse = _reference(with_table)
  if not with_table:
    ref_grads[-1] = np.zeros_like(TABLE)  # no table in the call: no gradient into it

  empty = np.einsum("BNT->BTN", EMPTY)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[empty] == 0)
  lse = np.einsum(f"{layout.replace('H', '')}->BTN", np.asarray(lse))  # [B, T, N]
  assert lse.dtype == np.float32
  np.testing.assert_array_equal(lse[empty], EMPTY_LSE)
  np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)
  for name, g, r in zip(("q", "k", "v", "table"), grads, ref_grads):
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")

