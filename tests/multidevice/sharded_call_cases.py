"""`dot_product_attention` on a mesh, on 8 simulated CPU devices: a 2 x 4 mesh
("data", "model") with the batch and the heads sharded, under jax.jit(jax.vjp), on
Explicit axes (jax.make_mesh's default: the sharding is in the types) and on Auto axes
(the call runs under shard_map because the TPU and GPU choices are Pallas kernels).
Values and gradients against the float64 NumPy references (tests/reference*.py); the
gradients of arrays the mods close over against the same call on one device (the
sharding must change nothing).

"quick": mods that read b and n, sinks, lengths, on the default implementation, on
both kinds of axes; grouped heads (K = 2 over 4 devices) with a bias and ALiBi,
blockwise; the sequence sharded (gathered) with a window and documents; dropout draws
that differ between devices; the interpreted flex_tpu kernel; the errors;
decode_attention over a paged cache, rows and kv heads split, on both kinds of axes;
on Explicit axes, the Transformer's training step (rows, rotary positions) and its
greedy sampling through the paged and the per-row caches, jattn.nnx.MultiHeadAttention
without an out_sharding and jattn.linen's module; a jax.vmap over an axis sharded on
Explicit "data". "all" adds a block mask, a query without a batch axis called eagerly
(compiled once), and a call inside a caller's shard_map over one of the axes, and Auto
axes of other names (left to the compiler), the Transformer in columns with learned
positions, and sampling over int8 pages.

Run by tests/multidevice/test_sharded_call.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. One "ok  "/"FAIL" line per
check; exits non-zero on any failure.
"""

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret
from jattn._src.parallel import sharded_call
from tests.multidevice.compare import raises, report

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from reference import reference_attention, reference_mask, reference_mods  # noqa: E402
from reference_grads import reference_mods_vjp, reference_vjp  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 3e-5  # float32 against float64, relative to the largest entry (at least 1)
B, T, N, H = 4, 16, 8, 8
MESH = None  # the 2 x 4 mesh of Explicit axes, made by main (pytest imports this module)
QUICK = "quick" in sys.argv


def error(got, want):
  want = np.asarray(want, np.float64)
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(1.0, np.abs(want).max()))


def on(x, *spec, mesh=None):
  return jax.device_put(x, NamedSharding(mesh or MESH, P(*spec)))


def spec_of(x):
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def mods_case(rng, mesh=None):
  """The default implementation; a hand-written document mask_mod (reads b, closes over
  replicated ids) and ALiBi-like score_mod (reads n, closes over slopes), sinks split
  with the heads, lengths split with the batch; GQA with K split as N. mesh: MESH
  (Explicit axes), or one of Auto axes, where the types carry no sharding and the
  call runs under shard_map because the TPU and GPU choices are Pallas kernels."""
  mesh = mesh or MESH
  explicit = mesh.axis_types[0] == AxisType.Explicit
  K = 4
  q, k, v = normal(rng, B, T, N, H), normal(rng, B, T, K, H), normal(rng, B, T, K, H)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=-1).astype(np.int32)
  slopes, sinks = normal(rng, N), normal(rng, N)
  lengths = np.array([16, 11, 7, 14], np.int32)
  d_out = normal(rng, B, T, N, H)

  def attend(q, k, v, slopes, sinks, ids, lengths):
    return jattn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths,
        mask_mod=lambda b, n, t, s: ids[b, t] == ids[b, s],
        score_mod=lambda x, b, n, t, s: x + slopes[n] * (s - t).astype(jnp.float32),
        sinks=sinks)

  def vjp(*arrays):
    out, pullback = jax.vjp(lambda *a: attend(*a, *arrays[5:]), *arrays[:5])
    return out, pullback(d_out)

  with jax.set_mesh(mesh):
    sharded = (on(q, "data", None, "model", mesh=mesh), on(k, "data", None, "model", mesh=mesh),
               on(v, "data", None, "model", mesh=mesh), on(slopes, mesh=mesh),
               on(sinks, "model", mesh=mesh), on(ids, mesh=mesh),
               on(lengths, "data", mesh=mesh))
    out, grads = jax.jit(vjp)(*sharded)
    program = str(jax.make_jaxpr(vjp)(*sharded))
  _, one_device = jax.jit(vjp)(q, k, v, slopes, sinks, ids, lengths)

  allowed = reference_mask(B, N, T, T, is_causal=True, kv_lengths=lengths,
                           q_segment_ids=ids, kv_segment_ids=ids)
  distance = np.arange(T)[None, :] - np.arange(T)[:, None]  # s - t
  score = lambda x: x + np.asarray(slopes, np.float64)[None, :, None, None] * distance
  want = reference_mods_vjp(q, k, v, d_out, allowed=allowed, score=score, sinks=sinks)
  errors = [error(g, w) for g, w in zip((out, *grads[:3]), want)]
  errors += [error(g, w) for g, w in zip(grads[3:], one_device[3:])]
  # the shard_map splits the batch over "data" and the heads over "model"
  split = "shard_map" in program and "P('data', None, 'model'" in program
  ok = max(errors) <= TOL and split and (
      not explicit or spec_of(out) == ("data", None, "model", None))
  kind = "Explicit" if explicit else "Auto"
  return report(f"{kind} axes: document + alibi-like mods, sinks, lengths (default "
                f"implementation)", ok,
                f"out {spec_of(out)}, batch and heads split {split}; max |err| out, dq, dk, "
                f"dv, d slopes, d sinks = " + ", ".join(f"{e:.1e}" for e in errors))


