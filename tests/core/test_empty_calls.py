"""Calls with nothing to compute: no batch row, no query or no key; and no value depth.

jax.nn.dot_product_attention takes T = 0 and S = 0 (zeros: no key). Every row of such a
call is a row with no visible key, or there is none, so jattn answers as the contract says
for those rows (out zeros, lse the empty-row constant or the sink's logit, max logits the
constant, gradients zeros), in every implementation, kernels included, without running
one (a max over no key has no identity; a kernel's tiling divides by T and S).
Letters: B T S N K H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret

EMPTY_ROW = np.float32(-0.7 * np.finfo(np.float32).max)  # the documented lse of no key
SIZES = dict(B=2, T=3, S=4, N=4, K=2, H=5, D=6)
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def _arrays(zero, layout="BTNH"):
  size = {**SIZES, zero: 0}
  shape = lambda letters: tuple(size[c] for c in letters)
  q_letters = layout
  k_letters = q_letters.replace("T", "S").replace("N", "K")
  v_letters = k_letters.replace("H", "D")
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal(shape(letters)), jnp.float32)
               for letters in (q_letters, k_letters, v_letters))


@pytest.mark.parametrize("implementation", ["xla", "vmap", "blockwise", None])
@pytest.mark.parametrize("zero", ["B", "T", "S"])
def test_an_empty_call_answers_as_rows_with_no_key(zero, implementation):
  q, k, v = _arrays(zero)
  kw = dict(implementation=implementation, is_causal=True, sinks=SINKS,
            score_mod=mods.soft_cap(3.0), return_residual=True, return_max_logits=True)
  out, lse, max_logits = jattn.dot_product_attention(q, k, v, **kw)
  B, T, N, D = (0 if zero == c else SIZES[c] for c in "BTND")
  assert out.shape == (B, T, N, D) and out.dtype == v.dtype
  np.testing.assert_array_equal(out, 0.0)
  # with sinks a row with no key has lse = the sink's logit; max logits ignore sinks
  np.testing.assert_array_equal(lse, np.broadcast_to(SINKS, (B, T, N)))
  np.testing.assert_array_equal(max_logits, np.full((B, T, N), EMPTY_ROW))
  grads = jax.grad(lambda q, k, v, sinks: jnp.sum(jattn.dot_product_attention(
      q, k, v, implementation=implementation, sinks=sinks) ** 2),
      argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(SINKS))
  for g, x in zip(grads, (q, k, v, SINKS)):
    assert g.shape == x.shape
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("zero", ["T", "S"])
def test_as_jax_nn_for_no_query_and_no_key(zero):
  q, k, v = _arrays(zero)
  v = v[..., :SIZES["H"]]  # jax.nn takes H = D only
  want = jax.nn.dot_product_attention(q, k, v)
  got = jattn.dot_product_attention(q, k, v)
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)


def test_no_key_in_another_layout_with_weights_and_without_sinks():
  q, k, v = _arrays("S", layout="BNHT")  # tokens as columns: out [B, N, D, T]
  out, weights, lse = jattn.dot_product_attention(
      q, k, v, layout="BNHT", implementation="xla", return_weights=True,
      return_residual=True)
  B, T, S, N, D = (SIZES[c] if c != "S" else 0 for c in "BTSND")
  assert out.shape == (B, N, D, T) and weights.shape == (B, N, T, S)
  np.testing.assert_array_equal(out, 0.0)
  np.testing.assert_array_equal(lse, np.full((B, N, T), EMPTY_ROW))


@pytest.mark.parametrize("kernel", ["flex_tpu", "flex_gpu", "flex_mgpu_ws", "splash"])
def test_kernels_take_an_empty_call_and_explain_says_nothing_runs(kernel):
  q, k, v = _arrays("S")
  with pallas_interpret():
    out = jattn.dot_product_attention(q, k, v, implementation=kernel, is_causal=True)
  np.testing.assert_array_equal(out, 0.0)
  report = str(jattn.explain(q, k, v, is_causal=True))
  for platform in ("cpu", "tpu", "cuda"):
    assert f"{platform}: " in report
  assert report.count("NoWork(S = 0") == 3, report
  assert "why:" not in report  # no reason of speed for a call that runs nothing


@pytest.mark.parametrize("implementation", ["xla", "vmap", "blockwise"])
def test_no_value_depth_still_has_its_keys_lse_and_max_logits(implementation):
  """D = 0 is no empty call: out is empty, but lse and max logits are those of the keys
  (float64 NumPy: causal, sinks)."""
  q, k, v = _arrays("D")
  out, lse, max_logits = jattn.dot_product_attention(
      q, k, v, implementation=implementation, is_causal=True, sinks=SINKS,
      return_residual=True, return_max_logits=True)
  assert out.shape == (SIZES["B"], SIZES["T"], SIZES["N"], 0)
  G = SIZES["N"] // SIZES["K"]
  logits = np.einsum("btnh,bsnh->btns", np.asarray(q, np.float64),
                     np.repeat(np.asarray(k, np.float64), G, axis=2)) / np.sqrt(SIZES["H"])
  t, s_ = np.arange(SIZES["T"])[:, None, None], np.arange(SIZES["S"])[None, None, :]
  logits = np.where((s_ <= t)[None], logits, -np.inf)  # [B, T, N, S]
  want_max = logits.max(-1)
  with np.errstate(divide="ignore"):
    terms = np.concatenate([logits, np.broadcast_to(SINKS[None, None, :, None],
                                                    logits.shape[:3] + (1,))], -1)
  want_lse = np.log(np.exp(terms - want_max[..., None]).sum(-1)) + want_max
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_logits, want_max, rtol=1e-5, atol=1e-5)
