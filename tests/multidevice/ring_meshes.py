"""Ring attention on meshes made the jax 0.10 way (`jax.make_mesh`, Explicit or Auto axes),
with inputs unsharded, sharded along the sequence, or along batch or heads.

Run by tests/test_ring.py in a subprocess on 8 simulated CPU devices. Each case
compares values and gradients of q, k, v, under jax.jit, with
jax.nn.dot_product_attention on unsharded copies (an independent reference).
Prints "ok  name" / "FAIL name"; exits non-zero on a failure or an exception.
"quick" (the CI tier): the four Explicit-axis cases that failed before resharding
(unsharded inputs, set_mesh, batch-sharded inputs, the 3-axis mesh); else all ten.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jattn

jax.config.update("jax_default_matmul_precision", "highest")

B, T, N, K, H = 2, 32, 4, 2, 8
ATOL = 2e-5


QUICK = {"Explicit seq axis, unsharded inputs",
         "Explicit seq axis, implementation='ring' under jax.set_mesh",
         "Explicit data x seq, inputs sharded along B, batch_axis_name='data'",
         "Explicit data x model x seq under jax.set_mesh"}


def check(name, ring_fn, arrays, **kwargs) -> bool:
  """ring_fn(q, k, v) on `arrays` (sharded as given) against jax.nn on unsharded copies."""
  if "quick" in sys.argv and name not in QUICK:
    return True
  plain = [jnp.asarray(np.asarray(x)) for x in arrays]
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, N, H)), jnp.float32)

  def values_and_grads(fn, xs):
    out, pullback = jax.vjp(jax.jit(fn), *xs)
    return [np.asarray(out)] + [np.asarray(g) for g in pullback(cot)]

  try:
    out = jax.jit(ring_fn)(*arrays)  # laid out as the query came in
    want_sharding = getattr(jax.typeof(arrays[0]).sharding, "spec", None)
    assert getattr(jax.typeof(out).sharding, "spec", None) == want_sharding, (
        jax.typeof(out), jax.typeof(arrays[0]))
    got = values_and_grads(ring_fn, arrays)
  except Exception as e:  # a failing case names itself, the others still run
    print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return False
  want = values_and_grads(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kwargs), plain)
  errors = [float(np.max(np.abs(a - b))) for a, b in zip(got, want)]
  ok = all(e <= ATOL for e in errors)
  print(f"{'ok  ' if ok else 'FAIL'} {name}: max |err| out, dq, dk, dv = "
        + ", ".join(f"{e:.1e}" for e in errors), flush=True)
  return ok


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in "kv")
  explicit, auto = (AxisType.Explicit,), (AxisType.Auto,)
  ok = True
  for kind, types in (("Explicit", explicit), ("Auto", auto)):
    mesh = jax.make_mesh((8,), ("seq",), axis_types=types)
    ring = lambda q, k, v, mesh=mesh: jattn.ring_attention(q, k, v, mesh=mesh,
                                                          axis_name="seq", is_causal=True)
    ok &= check(f"{kind} seq axis, unsharded inputs", ring, (q, k, v), is_causal=True)
    on_seq = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    ok &= check(f"{kind} seq axis, inputs sharded along T", ring, on_seq, is_causal=True)

    with jax.set_mesh(mesh):
      ok &= check(f"{kind} seq axis, implementation='ring' under jax.set_mesh",
                  lambda q, k, v: jattn.dot_product_attention(
                      q, k, v, is_causal=True, implementation="ring"), (q, k, v), is_causal=True)

  grid = jax.make_mesh((2, 4), ("data", "seq"), axis_types=explicit * 2)
  on_batch = [jax.device_put(x, NamedSharding(grid, P("data"))) for x in (q, k, v)]
  ok &= check("Explicit data x seq, inputs sharded along B, batch_axis_name='data'",
              lambda q, k, v: jattn.ring_attention(q, k, v, mesh=grid, axis_name="seq",
                                                   batch_axis_name="data"), on_batch)
  ok &= check("Explicit data x seq, inputs sharded along B, batch not sharded by the ring",
              lambda q, k, v: jattn.ring_attention(q, k, v, mesh=grid, axis_name="seq"),
              on_batch)
  heads = jax.make_mesh((2, 4), ("model", "seq"), axis_types=explicit * 2)
  on_heads = [jax.device_put(x, NamedSharding(heads, P(None, None, "model"))) for x in (q, k, v)]
  ok &= check("Explicit model x seq, inputs sharded along heads, head_axis_name='model'",
              lambda q, k, v: jattn.ring_attention(q, k, v, mesh=heads, axis_name="seq",
                                                   head_axis_name="model", is_causal=True),
              on_heads, is_causal=True)

  cube = jax.make_mesh((2, 2, 2), ("data", "model", "seq"), axis_types=explicit * 3)
  with jax.set_mesh(cube):
    ok &= check("Explicit data x model x seq under jax.set_mesh",
                lambda q, k, v: jattn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="ring"), (q, k, v), is_causal=True)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
