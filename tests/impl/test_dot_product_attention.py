"""jattn.dot_product_attention against a float64 NumPy reference and jax.nn."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import (EXPECTED, W_K, W_Q, W_V, X, f64, from_layout, make_qkv,
                     randn, random_mask, to_layout)
from tests.reference import numerical_grad, reference_attention, reference_mask

IMPLS = [None, "xla", "vmap"]
ATOL = RTOL = 1e-5
STATIC = ("scale", "is_causal", "local_window_size", "layout", "implementation",
          "dropout_rate", "return_weights")


@functools.lru_cache(maxsize=None)
def _jitted(static_items):
  return jax.jit(functools.partial(jattn.dot_product_attention,
                                   **dict(static_items)))


def run(q, k, v, bias=None, mask=None, *, jit=False, **kwargs):
  """Call dot_product_attention, optionally under jit (arrays traced)."""
  static = {name: kwargs.pop(name) for name in list(kwargs) if name in STATIC}
  if jit:
    fn = _jitted(tuple(sorted(static.items())))
  else:
    fn = functools.partial(jattn.dot_product_attention, **static)
  return fn(q, k, v, bias, mask, **kwargs)


# --------------------------------------------------------------------------
# Test cases: shapes and arguments shared with jax.nn.dot_product_attention.

def _case(name):
  """Build (q, k, v, kwargs) for a named case, deterministic per name."""
  spec = dict(CASES[name])
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  dims = dict(B=2, T=5, S=6, N=4, K=None, H=8, D=None)
  dims.update({d: spec.pop(d) for d in list(spec) if d in dims})
  q, k, v = make_qkv(rng, **dims)
  kwargs = {}
  for arg, value in spec.items():
    if arg == "bias":
      kwargs["bias"] = randn(rng, value)
    elif arg == "mask":
      kwargs["mask"] = random_mask(rng, value)
    elif arg in ("query_seq_lengths", "key_value_seq_lengths",
                 "q_segment_ids", "kv_segment_ids"):
      kwargs[arg] = np.asarray(value, np.int32)
    else:
      kwargs[arg] = value
  return q, k, v, kwargs


CASES = {
    "plain": dict(),
    "bias_full": dict(bias=(2, 4, 5, 6)),
    "bias_broadcast": dict(bias=(1, 1, 5, 6)),
    "bias_per_head": dict(bias=(1, 4, 1, 6)),
    "mask_batch": dict(mask=(2, 1, 5, 6)),
    "mask_full_and_bias": dict(mask=(2, 4, 5, 6), bias=(2, 1, 5, 6)),
    "scale": dict(scale=0.3),
    "causal_square": dict(T=6, S=6, is_causal=True),
    "causal_t_lt_s": dict(T=4, S=6, is_causal=True),
    "causal_t_gt_s": dict(T=6, S=4, is_causal=True),
    "q_lengths": dict(query_seq_lengths=[3, 5]),
    "kv_lengths": dict(key_value_seq_lengths=[2, 6]),
    "lengths_causal": dict(T=6, S=6, is_causal=True,
                           query_seq_lengths=[4, 6],
                           key_value_seq_lengths=[5, 3]),
    "window_int": dict(T=6, S=6, local_window_size=1),
    "window_left": dict(T=6, S=6, local_window_size=(2, 0)),
    "window_right": dict(T=5, S=6, local_window_size=(0, 2)),
    "gqa": dict(K=2, mask=(2, 4, 5, 6), bias=(1, 4, 5, 6)),
    "mqa": dict(K=1, bias=(2, 4, 5, 6), is_causal=True),
    "everything": dict(T=6, S=6, K=2, H=4, bias=(2, 4, 6, 6),
                       mask=(2, 1, 6, 6), is_causal=True,
                       local_window_size=(3, 1), query_seq_lengths=[6, 4],
                       key_value_seq_lengths=[5, 6], scale=0.4),
}


def _valid_rows(q, k, kwargs):
  """Bool [B, N, T]: query rows with at least one attendable key."""
  B, T, N, _ = q.shape
  S = k.shape[1]
  allowed = reference_mask(
      B, N, T, S, mask=kwargs.get("mask"), is_causal=kwargs.get("is_causal"),
      q_lengths=kwargs.get("query_seq_lengths"),
      kv_lengths=kwargs.get("key_value_seq_lengths"),
      window=kwargs.get("local_window_size"),
      q_segment_ids=kwargs.get("q_segment_ids"),
      kv_segment_ids=kwargs.get("kv_segment_ids"))
  return allowed.any(-1)


@functools.lru_cache(maxsize=None)
def _jax_nn(name):
  q, k, v, kwargs = _case(name)
  return np.asarray(jax.nn.dot_product_attention(q, k, v, **kwargs))


def _check_against_reference(out, q, k, v, kwargs, atol=ATOL, rtol=RTOL):
  want = reference_attention(q, k, v, **kwargs)
  assert out.shape == want.shape
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=atol,
                             rtol=rtol)
  valid = _valid_rows(q, k, kwargs)  # [B, N, T]
  dead = np.asarray(out).transpose(0, 2, 1, 3)[~valid]
  np.testing.assert_array_equal(dead, np.zeros_like(dead))


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_jax_nn_and_reference(name, implementation):
  q, k, v, kwargs = _case(name)
  out = run(q, k, v, implementation=implementation, **kwargs)
  assert out.dtype == jnp.float32
  _check_against_reference(out, q, k, v, kwargs)
  valid = _valid_rows(q, k, kwargs)
  ours = np.asarray(out).transpose(0, 2, 1, 3)[valid]
  theirs = _jax_nn(name).transpose(0, 2, 1, 3)[valid]
  np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
@pytest.mark.parametrize("name", ["plain", "mask_full_and_bias",
                                  "causal_t_gt_s", "lengths_causal",
                                  "window_left", "everything"])
def test_jit_matches_jax_nn_and_reference(name, implementation):
  q, k, v, kwargs = _case(name)
  out = run(q, k, v, implementation=implementation, jit=True, **kwargs)
  _check_against_reference(out, q, k, v, kwargs)
  valid = _valid_rows(q, k, kwargs)
  np.testing.assert_allclose(
      np.asarray(out).transpose(0, 2, 1, 3)[valid],
      _jax_nn(name).transpose(0, 2, 1, 3)[valid], atol=ATOL, rtol=RTOL)


def test_unbatched_default_layout_matches_jax_nn():
  rng = np.random.default_rng(20)
  q, k, v = make_qkv(rng, B=None, T=5, S=6, N=4, K=2, H=8)
  bias = randn(rng, (4, 5, 6))
  mask = random_mask(rng, (1, 5, 6))
  mask[..., 0] = True
  out = jattn.dot_product_attention(q, k, v, bias, mask, is_causal=True)
  assert out.shape == (5, 4, 8)
  want = jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)
  np.testing.assert_allclose(out, want, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(
      out, reference_attention(q, k, v, bias, mask, is_causal=True),
      atol=ATOL, rtol=RTOL)


def test_worked_example_through_dot_product_attention():
  q, k, v = (jnp.asarray(X @ w)[None, :, None, :] for w in (W_Q, W_K, W_V))
  out = jattn.dot_product_attention(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[0, :, 0, :], EXPECTED, atol=1e-4)


# --------------------------------------------------------------------------
# Beyond jax.nn: D != H, segment ids, layouts.

REF_CASES = {
    "value_depth": dict(D=3),
    "value_depth_gqa": dict(K=2, D=5, mask=(2, 4, 5, 6), bias=(2, 1, 5, 6),
                            is_causal=True),
    "segments": dict(T=6, S=6, q_segment_ids=[[0, 0, 1, 1, 1, 2],
                                              [3, 3, 3, 3, 4, 4]],
                     kv_segment_ids=[[0, 0, 1, 1, 1, 2],
                                     [3, 3, 3, 3, 4, 4]]),
    "segments_causal_gqa": dict(T=6, S=6, K=1, D=2, is_causal=True,
                                q_segment_ids=[[0, 0, 0, 1, 1, 1],
                                               [0, 1, 1, 1, 2, 2]],
                                kv_segment_ids=[[0, 0, 0, 1, 1, 1],
                                                [0, 1, 1, 1, 2, 2]]),
    "segments_cross": dict(T=4, S=6, q_segment_ids=[[1, 1, 2, 2], [0, 1, 0, 1]],
                           kv_segment_ids=[[1, 2, 1, 2, 2, 1],
                                           [1, 1, 1, 0, 0, 0]],
                           bias=(2, 4, 4, 6)),
    "segments_and_lengths": dict(T=6, S=6, q_segment_ids=[[0, 0, 1, 1, 2, 2]] * 2,
                                 kv_segment_ids=[[0, 0, 1, 1, 2, 2]] * 2,
                                 key_value_seq_lengths=[5, 6],
                                 local_window_size=(1, 1)),
}
CASES.update(REF_CASES)  # _case() looks names up in CASES


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("name", list(REF_CASES))
def test_matches_reference(name, implementation):
  q, k, v, kwargs = _case(name)
  out = run(q, k, v, implementation=implementation, **kwargs)
  _check_against_reference(out, q, k, v, kwargs)


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
@pytest.mark.parametrize("name", ["segments_causal_gqa", "segments_cross"])
def test_segments_jit(name, implementation):
  q, k, v, kwargs = _case(name)
  out = run(q, k, v, implementation=implementation, jit=True, **kwargs)
  _check_against_reference(out, q, k, v, kwargs)


def test_segment_ids_equal_explicit_mask():
  q, k, v, kwargs = _case("segments_cross")
  seg = run(q, k, v, **kwargs)
  q_ids, kv_ids = kwargs.pop("q_segment_ids"), kwargs.pop("kv_segment_ids")
  mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  explicit = run(q, k, v, mask=mask, **kwargs)
  np.testing.assert_allclose(seg, explicit, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(seg, reference_attention(
      q, k, v, mask=mask, **kwargs), atol=ATOL, rtol=RTOL)


LAYOUTS = ["BTNH", "BNTH", "BNHT", "NHBT", "TNH"]


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(layout, implementation):
  rng = np.random.default_rng(30)
  batched = "B" in layout
  B = 2 if batched else None
  q, k, v = make_qkv(rng, B=B, T=5, S=6, N=4, K=2, H=8, D=3)
  lead = (2,) if batched else ()
  mask = random_mask(rng, lead + (1, 5, 6))
  mask[..., 0, :] = False  # a fully masked query row
  bias = randn(rng, (4, 5, 6) if not batched else (1, 4, 5, 6))
  kwargs = dict(bias=bias, mask=mask, local_window_size=(4, 2))
  if batched:
    kwargs["query_seq_lengths"] = np.array([5, 3], np.int32)
  want, want_w = reference_attention(q, k, v, return_weights=True, **kwargs)
  out, weights = run(to_layout(q, layout), to_layout(k, layout),
                     to_layout(v, layout), layout=layout,
                     implementation=implementation, return_weights=True,
                     **kwargs)
  assert out.shape == to_layout(want, layout).shape
  np.testing.assert_allclose(from_layout(out, layout), want, atol=ATOL,
                             rtol=RTOL)
  # weights stay in logical [B, N, T, S] order whatever the layout
  assert weights.shape == want_w.shape
  np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layout", ["BNTH", "BNHT"])
def test_layouts_jit_causal(layout):
  rng = np.random.default_rng(31)
  q, k, v = make_qkv(rng, B=2, T=6, S=6, N=2, K=1, H=4, D=3)
  kwargs = dict(is_causal=True, key_value_seq_lengths=np.array([4, 6], np.int32))
  out = run(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout),
            layout=layout, jit=True, **kwargs)
  np.testing.assert_allclose(from_layout(out, layout),
                             reference_attention(q, k, v, **kwargs),
                             atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["everything", "segments_causal_gqa",
                                  "value_depth_gqa"])
def test_xla_and_vmap_agree(name):
  q, k, v, kwargs = _case(name)
  a = run(q, k, v, implementation="xla", jit=True, **kwargs)
  b = run(q, k, v, implementation="vmap", jit=True, **kwargs)
  np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
  _check_against_reference(b, q, k, v, kwargs)


# --------------------------------------------------------------------------
# Fully masked rows: zeros and finite gradients.

def _dead_row_case(source):
  rng = np.random.default_rng(40)
  T, S = (6, 3) if source == "window" else (5, 5)
  q, k, v = make_qkv(rng, B=2, T=T, S=S, N=2, K=1, H=4, D=3)
  bias = randn(rng, (2, 2, T, S))
  kwargs = {}
  if source == "mask":
    mask = np.ones((2, 2, T, S), bool)
    mask[0, 1, 2] = False
    mask[1, :, 4] = False
    kwargs["mask"] = mask
  elif source == "q_lengths":
    kwargs["query_seq_lengths"] = np.array([2, 5], np.int32)
  elif source == "kv_lengths_zero":
    kwargs["key_value_seq_lengths"] = np.array([0, 4], np.int32)
  elif source == "window":
    kwargs["local_window_size"] = (0, 0)  # rows 3..5 see no key
  elif source == "segments":
    kwargs["q_segment_ids"] = np.array([[1, 1, 2, 3, 3], [0, 0, 0, 0, 7]],
                                       np.int32)
    kwargs["kv_segment_ids"] = np.array([[1, 2, 2, 2, 1], [0, 0, 1, 1, 1]],
                                        np.int32)
  return q, k, v, bias, kwargs


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("source", ["mask", "q_lengths", "kv_lengths_zero",
                                    "window", "segments"])
def test_fully_masked_rows_zero_and_finite_grads(source, implementation):
  q, k, v, bias, kwargs = _dead_row_case(source)
  valid = _valid_rows(q, k, kwargs)
  assert not valid.all()  # the case really has dead rows
  out = run(q, k, v, bias, implementation=implementation, **kwargs)
  _check_against_reference(out, q, k, v, dict(kwargs, bias=bias))

  def loss(q, k, v, bias):
    return jnp.sum(run(q, k, v, bias, implementation=implementation,
                       **kwargs) ** 2)

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
  for g in grads:
    assert np.all(np.isfinite(g))
  dq, _, _, dbias = (np.asarray(g) for g in grads)
  dead = ~valid  # [B, N, T]
  np.testing.assert_array_equal(dq.transpose(0, 2, 1, 3)[dead], 0)
  np.testing.assert_array_equal(dbias[dead], 0)


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
def test_grads_match_numerical_reference(implementation):
  """Gradients against central differences of the float64 reference."""
  rng = np.random.default_rng(41)
  q, k, v = make_qkv(rng, B=1, T=3, S=4, N=2, K=1, H=2, D=3)
  bias = randn(rng, (1, 2, 3, 4))
  mask = np.ones((1, 1, 3, 4), bool)
  mask[0, 0, 1] = False          # a fully masked row
  mask[0, 0, 2, 1:3] = False
  seg_q = np.array([[0, 0, 1]], np.int32)
  seg_kv = np.array([[0, 1, 1, 1]], np.int32)
  kwargs = dict(mask=mask, is_causal=False, q_segment_ids=seg_q,
                kv_segment_ids=seg_kv, scale=0.7)
  cot = randn(rng, (1, 3, 2, 3))
  args = (q, k, v, bias)

  def loss(*a):
    return jnp.sum(run(*a, implementation=implementation, **kwargs) * cot)

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
  for i, g in enumerate(grads):
    def ref_loss(x, i=i):
      a = [np.asarray(t, np.float64) for t in args]
      a[i] = x
      return np.sum(reference_attention(*a, **kwargs) * cot)
    want = numerical_grad(ref_loss, args[i])
    np.testing.assert_allclose(g, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
@pytest.mark.parametrize("name", ["mask_full_and_bias", "mqa", "window_right",
                                  "q_lengths"])
def test_grads_match_jax_nn(name, implementation):
  q, k, v, kwargs = _case(name)
  bias = kwargs.pop("bias", None)
  if bias is None:
    bias = np.zeros((1, 1, q.shape[1], k.shape[1]), np.float32)
  cot = randn(np.random.default_rng(42), q.shape[:3] + (v.shape[-1],))

  def loss(fn):
    return lambda q, k, v, b: jnp.sum(fn(q, k, v, b, **kwargs) * cot)

  ours = jax.grad(loss(functools.partial(
      run, implementation=implementation, jit=True)), argnums=(0, 1, 2, 3))(
          q, k, v, bias)
  theirs = jax.grad(loss(jax.nn.dot_product_attention),
                    argnums=(0, 1, 2, 3))(q, k, v, bias)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------
# Low precision and large logits.


def _naive_low_precision(q, k, v, bias, mask):
  """Everything in the input dtype: how far a plain computation drifts."""
  dtype = q.dtype
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
  scale = jnp.asarray(1 / np.sqrt(q.shape[-1]), dtype)
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale + bias
  logits = jnp.where(mask, logits, jnp.asarray(-1e4, dtype))
  w = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("BNTS,BSNH->BTNH", w, v)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=["bf16", "f16"])
def test_low_precision(dtype, implementation):
  rng = np.random.default_rng(50)
  q, k, v = make_qkv(rng, B=2, T=5, S=6, N=4, K=2, H=8, D=8)
  q, k = 3 * q, 3 * k  # logits ~ +-30: where half-precision logits go wrong
  bias = randn(rng, (2, 1, 5, 6))
  mask = random_mask(rng, (2, 4, 5, 6))
  mask[..., 0] = True
  q, k, v, bias = (jnp.asarray(x, dtype) for x in (q, k, v, bias))
  out = run(q, k, v, bias, mask, implementation=implementation,
            is_causal=True)
  assert out.dtype == dtype
  # Reference in float64 on the rounded inputs.
  causal = np.tril(np.ones((5, 6), bool))
  want = reference_attention(f64(q), f64(k), f64(v), f64(bias),
                             mask & causal)
  naive = _naive_low_precision(q, k, v, bias, mask & causal)
  naive_err = np.max(np.abs(f64(naive) - want))
  err = np.max(np.abs(f64(out) - want))
  assert np.all(np.isfinite(f64(out)))
  # float32 logits/softmax: at most twice the naive error (the suite's rule),
  # and at logits this large clearly below it (logits left in half precision
  # would match the naive error).
  assert err <= 2 * naive_err, (err, naive_err)
  assert err <= 0.5 * naive_err, (err, naive_err)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
def test_large_logits_stay_finite(dtype, implementation):
  rng = np.random.default_rng(51)
  q = rng.uniform(-100, 100, (1, 4, 2, 4)).astype(np.float32)
  k = rng.uniform(-100, 100, (1, 6, 2, 4)).astype(np.float32)
  v = randn(rng, (1, 6, 2, 3))
  mask = np.ones((1, 2, 4, 6), bool)
  mask[0, 0, 1, :5] = False
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  out = run(q, k, v, None, mask, implementation=implementation)
  assert out.dtype == dtype
  assert np.all(np.isfinite(f64(out)))
  want = reference_attention(f64(q), f64(k), f64(v), mask=mask)
  tol = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2, jnp.float16: 3e-3}[dtype]
  np.testing.assert_allclose(f64(out), want, atol=tol, rtol=tol)
  grads = jax.grad(lambda q, k, v: jnp.sum(
      run(q, k, v, None, mask, implementation=implementation).astype(
          jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert g.dtype == dtype
    assert np.all(np.isfinite(f64(g)))


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
def test_large_logits_with_small_differences(dtype, implementation):
  """Logits ~5000 that differ by < 1: only float32 logits resolve them.

  Every input is exact in bf16/f16, so the float64 reference sees the same
  numbers; logits held in half precision would round all of them to one value.
  """
  delta = np.array([-2.0, -1.0, 0.0, 1.0, 2.0, 0.5], np.float32)
  q = np.zeros((1, 3, 1, 4), np.float32)
  q[0, :, 0, 0] = 100.0
  q[0, :, 0, 1] = [1.0, -1.0, 0.5]
  k = np.zeros((1, 6, 1, 4), np.float32)
  k[0, :, 0, 0] = 100.0
  k[0, :, 0, 1] = delta
  v = randn(np.random.default_rng(52), (1, 6, 1, 3))
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  out = run(q, k, v, implementation=implementation)
  assert out.dtype == dtype
  want = reference_attention(f64(q), f64(k), f64(v))
  tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}[dtype]
  np.testing.assert_allclose(f64(out), want, atol=tol, rtol=0)


# --------------------------------------------------------------------------
# return_weights

@pytest.mark.parametrize("implementation", IMPLS)
def test_return_weights(implementation):
  q, k, v, kwargs = _case("everything")
  out, weights = run(q, k, v, implementation=implementation,
                     return_weights=True, **kwargs)
  want, want_w = reference_attention(q, k, v, return_weights=True, **kwargs)
  assert weights.shape == (2, 4, 6, 6)
  np.testing.assert_allclose(out, want, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)
  valid = _valid_rows(q, k, kwargs)
  sums = np.asarray(weights).sum(-1)
  assert (~valid).any() and valid.any()
  np.testing.assert_allclose(sums[valid], 1.0, atol=1e-5)
  np.testing.assert_array_equal(sums[~valid], 0.0)
  plain = run(q, k, v, implementation=implementation, **kwargs)
  assert isinstance(plain, jax.Array)
  np.testing.assert_allclose(plain, out, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------
# Dropout

def _dropout_inputs():
  rng = np.random.default_rng(60)
  q, k, v = make_qkv(rng, B=2, T=4, S=5, N=2, K=1, H=4, D=3)
  mask = np.ones((2, 1, 4, 5), bool)
  mask[1, 0, 3] = False
  return q, k, v, mask


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
def test_dropout_rng_determinism(implementation):
  q, k, v, mask = _dropout_inputs()
  f = functools.partial(run, q, k, v, None, mask, jit=True, dropout_rate=0.5,
                        implementation=implementation)
  a = np.asarray(f(dropout_rng=jax.random.key(0)))
  b = np.asarray(f(dropout_rng=jax.random.key(0)))
  c = np.asarray(f(dropout_rng=jax.random.key(1)))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  no_drop = reference_attention(q, k, v, mask=mask)
  assert not np.allclose(a, no_drop, atol=1e-3)
  assert np.all(np.isfinite(a))
  np.testing.assert_array_equal(a[1, 3, :], 0)  # masked row stays zero
  d = np.asarray(f(dropout_rng=jax.random.PRNGKey(0)))  # raw uint32 keys too
  assert np.all(np.isfinite(d)) and not np.allclose(d, no_drop, atol=1e-3)


def test_dropout_rate_zero_is_identity():
  q, k, v, mask = _dropout_inputs()
  out = run(q, k, v, None, mask, dropout_rate=0.0,
            dropout_rng=jax.random.key(3))
  np.testing.assert_allclose(out, reference_attention(q, k, v, mask=mask),
                             atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("implementation, layout", [
    ("xla", "BTNH"), ("vmap", "BTNH"), ("vmap", "BNHT")])  # BNHT: the columns path
def test_dropout_drops_weights_with_inverted_scaling(implementation, layout):
  """With one-hot values, out = weights * keep / (1 - rate), keep in {0, 1}."""
  rate = 0.4
  rng = np.random.default_rng(61)
  B, T, S, N, H = 2, 4, 6, 2, 4
  q = randn(rng, (B, T, N, H))
  k = randn(rng, (B, S, N, H))
  v = np.broadcast_to(np.eye(S, dtype=np.float32)[None, :, None, :],
                      (B, S, N, S)).copy()
  to = (lambda x: x) if layout == "BTNH" else (lambda x: x.transpose(0, 2, 3, 1))
  out, weights = run(to(q), to(k), to(v), implementation=implementation, layout=layout,
                     dropout_rate=rate, dropout_rng=jax.random.key(7),
                     return_weights=True)
  want_w = reference_attention(q, k, v, return_weights=True)[1]
  np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)
  out = np.asarray(out, np.float64)
  dropped = out.transpose(0, 2, 1, 3) if layout == "BTNH" else out.transpose(0, 1, 3, 2)
  keep = dropped * (1 - rate) / want_w
  kept = np.isclose(keep, 1.0, atol=1e-4)
  zero = np.abs(dropped) < 1e-7
  assert np.all(kept | zero), keep
  assert 0.15 < zero.mean() < 0.65, zero.mean()


@pytest.mark.parametrize("implementation", ["xla", "vmap"])
def test_dropout_expectation_is_no_dropout_output(implementation):
  rate = 0.25
  q, k, v, mask = _dropout_inputs()
  keys = jax.random.split(jax.random.key(8), 400)
  sample = jax.jit(jax.vmap(lambda key: jattn.dot_product_attention(
      q, k, v, None, mask, dropout_rate=rate, dropout_rng=key,
      implementation=implementation)))
  outs = np.asarray(sample(keys), np.float64)
  mean = outs.mean(0)
  want = reference_attention(q, k, v, mask=mask)
  assert outs.std(0).max() > 0.05  # samples really differ
  np.testing.assert_allclose(mean, want, atol=0.15)
  slope = np.sum(mean * want) / np.sum(want * want)
  assert abs(slope - 1) < 0.05, slope
