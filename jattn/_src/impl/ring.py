"""`ring_attention`: sequence-parallel attention over a mesh axis, with shard_map."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jattn._src.core import checks as _checks
from jattn._src.core.attend import default_scale
from jattn._src.masks.block_mask import check_block_mask
from jattn._src.core.block_sizes import BlockSizes, default_block_sizes
from jattn._src.call import check_arrays, lengths as _lengths, segment_ids as _segment_ids
from jattn._src.dispatch import Choice, per_platform, record, residual_in_layout
from jattn._src.impl import interpret
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import flex_tpu
from jattn._src.masks.structural import MaskSpec
from jattn._src.impl.registry import PLATFORMS
from jattn._src.core.layout import Layout, parse_layout
from jattn._src.masks.programmable import build_mods
from jattn._src.impl.ring_loop import Ring, chunk_offsets, from_zigzag, ring_core, to_zigzag


def ring_attention(query, key, value, *, mesh: Mesh | AbstractMesh, axis_name: str = "seq",
                   scale: float | None = None, is_causal: bool = False,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   q_segment_ids=None, kv_segment_ids=None,
                   layout: str = "BTNH", batch_axis_name: str | None = None,
                   head_axis_name: str | None = None, load_balance: bool = True,
                   block_sizes: BlockSizes | None = None, return_residual: bool = False,
                   mask_mod=None, score_mod=None, sinks=None, block_mask=None):
  """Attention with the sequence sharded over `mesh` axis `axis_name` (ring attention).

  Same arrays and result as `dot_product_attention` (query [B, T, N, H], key
  [B, S, K, H], value [B, S, K, D] in `layout`), computed with `shard_map`:
  T and S are split over the P devices of `axis_name`, each device keeps its
  queries and the key/value blocks go round the ring (`jax.lax.ppermute`),
  forward and backward, so a device holds one block of K/V at a time.

  batch_axis_name / head_axis_name optionally shard B and the heads (N and K
  together) over other mesh axes. With is_causal and load_balance, tokens are
  dealt to devices in zig-zag order (chunks i and 2P-1-i) so every device does
  equal work: the chunks are exchanged inside the shard_map with two
  ppermutes, and the output comes back in the original order the same way.

  Within a device each step runs the blockwise implementation (block_sizes,
  default per platform), so per-device memory is linear in T / P. On TPU each
  step runs jattn's flex_tpu Pallas kernel instead (forward and backward, the
  mods, causal mask and block skipping at the step's global positions; block_sizes,
  if given, are its tiles), wherever the kernel takes the step; where it cannot
  (lengths, segment ids, tiles it refuses, ...), blockwise; each platform's step
  and the kernel's reason are reported by `jattn.explain(...,
  implementation="ring")` inside `jax.set_mesh`, or `jattn.explain_calls()`
  around the call.

  return_residual=True returns (out, lse) as `dot_product_attention`.

  mask_mod, score_mod, sinks: as `dot_product_attention`; the mods see global
  positions on every device, and each step skips the key blocks mask_mod
  leaves empty (classified per step; a block_mask is checked, not needed).
  With them, B and the heads must not be sharded (batch_axis_name and
  head_axis_name None): the mods index the whole batch and every head.

  The mesh's axes may be Explicit (`jax.make_mesh`'s default) or Auto, and the
  inputs unsharded or sharded along any axis of it: on Explicit axes they are
  resharded to the ring's layout (`jax.sharding.reshard`) and the output comes
  back with the query's sharding (D unsharded), the lse with the query's
  without H; Auto axes are placed by shard_map.

  Requires T and S divisible by P (by 2P for the zig-zag order); T and S may
  differ. bias, a dense mask, a local window and dropout are not supported here.

  Raises:
    ValueError: an axis name the mesh lacks, one mesh axis named twice, an
      input sharded over an axis the mesh lacks, T or S not divisible by P (2P),
      an unsupported argument (bias, mask, local window, dropout), or any
      check of `dot_product_attention`, naming the argument and shapes.

  Examples:
    >>> import jax, jattn
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))   # P = 1 here; 8 on 8 devices
    >>> q = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))    # [B, T, N, H]
    >>> jattn.ring_attention(q, q, q, mesh=mesh, axis_name="seq", is_causal=True).shape
    (1, 32, 2, 8)
  """
  query = _checks.float_array("query", query)
  key = _checks.float_array("key", key)
  value = _checks.float_array("value", value)
  lay = parse_layout(layout, query.shape)
  dims = dataclasses.asdict(check_arrays(query, key, value, lay))
  B, T, S = dims["B"], dims["T"], dims["S"]
  q_len = _lengths("query_seq_lengths", query_seq_lengths, B, lay.has_batch)
  kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, B, lay.has_batch)
  q_ids, kv_ids = _segment_ids(q_segment_ids, kv_segment_ids, B, T, S, lay.has_batch)
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  scale = default_scale(dims["H"]) if scale is None else scale
  if not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python float for ring_attention, got {scale!r}")
  zigzag = is_causal and load_balance
  num_devices = _check_mesh(mesh, axis_name, batch_axis_name, head_axis_name,
                            dims, 2 if zigzag else 1)
  mods = build_mods(mask_mod, score_mod, sinks, block_mask, N=dims["N"])
  if mods is not None:
    if block_mask is not None:
      check_block_mask(block_mask, B=B, N=dims["N"], T=T, S=S, block_sizes=None,
                       has_batch=lay.has_batch)
      mods = dataclasses.replace(mods, block_mask=None)  # each step classifies its range
    sharded = [n for n, a in (("batch_axis_name", batch_axis_name),
                              ("head_axis_name", head_axis_name)) if a is not None]
    if sharded:
      raise ValueError(f"mask_mod, score_mod and sinks in ring attention need the whole "
                       f"batch and every head on each device, got {', '.join(sharded)}; "
                       f"shard only the sequence (a mesh with the 'seq' axis alone)")

  home = _home(query, lay, mesh)
  if not lay.has_batch:
    query, key, value = (x[None] for x in (query, key, value))
    lay = Layout("B" + lay.query)
  # What each step runs on each platform (the flex_tpu kernel on TPU where it takes
  # the step, else the blockwise loop with the platform's block sizes, clipped to one
  # device's chunk), chosen when the program is lowered: one branch when they agree.
  chunk_t, chunk_s = T // num_devices, S // num_devices
  local = _local_dims(dims, mesh, batch_axis_name, head_axis_name)
  structure = MaskSpec(is_causal=is_causal, q_lengths=q_len, kv_lengths=kv_len,
                       q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  modifiers = Modifiers(structure=structure, mods=mods, scale=float(scale))
  steps = (chunk_t // (2 if zigzag else 1), chunk_s // (2 if zigzag else 1))
  branches, choices = {}, []
  for platform in PLATFORMS:
    sizes = (block_sizes or default_block_sizes(platform)).clipped(chunk_t, chunk_s)
    kernel = _step_kernel(platform, local, steps, query.dtype, modifiers, block_sizes)
    if isinstance(kernel, flex_tpu.Plan):
      step, passed_over = RingStep("flex_tpu", kernel), ()
    else:  # not tried (None), or refused: the reason goes into the report
      step, passed_over = RingStep("blockwise", sizes), (() if kernel is None else (
          ("flex_tpu", kernel),))
      kernel = None
    choices.append(Choice(platform, "ring", step, passed_over))
    branches[platform] = (step, functools.partial(
        _sharded, mesh=mesh, axis_name=axis_name, batch_axis_name=batch_axis_name,
        head_axis_name=head_axis_name, num_devices=num_devices, scale=float(scale),
        is_causal=is_causal, zigzag=zigzag, layout=lay, block_sizes=sizes, kernel=kernel))
  record(choices)
  out, lse = per_platform(branches, query, key, value, q_len, kv_len, q_ids, kv_ids, mods)
  lse = residual_in_layout(lse, lay, out.dtype)  # [B, T, N] for "BTNH"
  if not dims["has_batch"]:
    out, lse = out[0], lse[0]
  out, lse = home(out, lse)
  return (out, lse) if return_residual else out


@dataclasses.dataclass(frozen=True)
class RingStep:
  """What every step of the ring runs on one platform (the plan in its report)."""

  implementation: str  # "flex_tpu" (the Pallas kernel) or "blockwise" (the lax loop)
  plan: object  # the kernel's `flex_tpu.Plan`, or the loop's `BlockSizes`

  def __str__(self) -> str:
    return f"each step runs {self.implementation}: {self.plan}"


def _step_kernel(platform, local, steps, dtype, modifiers, block_sizes):
  """The flex_tpu plan of one step (a query chunk against a key/value chunk, at traced
  global offsets) on `platform`, or the reason it refuses the step; None where it is
  not tried: any platform but TPU, unless inside `pallas_interpret()` (tests)."""
  interpreting = interpret.interpreting()
  if platform != "tpu" and not interpreting:
    return None
  return flex_tpu.plan(B=local["B"], T=steps[0], S=steps[1], N=local["N"], K=local["K"],
                       H=local["H"], D=local["D"], dtype=dtype, modifiers=modifiers,
                       block_q=None if block_sizes is None else block_sizes.q,
                       block_kv=None if block_sizes is None else block_sizes.kv,
                       interpret=interpreting, offsets=True)


def _local_dims(dims, mesh, batch_axis_name, head_axis_name) -> dict:
  """B, N, K of one device (the batch and heads split over their mesh axes), H, D."""
  split = lambda size, axis: size if axis is None else size // mesh.shape[axis]
  return dict(B=split(dims["B"], batch_axis_name), N=split(dims["N"], head_axis_name),
              K=split(dims["K"], head_axis_name), H=dims["H"], D=dims["D"])


# The mesh axis names that dot_product_attention(implementation="ring") uses.
SEQUENCE_AXIS, BATCH_AXIS, HEADS_AXIS = "seq", "data", "model"


def ring_from_context(query, key, value, bias, mask, *, local_window_size,
                      dropout_rate, return_weights, block_sizes, broadcast_dropout,
                      **kwargs):
  """`dot_product_attention(implementation="ring")`: ring attention over the mesh
  set with `jax.set_mesh`, its "seq" axis the ring; "data" and "model" axes, if
  present, shard the batch and the heads."""
  unsupported = [name for name, given in (
      ("bias", bias is not None), ("mask", mask is not None),
      ("local_window_size", local_window_size is not None),
      ("dropout_rate", bool(dropout_rate)), ("return_weights", bool(return_weights)),
      ("broadcast_dropout", bool(broadcast_dropout)))
                 if given]
  if unsupported:
    raise ValueError(f"implementation='ring' does not support {', '.join(unsupported)}: "
                     f"each needs the whole [T, S] grid; use 'blockwise' on one device")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or SEQUENCE_AXIS not in mesh.axis_names:
    raise ValueError(f"implementation='ring' needs a mesh with a {SEQUENCE_AXIS!r} axis "
                     f"set by `with jax.set_mesh(mesh):`, got {mesh}")
  present = lambda name: name if name in mesh.axis_names else None
  return ring_attention(query, key, value, mesh=mesh, axis_name=SEQUENCE_AXIS,
                        batch_axis_name=present(BATCH_AXIS),
                        head_axis_name=present(HEADS_AXIS), block_sizes=block_sizes,
                        **kwargs)


def _check_mesh(mesh, axis_name, batch_axis_name, head_axis_name, dims, chunks) -> int:
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
  for letter, size in (("T", dims["T"]), ("S", dims["S"])):
    if size % (chunks * P):
      raise ValueError(
          f"length {letter}={size} must be divisible by {chunks * P} "
          f"({chunks} chunk(s) for each of the {P} devices of mesh axis {axis_name!r})")
  for arg, name, letters in (("batch_axis_name", batch_axis_name, "B"),
                             ("head_axis_name", head_axis_name, "NK")):
    if name is None:
      continue
    for letter in letters:
      if dims[letter] % mesh.shape[name]:
        raise ValueError(f"{letter}={dims[letter]} must be divisible by the "
                         f"{mesh.shape[name]} devices of {arg} {name!r}")
  return P


# Not wrapped in its own jax.jit with the mesh as a static argument: with jax
# 0.10.2 that made the backward pass of a second mesh (same shapes) reuse the
# first mesh's shardings and fail. Callers jit the whole step anyway.
def _sharded(query, key, value, q_len, kv_len, q_ids, kv_ids, mods, *, mesh, axis_name,
             batch_axis_name, head_axis_name, num_devices, scale, is_causal,
             zigzag, layout: Layout, block_sizes: BlockSizes, kernel=None):
  T, S = query.shape[layout.axis("T")], key.shape[layout.axis("S")]
  mesh_axis = {"B": batch_axis_name, "T": axis_name, "S": axis_name,
               "N": head_axis_name, "K": head_axis_name}
  spec = lambda letters: PartitionSpec(*(mesh_axis.get(c) for c in letters))
  chunks = 2 if zigzag else 1
  ring = Ring(axis_name, num_devices, chunks, scale, is_causal, layout,
              block_sizes, kernel)

  def local(q, k, v, q_ids, kv_ids, q_len, kv_len, mods):
    if zigzag:
      reorder = lambda x, axis: to_zigzag(x, axis, axis_name, num_devices)
      q, k, v = (reorder(x, layout.axis("T")) for x in (q, k, v))
      if q_ids is not None:
        q_ids, kv_ids = reorder(q_ids, 1), reorder(kv_ids, 1)
    q_offsets = chunk_offsets(T, chunks, axis_name, num_devices)
    kv_offsets = chunk_offsets(S, chunks, axis_name, num_devices)
    out, lse = ring_core(ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                         mods)
    if zigzag:
      out = from_zigzag(out, layout.axis("T"), axis_name, num_devices)
      lse = from_zigzag(lse, 2, axis_name, num_devices)  # [B, N, T]
    return out, lse

  # An absent (None) optional argument is an empty pytree: any spec fits it.
  ids_spec = spec("BT")
  in_specs = (spec(layout.query), spec(layout.key), spec(layout.value),
              ids_spec, ids_spec, spec("B"), spec("B"), PartitionSpec())
  args = _place((query, key, value, q_ids, kv_ids, q_len, kv_len, mods), in_specs, mesh)
  out = jax.shard_map(
      local, mesh=mesh, in_specs=in_specs,
      out_specs=(spec(layout.out), spec("BNT")),
      # The blockwise loops inside start their accumulators from constants,
      # which the varying-manual-axes type check would reject as loop carries.
      check_vma=False,
  )(*args)
  return out


_ARG_NAMES = ("query", "key", "value", "q_segment_ids", "kv_segment_ids",
              "query_seq_lengths", "key_value_seq_lengths", "mask_mod/score_mod/sinks arrays")


def _place(args, in_specs, mesh):
  """The arguments of the shard_map, resharded to `in_specs` on the mesh's Explicit axes.

  An Explicit axis (`jax.make_mesh`'s default) is part of an array's type, and
  shard_map takes only arrays whose type already matches in_specs: whatever
  the caller's sharding (none, the sequence, batch or heads), reshard. Auto
  axes are left to shard_map, which places the arrays itself.
  """
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  for arg, name in zip(args, _ARG_NAMES):
    for x in jax.tree.leaves(arg):
      _check_placement(name, x, mesh)
  if not explicit:
    return args

  def place(x, spec):
    spec = PartitionSpec(*(_only(a, explicit) for a in spec))
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))

  return tuple(jax.tree.map(lambda x, spec=spec: place(x, spec), arg)
               for arg, spec in zip(args, in_specs))


def _home(query, layout: Layout, mesh):
  """A function that gives (out, lse) the query's sharding on the mesh's Explicit axes.

  Under Explicit axes the sharding is part of the type, and attention keeps it as
  jax.nn's does: the output is sharded as the query (its D axis not at all), the
  lse as the query without H. Auto axes are left to the compiler.
  """
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  if not explicit:
    return lambda out, lse: (out, lse)
  _check_placement("query", query, mesh)
  # a spec may be shorter than the rank: the letters past its end are unsharded (None)
  spec = jax.typeof(query).sharding.spec
  axis = {letter: _only(entry, explicit) for letter, entry in zip(layout.query, spec)}
  at = lambda letters: NamedSharding(mesh, PartitionSpec(*(axis.get(c) for c in letters)))
  rows = layout.query.replace("H", "")
  return lambda out, lse: (jax.sharding.reshard(out, at(layout.out)),
                           jax.sharding.reshard(lse, at(rows)))


def _only(entry, axes):
  """A PartitionSpec entry restricted to `axes` (None when none is left)."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return None
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  kept = tuple(a for a in names if a in axes)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def _check_placement(name, x, mesh):
  """An array sharded over an axis the ring's mesh lacks cannot be resharded onto it."""
  sharding = jax.typeof(x).sharding
  used = {a for entry in sharding.spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)}
  foreign = sorted(used - set(mesh.axis_names))
  if foreign:
    raise ValueError(f"{name} {jax.typeof(x).str_short()} is sharded over mesh axis "
                     f"{foreign[0]!r} ({sharding.spec}), which the mesh of ring attention "
                     f"lacks (its axes are {dict(mesh.shape)}); put it on that mesh first")
