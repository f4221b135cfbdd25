"""jattn under jax_enable_x64: float32 calls as without it, float64 calls in float64.

Under x64 a Python int in lax.div / lax.rem / dynamic_slice becomes int64 against the
kernels' int32 indices, and jnp.arange defaults to int64. On a CPU with
implementation=None the TPU and GPU kernels' programs are traced too, so before, a
float32 default call failed under x64; so did create_block_mask, the blockwise bias
gradient and the paged decode kernels. A float64 call with a score_mod failed (the mod
was traced on a float32 score), with sinks lost float64 precision, and a float64 decode
computed in float32.
References: float64 NumPy and plain float64 jnp autodiff, written here.
Letters: B T S N K H D.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.helpers import needs_api

B, T, N, K, H = 2, 64, 4, 2, 16


def _qkv(dtype=np.float32, T=T, H=H, heads=(N, K)):
  rng = np.random.default_rng(0)
  n, k = heads
  shapes = ((B, T, n, H), (B, T, k, H), (B, T, k, H))
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _dense(q, k, v, *, causal=True, bias=None, window=None, cap=None, sinks=None,
           scale=None):
  """Attention in plain jnp on whatever dtype it is given (float64 here), GQA."""
  G = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, G, axis=2) for x in (k, v))
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  x = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
  if cap is not None:
    x = cap * jnp.tanh(x / cap)
  if bias is not None:
    x = x + bias
  t, s = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None]
  visible = (s <= t) if causal else np.ones((q.shape[1], k.shape[1]), bool)
  if window is not None:
    visible = visible & (s >= t - window)
  x = jnp.where(visible, x, -jnp.inf)
  if sinks is not None:
    x = jnp.concatenate([x, jnp.broadcast_to(sinks[None, :, None, None],
                                             x.shape[:3] + (1,))], -1)
  weights = jax.nn.softmax(x, -1)[..., :k.shape[1]]
  return jnp.einsum("bnts,bsnd->btnd", weights, v)


def _as64(*arrays):
  return tuple(jnp.asarray(a, jnp.float64) for a in arrays)


def _value_and_dq(f, q, k, v):
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[:3] + v.shape[-1:]),
                  q.dtype)
  loss = lambda q: jnp.sum(f(q, k, v).astype(w.dtype) * w)
  return f(q, k, v), jax.grad(loss)(q)


@pytest.mark.parametrize("implementation", [None, pytest.param("flex_tpu",
                                                                marks=pytest.mark.slow)])
def test_float32_calls_under_x64_match_float64(implementation):
  q, k, v = _qkv()
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                  implementation=implementation)
  with jax.enable_x64(True):
    with pallas_interpret(implementation is not None):
      out, dq = _value_and_dq(f, q, k, v)
    want, want_dq = _value_and_dq(lambda q, k, v: _dense(q, k, v), *_as64(q, k, v))
  assert out.dtype == dq.dtype == jnp.float32
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(dq, want_dq, atol=5e-5)


def test_block_masks_and_the_blockwise_bias_gradient_under_x64():
  q, k, v = _qkv(T=128)
  bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, 128, 128)), jnp.float32)
  with jax.enable_x64(True):
    block_mask = jattn.create_block_mask(jattn.mods.sliding_window(16), None, None, 128, 128)
    out = jattn.dot_product_attention(q, k, v, block_mask=block_mask,
                                      implementation="blockwise")
    d_bias = jax.grad(lambda b: jnp.sum(jnp.sin(jattn.dot_product_attention(
        q, k, v, bias=b, is_causal=True, implementation="blockwise"))))(bias)
    q64, k64, v64, b64 = _as64(q, k, v, bias)
    want = _dense(q64, k64, v64, window=16)
    want_d_bias = jax.grad(lambda b: jnp.sum(jnp.sin(_dense(q64, k64, v64, bias=b))))(b64)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(d_bias, want_d_bias, atol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_float64_calls_with_a_score_mod_and_sinks_stay_float64(implementation):
  with jax.enable_x64(True):
    q, k, v = _qkv(np.float64)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float64)
    kw = dict(is_causal=True, score_mod=jattn.mods.soft_cap(3.0), sinks=sinks)
    out, dq = _value_and_dq(lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation=implementation, **kw), q, k, v)
    want, want_dq = _value_and_dq(lambda q, k, v: _dense(q, k, v, cap=3.0, sinks=sinks),
                                  q, k, v)
  assert out.dtype == dq.dtype == jnp.float64
  # float32 anywhere on the way would leave errors near 1e-7
  np.testing.assert_allclose(out, want, atol=1e-12)
  np.testing.assert_allclose(dq, want_dq, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["paged_tpu", "paged_gpu"])
def test_paged_decode_kernels_under_x64_match_float64(implementation):
  lengths = np.array([13, 6])
  rng = np.random.default_rng(3)
  k, v = (jnp.asarray(rng.standard_normal((B, 16, K, H)), jnp.float32) for _ in "kv")
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)  # each row's last token
  with jax.enable_x64(True):
    cache = jattn.paged.init_cache(B, 32, num_kv_heads=K, head_dim=H, page_size=4,
                                   num_pages=16, dtype=jnp.float32)
    cache = jattn.paged.append(cache, k, v, jnp.asarray(lengths, jnp.int32))
    with pallas_interpret():
      out = jattn.decode_attention(q, cache, is_causal=True, implementation=implementation)
    wants = [_dense(*_as64(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length]),
                    causal=False) for b, length in enumerate(lengths)]
  for b, want in enumerate(wants):
    np.testing.assert_allclose(out[b:b + 1], want, atol=2e-5, err_msg=f"row {b}")


@pytest.mark.parametrize("implementation", ["split", "xla"])
def test_float64_decode_stays_float64(implementation):
  """Before, decode computed a float64 query in float32 (errors near 1e-7)."""
  lengths = np.array([13, 6])
  rng = np.random.default_rng(4)
  with jax.enable_x64(True):
    k, v = (jnp.asarray(rng.standard_normal((B, 16, K, H)), jnp.float64) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float64)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float64)
    cache = jattn.paged.init_cache(B, 32, num_kv_heads=K, head_dim=H, page_size=4,
                                   num_pages=16, dtype=jnp.float64)
    cache = jattn.paged.append(cache, k, v, jnp.asarray(lengths, jnp.int32))
    # (a scale float32 cannot hold: it was rounded before)
    out = jattn.decode_attention(q, cache, score_mod=jattn.mods.soft_cap(3.0), sinks=sinks,
                                 scale=0.3, implementation=implementation)
    wants = [_dense(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length], causal=False,
                    cap=3.0, sinks=sinks, scale=0.3) for b, length in enumerate(lengths)]
  assert out.dtype == jnp.float64
  for b, want in enumerate(wants):
    np.testing.assert_allclose(out[b:b + 1], want, atol=1e-12, err_msg=f"row {b}")


@pytest.mark.slow
@pytest.mark.parametrize("implementation, heads, x64", [
    ("flex_mgpu", (4, 2), "context"),
    # jax's Mosaic GPU interpreter runs a kernel of several warpgroups on threads of its
    # own, which do not see a thread's `jax.enable_x64` context: it traces the
    # warp-specialised kernel's loops with x64 on and lowers them with it off, and fails
    # to verify (jax 0.12.0.1; flex_mgpu, one warpgroup, runs on the caller's thread).
    # So x64 is switched on for the process. With grouped heads (N = 4, K = 2) the
    # interpreted program then stalled, in each of three runs: the consumers wait at the
    # side-input barrier and the producer's thread, inside its XLA program, never issues
    # the copies (not understood; with x64 off the same call ran). Thorough, without
    # grouped heads, so that a stall cannot hang the default tier.
    pytest.param("flex_mgpu_ws", (4, 4), "process", marks=pytest.mark.thorough)])
def test_mosaic_gpu_kernels_under_x64_match_float64(implementation, heads, x64):
  q, k, v = _qkv(jnp.bfloat16, H=64, heads=heads)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                  implementation=implementation)
  was = jax.config.jax_enable_x64
  switch = jax.enable_x64(True) if x64 == "context" else contextlib.nullcontext()
  if x64 == "process":
    jax.config.update("jax_enable_x64", True)
  try:
    with switch, pallas_interpret():
      out = f(q, k, v)
      want = _dense(*_as64(q, k, v))
  except ValueError as error:
    if "InterpretGPUParams" in str(error):  # jax 0.10 has no Mosaic GPU interpreter
      pytest.skip(str(error))
    raise
  finally:
    jax.config.update("jax_enable_x64", was)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)


@needs_api("pallas_mha")
def test_jaxs_pallas_kernel_refuses_its_masks_under_x64_by_name():
  q, k, v = _qkv()
  with jax.enable_x64(True), pallas_interpret(), pytest.raises(
      ValueError, match="implementation='pallas' cannot run this call: under jax_enable_x64"):
    jattn.dot_product_attention(q, k, v, is_causal=True, implementation="pallas")
