"""flex_gpu reading and writing its tiles where they lie (jattn/_src/kernels/layout_specs.py):
whole tiles in a layout with tokens before features go into the kernels as the caller's
arrays, with no transpose or padding copy; values and gradients in interpret mode against
float64, in every such layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.reference_grads import reference_vjp

B, T, S, N, K, H = 2, 32, 64, 4, 2, 16  # whole tiles: 32 x 64, H a power of two
Q_IDS = np.stack([np.arange(T) // 9, np.arange(T) // 20])
KV_IDS = np.stack([np.arange(S) // 18, np.arange(S) // 40])
MASKS = dict(is_causal=True, q_segment_ids=Q_IDS, kv_segment_ids=KV_IDS)
# layout -> its letters' order as an einsum from "btnh" (tokens before features in each)
LAYOUTS = {"BTNH": "btnh", "BNTH": "bnth", "NTBH": "ntbh"}


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  return [r.standard_normal(shape).astype(np.float32)
          for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))]


def _to(layout, x):
  return jnp.asarray(np.einsum(f"btnh->{LAYOUTS[layout]}", x))


def _from(layout, x):
  return np.einsum(f"{LAYOUTS[layout]}->btnh", np.asarray(x, np.float64))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_and_gradients_in_place_against_float64(layout):
  q, k, v, d_out = _inputs()
  want_out, *want_grads = reference_vjp(q, k, v, d_out, **MASKS)[:4]

  def attention(q, k, v):
    return jattn.dot_product_attention(q, k, v, implementation="flex_gpu", layout=layout,
                                       **MASKS)

  with pallas_interpret():
    out, vjp = jax.vjp(attention, *(_to(layout, x) for x in (q, k, v)))
    grads = vjp(_to(layout, d_out))
  np.testing.assert_allclose(_from(layout, out), want_out, atol=2e-5)
  for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
    np.testing.assert_allclose(_from(layout, got), want, atol=5e-5, err_msg=name)


def test_without_a_batch_axis():
  q, k, v, d_out = (x[:1] for x in _inputs(seed=1))
  masks = dict(is_causal=True)
  want_out, *want_grads = reference_vjp(q, k, v, d_out, **masks)[:4]

  def attention(q, k, v):
    return jattn.dot_product_attention(q, k, v, implementation="flex_gpu", layout="TNH",
                                       **masks)

  with pallas_interpret():
    out, vjp = jax.vjp(attention, q[0], k[0], v[0])
    grads = vjp(jnp.asarray(d_out[0]))
  np.testing.assert_allclose(out, want_out[0], atol=2e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want[0], atol=5e-5)


def _kernel_operand_shapes(fn, *args):
  """The shapes of the first operand of each flex_gpu kernel in fn's jaxpr."""
  shapes = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        shapes.append(tuple(eqn.invars[0].aval.shape))
      for sub in _sub_jaxprs(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


def _sub_jaxprs(params):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


@pytest.mark.parametrize("aligned", [True, False])
def test_the_kernels_take_the_callers_arrays_when_the_tiles_are_whole(aligned):
  """BTNH with whole tiles: forward, dq and dk/dv kernels read q as it lies, [B, T, N, H]
  (no transpose to [B, N, T, H] before them); an unaligned T goes through padded copies."""
  q, k, v, _ = _inputs()
  if not aligned:
    q = q[:, :T - 3]

  def loss(q, k, v):
    return jnp.sum(jattn.dot_product_attention(q, k, v, implementation="flex_gpu",
                                               is_causal=True))

  with pallas_interpret():
    shapes = _kernel_operand_shapes(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert len(shapes) == 3, shapes  # forward, dq, dk/dv
  Tq = q.shape[1]
  if aligned:
    # the dk/dv kernel's first operand is q as well, in place
    assert shapes == [(B, Tq, N, H)] * 3, shapes
  else:  # padded copies: [B, N, Tp, H], and [B, K, G, Tp, H] for the dk/dv kernel
    assert shapes == [(B, N, T, H)] * 2 + [(B, K, N // K, T, H)], shapes


def test_gradients_leave_the_kernels_in_the_inputs_dtype():
  """bfloat16: dq, dk and dv are written by the kernels in bfloat16 (no float32 copy
  converted after them), and agree with float64."""
  q, k, v, d_out = _inputs(seed=2)
  want_out, *want_grads = reference_vjp(q, k, v, d_out, **MASKS)[:4]
  q16, k16, v16, d16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, d_out))

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation="flex_gpu", **MASKS)
    return jnp.sum(out.astype(jnp.float32) * d16.astype(jnp.float32))

  grad = jax.grad(loss, argnums=(0, 1, 2))
  with pallas_interpret():
    dtypes = []

    def walk(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
          dtypes.append([str(x.aval.dtype) for x in eqn.outvars[:2]])
        for sub in _sub_jaxprs(eqn.params):
          walk(sub)

    walk(jax.make_jaxpr(grad)(q16, k16, v16).jaxpr)
    grads = grad(q16, k16, v16)
  # forward (out, lse), dq (dq, its read gradients), dk/dv (dk, dv)
  assert dtypes == [["bfloat16", "float32"], ["bfloat16", "float32"],
                    ["bfloat16", "bfloat16"]], dtypes
  for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
    assert got.dtype == jnp.bfloat16
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2 * scale,
                               err_msg=name)
