"""Forward-mode derivatives: Hessian-vector products (jax.jvp of jax.grad) and jax.hessian
through every jattn implementation, against plain float64 jnp autodiff written here.

A Pallas call has no JVP rule, so jattn's kernels take each pass's tangent from the
blockwise loop (jattn/_src/kernels/forward_mode.py). On a CPU with implementation=None
the program holds the TPU and GPU kernels' branches too, and JAX differentiates them all:
before, any Hessian-vector product of a default call failed there. JAX takes no forward
mode of a custom-VJP function itself (plain jax.jvp), nor any of jax's own kernels: those
failures carry a note saying what does work.
Letters: B T S N K H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret

B, T, S, N, K, H, D = 1, 40, 72, 4, 2, 16, 8
CAP = 20.0


def _inputs():
  rng = np.random.default_rng(0)
  arrays = dict(q=(B, T, N, H), k=(B, S, K, H), v=(B, S, K, D), slopes=(N,), sinks=(N,))
  primals = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for name, shape in arrays.items()}
  tangents = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
              for name, shape in arrays.items()}
  return primals, tangents


# score_mods: a per-head slope read from a captured array (it gets gradients), and a
# soft-cap. (Both in one mod, XLA:CPU at --xla_backend_optimization_level=0, the tests'
# flag, makes NaN in the compiled blockwise HVP, on jax 0.10 and 0.12; evaluated op by
# op, or compiled at the default level, it is finite and right: not jattn's arithmetic.)
MODS = ("slopes", "soft_cap")


def _jattn_loss(implementation, mod):
  def loss(a):
    if mod == "slopes":
      score_mod = lambda x, b, n, t, s: x - a["slopes"][n] * (t - s).astype(x.dtype) / 8
    else:
      score_mod = jattn.mods.soft_cap(CAP)
    out = jattn.dot_product_attention(a["q"], a["k"], a["v"], is_causal=True,
                                      score_mod=score_mod, sinks=a["sinks"],
                                      implementation=implementation)
    return jnp.sum(jnp.sin(out))
  return loss


def _dense_loss(a, mod):
  """The same function in plain jnp, run in float64: no jattn."""
  G = N // K
  k, v = (jnp.repeat(a[x], G, axis=2) for x in "kv")
  x = jnp.einsum("btnh,bsnh->bnts", a["q"], k) / np.sqrt(H)
  t, s = jnp.arange(T)[:, None], jnp.arange(S)[None]
  if mod == "slopes":
    logits = x - a["slopes"][None, :, None, None] * (t - s).astype(x.dtype) / 8
  else:
    logits = CAP * jnp.tanh(x / CAP)
  logits = jnp.where(s <= t, logits, -jnp.inf)
  sinks = jnp.broadcast_to(a["sinks"][None, :, None, None], logits.shape[:3] + (1,))
  weights = jax.nn.softmax(jnp.concatenate([logits, sinks], -1), -1)[..., :-1]
  return jnp.sum(jnp.sin(jnp.einsum("bnts,bsnd->btnd", weights, v)))


def _dense_causal(q, k, v):
  """Causal attention in plain jnp (T <= S, grouped heads), for float64."""
  G = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, G, axis=2) for x in (k, v))
  x = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  t, s = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None]
  weights = jax.nn.softmax(jnp.where(s <= t, x, -jnp.inf), -1)
  return jnp.einsum("bnts,bsnd->btnd", weights, v)


def _hvp_reference(primals, tangents, mod):
  with jax.enable_x64(True):
    as64 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tree)
    loss = lambda a: _dense_loss(a, mod)
    return jax.tree.map(np.asarray, jax.jvp(jax.grad(loss), (as64(primals),),
                                            (as64(tangents),))[1])


@pytest.mark.parametrize("implementation,mod", [
    ("xla", "slopes"), ("blockwise", "slopes"), ("blockwise", "soft_cap"), (None, "slopes"),
    (None, "soft_cap"), pytest.param("flex_tpu", "slopes", marks=pytest.mark.slow),
    pytest.param("flex_gpu", "soft_cap", marks=pytest.mark.slow)])
def test_hessian_vector_products_match_float64(implementation, mod):
  primals, tangents = _inputs()
  loss = _jattn_loss(implementation, mod)
  with pallas_interpret(implementation in ("flex_tpu", "flex_gpu")):
    hvp = jax.jit(lambda p, t: jax.jvp(jax.grad(loss), (p,), (t,))[1])(primals, tangents)
  want = _hvp_reference(primals, tangents, mod)
  for name in primals:
    np.testing.assert_allclose(hvp[name], want[name], atol=5e-5, rtol=1e-4, err_msg=name)


def test_hessian_of_a_default_call_matches_float64():
  """jax.hessian (forward over reverse) of a tiny default call on a CPU, whose program
  holds the TPU and GPU kernels as well."""
  q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 3, 2, 4)), jnp.float32)
  loss = lambda q: jnp.sum(jnp.sin(jattn.dot_product_attention(q, q, q, is_causal=True)))
  got = jax.hessian(loss)(q)
  with jax.enable_x64(True):
    dense = lambda q: jnp.sum(jnp.sin(_dense_causal(q, q, q)))
    want = np.asarray(jax.hessian(dense)(jnp.asarray(q, jnp.float64)))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_plain_forward_mode_of_xla_matches_float64_and_of_blockwise_says_what_works():
  primals, tangents = _inputs()
  q, k, v = (primals[x] for x in "qkv")
  t_q = tangents["q"]
  f = lambda implementation: lambda q: jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation)
  got = jax.jvp(f("xla"), (q,), (t_q,))[1]
  with jax.enable_x64(True):
    dense = lambda q: _dense_causal(q, *(jnp.asarray(x, jnp.float64) for x in (k, v)))
    want = np.asarray(jax.jvp(dense, (jnp.asarray(q, jnp.float64),),
                              (jnp.asarray(t_q, jnp.float64),))[1])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  with pytest.raises(TypeError, match="forward-mode") as error:
    jax.jvp(f("blockwise"), (q,), (t_q,))
  assert "implementation='xla' has one" in "\n".join(error.value.__notes__)


def test_forward_over_reverse_through_jaxs_own_kernel_names_it():
  q = jnp.ones((1, 128, 2, 16), jnp.float32)
  loss = lambda q: jnp.sum(jattn.dot_product_attention(q, q, q, implementation="splash"))
  with pallas_interpret(), pytest.raises(NotImplementedError) as error:
    jax.jvp(jax.grad(loss), (q,), (q,))
  note = "\n".join(error.value.__notes__)
  assert "'splash' on cpu" in note and "name one of jattn's" in note, note


@pytest.mark.slow
def test_hessian_vector_product_through_the_ring_with_kernel_steps_matches_float64():
  """"ring" (one device here) runs each step in the flex_tpu kernel where it plans one
  (interpreted on the CPU); each step's tangent comes from the blockwise step."""
  primals, tangents = _inputs()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  with jax.set_mesh(mesh), pallas_interpret(), jattn.explain_calls() as calls:
    hvp = jax.jvp(jax.grad(_jattn_loss("ring", "slopes")), (primals,), (tangents,))[1]
  assert calls[0].choices["cpu"].plan.implementation == "flex_tpu", calls[0]
  want = _hvp_reference(primals, tangents, "slopes")
  for name in primals:
    np.testing.assert_allclose(hvp[name], want[name], atol=5e-5, rtol=1e-4, err_msg=name)