def auto_case(rng):
  return mods_case(rng, jax.make_mesh((2, 4), ("data", "model"),
                                      axis_types=(AxisType.Auto,) * 2))


def grouped_heads_case(rng):
  """Two kv heads for 8 query heads split over 4 devices (K does not divide: each device
  keeps the one kv head its query heads share), a [B, N, T, S] bias split with the batch
  and heads, the ready-made ALiBi (reads n: called at the global head), the lse;
  blockwise. ALiBi is a bias slopes[n] (s - t) for the reference."""
  q, k, v = normal(rng, B, T, N, H), normal(rng, B, T, 2, H), normal(rng, B, T, 2, H)
  bias, slopes = normal(rng, B, N, T, T), normal(rng, N)
  d_out = normal(rng, B, T, N, H)

  def vjp(q, k, v, bias, slopes):
    (out, lse), pullback = jax.vjp(lambda *a: jattn.dot_product_attention(
        *a, is_causal=True, implementation="blockwise", return_residual=True,
        score_mod=mods.alibi(slopes)), q, k, v, bias)
    return out, lse, pullback((d_out, jnp.zeros_like(lse)))

  with jax.set_mesh(MESH):
    out, lse, grads = jax.jit(vjp)(on(q, "data", None, "model"), on(k, "data"),
                                   on(v, "data"), on(bias, "data", "model"), on(slopes))
  distance = np.arange(T)[None, :] - np.arange(T)[:, None]  # s - t
  bias = np.asarray(bias, np.float64) + np.asarray(slopes)[None, :, None, None] * distance
  want = reference_vjp(q, k, v, d_out, bias, is_causal=True)
  k_of_head = np.repeat(np.asarray(k, np.float64), N // 2, axis=2)  # [B, S, N, H]
  logits = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64),
                     k_of_head) / np.sqrt(H) + np.asarray(bias)
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  want_lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  errors = [error(g, w) for g, w in zip((out, *grads), want)]
  errors.append(error(lse, np.einsum("bnt->btn", want_lse)))
  ok = (max(errors) <= TOL and spec_of(out) == ("data", None, "model", None)
        and spec_of(lse) == ("data", None, "model"))
  return report("grouped heads split, K = 2 over 4 devices, bias, ALiBi, lse (blockwise)", ok,
                f"out {spec_of(out)}, lse {spec_of(lse)}; max |err| out, dq, dk, dv, "
                f"d bias, lse = " + ", ".join(f"{e:.1e}" for e in errors))


