"""Every implementation in every dtype, and blockwise under jax.vmap and jax.jit.

The rule for low precision (as in test_dot_product_attention.py): against a
float64 reference on the rounded inputs, an implementation's error is at most
about twice that of a naive computation held entirely in the input dtype. Where
logits are large, float32 logits make it clearly better than the naive one, so
logits (or the softmax) left in half precision fail. Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.reference_grads import reference_vjp

B, T, S, N, K, H = 2, 12, 10, 4, 2, 16
BS = jattn.BlockSizes(q=5, kv=3)  # divides neither T nor S
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
IMPLS = ["xla", "vmap", "blockwise"]
# float32: both errors are rounding noise; the suite's float32 tolerance on top.
SLACK = {"f32": 1e-5, "bf16": 0.0, "f16": 0.0}


def _inputs(dtype, logit_scale=3.0, seed=0):
  """q, k, v, d_out in `dtype`: q and k scaled so logits reach ~ +-30."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)) * logit_scale
  k = rng.standard_normal((B, S, K, H)) * logit_scale
  v, d_out = rng.standard_normal((B, S, K, H)), rng.standard_normal((B, T, N, H))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, d_out))


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _naive(q, k, v):
  """Causal attention with every step in the input dtype."""
  kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, kk) * jnp.asarray(1 / np.sqrt(H), q.dtype)
  logits = jnp.where(jnp.tril(jnp.ones((T, S), bool)), logits, jnp.asarray(-1e4, q.dtype))
  return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), vv)


def _values_and_grads(fn, q, k, v, d_out):
  out, pullback = jax.vjp(fn, q, k, v)
  return (out,) + pullback(d_out)


@pytest.fixture(scope="module")
def naive_errors():
  """Per dtype: max |naive - float64 reference| of out, d_query, d_key, d_value."""
  errors = {}
  for name, dtype in DTYPES.items():
    q, k, v, d_out = _inputs(dtype)
    got = jax.jit(_values_and_grads, static_argnums=0)(_naive, q, k, v, d_out)
    want = reference_vjp(*(_f64(x) for x in (q, k, v, d_out)), is_causal=True)
    errors[name] = [np.max(np.abs(_f64(g) - w)) for g, w in zip(got, want)]
  return errors


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_error_at_most_twice_naive(dtype, impl, naive_errors):
  q, k, v, d_out = _inputs(DTYPES[dtype])
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl,
      block_sizes=BS if impl == "blockwise" else None)
  got = jax.jit(_values_and_grads, static_argnums=0)(fn, q, k, v, d_out)
  want = reference_vjp(*(_f64(x) for x in (q, k, v, d_out)), is_causal=True)
  for label, g, w, naive in zip(("out", "d_query", "d_key", "d_value"), got, want,
                                naive_errors[dtype]):
    assert g.dtype == DTYPES[dtype], label
    err = np.max(np.abs(_f64(g) - w))
    assert err <= 2 * naive + SLACK[dtype], (label, err, naive)
    if dtype != "f32" and label == "out":
      # float32 logits and softmax: well under the naive error at logits ~ +-30
      assert err <= 0.5 * naive, (label, err, naive)


# ----------------------------------------------------------------- vmap and jit

def test_blockwise_under_vmap_and_jit():
  """jax.vmap over an extra leading axis (and over per-example lengths), under jit,
  values and gradients against the float64 reference of each example."""
  E = 3  # the vmapped axis
  rng = np.random.default_rng(5)
  q, k, v, d_out = (rng.standard_normal((E,) + shape).astype(np.float32) for shape in (
      (B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
  kv_lengths = np.array([[10, 4], [7, 1], [0, 9]], np.int32)  # [E, B]

  def one(q, k, v, lengths, d_out):
    fn = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths,
        implementation="blockwise", block_sizes=BS)
    return _values_and_grads(fn, q, k, v, d_out)
  got = jax.jit(jax.vmap(one))(q, k, v, kv_lengths, d_out)
  for e in range(E):
    want = reference_vjp(q[e], k[e], v[e], d_out[e], is_causal=True,
                         key_value_seq_lengths=kv_lengths[e])
    for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
      np.testing.assert_allclose(g[e], w, rtol=1e-5, atol=1e-5, err_msg=f"{label} {e}")


# ----------------------------------------------------------------- grouped heads

def _shapes_in(jaxpr):
  """Every intermediate's shape in a jaxpr, sub-jaxprs (scan, cond, custom_vjp) included."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield getattr(var.aval, "shape", ())
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _shapes_in(inner)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_heads_do_not_copy_key_and_value(impl):
  """No intermediate as large as K/V repeated over the G query heads of each kv head
  ([B, S, N, H] or any blocked form of it), forward or backward. T is short, so
  the logits stay below that size too."""
  T, S, N, K, H = 2, 40, 6, 2, 8  # G = 3
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, S, K, H)), jnp.float32) for _ in range(2))
  fn = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl,
      block_sizes=jattn.BlockSizes(q=2, kv=8) if impl == "blockwise" else None))
  copy = S * N * H  # numel of one K/V copy per query head
  for f in (fn, jax.grad(fn, argnums=(0, 1, 2))):
    biggest = max(int(np.prod(s)) for s in _shapes_in(jax.make_jaxpr(f)(q, k, v).jaxpr))
    assert biggest < copy, (impl, biggest, copy)


# ----------------------------------------------------------------- float64

@pytest.mark.parametrize("impl", IMPLS)
def test_float64_stays_float64(impl):
  """With x64 enabled, float64 inputs are computed in float64 throughout (logits too):
  values and gradients agree with the float64 reference to ~1e-12."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.float64) for s in (
        (B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    fn = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl,
        block_sizes=BS if impl == "blockwise" else None)
    got = _values_and_grads(fn, q, k, v, d_out)
    want = reference_vjp(q, k, v, d_out, is_causal=True)
    for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
      assert g.dtype == jnp.float64, label
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-10, err_msg=label)


@pytest.mark.parametrize("is_causal", [False, pytest.param(True, marks=pytest.mark.thorough)])
def test_float64_with_the_default_implementation(is_causal):
  """implementation=None traces every platform's branch, so no branch may take a kernel
  that cannot run float64 (jax's GPU kernel could not): values and gradients against
  the float64 reference, with T = S, where every fused kernel's shape rules are met."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(8)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.float64) for s in (
        (B, 8, N, H), (B, 8, K, H), (B, 8, K, H), (B, 8, N, H)))
    fn = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=is_causal)
    got = _values_and_grads(fn, q, k, v, d_out)
    want = reference_vjp(q, k, v, d_out, is_causal=is_causal)
    for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
      assert g.dtype == jnp.float64, label
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-10, err_msg=label)
    for platform in ("cpu", "tpu", "cuda"):
      assert jattn.explain(q, k, v, is_causal=is_causal).implementation(platform) in (
          "xla", "blockwise"), platform
