"""What each device runs under each context-parallel strategy, inside one shard_map.

  ring        query and K/V chunks dealt in the balanced order (`relayout`); the K/V
              go round the ring in P steps (`ring_loop`).
  all_gather  the queries dealt in the balanced order; the K/V gathered once along
              the sequence (`jax.lax.all_gather`), so each device attends its
              queries to all of S in one step, chunk pair by chunk pair (skipping
              the empty ones, as the ring does).
  ulysses     `jax.lax.all_to_all` turns the sequence sharding into head sharding:
              each device gets every position of N / P query heads (K / P kv heads),
              runs ordinary attention with the mask unchanged, and a second
              all-to-all turns the output back. The mods see global head indices.

The per-row results (the lse, and the max logits when asked) go back to the caller's
order as the output does.

Gradients: jax transposes the collectives (ppermute, all_gather -> reduce-scatter,
all_to_all); the attention itself is `ring_core`'s custom VJP.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jattn._src.parallel.ring_loop import Ring, ring_core
from jattn._src.masks.programmable import build_mods
from jattn._src.parallel.balance import ChunkOrder
from jattn._src.parallel.mesh import place
from jattn._src.parallel.relayout import from_order, to_order


@dataclasses.dataclass(frozen=True)
class Local:
  """The static part of one device's program: the strategy, its loop, its chunk order."""

  strategy: str  # "ring", "all_gather" or "ulysses"
  ring: Ring
  order: ChunkOrder | None  # ring and all_gather