def sequence_case(rng):
  """The query's sequence sharded: gathered for the call, the output sharded back so; a
  ready-made document mask over batch-sharded ids (replicated for it) and a window."""
  q, k, v = normal(rng, B, T, N, H), normal(rng, B, T, 2, H), normal(rng, B, T, 2, H)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=-1).astype(np.int32)
  with jax.set_mesh(MESH):
    out = jax.jit(lambda q, k, v, ids: jattn.dot_product_attention(
        q, k, v, mask_mod=mods.and_masks(mods.sliding_window(3), mods.document(ids)),
        q_segment_ids=ids, kv_segment_ids=ids))(
            on(q, "data", "model"), on(k, "data", "model"), on(v, "data", "model"),
            on(ids, "data"))
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  window = (t - 3 <= s) & (s <= t)
  want = reference_attention(q, k, v, mask=window, q_segment_ids=ids, kv_segment_ids=ids)
  e = error(out, want)
  ok = e <= TOL and spec_of(out) == ("data", "model", None, None)
  return report("sequence sharded: window + documents + segment ids", ok,
                f"out {spec_of(out)}; max |err| {e:.1e}")


def dropout_case(rng):
  """Every batch row and head the same: the draws of different devices must differ
  (one key on every device would repeat them), a second call repeats the first, and
  broadcast_dropout's one draw is the same on every device."""
  row = normal(rng, 1, T, 1, H)
  q = jnp.broadcast_to(row, (B, T, N, H))
  rng_key = jax.random.key(3)
  with jax.set_mesh(MESH):
    f = jax.jit(lambda q, key, broadcast: jattn.dot_product_attention(
        q, q, q, dropout_rate=0.5, dropout_rng=key, broadcast_dropout=broadcast),
                static_argnums=2)
    x = on(q, "data", None, "model")
    out, again = np.asarray(f(x, rng_key, False)), np.asarray(f(x, rng_key, False))
    shared = np.asarray(f(x, rng_key, True))
  # one (batch row, head) of each device: rows 0 and 2 are on different "data" devices,
  # heads 0 and 2 on different "model" devices
  picks = [out[0, :, 0], out[2, :, 0], out[0, :, 2], out[2, :, 2]]
  distinct = all(not np.allclose(a, b) for i, a in enumerate(picks) for b in picks[:i])
  broadcast = np.allclose(shared, shared[:1, :, :1])  # every row and head as the first
  ok = distinct and np.array_equal(out, again) and broadcast
  return report("dropout: devices draw apart, a call repeats, broadcast shares", ok,
                f"distinct across devices {distinct}, repeatable "
                f"{np.array_equal(out, again)}, broadcast one draw {broadcast}")


