"""Ring attention against single-device attention on 8 simulated CPU devices.

Run by tests/multidevice/test_ring.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, so that the rest of the
suite keeps one device. Exits non-zero, naming the case, on any mismatch.
"quick" (the default tier): 7 of the 12 checks, the lengths with several blocks per
device in contiguous order (zig-zag in the 2x2x2 case); the full set adds the plain
non-causal, causal zig-zag and causal contiguous cases, the lengths with several
blocks in zig-zag order, and the unbatched layout TNH.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tests.multidevice import compare
import jattn

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

ATOL = 2e-5  # float32, values and gradients


def transpose_to(x, layout):
  src = "BTNH" if len(layout) == 4 else "TNH"
  return jnp.transpose(x, [src.index(c) for c in layout])


def check(name, ring_fn, ref_fn, arrays, eager=False):
  return compare.check(name, ring_fn, ref_fn, arrays, tol=ATOL, eager=eager)


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  B, T, N, K, H, D = 2, 32, 4, 2, 8, 6
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32)
  lengths = dict(query_seq_lengths=jnp.array([29, 5], jnp.int32),
                 key_value_seq_lengths=jnp.array([17, 0], jnp.int32))
  segments = dict(q_segment_ids=jnp.asarray(np.repeat([[0, 1, 1, 2]], B, 0).repeat(T // 4, 1)),
                  kv_segment_ids=jnp.asarray(np.repeat([[0, 1, 1, 2]], B, 0).repeat(T // 4, 1)))
  seq = Mesh(np.array(jax.devices()), ("seq",))
  cube = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "model", "seq"))

  lengths_blocks = ("causal + lengths (a row with no key), several blocks per device", seq,
                    dict(is_causal=True, **lengths), dict(block_sizes=jattn.BlockSizes(q=2, kv=3)))
  cube_case = ("2x2x2 mesh: data, model, seq", cube, dict(is_causal=True, **lengths),
               dict(batch_axis_name="data", head_axis_name="model"))
  if "quick" in sys.argv:
    cases = [
        ("causal + segments", seq, dict(is_causal=True, **segments), {}),
        (lengths_blocks[0] + ", contiguous", seq, lengths_blocks[2],
         dict(lengths_blocks[3], load_balance=False)),
        cube_case,
    ]
  else:
    cases = [
        ("full, GQA, D != H", seq, {}, {}),
        ("causal, zig-zag", seq, dict(is_causal=True), {}),
        ("causal, contiguous", seq, dict(is_causal=True), dict(load_balance=False)),
        ("causal + segments", seq, dict(is_causal=True, **segments), {}),
        lengths_blocks,
        (lengths_blocks[0] + ", contiguous", seq, lengths_blocks[2],
         dict(lengths_blocks[3], load_balance=False)),
        cube_case,
    ]
  ok = True
  for name, mesh, common, ring_only in cases:
    ring = lambda q, k, v: jattn.ring_attention(
        q, k, v, mesh=mesh, axis_name="seq", **common, **ring_only)
    ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **common)
    # one case outside jit (forward and pullback op by op), the cheapest; the rest jitted
    eager = name == lengths_blocks[0] + ", contiguous"
    ok &= check(name + (" (eager)" if eager else ""), ring, ref, (q, k, v), eager=eager)

  for layout in ("BNHT",) if "quick" in sys.argv else ("BNHT", "TNH"):
    arrays = [transpose_to(x if layout != "TNH" else x[0], layout) for x in (q, k, v)]
    kwargs = dict(is_causal=True, layout=layout)
    ring = lambda q, k, v: jattn.ring_attention(q, k, v, mesh=seq, axis_name="seq", **kwargs)
    ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    ok &= check(f"layout {layout}", ring, ref, arrays)

  with jax.set_mesh(cube):
    kwargs = dict(lengths)  # not causal: contiguous blocks
    ring = jax.jit(lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="ring", **kwargs))
    ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    ok &= check("implementation='ring' in jit, mesh from jax.set_mesh", ring, ref, (q, k, v))

  # return_residual: the lse [B, T, N] comes home from the zig-zag and the sharded heads
  _, lse = jattn.ring_attention(q, k, v, mesh=cube, axis_name="seq", batch_axis_name="data",
                                head_axis_name="model", is_causal=True, return_residual=True,
                                **lengths)
  _, want = jattn.dot_product_attention(q, k, v, implementation="xla", is_causal=True,
                                        return_residual=True, **lengths)
  error = np.max(np.abs(np.asarray(lse) - np.asarray(want)) / np.maximum(1, np.abs(want)))
  good = lse.shape == want.shape and error <= ATOL
  print(f"{'ok  ' if good else 'FAIL'} return_residual on the 2x2x2 mesh: {error:.1e}")
  ok &= good

  try:
    jattn.ring_attention(q[:, :12], k[:, :12], v[:, :12], mesh=seq, is_causal=True)
    print("FAIL indivisible length raised nothing")
    ok = False
  except ValueError as e:
    good = "T=12" in str(e) and "8 devices" in str(e)
    print(f"{'ok  ' if good else 'FAIL'} indivisible length: {e}")
    ok &= good
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
