"""Ring attention with mask_mod, score_mod and sinks on 8 simulated CPU devices,
against single-device "xla" (values and gradients, captured arrays and sinks included).

Run by tests/multidevice/test_ring_mods.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 ("quick": two of the three
cases, for the default tier). Exits non-zero on any mismatch.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tests.multidevice import compare
import jattn
from jattn import mods

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 3e-5  # float32, relative to the largest reference entry (at least 1)


def check(name, ring_fn, ref_fn, arrays):
  return compare.check(name, ring_fn, ref_fn, arrays, tol=TOL, relative=True)


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  B, T, N, K, H, D = 2, 32, 4, 2, 8, 6
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32)
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=-1), jnp.int32)
  slopes = jnp.asarray(rng.standard_normal(N), jnp.float32)
  table = jnp.asarray(rng.standard_normal((N, 9)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  seq = Mesh(np.array(jax.devices()), ("seq",))
  ok = True

  # zig-zag order: a device's positions are not contiguous; the mods must see global ones
  kw = lambda sl, sk: dict(is_causal=True, mask_mod=mods.document(ids, ids),
                           score_mod=mods.alibi(sl), sinks=sk)
  ring = lambda q, k, v, sl, sk: jattn.ring_attention(q, k, v, mesh=seq, **kw(sl, sk))
  ref = lambda q, k, v, sl, sk: jattn.dot_product_attention(q, k, v, implementation="xla",
                                                            **kw(sl, sk))
  ok &= check("causal zig-zag + document + alibi + sinks", ring, ref, (q, k, v, slopes, sinks))

  if "quick" not in sys.argv:  # contiguous, several blocks per device, per-head window
    per_head = lambda b, n, t, s: (s <= t + 1) & (s >= t - 3 - 2 * n)
    kw2 = lambda tb: dict(mask_mod=per_head, score_mod=mods.relative_bias(tb))
    ring = lambda q, k, v, tb: jattn.ring_attention(
        q, k, v, mesh=seq, block_sizes=jattn.BlockSizes(q=2, kv=3), **kw2(tb))
    ref = lambda q, k, v, tb: jattn.dot_product_attention(q, k, v, implementation="xla",
                                                          **kw2(tb))
    ok &= check("per-head window + relative_bias, 2x3 blocks", ring, ref, (q, k, v, table))

  with jax.set_mesh(seq):  # implementation="ring" inside jit, sinks traced
    kw3 = lambda sk: dict(mask_mod=mods.chunked(8), score_mod=mods.soft_cap(2.0), sinks=sk)
    ring = jax.jit(lambda q, k, v, sk: jattn.dot_product_attention(
        q, k, v, implementation="ring", **kw3(sk)))
    ref = lambda q, k, v, sk: jattn.dot_product_attention(q, k, v, implementation="xla", **kw3(sk))
    ok &= check("implementation='ring' in jit: chunked + soft_cap + sinks", ring, ref,
                (q, k, v, sinks))
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
