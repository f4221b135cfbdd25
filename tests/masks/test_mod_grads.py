"""Gradients into the arrays a score_mod captures, and into sinks: against central
finite differences of the float64 NumPy reference, under jit (arrays traced), under
vmap (over the arrays), and the same on every run. Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from tests.reference import numerical_grad
from tests.masks.test_mods import (BS, KEY, N, Q, S, SINKS, SLOPES, T, TABLE, V, n_, reference,
                             s_, t_)

IMPLS = ["xla", "vmap", "blockwise"]
COTANGENT = np.random.default_rng(5).standard_normal((2, T, N, 6))
TEMPERATURE = np.array([1.5, 0.5, 2.0, 1.0], np.float32)
WINDOW = (s_ >= t_ - 6) & (s_ <= t_ + 1)  # the mask of every case: sliding_window(6, 1)

# name -> (array, function array -> score_mod (or "sinks"), NumPy score of (logits, array))
CASES = {
    "alibi_slopes": (SLOPES, mods.alibi, lambda l, a: l + a[n_] * (s_ - t_)),
    "relative_bias_table": (TABLE, mods.relative_bias,
                            lambda l, a: l + a[n_, np.clip(s_ - t_, -3, 3) + 3]),
    "per_head_temperature": (TEMPERATURE, lambda a: (lambda x, b, n, t, s: x / a[n]),
                             lambda l, a: l / a[n_]),
    "soft_cap_learned": (np.float32(0.8), mods.soft_cap, lambda l, a: a * np.tanh(l / a)),
    "sinks": (SINKS, "sinks", None),
}


def _out(impl, array, make):
  kwargs = dict(sinks=array) if make == "sinks" else dict(score_mod=make(array))
  if impl == "blockwise":
    kwargs["block_sizes"] = BS
  return jattn.dot_product_attention(Q, KEY, V, implementation=impl,
                                     mask_mod=mods.sliding_window(6, 1), **kwargs)


def _loss(impl, make):
  return lambda a: jnp.sum(_out(impl, a, make) * COTANGENT.astype(np.float32))


def _reference_loss(name):
  _, make, score = CASES[name]
  def loss(a):
    if make == "sinks":
      out, _ = reference(Q, KEY, V, allowed=WINDOW, sinks=a)
    else:
      out, _ = reference(Q, KEY, V, allowed=WINDOW, score=lambda l: score(l, a))
    return float(np.sum(out * COTANGENT))
  return loss


@pytest.mark.parametrize("name,impl", [
    pytest.param(n, i, marks=() if i == "xla" or (n, i) in {
        ("alibi_slopes", "blockwise"), ("sinks", "blockwise"),
        ("per_head_temperature", "vmap")} else pytest.mark.thorough)
    for n in sorted(CASES) for i in IMPLS])
def test_gradient_matches_finite_differences(impl, name):
  array, make, _ = CASES[name]
  grad = jax.grad(_loss(impl, make))(jnp.asarray(array))
  expected = numerical_grad(_reference_loss(name), np.asarray(array, np.float64))
  np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.thorough), "blockwise"])
def test_gradients_under_jit_with_traced_arrays_are_deterministic(impl):
  """The mod is built inside jit from traced arrays; two runs give identical bits."""
  grad = jax.jit(jax.grad(lambda sl: _loss(impl, mods.alibi)(sl)))
  first, second = grad(jnp.asarray(SLOPES)), grad(jnp.asarray(SLOPES))
  np.testing.assert_array_equal(first, second)
  expected = numerical_grad(_reference_loss("alibi_slopes"), np.asarray(SLOPES, np.float64))
  np.testing.assert_allclose(first, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.thorough), "blockwise"])
def test_vmap_over_captured_arrays(impl):
  """jax.vmap over a batch of ALiBi slopes: values and gradients per row."""
  batch = np.stack([SLOPES, -SLOPES, 2 * SLOPES])
  outs = jax.vmap(lambda sl: _out(impl, sl, mods.alibi))(jnp.asarray(batch))
  grads = jax.vmap(jax.grad(_loss(impl, mods.alibi)))(jnp.asarray(batch))
  for row, out, grad in zip(batch, outs, grads):
    ref, _ = reference(Q, KEY, V, allowed=WINDOW, score=lambda l: l + row[n_] * (s_ - t_))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    expected = numerical_grad(_reference_loss_for_slopes(row), np.asarray(row, np.float64))
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def _reference_loss_for_slopes(_row):
  return lambda a: float(np.sum(reference(
      Q, KEY, V, allowed=WINDOW, score=lambda l: l + a[n_] * (s_ - t_))[0] * COTANGENT))


def test_gradients_agree_across_implementations_with_everything():
  """Query/key/value, bias, sinks and a relative-bias table at once: blockwise == xla."""
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, N, T, S)), jnp.float32)
  def loss(impl, q, k, v, bias, table, sinks):
    out = jattn.dot_product_attention(
        q, k, v, bias, implementation=impl, score_mod=mods.relative_bias(table),
        mask_mod=mods.causal(), sinks=sinks, query_seq_lengths=jnp.array([13, 6]),
        block_sizes=BS if impl == "blockwise" else None)
    return jnp.sum(out * COTANGENT.astype(np.float32))
  args = (Q, KEY, V, bias, jnp.asarray(TABLE), jnp.asarray(SINKS))
  g_xla = jax.grad(lambda *a: loss("xla", *a), argnums=range(6))(*args)
  g_blk = jax.grad(lambda *a: loss("blockwise", *a), argnums=range(6))(*args)
  for name, a, b in zip(("q", "k", "v", "bias", "table", "sinks"), g_blk, g_xla):
    np.testing.assert_allclose(a, b, rtol=5e-5, atol=5e-5, err_msg=name)