def _dealt(local: Local, q, k, v, q_ids, kv_ids, q_len, kv_len, mods, visible):
  """ring and all_gather: the chunks in the balanced order, each at its global offset."""
  lay, order, name = local.ring.layout, local.order, local.ring.axis_name
  to = lambda x, axis: None if x is None else to_order(x, axis, name, order)
  q, q_ids = to(q, lay.axis("T")), to(q_ids, 1)
  chunks = jnp.asarray(order.table())[jax.lax.axis_index(name)]  # [c] global chunk indices
  t_chunk = q.shape[lay.axis("T")] // order.c
  if local.strategy == "ring":
    k, v, kv_ids = to(k, lay.axis("S")), to(v, lay.axis("S")), to(kv_ids, 1)
    kv_offsets = chunks * (k.shape[lay.axis("S")] // order.c)
  else:  # every device's K/V in the caller's (contiguous) order, in chunks of the order's
    gather = lambda x, axis: None if x is None else jax.lax.all_gather(
        x, name, axis=axis, tiled=True)
    k, v, kv_ids = gather(k, lay.axis("S")), gather(v, lay.axis("S")), gather(kv_ids, 1)
    size = k.shape[lay.axis("S")] // order.C
    kv_offsets = jnp.arange(order.C, dtype=jnp.int32) * size
  out, lse, top = ring_core(local.ring, q, k, v, chunks * t_chunk, kv_offsets, q_ids,
                            kv_ids, q_len, kv_len, mods, visible)
  back = lambda x, axis: None if x is None else from_order(x, axis, name, order)
  return back(out, lay.axis("T")), back(lse, 2), back(top, 2)  # lse, top [B, N, t]


def local_heads(mods, first, count: int):
  """The mods of query heads first .. first + count - 1, called with local head indices:
  sinks sliced, a mask_mod or score_mod that reads n traced again with n + first."""
  if mods is None:
    return None
  fields = dict(block_mask=None)
  if mods.sinks is not None:
    fields["sinks"] = jax.lax.dynamic_slice_in_dim(mods.sinks, first, count)
  if mods.mask_jaxpr is not None and mods.mask_mod is None and mods.mask_uses(1):
    shifted = build_mods(lambda b, n, t, s: mods.mask(b, n + first, t, s), None, None, None,
                         N=count)
    fields.update(mask_jaxpr=shifted.mask_jaxpr, mask_consts=shifted.mask_consts)
  if mods.has_score and mods.score_uses(2):
    shifted = build_mods(None, lambda x, b, n, t, s: mods.score(x, b, n + first, t, s), None,
                         None, N=count, logits_dtype=mods.score_dtype)
    fields.update(score_jaxpr=shifted.score_jaxpr, score_consts=shifted.score_consts)
  return dataclasses.replace(mods, **fields)


def _ulysses(local: Local, q, k, v, q_ids, kv_ids, q_len, kv_len, mods):
  """Sequence sharding -> head sharding, ordinary attention, and back."""
  lay, name = local.ring.layout, local.ring.axis_name
  to_heads = lambda x, heads, length: jax.lax.all_to_all(
      x, name, split_axis=lay.axis(heads), concat_axis=lay.axis(length), tiled=True)
  q, k, v = to_heads(q, "N", "T"), to_heads(k, "K", "S"), to_heads(v, "K", "S")
  gather = lambda x: None if x is None else jax.lax.all_gather(x, name, axis=1, tiled=True)
  q_ids, kv_ids = gather(q_ids), gather(kv_ids)
  count = q.shape[lay.axis("N")]
  mods = local_heads(mods, jax.lax.axis_index(name) * count, count)
  zero = jnp.zeros((1,), jnp.int32)
  out, lse, top = ring_core(local.ring, q, k, v, zero, zero, q_ids, kv_ids, q_len, kv_len,
                            mods)
  out = jax.lax.all_to_all(out, name, split_axis=lay.axis("T"), concat_axis=lay.axis("N"),
                           tiled=True)
  rows = lambda x: None if x is None else jax.lax.all_to_all(
      x, name, split_axis=2, concat_axis=1, tiled=True)
  return out, rows(lse), rows(top)  # lse, top [B, N, t]


def _body(local: Local, q, k, v, q_ids, kv_ids, q_len, kv_len, mods, visible):
  if mods is not None:
    mods = mods.traced()
  if local.strategy == "ulysses":
    return _ulysses(local, q, k, v, q_ids, kv_ids, q_len, kv_len, mods)
  return _dealt(local, q, k, v, q_ids, kv_ids, q_len, kv_len, mods, visible)


@functools.lru_cache(maxsize=64)
def _compiled_body(local: Local):
  """The body, jitted once per static description: eagerly, shard_map would otherwise
  dispatch each of the dealing's small ops on its own (seconds per call)."""
  return jax.jit(functools.partial(_body, local))


# The shard_map is not wrapped in its own jax.jit with the mesh as a static argument: with jax
# 0.10.2 that made the backward pass of a second mesh (same shapes) reuse the
# first mesh's shardings and fail. Callers jit the whole step anyway.
def sharded(query, key, value, q_len, kv_len, q_ids, kv_ids, mods, visible, *, local: Local,
            mesh, batch_axis_name, head_axis_name):
  """(out, lse [B, N, T], max logits [B, N, T] or None unless `local.ring.max_logits`) of
  the call, the sequence sharded over `local.ring.axis_name`."""
  layout, axis_name = local.ring.layout, local.ring.axis_name
  mesh_axis = {"B": batch_axis_name, "T": axis_name, "S": axis_name,
               "N": head_axis_name, "K": head_axis_name}
  spec = lambda letters: PartitionSpec(*(mesh_axis.get(c) for c in letters))
  # An absent (None) optional argument is an empty pytree: any spec fits it.
  ids_spec = spec("BT")
  in_specs = (spec(layout.query), spec(layout.key), spec(layout.value),
              ids_spec, ids_spec, spec("B"), spec("B"), PartitionSpec(), PartitionSpec())
  args = place((query, key, value, q_ids, kv_ids, q_len, kv_len, mods, visible), in_specs,
               mesh)
  return jax.shard_map(
      _compiled_body(local), mesh=mesh, in_specs=in_specs,
      out_specs=(spec(layout.out), spec("BNT"), spec("BNT")),  # an absent max: any spec
      # The blockwise loops inside start their accumulators from constants,
      # which the varying-manual-axes type check would reject as loop carries.
      check_vma=False,
  )(*args)
