"""`decode_attention` on a mesh: each device its rows and kv heads of the paged cache.

As `parallel/sharded_call.py` does for `dot_product_attention`, and for the same two
cases: arrays typed with Explicit mesh axes, or a mesh of Auto axes set by
`jax.set_mesh` where a platform's choice is a Pallas kernel (paged_tpu, paged_gpu),
which the compiler cannot partition. Under shard_map:

  heads   the query's N and the pool's K (pages [P, K, page_size, H|D], their
          scales [P, K]) split together, where K divides over the devices;
  rows    the query's B, the block table, lengths and query_lengths split; the page
          pool whole on every device of a row group (any row may hold any page);
  mods    see global (b, n), as in `sharded_call`.

The split: the query's B and N axes on Explicit mesh axes, else the mesh's Auto
"data" and "model" axes.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from jattn._src.parallel import sharded_call
from jattn._src.parallel.mesh import devices_along, placed

__all__ = ["mesh_for", "run"]


def mesh_for(query, cache, mods, choices):
  """The mesh the call runs its rows and heads on, or None (the ordinary path)."""
  mesh = sharded_call.explicit_mesh(dict(query=query, cache=cache, mods=mods))
  return mesh if mesh is not None else sharded_call.mesh_of_kernels(choices)


def _split(query, K: int, mesh):
  """(batch axes, head axes), kept where B, and N with K, divide over them."""
  batch, heads = sharded_call.query_axes(query, 0, 2, mesh)
  size = lambda axes: devices_along(mesh, axes)
  B, _, N, _ = query.shape
  if B % size(batch):
    batch = ()
  if N % size(heads) or K % size(heads):
    heads = ()
  return batch, heads


def run(query, cache, mods, q_lengths, *, mesh, mask_mod, score_mod, options,
        decode_attention):
  """The checked call's out (and max logits, if options asks), each device running
  `decode_attention(**options)` on its rows and heads."""
  batch, heads = _split(query, cache.key_pages.shape[1], mesh)
  B_local = query.shape[0] // devices_along(mesh, batch)
  N_local = query.shape[2] // devices_along(mesh, heads)
  rows, kv = batch or None, heads or None
  pool = PartitionSpec(None, kv)  # [P, K, ...]
  cache_spec = type(cache)(
      key_pages=pool, value_pages=pool, block_table=PartitionSpec(rows),
      lengths=PartitionSpec(rows), page_free=PartitionSpec(), error=PartitionSpec(),
      key_scales=None if cache.key_scales is None else pool,
      value_scales=None if cache.value_scales is None else pool)
  args = {"query": (query, PartitionSpec(rows, None, kv)), "cache": (cache, cache_spec),
          "q_lengths": (jax.numpy.asarray(q_lengths), PartitionSpec(rows))}
  if not isinstance(options["scale"], (int, float)):
    args["scale"] = (options["scale"], PartitionSpec())
  traced, how = None if mods is None else mods.traced(), {}
  if traced is not None:
    mod_args, how = sharded_call.mod_arguments(traced, mask_mod, score_mod)
    args.update((name, (x, PartitionSpec())) for name, x in mod_args.items())
    if traced.sinks is not None:
      args["sinks"] = (traced.sinks, PartitionSpec(kv))
  names = tuple(args)
  in_specs = tuple(args[n][1] for n in names)

  def place(value, spec):
    if isinstance(spec, PartitionSpec):  # one spec for every array of the value
      return jax.tree.map(lambda x: placed(x, spec, mesh), value)
    return type(value)(**{  # the cache, field by field
        f.name: None if getattr(value, f.name) is None else placed(
            getattr(value, f.name), getattr(spec, f.name), mesh)
        for f in dataclasses.fields(value)})

  values = tuple(place(args[n][0], args[n][1]) for n in names)

  def body(*values):
    a = dict(zip(names, values))
    b0 = (jax.lax.axis_index(batch) * B_local) if batch else 0
    n0 = (jax.lax.axis_index(heads) * N_local) if heads else 0
    local_mask, local_score = sharded_call.local_mods(how, a, b0, n0)
    local = dict(options, scale=a.get("scale", options["scale"]))
    got = decode_attention(a["query"], a["cache"], query_lengths=a["q_lengths"],
                           mask_mod=local_mask, score_mod=local_score, sinks=a.get("sinks"),
                           **local)
    return got if isinstance(got, tuple) else (got,)

  out_specs = (PartitionSpec(rows, None, kv),) * (1 + options["return_max_logits"])
  got = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      axis_names=sharded_call.unmanual(mesh), check_vma=False)(*values)
  return got if options["return_max_logits"] else got[0]