def flex_tpu_case(rng):
  """The interpreted flex_tpu kernel under the shard_map: ready-made causal + documents."""
  T2 = 128
  q, k, v = normal(rng, B, T2, N, H), normal(rng, B, T2, 4, H), normal(rng, B, T2, 4, H)
  ids = np.sort(rng.integers(0, 3, (B, T2)), axis=-1).astype(np.int32)
  d_out = normal(rng, B, T2, N, H)

  def vjp(q, k, v, ids):
    out, pullback = jax.vjp(lambda *a: jattn.dot_product_attention(
        *a, mask_mod=mods.causal(), q_segment_ids=ids, kv_segment_ids=ids,
        implementation="flex_tpu"), q, k, v)
    return out, pullback(d_out)

  with jax.set_mesh(MESH), pallas_interpret():
    out, grads = jax.jit(vjp)(on(q, "data", None, "model"), on(k, "data", None, "model"),
                              on(v, "data", None, "model"), on(ids, "data"))
  want = reference_vjp(q, k, v, d_out, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
  errors = [error(g, w) for g, w in zip((out, *grads), want)]
  return report("interpreted flex_tpu: causal + segment ids", max(errors) <= TOL,
                "max |err| out, dq, dk, dv = " + ", ".join(f"{e:.1e}" for e in errors))


def block_mask_case(rng):
  """A block mask of a per-row document mask (B-dependent classes) split with the batch."""
  q = normal(rng, B, T, N, H)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=-1).astype(np.int32)
  doc = mods.document(jnp.asarray(ids))
  block_mask = jattn.create_block_mask(doc, B, None, T, T,
                                       block_sizes=jattn.BlockSizes(q=4, kv=4))
  with jax.set_mesh(MESH):
    out = jax.jit(lambda q, bm: jattn.dot_product_attention(q, q, q, block_mask=bm))(
        on(q, "data", None, "model"), block_mask)
  want = reference_attention(q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
  e = error(out, want)
  return report("block mask of documents (blockwise)", e <= TOL, f"max |err| {e:.1e}")


def unbatched_eager_case(rng):
  """A query without a batch axis, heads sharded, called eagerly: twice with new values,
  one compilation."""
  q, q2 = normal(rng, T, N, H), normal(rng, T, N, H)
  attend = lambda q: jattn.dot_product_attention(
      on(q, None, "model"), on(q, None, "model"), on(q, None, "model"), is_causal=True)
  with jax.set_mesh(MESH):
    out = attend(q)
    compiled = sharded_call._sharded._cache_size()
    attend(q2)
    again = sharded_call._sharded._cache_size()
  want = reference_attention(q, q, q, is_causal=True)
  e = error(out, want)
  ok = e <= TOL and spec_of(out) == (None, "model", None) and again == compiled
  return report("no batch axis, eager, compiled once", ok,
                f"out {spec_of(out)}; max |err| {e:.1e}; programs {compiled} -> {again}")


def partly_manual_case(rng):
  """Inside a caller's shard_map over "data" (Auto "model" left): the call splits the
  heads over "model" only, in a shard_map of its own."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  q = normal(rng, B, T, N, H)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(lambda x: jattn.dot_product_attention(x, x, x, is_causal=True),
                              mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              axis_names={"data"}))
    out = f(q)
    nested = str(jax.make_jaxpr(f)(q)).count("shard_map") == 2
  e = error(out, reference_attention(q, q, q, is_causal=True))
  return report("inside a shard_map over one axis", e <= TOL and nested,
                f"a shard_map of its own {nested}; max |err| {e:.1e}")


def decode_case(rng, explicit):
  """decode_attention over a paged cache: the rows over "data", the query heads and the
  pool's kv heads over "model"; causal, ALiBi (reads n), sinks; against float64 over
  the dense prompt. Explicit axes: the cache placed so (pools by kv head, tables by
  row), and a hand-written document mask_mod (reads b). Auto axes: the TPU choice
  (paged_tpu, a Pallas kernel, which takes no documents yet) puts the call under
  shard_map."""
  S, K, page, H = 16, 4, 8, 128  # head dims the TPU kernel takes (128 lanes)
  lengths = np.array([13, 7, 16, 4], np.int32)
  k, v, q = normal(rng, B, S, K, H), normal(rng, B, S, K, H), normal(rng, B, 1, N, H)
  ids = np.sort(rng.integers(0, 3, (B, S)), axis=-1).astype(np.int32)
  slopes, sinks = normal(rng, N), normal(rng, N)
  cache = jattn.paged.append(jattn.paged.init_cache(B, S, num_kv_heads=K, head_dim=H,
                                                     page_size=page), k, v, lengths)
  kind = AxisType.Explicit if explicit else AxisType.Auto
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)

  if not explicit:
    ids = np.zeros_like(ids)  # one document

  def decode(q, cache, slopes, sinks, ids):
    document = lambda b, n, t, s: ids[b, t] == ids[b, s]
    return jattn.decode_attention(
        q, cache, mask_mod=mods.and_masks(mods.causal(), document) if explicit else None,
        is_causal=not explicit, score_mod=mods.alibi(slopes), sinks=sinks)

  with jax.set_mesh(mesh):
    pool = NamedSharding(mesh, P(None, "model"))
    if explicit:
      cache = dataclasses.replace(
          cache, key_pages=jax.device_put(cache.key_pages, pool),
          value_pages=jax.device_put(cache.value_pages, pool),
          block_table=on(cache.block_table, "data", mesh=mesh),
          lengths=on(cache.lengths, "data", mesh=mesh))
    x = on(q, "data", None, "model", mesh=mesh)
    out = jax.jit(decode)(x, cache, on(slopes, mesh=mesh), on(sinks, "model", mesh=mesh),
                          on(ids, mesh=mesh))
    program = str(jax.make_jaxpr(decode)(x, cache, slopes, sinks, ids))
  position = (lengths - 1)[:, None, None, None]  # each row's query: its last token
  s = np.arange(S)[None, None, None, :]
  same_doc = (ids[np.arange(B), lengths - 1][:, None] == ids)[:, None, None, :]
  allowed = (s <= position) & (s < lengths[:, None, None, None]) & same_doc
  score = lambda x: x + np.asarray(slopes, np.float64)[None, :, None, None] * (s - position)
  want, _ = reference_mods(q, k, v, allowed=allowed, score=score, sinks=sinks)
  e = error(out, want)
  split = "shard_map" in program and "P('data', None, 'model'" in program
  ok = e <= TOL and split and (not explicit or spec_of(out) == ("data", None, "model", None))
  return report(f"decode on {'Explicit' if explicit else 'Auto'} axes: causal "
                f"{'+ documents ' if explicit else ''}+ ALiBi + sinks", ok, f"out {spec_of(out)}, rows and heads split {split}; "
                f"max |err| {e:.1e}")


def transformer_case(rng, layout="rows", position_encoding="rope"):
  """The Transformer's training step (loss and gradients of every parameter) on Explicit
  axes: parameters sharded by jattn.sharding (heads and the MLP's hidden units over
  "model"), tokens over "data"; against the same step on one device. The embedding
  lookups, the attention's and the MLP's output projections (contractions over a
  sharded N or E) say their output sharding; the logits come back batch-sharded."""
  import optax
  from flax import nnx
  import jattn.transformer as tr
  config = tr.TransformerConfig(
      vocab_size=32, max_len=T, num_layers=1, features=32, num_heads=N, num_kv_heads=4,
      mlp_features=64, layout=layout, position_encoding=position_encoding,
      previous_token_embedding=True, sinks=True, logit_soft_cap=20.0)
  graphdef, params = nnx.split(tr.Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)

  def loss_and_grads(params, tokens):
    def loss(params):
      logits = nnx.merge(graphdef, params)(tokens[:, :-1])  # [B, T - 1, V]
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits
    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, logits, grads

  with jax.set_mesh(MESH):
    sharded = jax.device_put(params, jattn.sharding.state_shardings(params, MESH))
    x = on(tokens, "data", None)
    value, logits, grads = jax.jit(loss_and_grads)(sharded, x)
    program = str(jax.make_jaxpr(loss_and_grads)(sharded, x))
  want_value, want_logits, want_grads = jax.jit(loss_and_grads)(params, tokens)
  errors = [error(value, want_value), error(logits, want_logits)]
  errors.append(max(error(g, w) for g, w in zip(jax.tree.leaves(grads),
                                                jax.tree.leaves(want_grads))))
  split = "shard_map" in program
  kernel = sharded["blocks"][0]["attention"]["query"]["kernel"][...]
  ok = (max(errors) <= TOL and split and spec_of(logits) == ("data", None, None)
        and spec_of(kernel) == (None, "model", None))
  return report(f"Transformer train step on Explicit axes ({layout}, {position_encoding})", ok,
                f"logits {spec_of(logits)}, attention under shard_map {split}; max |err| "
                f"loss, logits, grads = " + ", ".join(f"{e:.1e}" for e in errors))


def sampling_case(rng, cache_dtype=None):
  """The Transformer samples on Explicit axes (weights placed by jattn.sharding, prompts
  over "data"): greedy `generate` through the paged cache (the rows share one page pool,
  so the cache's bookkeeping stays whole on every device; the pools' kv heads split as
  the key kernel's, over "model"), and decoding through the per-row cache (a prompt,
  then a token; its kv heads split the same way); the tokens and logits of the same
  calls on one device. (The previous-token embedding caches each row's last token
  between steps.)"""
  from flax import nnx
  import jattn.transformer as tr
  config = tr.TransformerConfig(vocab_size=32, max_len=32, num_layers=1, features=32,
                                num_heads=N, num_kv_heads=4, mlp_features=64,
                                position_encoding="rope", previous_token_embedding=True)
  model = tr.Transformer(config, rngs=nnx.Rngs(0))
  prompts = jnp.asarray(rng.integers(0, config.vocab_size, (B, 8)), jnp.int32)
  prompt_lengths = jnp.array([8, 5, 3, 8], jnp.int32)
  sample = lambda m, p, n: m.generate(p, n, 6, jax.random.key(0), temperature=0.0,
                                      cache_dtype=cache_dtype)
  want, want_lengths = sample(model, prompts, prompt_lengths)
  step = nnx.jit(lambda m, x: m(x, decode=True))  # (eagerly: 4x the time, op by op)
  model.init_cache(B, config.max_len)
  want_logits = [step(model, prompts), step(model, prompts[:, :1])]
  with jax.set_mesh(MESH):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sharded = nnx.merge(graphdef, jax.device_put(
        params, jattn.sharding.state_shardings(params, MESH)), rest)
    x = on(prompts, "data")
    tokens, lengths = sample(sharded, x, on(prompt_lengths, "data"))
    pool = sharded.blocks[0].attention.paged_cache.get_value()
    sharded.init_cache(B, config.max_len)
    logits = [step(sharded, x), step(sharded, x[:, :1])]
    # the writes keep the cache's type (eagerly a batch-sharded write into it was refused;
    # under jit it changed the cache's type, so the next step compiled again)
    cache = sharded.blocks[0].attention.cached_key[...]
  heads = (None, "model", None, None)
  split = (spec_of(pool.key_pages) == spec_of(pool.value_pages) == heads
           and pool.key_pages.addressable_shards[0].data.shape[1] == 1
           and (cache_dtype is None or spec_of(pool.key_scales) == heads[:2]))
  same_type = spec_of(cache) == (None, None, "model", None)
  same = (np.array_equal(np.asarray(tokens), np.asarray(want))
          and np.array_equal(np.asarray(lengths), np.asarray(want_lengths)))
  errors = [error(a, b) for a, b in zip(logits, want_logits)]
  ok = (same and split and same_type and max(errors) <= TOL
        and spec_of(tokens) == ("data", None))
  kind = "int8" if cache_dtype is not None else "float32"
  return report(f"Transformer sampling on Explicit axes ({kind} pages)", ok,
                f"tokens {spec_of(tokens)}, the tokens of one device {same}, pools "
                f"{spec_of(pool.key_pages)}, per-row cache {spec_of(cache)}; max |err| "
                f"logits of the per-row cache (prompt, token) = "
                + ", ".join(f"{e:.1e}" for e in errors))


def module_case(rng):
  """jattn.nnx.MultiHeadAttention on Explicit axes, its heads over "model" and the
  inputs' rows over "data", called with no out_sharding: its output projection contracts
  the sharded heads, so the module says the output's sharding (the input's). Output and
  the gradient of the input against the same call on one device."""
  from flax import nnx
  F = 32
  layer = jattn.nnx.MultiHeadAttention(N, F, num_kv_heads=4, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer, nnx.Param)
  # jattn.sharding's rules, as they place a Transformer layer's "attention/..." weights
  heads = lambda path, w: jattn.sharding.partition_spec(
      "attention/" + jattn.sharding.path_name(path), w.ndim)
  x = normal(rng, B, T, F)

  def vjp(params, x):
    out, pullback = jax.vjp(lambda x: nnx.merge(graphdef, params)(x, is_causal=True), x)
    return out, pullback(jnp.ones_like(out))[0]

  with jax.set_mesh(MESH):
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, w: on(w, *heads(path, w)), params)
    out, dx = jax.jit(vjp)(sharded, on(x, "data"))
  want, want_dx = jax.jit(vjp)(params, x)
  errors = [error(out, want), error(dx, want_dx)]
  ok = max(errors) <= TOL and spec_of(out) == ("data", None, None)
  return report("nnx.MultiHeadAttention on Explicit axes, no out_sharding", ok,
                f"out {spec_of(out)}; max |err| out, d inputs = "
                + ", ".join(f"{e:.1e}" for e in errors))


def linen_module_case(rng):
  """jattn.linen.MultiHeadDotProductAttention on Explicit axes, as module_case: flax's
  signature has no out_sharding, so the module lays its output out as inputs_q. Output
  and the gradient of the input against the same call on one device."""
  F = 32
  layer = jattn.linen.MultiHeadDotProductAttention(num_heads=N, qkv_features=F,
                                                   num_kv_heads=4)
  x = normal(rng, B, T, F)
  params = layer.init(jax.random.key(0), x)["params"]
  heads = lambda path, w: jattn.sharding.partition_spec(
      "attention/" + jattn.sharding.path_name(path), w.ndim)

  def vjp(params, x):
    out, pullback = jax.vjp(lambda x: layer.apply({"params": params}, x, is_causal=True), x)
    return out, pullback(jnp.ones_like(out))[0]

  with jax.set_mesh(MESH):
    sharded = jax.tree_util.tree_map_with_path(lambda path, w: on(w, *heads(path, w)), params)
    out, dx = jax.jit(vjp)(sharded, on(x, "data"))
  want, want_dx = jax.jit(vjp)(params, x)
  errors = [error(out, want), error(dx, want_dx)]
  kernel = spec_of(sharded["out"]["kernel"])
  ok = max(errors) <= TOL and spec_of(out) == ("data", None, None) and "model" in kernel
  return report("linen.MultiHeadDotProductAttention on Explicit axes", ok,
                f"out kernel {kernel}, out {spec_of(out)}; max |err| out, d inputs = "
                + ", ".join(f"{e:.1e}" for e in errors))


def other_names_case(rng):
  """Auto axes named neither "data" nor "model": left to the compiler (no shard_map),
  which partitions the CPU path by the inputs' shardings."""
  mesh = jax.make_mesh((2, 4), ("rows", "heads"), axis_types=(AxisType.Auto,) * 2)
  q = normal(rng, B, T, N, H)
  with jax.set_mesh(mesh):
    x = on(q, "rows", None, "heads", mesh=mesh)
    f = jax.jit(lambda x: jattn.dot_product_attention(x, x, x, is_causal=True))
    out = f(x)
    left = "shard_map" not in str(jax.make_jaxpr(f)(x))
  e = error(out, reference_attention(q, q, q, is_causal=True))
  return report("Auto axes of other names: left to the compiler", e <= TOL and left,
                f"no shard_map {left}; max |err| {e:.1e}")


