"""`dot_product_attention` on a mesh: each device its batch rows and heads, under shard_map.

Two cases need it:

  Explicit axes (`jax.make_mesh`'s default): an array's sharding is part of its
    type, and every op must say how its result is sharded. jattn's kernels
    (Pallas calls), its blockwise loops and the platform branches cannot: they
    are per-device programs. The batch and heads are split as the query's are.
  Auto axes of the mesh set by `jax.set_mesh`, where a platform's choice is a
    Pallas kernel: the compiler cannot partition one ("Mosaic kernels cannot be
    automatically partitioned"), so training on a TPU slice failed to compile.
    The types say nothing of the sharding, so the batch goes over the mesh's
    "data" axis and the heads over "model", jattn's naming (`jattn.sharding`),
    where present; other axes see the whole call.

Attention is independent across batch rows and heads, so each device runs the
ordinary call on its share:

  B, N    split (K with N when K divides over the same devices; else every device
          keeps the kv head its query heads share, or the heads are not split);
  T, S, H, D  whole on each device: sequence sharding is what
          `jattn.ring_attention` and `jattn.context_parallel_attention` are for;
  mods    see global (b, n): mask_mod and score_mod that read b or n are called
          with b + first row, n + first head; the arrays they close over are
          replicated; sinks and a block mask are split with the heads and rows;
  dropout one draw per device, its key folded with the device's place on the
          batch and head axes, so devices do not repeat each other's draw (with
          broadcast_dropout, the one draw every row and head shares).

On Explicit axes the output keeps the query's sharding (D unsharded), the lse and
max logits the query's without H, as jax.nn's do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import AxisType, PartitionSpec

from jattn._src import compat
from jattn._src.call import Call
from jattn._src.core.explicit_axes import axes_of, explicit_axes
from jattn._src.core.layout import Layout
from jattn._src.parallel.mesh import axes_at, devices_along, home, placed

__all__ = ["explicit_mesh", "local_mods", "mesh_of_kernels", "mod_arguments", "query_axes", "run",
           "unmanual"]

# jattn's mesh axis names (`jattn.sharding`): the batch and the heads
BATCH_AXIS, HEADS_AXIS = "data", "model"


def explicit_mesh(named_arrays: dict):
  """The mesh whose Explicit axes shard any of the arrays (name -> pytree), or None.

  Raises a ValueError when two arrays are sharded on different meshes."""
  found = None
  for name, tree in named_arrays.items():
    for x in jax.tree.leaves(tree):
      mesh, used = explicit_axes(x)
      if not used:
        continue
      if found is not None and mesh != found[1]:
        raise ValueError(f"{name} {jax.typeof(x).str_short()} is sharded on mesh "
                         f"{dict(mesh.shape)}, {found[0]} on mesh {dict(found[1].shape)}: "
                         f"put the arrays of one attention call on one mesh")
      found = found or (name, mesh)
  return None if found is None else found[1]


@dataclasses.dataclass(frozen=True)
class Split:
  """How the batch and heads are split: mesh axes (tuples, maybe empty) and devices."""

  batch: tuple
  heads: tuple
  # "split": K with N (or neither split); "one": each device the kv head its heads share
  kv_heads: str
  batch_devices: int
  head_devices: int

  def spec(self, letters: str) -> PartitionSpec:
    axis = {"B": self.batch, "N": self.heads, "K": self.heads if self.kv_heads == "split" else ()}
    return PartitionSpec(*((axis.get(c) or None) for c in letters))


def query_axes(query, batch_axis: int, head_axis: int, mesh) -> tuple:
  """(batch, heads): the mesh axes the query's type shards its batch and head axes over
  (Explicit), else the mesh's Auto "data" and "model" axes, as tuples (maybe empty)."""
  explicit, auto = axes_of(mesh, AxisType.Explicit), axes_of(mesh, AxisType.Auto)
  spec = jax.typeof(query).sharding.spec
  return (axes_at(spec, batch_axis, explicit) or tuple({BATCH_AXIS} & auto),
          axes_at(spec, head_axis, explicit) or tuple({HEADS_AXIS} & auto))


