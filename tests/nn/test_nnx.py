"""jattn.nnx.MultiHeadAttention against flax.nnx.MultiHeadAttention with the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.nnx

B, T, S, F = 2, 5, 7, 16


def _pair(num_heads=4, num_kv_heads=None, **kw):
  """(jattn module, flax module) with jattn's parameters copied from flax's."""
  theirs = nnx.MultiHeadAttention(num_heads, F, num_kv_heads=num_kv_heads, decode=False,
                                  rngs=nnx.Rngs(0), **kw)
  ours = jattn.nnx.MultiHeadAttention(num_heads, F, num_kv_heads=num_kv_heads,
                                      rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return ours, theirs


def _columns(ours_layout, x):
  """[B, T, F] -> [B, F, T] for the columns layout."""
  return x if ours_layout == "rows" else jnp.swapaxes(x, 1, 2)


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_parameters_have_flax_names_and_shapes():
  ours = jattn.nnx.MultiHeadAttention(4, F, qkv_features=8, out_features=12,
                                      num_kv_heads=2, rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(4, F, qkv_features=8, out_features=12, num_kv_heads=2,
                                  rngs=nnx.Rngs(0))
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  assert shapes(ours) == shapes(theirs)
  assert shapes(ours)["key"]["kernel"] == (F, 2, 2)  # [F, K, H]
  assert shapes(ours)["out"]["kernel"] == (4, 2, 12)  # [N, H, F]


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_matches_flax(layout, num_kv_heads, is_causal):
  ours, theirs = _pair(4, num_kv_heads)
  ours.layout = layout
  x = _x((B, T, F), 0)
  expected = theirs(x, is_causal=is_causal)
  got = ours(_columns(layout, x), is_causal=is_causal)
  np.testing.assert_allclose(_columns(layout, got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_cross_attention_with_mask_matches_flax(layout):
  ours, theirs = _pair(4, 2)
  ours.layout = layout
  xq, xkv = _x((B, T, F), 0), _x((B, S, F), 1)
  mask = jax.random.bernoulli(jax.random.key(2), 0.6, (B, 1, T, S))
  expected = theirs(xq, xkv, mask=mask)
  got = ours(_columns(layout, xq), _columns(layout, xkv), mask=mask)
  np.testing.assert_allclose(_columns(layout, got), expected, rtol=1e-5, atol=1e-5)


def test_implementation_is_passed_through():
  ours, theirs = _pair(4)
  ours.implementation = "vmap"
  x = _x((B, T, F), 0)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
  ours.implementation = "no-such-implementation"
  with pytest.raises(ValueError, match="implementation"):
    ours(x)


def test_dtype_and_param_dtype():
  ours, theirs = _pair(4, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  assert ours.query.kernel[...].dtype == jnp.bfloat16
  x = _x((B, T, F), 0).astype(jnp.bfloat16)
  got = ours(x)
  with jax.numpy_dtype_promotion("standard"):  # jax.nn's own bf16 path promotes implicitly
    expected = theirs(x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                             rtol=0.05, atol=0.05)


def _identical_heads_module(rate, seed):
  """Every head has the same weights, so heads differ only by their dropout."""
  m = jattn.nnx.MultiHeadAttention(4, F, dropout_rate=rate, rngs=nnx.Rngs(seed))
  for proj in (m.query, m.key, m.value):
    proj.kernel[...] = jnp.broadcast_to(proj.kernel[...][:, :1], proj.kernel[...].shape)
  return m


def _per_head_outputs(m, x, **kw):
  """[B, T, N, D]: the attention output of each head before the out projection."""
  from jattn._src.nn import attend_step  # both modules attend through it

  captured = {}
  original = attend_step.dot_product_attention
  def spy(*args, **kwargs):
    captured["out"] = original(*args, **kwargs)
    return captured["out"]
  attend_step.dot_product_attention = spy
  try:
    m(x, **kw)
  finally:
    attend_step.dot_product_attention = original
  return captured["out"]


def test_dropout_independent_per_head_and_reproducible():
  x = _x((B, T, F), 0)
  a = _per_head_outputs(_identical_heads_module(0.5, 3), x, deterministic=False)
  b = _per_head_outputs(_identical_heads_module(0.5, 3), x, deterministic=False)
  clean = _per_head_outputs(_identical_heads_module(0.5, 3), x, deterministic=True)
  np.testing.assert_array_equal(a, b)  # same seed, same dropout
  np.testing.assert_allclose(clean[:, :, 0], clean[:, :, 1], rtol=1e-6)  # heads identical
  assert not np.allclose(a[:, :, 0], a[:, :, 1])  # dropout differs between heads
  assert not np.allclose(a, clean)
  m = _identical_heads_module(0.5, 3)
  assert not np.allclose(_per_head_outputs(m, x, deterministic=False),
                         _per_head_outputs(m, x, deterministic=False))  # stream advances


def test_dropout_needs_deterministic():
  m = jattn.nnx.MultiHeadAttention(4, F, dropout_rate=0.1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="deterministic"):
    m(_x((B, T, F), 0))


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match=r"qkv_features \(10\) must be divisible by num_heads \(4\)"):
    jattn.nnx.MultiHeadAttention(4, 10, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
    jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="layout must be one of"):
    jattn.nnx.MultiHeadAttention(4, F, layout="diagonal", rngs=nnx.Rngs(0))
  m = jattn.nnx.MultiHeadAttention(4, F, layout="columns", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"inputs_q: expected features F = in_features = 16 .*"
                                       r"\[B, F, T\], got shape \(2, 5, 16\)"):
    m(_x((B, T, F), 0))
  with pytest.raises(ValueError, match=r"inputs_q: expected rank 3"):
    m(_x((F,), 0))  # (as flax, [F, T] is one unbatched sequence)
  with pytest.raises(ValueError, match="init_cache"):
    m(_x((B, F, T), 0), is_causal=True, decode=True)