def vmap_case(rng):
  """jax.vmap over an axis E sharded over "data" (Explicit), the heads over "model":
  inside the vmap "data" is the vmap's (the types no longer show it), so the call's
  shard_map splits only the heads, and the implementations jax cannot batch over such an
  axis (Pallas calls, the blockwise loops) refuse it: the default takes "xla". Values and
  gradients against float64; a named "blockwise" is a ValueError naming the axis; and
  decode_attention over E paged caches, whose default (split) refuses too."""
  E = 4  # 2 per device: jax batches a Pallas call over 1 by dropping the axis
  q = normal(rng, E, B, T, N, H)
  ids = np.sort(rng.integers(0, 3, (E, B, T)), axis=-1).astype(np.int32)
  d_out = normal(rng, E, B, T, N, H)

  def vjp(q, ids, implementation=None):
    attend = jax.vmap(lambda q, ids: jattn.dot_product_attention(
        q, q, q, is_causal=True, mask_mod=mods.document(ids), implementation=implementation))
    out, pullback = jax.vjp(lambda q: attend(q, ids), q)
    return out, pullback(d_out)[0]

  with jax.set_mesh(MESH):
    x, sharded_ids = on(q, "data", None, None, "model"), on(ids, "data")
    out, dq = jax.jit(vjp)(x, sharded_ids)
    program = str(jax.make_jaxpr(vjp)(x, sharded_ids))
    ok = raises("vmap over Explicit axes: a named blockwise refuses", lambda: jax.jit(
        functools.partial(vjp, implementation="blockwise"))(x, sharded_ids),
        "'blockwise' cannot run", "vmap", "['data']", "implementation='xla'")
  errors, out_np, dq = [], np.asarray(out), np.asarray(dq)
  for e in range(E):
    allowed = reference_mask(B, N, T, T, is_causal=True, q_segment_ids=ids[e],
                             kv_segment_ids=ids[e])
    want = reference_mods_vjp(q[e], q[e], q[e], d_out[e], allowed=allowed)
    # q is the query, key and value: its gradient is the sum of the three
    errors += [error(out_np[e], want[0]), error(dq[e], sum(want[1:4]))]
  split = "shard_map" in program and "P(None, None, None, 'model'" in program  # E, B, T, N
  # decode_attention likewise: its default (split over keys, nested loops) refuses, the
  # dense path takes it; against the same calls on one device (split)
  S, K, lengths = 16, 4, np.array([[13, 7, 16, 4]] * E, np.int32)
  k, query = normal(rng, E, B, S, K, H), normal(rng, E, B, 1, N, H)
  caches = jax.vmap(lambda k, n: jattn.paged.append(jattn.paged.init_cache(
      B, S, num_kv_heads=K, head_dim=H, page_size=8), k, k, n))(k, lengths)
  decode = jax.vmap(lambda q, cache: jattn.decode_attention(q, cache, is_causal=True))
  with jax.set_mesh(MESH):
    decoded = jax.jit(decode)(on(query, "data"), jax.tree.map(lambda x: on(x, "data"), caches))
  errors.append(error(decoded, decode(query, caches)))
  ok &= report("vmap over an axis sharded on Explicit axes (default implementations)",
               max(errors) <= TOL and split and spec_of(out) == ("data", None, None, "model", None),
               f"out {spec_of(out)}, heads split {split}; max |err| out, dq, decoded = "
               f"{max(errors[0:-1:2]):.1e}, {max(errors[1:-1:2]):.1e}, {errors[-1]:.1e}")
  return ok


