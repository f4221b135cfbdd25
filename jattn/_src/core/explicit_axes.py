"""The Explicit mesh axes an array's type is sharded over, and the array replicated on them.

Under `jax.sharding.AxisType.Explicit` axes (`jax.make_mesh`'s default) the sharding
is part of an array's type (`jax.typeof(x).sharding`); Auto axes are not, and an
array outside any mesh has none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def axes_of(mesh, kind: AxisType) -> set:
  """The names of the mesh's axes of `kind` (Explicit, Auto or Manual)."""
  return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == kind}


def explicit_axes(x) -> tuple:
  """(mesh, the Explicit axes x's type is sharded over, in spec order); (None, ()) if none."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return None, ()
  explicit = axes_of(mesh, AxisType.Explicit)
  used = tuple(a for entry in sharding.spec
               if entry is not None and entry is not PartitionSpec.UNCONSTRAINED
               for a in ((entry,) if isinstance(entry, str) else entry) if a in explicit)
  return mesh, used


def explicit_sharding(x, new_axes: int = 0):
  """x's sharding, with `new_axes` unsharded axes appended, as the out_sharding of an op
  whose result is laid out as x (plus new trailing axes); None when x's type has no mesh
  of Explicit axes, where jax infers the result's sharding itself. For ops jax cannot
  infer it for on Explicit axes: a contraction over a sharded axis, a gather by sharded
  ids. (x itself may be replicated there, while the other operand is sharded.)"""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if mesh is None or mesh.empty or not axes_of(mesh, AxisType.Explicit):
    return None
  spec = tuple(jax.typeof(x).sharding.spec)
  spec += (None,) * (jnp.ndim(x) - len(spec) + new_axes)  # a spec may leave trailing axes out
  return NamedSharding(mesh, PartitionSpec(*spec))


def unsharded(x):
  """x replicated on the Explicit axes its type is sharded over; x itself when it is no
  array or not so sharded. For arrays read at any index, as a mod reads them."""
  if not isinstance(x, (jax.Array, jax.core.Tracer)):
    return x
  mesh, used = explicit_axes(x)
  if not used:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))


def laid_out_as(x, like):
  """x resharded as `like` (an array of x's shape) where either is sharded over Explicit
  axes: an op that writes x into `like` (a cache) keeps like's type. x itself elsewhere."""
  if not (explicit_axes(x)[1] or explicit_axes(like)[1]):
    return x
  return jax.sharding.reshard(x, jax.typeof(like).sharding)


def zeros(shape, dtype, sharding=None):
  """jnp.zeros laid out by `sharding` (a NamedSharding, or None for jax's default) from
  the start, never whole on one device: placed when called eagerly, and on Explicit axes
  typed so under jit too (which needs the mesh set there, as any Explicit program)."""
  z = jnp.zeros(shape, dtype, device=sharding)
  if sharding is None:
    return z
  if axes_of(sharding.mesh, AxisType.Explicit):
    return jax.sharding.reshard(z, sharding)  # device= alone is not kept under jit
  return jax.lax.with_sharding_constraint(z, sharding)


def whole_along(x, axis: int):
  """x with `axis` unsharded (gathered) and its other axes as they were, where x is
  sharded over Explicit axes; x itself elsewhere. For a small array sliced or shifted
  along an axis that may be split (jax cannot slice a sharded axis unevenly)."""
  sharding = explicit_sharding(x)
  if sharding is None or sharding.spec[axis] is None:
    return x
  spec = list(sharding.spec)
  spec[axis] = None
  return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec(*spec)))
