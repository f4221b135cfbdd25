"""jattn.linen.MultiHeadAttention against flax.linen's, and bit-identical to jattn.nnx's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jattn
import jattn.linen
import jattn.nnx

B, T, S, F = 2, 5, 7, 16


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _columns(layout, x):
  return x if layout == "rows" else jnp.swapaxes(x, 1, 2)


def test_parameter_tree_equals_flax_linen():
  x = _x((B, T, F), 0)
  ours = jattn.linen.MultiHeadAttention(4, qkv_features=8, out_features=12).init(
      jax.random.key(0), x)
  theirs = nn.MultiHeadDotProductAttention(4, qkv_features=8, out_features=12).init(
      jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, theirs)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_matches_flax_linen_with_its_params(layout):
  xq, xkv = _x((B, T, F), 0), _x((B, S, F), 1)
  mask = jax.random.bernoulli(jax.random.key(2), 0.6, (B, 1, T, S))
  theirs = nn.MultiHeadDotProductAttention(4, qkv_features=8)
  params = theirs.init(jax.random.key(0), xq, xkv)
  expected = theirs.apply(params, xq, xkv, mask=mask)
  ours = jattn.linen.MultiHeadAttention(4, qkv_features=8, layout=layout)
  got = ours.apply(params, _columns(layout, xq), _columns(layout, xkv), mask=mask)
  np.testing.assert_allclose(_columns(layout, got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_nnx_and_linen_bit_identical(layout, num_kv_heads):
  x = _columns(layout, _x((B, T, F), 0))
  m = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=num_kv_heads, layout=layout,
                                   rngs=nnx.Rngs(0))
  params = {"params": nnx.to_pure_dict(nnx.state(m, nnx.Param))}
  got = jattn.linen.MultiHeadAttention(4, num_kv_heads=num_kv_heads, layout=layout).apply(
      params, x, is_causal=True)
  np.testing.assert_array_equal(got, m(x, is_causal=True))


def test_dropout_uses_dropout_rng_and_is_reproducible():
  x = _x((B, T, F), 0)
  m = jattn.linen.MultiHeadAttention(4, dropout_rate=0.5)
  params = m.init(jax.random.key(0), x, deterministic=True)
  run = lambda seed: m.apply(params, x, deterministic=False,
                             rngs={"dropout": jax.random.key(seed)})
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.allclose(run(1), run(2))
  assert not np.allclose(run(1), m.apply(params, x, deterministic=True))


def test_bad_arguments_name_themselves():
  x = _x((B, T, F), 0)
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
    jattn.linen.MultiHeadAttention(4, num_kv_heads=3).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="layout must be one of"):
    jattn.linen.MultiHeadAttention(4, layout="BTNH").init(jax.random.key(0), x)


@pytest.mark.parametrize("layout,num_kv_heads", [("rows", 2), ("columns", 2), ("rows", 1)])
def test_causal_grouped_heads_match_flax_with_repeated_kv_heads(layout, num_kv_heads):
  """flax.linen has no grouped heads; K/V heads repeated G times in its kernels are
  the same model. Causal self-attention, with flax's own causal mask."""
  N, H = 4, 4
  x = _x((B, T, F), 0)
  ours = jattn.linen.MultiHeadAttention(N, qkv_features=N * H, num_kv_heads=num_kv_heads,
                                        layout=layout)
  params = ours.init(jax.random.key(3), _columns(layout, x))
  params = jax.tree.map(  # non-zero biases, so the repeated ones are checked too
      lambda p: p + 0.1 * _x(p.shape, 4) if p.ndim == 2 and p.shape[-1] == H else p, params)
  G = N // num_kv_heads
  repeat = lambda p: jnp.repeat(p, G, axis=-2)  # [F, K, H] / [K, H]: kv head n // G
  theirs_params = {"params": dict(params["params"], **{
      name: {leaf: repeat(w) for leaf, w in params["params"][name].items()}
      for name in ("key", "value")})}
  expected = nn.MultiHeadDotProductAttention(N, qkv_features=N * H).apply(
      theirs_params, x, mask=nn.make_causal_mask(jnp.ones((B, T))))
  got = ours.apply(params, _columns(layout, x), is_causal=True)
  np.testing.assert_allclose(_columns(layout, got), expected, rtol=1e-5, atol=1e-5)
