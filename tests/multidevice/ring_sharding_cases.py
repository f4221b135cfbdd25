"""Ring attention under jax's sharding API on 8 simulated CPU devices: meshes from
jax.make_mesh with Explicit axes (its default) and Auto axes, inputs unsharded,
sharded along the sequence or along batch and heads, eagerly and under
jax.jit(jax.vjp), through `ring_attention(mesh=...)` and through
`dot_product_attention(implementation="ring")` inside `jax.set_mesh`. Values and
gradients against the float64 NumPy reference (tests/reference_grads.py).

Run by tests/multidevice/test_ring.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. One "ok  "/"FAIL" line per
check; exits non-zero on any failure.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from tests.multidevice.compare import raises, report

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from reference_grads import reference_vjp  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5  # float32 against float64, relative to the largest entry (at least 1)
B, T, N, K, H = 2, 16, 4, 2, 8
LENGTHS = np.array([13, 6], np.int32)


def check(name, fn, arrays, d_out, *, is_causal, spec=None, ids=None):
  """fn(q, k, v) -> out; its value and vjp against the float64 reference, and (spec
  given) the output's sharding type: the query's on an Explicit mesh, as jax.nn keeps it.
  ids: the segment ids fn passes (for queries and keys), if any."""
  ids = None if ids is None else np.asarray(ids)
  want = reference_vjp(*arrays, d_out, is_causal=is_causal, key_value_seq_lengths=LENGTHS,
                       q_segment_ids=ids, kv_segment_ids=ids)[:4]
  out, pullback = jax.vjp(fn, *arrays)
  got = [out, *pullback(jnp.asarray(d_out, jnp.float32))]
  errors = [np.max(np.abs(np.asarray(g, np.float64) - w)) / max(1.0, np.max(np.abs(w)))
            for g, w in zip(got, want)]
  ok = all(e <= TOL for e in errors)
  if spec is not None:
    padded = lambda p: tuple(p) + (None,) * (out.ndim - len(p))  # public: a spec is a tuple
    ok &= padded(jax.typeof(out).sharding.spec) == padded(spec)
  return report(name, ok,
                f"out sharding {jax.typeof(out).sharding.spec}; max |err| out, dq, dk, dv = "
                + ", ".join(f"{e:.1e}" for e in errors))


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(s).astype(np.float32)
            for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]
  d_out = rng.standard_normal((B, T, N, H)).astype(np.float32)
  kv_len = jnp.asarray(LENGTHS)
  ok = True
  quick = "quick" in sys.argv
  for kind in (AxisType.Explicit,) if quick else (AxisType.Explicit, AxisType.Auto):
    explicit = kind == AxisType.Explicit
    seq = jax.make_mesh((4,), ("seq",), axis_types=(kind,))
    cube = jax.make_mesh((2, 2, 2), ("data", "model", "seq"), axis_types=(kind,) * 3)
    put = lambda mesh, spec: [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]
    along_seq, batch_heads = put(cube, P(None, "seq")), put(cube, P("data", None, "model"))

    # unsharded NumPy inputs, eagerly, on a 4-device mesh of "seq" alone (contiguous
    # blocks: a quarter of the zig-zag order's compile time; ring_lengths_cases.py runs
    # the zig-zag order on a jax.make_mesh mesh), with segment ids sharded along the
    # sequence (read whole for the balance and as a mask mod: replicated first)
    ids = jax.device_put(np.repeat(np.arange(3), [5, 7, 4])[None].repeat(B, 0).astype(np.int32),
                         NamedSharding(seq, P(None, "seq")))
    ring = lambda q, k, v: jattn.ring_attention(q, k, v, mesh=seq, is_causal=True,
                                                load_balance=False,
                                                key_value_seq_lengths=kv_len,
                                                q_segment_ids=ids, kv_segment_ids=ids)
    ok &= check(f"{kind.name}: unsharded inputs, seq-sharded segment ids, eager, seq mesh",
                ring, arrays, d_out, is_causal=True, ids=ids, spec=P() if explicit else None)
    # inputs sharded along batch and heads; the ring shards them along the sequence too
    ring = jax.jit(lambda q, k, v: jattn.ring_attention(
        q, k, v, mesh=cube, batch_axis_name="data", head_axis_name="model",
        key_value_seq_lengths=kv_len))
    ok &= check(f"{kind.name}: batch/heads-sharded inputs, jit, 2x2x2", ring, batch_heads,
                d_out, is_causal=False, spec=P("data", None, "model") if explicit else None)
    # implementation="ring" inside jax.set_mesh, inputs already sharded along the sequence
    with jax.set_mesh(cube):
      ring = jax.jit(lambda q, k, v: jattn.dot_product_attention(
          q, k, v, implementation="ring", key_value_seq_lengths=kv_len))
      ok &= check(f"{kind.name}: seq-sharded inputs, implementation='ring' in set_mesh + jit",
                  ring, along_seq, d_out, is_causal=False,
                  spec=P(None, "seq") if explicit else None)
      if explicit and not quick:  # batch/heads-sharded inputs, the ring not sharding them
        ring = jax.jit(lambda q, k, v: jattn.ring_attention(
            q, k, v, mesh=cube, is_causal=True, key_value_seq_lengths=kv_len))
        ok &= check(f"{kind.name}: batch/heads-sharded inputs, ring over seq only",
                    ring, batch_heads, d_out, is_causal=True, spec=P("data", None, "model"))

  # a mesh of both kinds: data Explicit, seq Auto
  mixed = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit, AxisType.Auto))
  with jax.set_mesh(mixed):
    ring = jax.jit(lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="ring", key_value_seq_lengths=kv_len))
    batch = [jax.device_put(x, NamedSharding(mixed, P("data"))) for x in arrays]
    ok &= check("data Explicit + seq Auto: batch-sharded inputs", ring, batch, d_out,
                is_causal=False, spec=P("data"))

  # layouts that cannot be: an input on an axis the ring's mesh lacks, one axis twice
  other = jax.make_mesh((2, 4), ("expert", "seq"))
  q_elsewhere = jax.device_put(arrays[0], NamedSharding(other, P("expert")))
  seq = jax.make_mesh((4,), ("seq",))
  ok &= raises("input sharded over an axis the mesh lacks",
               lambda: jattn.ring_attention(q_elsewhere, *arrays[1:], mesh=seq),
               "query", "'expert'")
  cube = jax.make_mesh((2, 2, 2), ("data", "model", "seq"))
  ok &= raises("the same mesh axis for the sequence and the heads",
               lambda: jattn.ring_attention(*arrays, mesh=cube, head_axis_name="seq"),
               "head_axis_name and axis_name", "'seq'")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
