"""Ring attention in float32, bfloat16 and float16, and under jax.vmap + jax.jit,
on 8 simulated CPU devices, against the float64 NumPy reference (values and the
plainly written gradient of tests/reference_grads.py).

Run by tests/multidevice/test_ring.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Prints one "ok  " or "FAIL"
line per case and exits non-zero on any failure. The low-precision rule is the
suite's: error at most twice that of a naive computation in the input dtype.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jattn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from reference_grads import reference_vjp  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

B, T, N, K, H = 2, 80, 4, 2, 8  # 10 tokens per device: zig-zag chunks of 5
SIZES = jattn.BlockSizes(q=2, kv=3)  # neither divides a chunk; key blocks start mid query block
LENGTHS = np.array([71, 7], np.int32)
# float32: both errors are rounding noise; on top, the suite's float32 tolerance
# relative to the largest value (the ring adds an lse combination per step, whose
# rounding grows with the logits, here up to ~20).
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 0.0, jnp.float16: 0.0}


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def naive(q, k, v):
  """Causal attention with kv lengths, every step in the input dtype."""
  kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, kk) * jnp.asarray(1 / np.sqrt(H), q.dtype)
  allowed = (jnp.tril(jnp.ones((T, T), bool))[None, None]
             & (jnp.arange(T)[None, :] < jnp.asarray(LENGTHS)[:, None])[:, None, None, :])
  logits = jnp.where(allowed, logits, jnp.asarray(-1e4, q.dtype))
  return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), vv)


def values_and_grads(fn, q, k, v, d_out):
  out, pullback = jax.vjp(fn, q, k, v)
  return [np.asarray(x) for x in (out,) + pullback(d_out)]


def report(name, errors, bounds):
  ok = all(e <= b for e, b in zip(errors, bounds))
  print(f"{'ok  ' if ok else 'FAIL'} {name}: max |err| out, dq, dk, dv = "
        + ", ".join(f"{e:.1e} (<= {b:.1e})" for e, b in zip(errors, bounds)), flush=True)
  return ok


def main():
  assert jax.device_count() == 8, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  rng = np.random.default_rng(0)
  base = [rng.standard_normal(s) * c for s, c in (
      ((B, T, N, H), 2.0), ((B, T, K, H), 2.0), ((B, T, K, H), 1.0), ((B, T, N, H), 1.0))]
  ring = lambda q, k, v: jattn.ring_attention(
      q, k, v, mesh=mesh, is_causal=True, key_value_seq_lengths=jnp.asarray(LENGTHS),
      block_sizes=SIZES)
  ok = True
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    q, k, v, d_out = (jnp.asarray(x, dtype) for x in base)
    want = reference_vjp(*(f64(x) for x in (q, k, v, d_out)), is_causal=True,
                         key_value_seq_lengths=LENGTHS)
    got = values_and_grads(jax.jit(ring), q, k, v, d_out)
    plain = values_and_grads(jax.jit(naive), q, k, v, d_out)
    ok &= all(g.dtype == dtype for g in got)
    errors = [np.max(np.abs(f64(g) - w)) for g, w in zip(got, want)]
    bounds = [2 * np.max(np.abs(f64(p) - w)) + RTOL[dtype] * np.max(np.abs(w))
              for p, w in zip(plain, want)]
    ok &= report(f"ring {jnp.dtype(dtype).name}, causal + lengths, GQA", errors, bounds)

  # jax.vmap over an extra leading axis, under jit (float32)
  E = 2
  q, k, v, d_out = (jnp.asarray(np.stack([x, x[:, ::-1]]), jnp.float32) for x in base)
  one = lambda q, k, v, d: values_and_grads_traced(ring, q, k, v, d)
  got = [np.asarray(x) for x in jax.jit(jax.vmap(one))(q, k, v, d_out)]
  for e in range(E):
    want = reference_vjp(q[e], k[e], v[e], d_out[e], is_causal=True,
                         key_value_seq_lengths=LENGTHS)
    errors = [np.max(np.abs(g[e] - w)) for g, w in zip(got, want)]
    bounds = [1e-5 * (1 + np.max(np.abs(w))) for w in want]
    ok &= report(f"ring under jax.vmap + jax.jit, example {e}", errors, bounds)
  sys.exit(0 if ok else 1)


def values_and_grads_traced(fn, q, k, v, d_out):
  out, pullback = jax.vjp(fn, q, k, v)
  return (out,) + pullback(d_out)


if __name__ == "__main__":
  main()