def errors_case(rng):
  """A hand-written mod indexing a batch-sharded array: jax 0.10 cannot trace that (a
  TypeError that says to replicate it), newer jax can (then the values must be right);
  arrays on two meshes: a ValueError naming both."""
  q = normal(rng, B, T, N, H)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=-1).astype(np.int32)
  with jax.set_mesh(MESH):
    x, sharded_ids = on(q, "data", None, "model"), on(ids, "data")
    attend = lambda: jax.jit(lambda q, ids: jattn.dot_product_attention(
        q, q, q, mask_mod=lambda b, n, t, s: ids[b, t] == ids[b, s]))(x, sharded_ids)
    try:
      out = attend()
    except TypeError:
      ok = raises("a mod over a sharded array says to replicate it", attend,
                  "mask_mod", "jax.sharding.reshard(x, jax.P())", kinds=(TypeError,))
    else:
      e = error(out, reference_attention(q, q, q, q_segment_ids=ids, kv_segment_ids=ids))
      ok = report("a mod over a sharded array (traced by this jax)", e <= TOL,
                  f"max |err| {e:.1e}")
  other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  k = jax.device_put(q, NamedSharding(other, P("data")))
  ok &= raises("arrays on two meshes", lambda: jattn.dot_product_attention(x, k, k),
               "one mesh", "query", "key")
  return ok


def main():
  global MESH
  assert jax.device_count() == 8, jax.devices()
  MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(0)
  cases = [mods_case, auto_case, grouped_heads_case, sequence_case, dropout_case,
           flex_tpu_case, errors_case, lambda rng: decode_case(rng, explicit=True),
           lambda rng: decode_case(rng, explicit=False), transformer_case, module_case,
           linen_module_case, sampling_case, vmap_case]
  if not QUICK:
    cases += [block_mask_case, unbatched_eager_case, partly_manual_case, other_names_case,
              lambda rng: transformer_case(rng, "columns", "learned"),
              lambda rng: sampling_case(rng, jnp.int8)]
  ok = True
  for case in cases:
    try:
      ok &= case(rng)
    except Exception as e:  # one broken case reports and the rest still run
      ok = report(case.__name__, False, f"{type(e).__name__}: {str(e)[:400]}")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
