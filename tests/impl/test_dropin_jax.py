"""jattn.dot_product_attention against jax.nn.dot_product_attention, argument by argument:
return_residual, bool-only masks, and jattn's broadcast_dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import make_qkv, raises, random_mask, to_layout

IMPLS = ["xla", "vmap", "blockwise"]
TOL = {np.float32: dict(rtol=1e-5, atol=1e-5),
       jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _with_empty_rows(rng, shape):
  mask = random_mask(rng, shape)
  mask[0, :, 1] = False  # query 1 of batch 0 sees no key: jax.nn's finite lse
  return mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_return_residual_equals_jax_nn(impl, dtype):
  rng = np.random.default_rng(0)
  q, k, v = make_qkv(rng, B=2, T=5, S=7, N=4, K=2, H=8, dtype=dtype)
  mask = _with_empty_rows(rng, (2, 1, 5, 7))
  bias = rng.standard_normal((1, 4, 5, 7)).astype(dtype)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([7, 4], jnp.int32))
  with jax.numpy_dtype_promotion("standard"):  # jax.nn's half precision needs it
    want_out, want_lse = jax.nn.dot_product_attention(q, k, v, bias, mask,
                                                      return_residual=True, **kw)
  out, lse = jattn.dot_product_attention(q, k, v, bias, mask, return_residual=True,
                                         implementation=impl, **kw)
  assert lse.shape == want_lse.shape == (2, 5, 4) and lse.dtype == want_lse.dtype
  np.testing.assert_allclose(np.float32(lse), np.float32(want_lse), **TOL[dtype])
  seen = np.asarray(mask[:, 0].any(-1))  # jax.nn averages the values of an empty row
  np.testing.assert_allclose(np.float32(out)[seen], np.float32(want_out)[seen], **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_return_residual_in_other_layouts_and_without_batch(impl):
  rng = np.random.default_rng(1)
  q, k, v = make_qkv(rng, B=None, T=6, S=6, N=2, H=8)
  _, want = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  _, lse = jattn.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                       implementation=impl)
  assert lse.shape == (6, 2)  # [T, N], as jax.nn's
  np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)
  qb, kb, vb = (to_layout(x, "NHT", "TNH") for x in (q, k, v))
  _, lse = jattn.dot_product_attention(qb, kb, vb, is_causal=True, return_residual=True,
                                       layout="NHT", implementation=impl)
  assert lse.shape == (2, 6)  # the query's layout without H: [N, T]
  np.testing.assert_allclose(lse, np.asarray(want).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_return_residual_under_jit_and_grad(impl):
  rng = np.random.default_rng(2)
  q, k, v = make_qkv(rng, B=1, T=4, S=4, N=2, H=8)

  def loss(fn, q, k, v, **kw):
    out, lse = fn(q, k, v, is_causal=True, return_residual=True, **kw)
    return (out ** 2).sum() + lse.sum()  # jax.nn stops the lse's gradient

  ours = jax.jit(jax.grad(lambda *a: loss(jattn.dot_product_attention, *a,
                                          implementation=impl), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(lambda *a: loss(jax.nn.dot_product_attention, *a), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(ours, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_return_residual_with_return_weights_and_ring():
  rng = np.random.default_rng(3)
  q, k, v = make_qkv(rng, B=1, T=4, S=4, N=2, H=8)
  _, want = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  out, weights, lse = jattn.dot_product_attention(q, k, v, is_causal=True, return_weights=True,
                                                  return_residual=True)
  assert weights.shape == (1, 2, 4, 4)
  np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  out, lse = jattn.ring_attention(q, k, v, mesh=mesh, is_causal=True, return_residual=True)
  np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)


def test_bad_return_residual_and_float_masks_are_refused_as_jax_nn_refuses_them():
  rng = np.random.default_rng(4)
  q, k, v = make_qkv(rng, B=1, T=3, S=3, N=2, H=8)
  with raises(TypeError, "return_residual must be a bool", "'yes'"):
    jattn.dot_product_attention(q, k, v, return_residual="yes")
  float_mask = np.ones((1, 1, 3, 3), np.float32)
  with pytest.raises(ValueError, match="mask dtype should be bool"):
    jax.nn.dot_product_attention(q, k, v, mask=float_mask)
  with raises(TypeError, "mask must be a bool array", "float32"):
    jattn.dot_product_attention(q, k, v, mask=float_mask)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_broadcast_dropout_shares_one_draw_across_batch_and_heads(impl):
  rng = np.random.default_rng(5)
  q, k, v = make_qkv(rng, B=1, T=4, S=6, N=1, H=8)
  # every batch element and head alike, so only their dropout can tell them apart
  q, k, v = (np.tile(x, (2, 1, 3, 1)) for x in (q, k, v))
  key = jax.random.key(7)
  kw = dict(dropout_rate=0.5, dropout_rng=key, implementation=impl)
  shared = np.asarray(jattn.dot_product_attention(q, k, v, broadcast_dropout=True, **kw))
  apart = np.asarray(jattn.dot_product_attention(q, k, v, **kw))
  for b, n in [(0, 1), (0, 2), (1, 0), (1, 2)]:
    np.testing.assert_array_equal(shared[b, :, n], shared[0, :, 0])
  assert not np.allclose(apart[0, :, 0], apart[0, :, 1])
  if impl == "xla":  # the draw itself: one [1, 1, T, S] Bernoulli, inverted scaling
    _, weights = jattn.dot_product_attention(q, k, v, return_weights=True)
    keep = jax.random.bernoulli(key, 0.5, (1, 1, 4, 6)).astype(jnp.float32) / 0.5
    want = jnp.einsum("BNTS,BSND->BTND", weights * keep, v)
    np.testing.assert_allclose(shared, want, rtol=1e-5, atol=1e-5)


def test_bad_broadcast_dropout_is_named():
  q, k, v = make_qkv(np.random.default_rng(6), B=1, T=3, S=3, N=2, H=8)
  with raises(TypeError, "broadcast_dropout must be a bool", "1"):
    jattn.dot_product_attention(q, k, v, broadcast_dropout=1)
