"""Every context-parallel strategy against one device on 8 simulated CPU devices.

Run by tests/multidevice/test_context_parallel.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. For each mask (causal, 16
documents of random lengths, a sliding window, prefix-LM, chunked, a hand-written
per-head mask_mod, sinks with ALiBi, soft-cap) and strategy (ring, all_gather,
ulysses): the output and the gradients with respect to q, k, v (and the sinks and
slopes) against single-device "xla", each jitted once (forward and backward).
"quick" (CI): all-gather with sinks and ALiBi (gradients of both), Ulysses with a
per-head mask_mod (the head offsets), the ring in a random order of 4 chunks per device
on 16 documents, that order's inverse, Ulysses on Explicit axes, and each strategy's
out, lse and max logits (return_max_logits, forward only) on documents with empty rows
and a soft-cap; "all": every mask and strategy, also Explicit and Auto axes for the
others and strategy=None.
Prints one "ok  " or "FAIL" line per check; exits non-zero on any failure.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from jattn import mods

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 3e-5  # float32, relative to the largest reference entry (at least 1)
B, T, N, K, H, D = 2, 64, 8, 8, 4, 3  # Ulysses on 8 devices needs N and K divisible by 8
STRATEGIES = ("ring", "all_gather", "ulysses")
QUICK = {("sinks + ALiBi, causal", "all_gather"), ("hand-written per-head mask_mod", "ulysses")}
EMPTY_ROW = np.float32(-0.7 * np.finfo(np.float32).max)  # lse and max logits of no key


def documents(rng, count):
  """int [B, T]: `count` packed documents of random lengths in each row."""
  cuts = [np.sort(rng.choice(np.arange(1, T), count - 1, replace=False)) for _ in range(B)]
  return jnp.asarray(np.stack([np.searchsorted(c, np.arange(T), side="right") for c in cuts]),
                     jnp.int32)


def check(name, fn, ref, arrays):
  """fn's output and its gradients with respect to every array against ref's, each side
  one jitted program (forward and backward together); relative to the largest entry."""
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(
      jax.eval_shape(ref, *arrays).shape), jnp.float32)

  def values_and_grads(f):
    out, pullback = jax.vjp(f, *arrays)
    spec = jax.typeof(out).sharding.spec  # on Explicit axes the cotangent is typed like out
    return out, pullback(jax.sharding.reshard(cotangent, spec) if any(spec) else cotangent)
  got, want = (jax.jit(values_and_grads, static_argnums=0)(f) for f in (fn, ref))
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  errors = [np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, np.max(np.abs(b)))
            for a, b in zip(got, want)]
  ok = all(e <= TOL for e in errors) and all(np.all(np.isfinite(g)) for g in got)
  print(f"{'ok  ' if ok else 'FAIL'} {name}: relative max |err| out, grads = "
        + ", ".join(f"{e:.1e}" for e in errors), flush=True)
  if not ok and os.environ.get("JATTN_FAIL_FAST"):
    sys.exit(1)
  return ok


def check_rows(name, got, want):
  """(out, lse, max logits) against the reference's, forward only: the rows that see no key
  exactly (EMPTY_ROW; an error relative to it would pass anything), the others within
  TOL; the reference must hold both kinds of row."""
  empty = want[2] == EMPTY_ROW  # [B, T, N]
  errors = [np.max(np.abs(got[0] - want[0]))] + [
      np.max(np.where(empty, 0.0, np.abs(a - b))) for a, b in zip(got[1:], want[1:])]
  ok = (empty.any() and not empty.all() and all(e <= TOL for e in errors)
        and all(np.array_equal(a[empty], b[empty]) for a, b in zip(got[1:], want[1:])))
  print(f"{'ok  ' if ok else 'FAIL'} {name}: max |err| out, lse, max logits = "
        + ", ".join(f"{e:.1e}" for e in errors) + f"; {empty.sum()} rows see no key",
        flush=True)
  if not ok and os.environ.get("JATTN_FAIL_FAST"):
    sys.exit(1)
  return ok


def cases(rng):
  """(name, keyword arguments of the call as a function of the differentiated extras, extras)."""
  ids = documents(rng, 16)
  prefix = jnp.asarray([20, 45], jnp.int32)
  per_head = lambda b, n, t, s: (s <= t + n % 2) & (s >= t - 4 - 2 * n)  # reads n: Ulysses
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  slopes = jnp.asarray(0.1 * rng.standard_normal(N), jnp.float32)  # ALiBi-sized logits
  return [
      ("causal", lambda: dict(is_causal=True), ()),
      ("16 uneven documents (causal)", lambda: dict(is_causal=True,
                                                    mask_mod=mods.document(ids)), ()),
      ("sliding window (5, 0)", lambda: dict(local_window_size=(5, 0)), ()),
      ("prefix-LM", lambda: dict(mask_mod=mods.prefix_lm(prefix)), ()),
      ("chunked(16) and causal", lambda: dict(is_causal=True, mask_mod=mods.chunked(16)), ()),
      ("hand-written per-head mask_mod", lambda: dict(mask_mod=per_head), ()),
      ("sinks + ALiBi, causal", lambda sk, sl: dict(is_causal=True, sinks=sk,
                                                    score_mod=mods.alibi(sl)), (sinks, slopes)),
      ("soft-cap + segment ids", lambda: dict(score_mod=mods.soft_cap(2.0), q_segment_ids=ids,
                                              kv_segment_ids=ids), ()),
  ]


def main():
  assert jax.device_count() == 8, jax.devices()
  quick = "quick" in sys.argv
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32)
  seq = jax.sharding.Mesh(np.array(jax.devices()), ("seq",))
  ok = True
  for name, kw, extras in cases(rng):
    for strategy in STRATEGIES:
      if quick and (name, strategy) not in QUICK:
        continue
      fn = lambda q, k, v, *x, kw=kw, strategy=strategy: jattn.context_parallel_attention(
          q, k, v, mesh=seq, strategy=strategy, **kw(*x))
      ref = lambda q, k, v, *x, kw=kw: jattn.dot_product_attention(
          q, k, v, implementation="xla", **kw(*x))
      ok &= check(f"{strategy}: {name}", fn, ref, (q, k, v, *extras))

  # The balance deals chunks out of order; dealt and returned, every chunk is home.
  from jattn._src.parallel import relayout
  order = jattn.ChunkOrder(tuple(tuple(sorted(r)) for r in rng.permutation(32).reshape(8, 4)))
  x = jnp.arange(2 * 96, dtype=jnp.float32).reshape(2, 96)
  # jitted: eagerly, each of the rounds' small ops would be dispatched on its own
  deal = jax.jit(jax.shard_map(lambda x: relayout.to_order(x, 1, "seq", order), mesh=seq,
                               in_specs=P(None, "seq"), out_specs=P(None, "seq"),
                               check_vma=False))
  back = jax.jit(jax.shard_map(lambda x: relayout.from_order(x, 1, "seq", order), mesh=seq,
                               in_specs=P(None, "seq"), out_specs=P(None, "seq"),
                               check_vma=False))
  dealt = np.asarray(deal(x))
  good = (np.array_equal(dealt, np.asarray(x)[:, order.positions(96)])
          and np.array_equal(np.asarray(back(jnp.asarray(dealt))), np.asarray(x)))
  print(f"{'ok  ' if good else 'FAIL'} a random order of 4 chunks per device and its inverse")
  ok &= good
  # ... and a call in that order: 4 chunks per device (the planner deals more only from
  # 128 tokens a chunk), chunk pairs of 2 queries and 2 keys
  name, kw, _ = cases(rng)[1]
  fn = lambda q, k, v: jattn.context_parallel_attention(q, k, v, mesh=seq, strategy="ring",
                                                        load_balance=order, **kw())
  ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **kw())
  ok &= check(f"ring in a random order of 4 chunks per device: {name}", fn, ref, (q, k, v))

  # Explicit axes (jax.make_mesh's default) with the inputs sharded along the sequence, and
  # Auto axes; under jax.jit(jax.vjp) in check. The output keeps the query's sharding.
  kw = dict(is_causal=True, mask_mod=mods.document(documents(rng, 4)))
  kinds = [(AxisType.Explicit, "ulysses")]
  if not quick:
    kinds += [(AxisType.Explicit, "all_gather"), (AxisType.Auto, "ulysses")]
  for kind, strategy in kinds:
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(kind,))
    whole = lambda x, mesh=mesh: jax.sharding.reshard(x, NamedSharding(mesh, P()))
    ref = lambda q, k, v, whole=whole: jattn.dot_product_attention(
        whole(q), whole(k), whole(v), implementation="xla", **kw)
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    fn = lambda q, k, v, mesh=mesh, strategy=strategy: jattn.context_parallel_attention(
        q, k, v, mesh=mesh, strategy=strategy, **kw)
    with jax.set_mesh(mesh):  # jit over arrays of Explicit shardings needs the mesh
      ok &= check(f"{kind.name} axes, inputs sharded over seq: {strategy}", fn, ref, sharded)
      if kind == AxisType.Explicit:  # traced only: the sharding is part of the type
        spec = jax.eval_shape(fn, *sharded).sharding.spec
        good = spec == P(None, "seq", None, None)
        print(f"{'ok  ' if good else 'FAIL'} Explicit axes, {strategy}: the output keeps "
              f"the query's sharding: {spec}")
        ok &= good

  # return_max_logits: a running max per device, home in the caller's order and layout.
  # Causal documents, and batch row 1's keys cut at 40: its rows of documents that start
  # later see no key. The cap sits below the largest raw logits. The ids and lengths are
  # arguments of the jitted call: traced, the balance deals zig-zag without reading them
  # (a shorter trace, and still out of order).
  max_kw = lambda ids, lengths: dict(
      is_causal=True, mask_mod=mods.document(ids), key_value_seq_lengths=lengths,
      score_mod=mods.soft_cap(1.0), return_residual=True, return_max_logits=True)
  arrays = (q, k, v, documents(np.random.default_rng(2), 16), jnp.asarray([T, 40], jnp.int32))
  run = lambda f: jax.tree.map(np.asarray, jax.jit(f)(*arrays))
  want = run(lambda q, k, v, *x: jattn.dot_product_attention(q, k, v, implementation="xla",
                                                             **max_kw(*x)))
  bnth = lambda x: jnp.einsum("BTNH->BNTH", x)

  def ulysses_bnth(q, k, v, *x):  # its results back in the reference's layout
    out, *rows = jattn.context_parallel_attention(
        *map(bnth, (q, k, v)), mesh=seq, strategy="ulysses", layout="BNTH", **max_kw(*x))
    return jnp.einsum("BNTD->BTND", out), *(jnp.einsum("BNT->BTN", r) for r in rows)

  calls = {
      "ring through implementation='ring'": lambda q, k, v, *x: jattn.dot_product_attention(
          q, k, v, implementation="ring", **max_kw(*x)),
      "all_gather": lambda q, k, v, *x: jattn.context_parallel_attention(
          q, k, v, mesh=seq, strategy="all_gather", **max_kw(*x)),
      "ulysses in the layout BNTH": ulysses_bnth}
  with jax.set_mesh(seq):
    for name, fn in calls.items():
      ok &= check_rows(f"max logits, {name}: documents with empty rows, soft-cap", run(fn),
                       want)

  if quick:
    sys.exit(0 if ok else 1)
  # strategy=None runs what the plan chose
  plan = jattn.context_parallel_plan(q, k[..., :1, :], v[..., :1, :], mesh=seq, **kw)
  fn = lambda q, k, v: jattn.context_parallel_attention(q, k, v, mesh=seq, **kw)
  ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **kw)
  ok &= check(f"strategy=None with K=1 (chose {plan.strategy})", fn, ref,
              (q, k[..., :1, :], v[..., :1, :]))
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
