"""The mesh of a context-parallel call: its axes checked, the arrays placed on it and back.

The mesh's axes may be Explicit (`jax.make_mesh`'s default) or Auto. On Explicit
axes an array's sharding is part of its type and shard_map takes only arrays
that already match its in_specs, so `place` reshards the inputs and `home`
gives the output the query's sharding; Auto axes are left to shard_map.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jattn._src.core.explicit_axes import axes_of
from jattn._src.core.layout import Layout


def check_mesh(mesh, axis_name, batch_axis_name, head_axis_name, dims) -> int:
  """The mesh and its axis names, and B, N, K divisible over their axes; returns P."""
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  for arg, name in (("axis_name", axis_name), ("batch_axis_name", batch_axis_name),
                    ("head_axis_name", head_axis_name)):
    if name is not None and name not in mesh.axis_names:
      raise ValueError(f"{arg} {name!r} is not an axis of the mesh, whose axes are "
                       f"{dict(mesh.shape)}")
  named = [(arg, name) for arg, name in (("axis_name", axis_name),
                                         ("batch_axis_name", batch_axis_name),
                                         ("head_axis_name", head_axis_name)) if name is not None]
  for i, (arg, name) in enumerate(named):
    for other, other_name in named[:i]:
      if name == other_name:
        raise ValueError(f"{arg} and {other} are both mesh axis {name!r}: each array "
                         f"axis needs a mesh axis of its own")
  P = mesh.shape[axis_name]
  for arg, name, letters in (("batch_axis_name", batch_axis_name, "B"),
                             ("head_axis_name", head_axis_name, "NK")):
    if name is None:
      continue
    for letter in letters:
      if dims[letter] % mesh.shape[name]:
        raise ValueError(f"{letter}={dims[letter]} must be divisible by the "
                         f"{mesh.shape[name]} devices of {arg} {name!r}")
  return P


_ARG_NAMES = ("query", "key", "value", "q_segment_ids", "kv_segment_ids",
              "query_seq_lengths", "key_value_seq_lengths", "mask_mod/score_mod/sinks arrays",
              "the chunk table")


def place(args, in_specs, mesh):
  """The arguments of the shard_map, resharded to `in_specs` on the mesh's Explicit axes.

  An Explicit axis (`jax.make_mesh`'s default) is part of an array's type, and
  shard_map takes only arrays whose type already matches in_specs: whatever
  the caller's sharding (none, the sequence, batch or heads), reshard. Auto
  axes are left to shard_map, which places the arrays itself.
  """
  for arg, name in zip(args, _ARG_NAMES):
    for x in jax.tree.leaves(arg):
      check_placement(name, x, mesh)
  return tuple(jax.tree.map(lambda x, spec=spec: placed(x, spec, mesh), arg)
               for arg, spec in zip(args, in_specs))


def placed(x, spec: PartitionSpec, mesh):
  """x resharded to spec on the mesh's Explicit axes; x itself on a mesh without them
  (shard_map places arrays on Auto axes itself)."""
  explicit = axes_of(mesh, AxisType.Explicit)
  if not explicit:
    return x
  spec = PartitionSpec(*(_only(a, explicit) for a in spec))
  return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def home(query, layout: Layout, mesh):
  """A function that gives (out, *rows) the query's sharding on the mesh's Explicit axes.

  Under Explicit axes the sharding is part of the type, and attention keeps it as
  jax.nn's does: the output is sharded as the query (its D axis not at all), the
  per-row results (lse, max logits) as the query without H. Auto axes are left to
  the compiler.
  """
  explicit = axes_of(mesh, AxisType.Explicit)
  if not explicit:
    return lambda out, *rows: (out, *rows)
  check_placement("query", query, mesh)
  # a spec may be shorter than the rank: the letters past its end are unsharded (None)
  spec = jax.typeof(query).sharding.spec
  axis = {letter: _only(entry, explicit) for letter, entry in zip(layout.query, spec)}
  at = lambda letters: NamedSharding(mesh, PartitionSpec(*(axis.get(c) for c in letters)))
  rows = layout.query.replace("H", "")
  return lambda out, *per_row: (jax.sharding.reshard(out, at(layout.out)),
                                *(jax.sharding.reshard(x, at(rows)) for x in per_row))


def axes_at(spec: PartitionSpec, position: int, axes) -> tuple:
  """The mesh axes among `axes` that spec shards its array axis `position` over (a
  tuple, empty when none; a spec may be shorter than the rank)."""
  kept = _only(spec[position] if position < len(spec) else None, axes)
  return () if kept is None else (kept,) if isinstance(kept, str) else kept


def devices_along(mesh, axes) -> int:
  """How many devices the mesh axes `axes` (names, possibly none) span together."""
  return math.prod(mesh.shape[a] for a in axes)


def _only(entry, axes):
  """A PartitionSpec entry restricted to `axes` (None when none is left)."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return None
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  kept = tuple(a for a in names if a in axes)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def check_placement(name, x, mesh):
  """An array sharded over an axis the call's mesh lacks cannot be resharded onto it."""
  sharding = jax.typeof(x).sharding
  used = {a for entry in sharding.spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)}
  foreign = sorted(used - set(mesh.axis_names))
  if foreign:
    raise ValueError(f"{name} {jax.typeof(x).str_short()} is sharded over mesh axis "
                     f"{foreign[0]!r} ({sharding.spec}), which the mesh of context-parallel "
                     f"attention lacks (its axes are {dict(mesh.shape)}); put it on that mesh "
                     f"first")


def local_dims(dims, mesh, batch_axis_name, head_axis_name) -> dict:
  """B, N, K of one device (the batch and heads split over their mesh axes), H, D."""
  split = lambda size, axis: size if axis is None else size // mesh.shape[axis]
  return dict(B=split(dims["B"], batch_axis_name), N=split(dims["N"], head_axis_name),
              K=split(dims["K"], head_axis_name), H=dims["H"], D=dims["D"])


def replicated(x, mesh):
  """x replicated on the mesh's Explicit axes (for a table every device computes whole)."""
  return None if x is None else placed(x, PartitionSpec(), mesh)
