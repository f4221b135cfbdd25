"""Where the drop-in arguments meet the programmable ones.

return_residual's lse with sinks and a score_mod, against a float64 NumPy
reference: lse = log(exp(sinks[n]) + sum_s exp(l_s)) over the visible keys,
l = score_mod(q . k * scale) (a row that sees no key: lse = sinks[n]); and mods
through `jattn.flax_attention_fn` inside flax's own module, against the dense mask
flax's default attention takes.
Letters as everywhere: B T S N K G H D F.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret
from tests.helpers import raises

B, T, S, N, K, H = 2, 11, 13, 4, 2, 8
G = N // K
CAP = 2.0
SINKS = np.array([0.5, -1.0, 3.0, 0.0], np.float32)
WINDOW = 2  # keys t - 2 .. t (T < S: every row sees its own key)


def _reference_lse(q, k, *, sinks):
  """float64 [B, T, N]: log of the softmax denominator, sliding window and soft-cap."""
  q, k = np.float64(q), np.float64(k)
  k = np.repeat(k, G, axis=2)  # [B, S, N, H]: kv head n // G serves query head n
  logits = np.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
  logits = CAP * np.tanh(logits / CAP)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  visible = (s <= t) & (s >= t - WINDOW)  # [T, S]
  terms = np.where(visible, np.exp(logits), 0.0).sum(-1)  # [B, N, T]
  terms = terms + (0.0 if sinks is None else np.exp(np.float64(sinks))[None, :, None])
  return np.einsum("BNT->BTN", np.log(terms))


@pytest.mark.parametrize("implementation", ["xla", "vmap", "blockwise"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_residual_is_the_log_denominator_with_mods_and_sinks(implementation, with_sinks):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  sinks = SINKS if with_sinks else None
  out, lse = jattn.dot_product_attention(
      q, k, v, implementation=implementation, return_residual=True,
      mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(WINDOW, 0)),
      score_mod=mods.soft_cap(CAP), sinks=sinks,
      block_sizes=jattn.BlockSizes(q=4, kv=3) if implementation == "blockwise" else None)
  assert lse.shape == (B, T, N) and out.shape == (B, T, N, H)
  np.testing.assert_allclose(lse, _reference_lse(q, k, sinks=sinks), rtol=1e-5, atol=1e-5)


def test_flax_module_takes_mods_through_flax_attention_fn():
  """flax.nnx.MultiHeadAttention with jattn's kernel and a mask_mod equals the same
  flax module with its default attention and the equivalent dense mask."""
  F, T_ = 16, 12
  x = np.random.default_rng(1).standard_normal((B, T_, F)).astype(np.float32)
  make = lambda fn: nnx.MultiHeadAttention(
      num_heads=N, in_features=F, decode=False, rngs=nnx.Rngs(0),
      **({} if fn is None else dict(attention_fn=fn)))
  chunk = mods.chunked(5)
  jattn_module = make(functools.partial(jattn.flax_attention_fn, mask_mod=chunk,
                                        implementation="blockwise",
                                        block_sizes=jattn.BlockSizes(q=4, kv=4)))
  flax_module = make(None)
  t = np.arange(T_)
  dense = (t[:, None] // 5 == t[None, :] // 5)[None, None]  # [1, 1, T, S]
  np.testing.assert_allclose(jattn_module(x), flax_module(x, mask=jnp.asarray(dense)),
                             rtol=1e-5, atol=1e-5)


def test_module_with_an_attention_fn_refuses_mods():
  module = jattn.nnx.MultiHeadAttention(
      N, 16, attention_fn=jattn.flax_attention_fn, rngs=nnx.Rngs(0))
  x = np.zeros((1, 4, 16), np.float32)
  with raises(ValueError, "mask_mod", "attention_fn"):
    module(x, mask_mod=mods.causal())
  with raises(ValueError, "use_sinks", "attention_fn"):
    jattn.nnx.MultiHeadAttention(N, 16, attention_fn=jattn.flax_attention_fn,
                                 use_sinks=True, rngs=nnx.Rngs(0))(x)


def _no_key_before(b, n, t, s):
  """Hand-written: causal, and rows t < 2 + b see no key at all."""
  return (s <= t) & (t >= 2 + b)


def _attention_with_lse(implementation, q, k, v, sinks):
  """(out [B, T, N, H], lse [B, T, N]) with sinks and `_no_key_before`."""
  kwargs = dict(mask_mod=_no_key_before, sinks=sinks, return_residual=True)
  if implementation == "ring":  # one device's ring: the ring's own sink step
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    return jattn.ring_attention(q, k, v, mesh=mesh, axis_name="seq",
                                block_sizes=jattn.BlockSizes(q=4, kv=3), **kwargs)
  with pallas_interpret(implementation in ("flex_tpu", "flex_gpu")):
    return jattn.dot_product_attention(
        q, k, v, implementation=implementation,
        block_sizes=jattn.BlockSizes(q=4, kv=3) if implementation == "blockwise" else None,
        **kwargs)


# every dense implementation in CI: a planted bug that left the empty row's lse at the
# empty-row constant in "xla" passed the CI tier while these were in the slow one
@pytest.mark.parametrize("implementation", [
    "blockwise", "xla", "vmap", pytest.param("ring", marks=pytest.mark.thorough),
    pytest.param("flex_tpu", marks=(pytest.mark.thorough, pytest.mark.interpret)),
    pytest.param("flex_gpu", marks=(pytest.mark.thorough, pytest.mark.interpret))])
def test_residual_of_a_row_with_no_key_is_the_sink(implementation):
  """The denominator of a row that sees no key holds only the sink: lse = sinks[n],
  out = 0; the other rows' lse = log(exp(sinks[n]) + sum_s exp(l_s)), float64."""
  rng = np.random.default_rng(5)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  out, lse = _attention_with_lse(implementation, q, k, v, SINKS)

  t, s, b = np.arange(T)[:, None], np.arange(S)[None, :], np.arange(B)[:, None, None]
  visible = (s <= t) & (t >= 2 + b)  # [B, T, S]
  empty = ~visible.any(-1)  # [B, T]: rows 0, 1 of batch 0, rows 0, 1, 2 of batch 1
  logits = np.einsum("BTNH,BSNH->BNTS", np.float64(q), np.repeat(np.float64(k), G, 2))
  terms = np.where(visible[:, None], np.exp(logits / np.sqrt(H)), 0.0).sum(-1)  # [B, N, T]
  expected = np.einsum("BNT->BTN", np.log(terms + np.exp(np.float64(SINKS))[None, :, None]))
  lse, out = np.asarray(lse), np.asarray(out)
  assert empty.sum() == 5 and lse.shape == (B, T, N)
  np.testing.assert_allclose(lse[empty], np.broadcast_to(SINKS, (5, N)), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, expected, rtol=1e-5, atol=1e-5)
  assert np.all(out[empty] == 0)