def split_of(call: Call, mesh) -> Split:
  """The query's batch and head sharding on the mesh's Explicit axes, else the mesh's
  Auto "data" and "model" axes; kept where the sizes divide over it."""
  lay, dims = call.layout, call.dims
  batch, heads = query_axes(call.query, lay.axis("B"), lay.axis("N"), mesh)
  size = lambda axes: devices_along(mesh, axes)
  if dims.B % size(batch):
    batch = ()
  if dims.N % size(heads):
    heads = ()
  m, G = size(heads), dims.N // dims.K
  if m == 1 or dims.K % m == 0:
    kv_heads = "split"
  elif G % (dims.N // m) == 0:  # a device's query heads all share one kv head
    kv_heads = "one"
  else:
    heads, kv_heads = (), "split"
  return Split(batch, heads, kv_heads, size(batch), size(heads))


# Implementations the compiler cannot partition (Pallas calls), of dot_product_attention
# and decode_attention; cuDNN's has jax's own partitioning rule, and the rest are jax ops.
KERNELS = frozenset({"flex_tpu", "splash", "flex_gpu", "flex_mgpu", "flex_mgpu_ws", "pallas",
                     "paged_tpu", "paged_gpu"})


def mesh_of_kernels(choices):
  """The mesh set by `jax.set_mesh` when a platform's choice is a Pallas kernel and the
  mesh has an Auto "data" or "model" axis of more than one device to split the batch or
  heads over; else None.

  Without such an axis the call is left to the compiler as before: jax ops (the CPU
  and cuDNN paths) it partitions by the inputs' shardings, which a shard_map that split
  nothing would replace by the whole call on every device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  auto = axes_of(mesh, AxisType.Auto)
  if not any(mesh.shape[a] > 1 for a in {BATCH_AXIS, HEADS_AXIS} & auto):
    return None
  if not any(c.implementation in KERNELS for c in choices):
    return None
  return mesh


def unmanual(mesh) -> set:
  """The axes a shard_map of ours maps: all but those a caller's shard_map made manual
  and those an enclosing vmap maps away (its array axis sharded over them)."""
  return (set(mesh.axis_names) - axes_of(mesh, AxisType.Manual)
          - compat.vmapped_mesh_axes())


def at_global(mod, reads_b: bool, reads_n: bool, b0, n0, first: int):
  """mod called with b + b0 and n + n0 where it reads them (first: b's argument number);
  mod itself when it reads neither (a ready-made mod keeps its closed-form classes)."""
  if not (reads_b or reads_n):
    return mod

  def shifted(*args):
    args = list(args)
    if reads_b:
      args[first] = args[first] + b0
    if reads_n:
      args[first + 1] = args[first + 1] + n0
    return mod(*args)
  return shifted


def ready_made(mod) -> bool:
  """A jattn.mods object of arrays only (no user function inside, as `and_masks` may
  hold): a pytree that can enter the shard_map as an argument."""
  return type(mod).__module__ == "jattn._src.masks.mods" and all(
      hasattr(x, "dtype") or isinstance(x, (int, float)) for x in jax.tree.leaves(mod))


def mod_arguments(traced, mask_mod, score_mod) -> tuple[dict, dict]:
  """The mods of one call for a shard_map: (name -> what enters it as an argument, each
  replicated; how each device calls the mods, static: `local_mods` reads it).

  traced: the call's `Mods.traced()`; mask_mod, score_mod: the caller's. A ready-made mod
  enters as itself (its arrays are its leaves); a user's function as its traced jaxpr
  (static) and the arrays it closes over."""
  args, how = {}, {}
  for kind, mod, jaxpr, consts, uses, b in (
      ("mask", mask_mod, traced.mask_jaxpr, traced.mask_consts, traced.mask_uses, 0),
      ("score", score_mod, traced.score_jaxpr, traced.score_consts, traced.score_uses, 1)):
    if jaxpr is None:  # no such mod (traced: a ready-made mask has its jaxpr too)
      continue
    how[f"{kind}_reads"] = (uses(b), uses(b + 1))  # b, n
    if mod is not None and ready_made(mod):
      how[kind] = "object"
      args[f"{kind}_mod"] = mod
    else:
      how.update({kind: "jaxpr", f"{kind}_jaxpr": jaxpr})
      args[f"{kind}_consts"] = consts
  return args, how


def local_mods(how: dict, arguments: dict, b0, n0) -> tuple:
  """(mask_mod, score_mod) of one device inside the shard_map, called at global (b, n):
  `how` and the arguments from `mod_arguments` (None where the call has none)."""
  def local(kind, first):
    if kind not in how:
      return None
    if how[kind] == "object":
      mod = arguments[f"{kind}_mod"]
    else:
      jaxpr, consts = how[f"{kind}_jaxpr"], arguments[f"{kind}_consts"]
      mod = lambda *i: jax.core.eval_jaxpr(jaxpr, consts, *i)[0]
    return at_global(mod, *how[f"{kind}_reads"], b0, n0, first=first)
  return local("mask", 0), local("score", 1)


@dataclasses.dataclass(frozen=True)
class _Program:
  """The static part of one call, the jit's key: the mesh and split, the arguments'
  names and specs, the call's flags, and how each mod is called on a device."""

  mesh: object
  split: Split
  names: tuple
  in_specs: tuple
  layout: str  # the query's letters, B included
  B_local: int
  N_local: int
  G: int
  options: tuple  # (name, value) of the flags dot_product_attention takes on each device
  mods: tuple = ()  # (name, value) of `mod_arguments`' how; a user's function as a jaxpr
  block_mask: object = None  # the caller's, for its static fields

  @property
  def cacheable(self) -> bool:
    """Whether a new call can hit the jit's cache: no jaxpr of a user's function (traced
    per call), no block mask."""
    return all(not name.endswith("_jaxpr") for name, _ in self.mods) and (
        self.block_mask is None)


def run(call: Call, mesh, *, implementation, dropout_rate, dropout_rng, broadcast_dropout,
        block_sizes, dot_product_attention):
  """(out, weights, lse, max logits) of the checked `call` (its arrays with a batch axis),
  each device running `dot_product_attention` on its rows and heads."""
  split = split_of(call, mesh)
  lay, dims, mods = call.layout, call.dims, call.modifiers.mods
  structure = call.structure
  spec = split.spec

  # Each argument with the spec it enters the shard_map with.
  args, specs = {}, {}

  def add(name, x, x_spec):
    if x is not None:
      args[name], specs[name] = x, x_spec

  def batch_heads(has_b: bool, has_n: bool) -> PartitionSpec:
    """[B|1, N|1, ...]: split where the array has the whole axis."""
    return PartitionSpec((split.batch or None) if has_b else None,
                         (split.heads or None) if has_n else None)

  add("query", call.query, spec(lay.query))
  add("key", call.key, spec(lay.key))
  add("value", call.value, spec(lay.value))
  for name, x in (("bias", call.modifiers.bias), ("mask", call.modifiers.mask)):
    if x is not None:  # [B|1, N|1, T|1, S|1]
      add(name, x, batch_heads(x.shape[0] > 1, x.shape[1] > 1))
  add("q_lengths", structure.q_lengths, spec("B"))
  add("kv_lengths", structure.kv_lengths, spec("B"))
  add("q_ids", structure.q_segment_ids, spec("B"))
  if not call.same_segment_ids:
    add("kv_ids", structure.kv_segment_ids, spec("B"))
  scale = call.scale
  if not isinstance(scale, (int, float)):
    add("scale", scale, PartitionSpec())
    scale = None
  if dropout_rate:
    add("dropout_rng", dropout_rng, PartitionSpec())

  how = {}
  if mods is not None:
    traced = mods.traced()
    mod_args, how = mod_arguments(traced, call.mask_mod, call.score_mod)
    for name, x in mod_args.items():
      add(name, x, PartitionSpec())
    add("sinks", traced.sinks, spec("N"))
    if traced.block_mask is not None:
      block_mask = traced.block_mask
      add("block_classes", block_mask.classes,
          batch_heads(block_mask.B is not None, block_mask.N is not None))

  names = tuple(args)
  options = dict(is_causal=call.is_causal, local_window_size=call.window,
                 implementation=implementation, dropout_rate=dropout_rate,
                 broadcast_dropout=broadcast_dropout, return_weights=call.return_weights,
                 block_sizes=block_sizes, return_residual=call.return_residual,
                 return_max_logits=call.return_max_logits, scale=scale,
                 same_segment_ids=call.same_segment_ids)
  program = _Program(mesh=mesh, split=split, names=names,
                     in_specs=tuple(specs[n] for n in names), layout=lay.query,
                     B_local=dims.B // split.batch_devices,
                     N_local=dims.N // split.head_devices, G=dims.N // dims.K,
                     options=tuple(options.items()), mods=tuple(how.items()),
                     block_mask=None if mods is None else mods.block_mask)
  # a user's traced function would never hit the jit's cache (and fill it): it runs in
  # the caller's trace; ready-made mods and plain calls compile once
  sharded = _sharded if program.cacheable else _sharded.__wrapped__
  out, *results = sharded(tuple(args[n] for n in names), program=program,
                          dot_product_attention=dot_product_attention)
  weights = results.pop(0) if call.return_weights else None
  out, *rows = home(call.query, lay, mesh)(out, *results)
  take = lambda asked: rows.pop(0) if asked else None
  return out, weights, take(call.return_residual), take(call.return_max_logits)


@functools.partial(jax.jit, static_argnames=("program", "dot_product_attention"))
def _sharded(values, *, program: _Program, dot_product_attention):
  """The shard_map of one call: the arguments placed on their specs, each device's call."""
  mesh, split, options = program.mesh, program.split, dict(program.options)
  values = tuple(jax.tree.map(lambda x, s=s: placed(x, s, mesh), x)
                 for x, s in zip(values, program.in_specs))

  def body(*values):
    a = dict(zip(program.names, values))
    b0 = (jax.lax.axis_index(split.batch) * program.B_local) if split.batch else 0
    n0 = (jax.lax.axis_index(split.heads) * program.N_local) if split.heads else 0
    key, value = a["key"], a["value"]
    if split.kv_heads == "one":  # every local query head reads kv head n0 // G
      axis = Layout(program.layout).axis("K")
      key, value = (jax.lax.dynamic_slice_in_dim(x, n0 // program.G, 1, axis=axis)
                    for x in (key, value))
    mask_mod, score_mod = local_mods(dict(program.mods), a, b0, n0)
    block_mask = None
    if program.block_mask is not None:  # its rows and heads; the mask is passed as mask_mod
      made = program.block_mask
      block_mask = dataclasses.replace(
          made, classes=a["block_classes"], mask_jaxpr=None, mask_consts=(),
          B=None if made.B is None else program.B_local,
          N=None if made.N is None else program.N_local)
    rng = a.get("dropout_rng")
    if rng is not None and (split.batch or split.heads) and not options["broadcast_dropout"]:
      # the device's place on the batch and head axes: without it every device would
      # drop the same entries of its share (which broadcast dropout wants: one draw for
      # every row and head)
      rng = jax.random.fold_in(rng, jax.lax.axis_index(split.batch + split.heads))
    q_ids = a.get("q_ids")
    flags = {k: v for k, v in options.items() if k not in ("same_segment_ids", "scale")}
    results = dot_product_attention(
        a["query"], key, value, a.get("bias"), a.get("mask"),
        scale=a.get("scale", options["scale"]), query_seq_lengths=a.get("q_lengths"),
        key_value_seq_lengths=a.get("kv_lengths"), q_segment_ids=q_ids,
        kv_segment_ids=q_ids if options["same_segment_ids"] else a.get("kv_ids"),
        layout=program.layout, dropout_rng=rng, mask_mod=mask_mod, score_mod=score_mod,
        sinks=a.get("sinks"), block_mask=block_mask, **flags)
    return results if isinstance(results, tuple) else (results,)

  rows = program.layout.replace("H", "")
  spec = split.spec
  out_specs = ((spec(Layout(program.layout).out),) + (spec("BNTS"),) * options["return_weights"]
               + (spec(rows),) * (options["return_residual"] + options["return_max_logits"]))
  # axes a caller's shard_map already made manual stay so
  return jax.shard_map(body, mesh=mesh, in_specs=program.in_specs, out_specs=out_specs,
                       axis_names=unmanual(mesh),
                       # the blockwise loops start their accumulators from constants,
                       # which the varying-manual-axes check would reject as carries
                       check_vma=False)(*values)

