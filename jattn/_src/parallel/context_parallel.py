"""`context_parallel_attention`: attention with the sequence sharded over a mesh axis.

Three strategies (`strategies.py`), each one `shard_map` over jax's collectives,
a load balance read from the mask's block classes (`balance.py`, `block_work.py`)
and a plan that models each strategy's work, bytes and memory and chooses one
when strategy=None (`plan.py`). `jattn.ring_attention` is the ring strategy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jattn._src.call import make_call
from jattn._src.core.layout import parse_layout
from jattn._src.dispatch import Choice, per_platform, record, residual_in_layout
from jattn._src.impl import interpret
from jattn._src.core.block_sizes import BlockSizes, default_block_sizes
from jattn._src.impl.registry import PLATFORMS
from jattn._src.parallel.ring_loop import Ring
from jattn._src.kernels import flex_tpu
from jattn._src.masks import structure_mods
from jattn._src.masks.modifiers import Modifiers
from jattn._src.parallel import block_work
from jattn._src.parallel import plan as _plan
from jattn._src.parallel.balance import ChunkOrder, contiguous
from jattn._src.parallel.mesh import check_mesh, home, local_dims, replicated
from jattn._src.parallel.strategies import Local, sharded

STRATEGIES = _plan.STRATEGIES

# What cannot be split over devices, and why (the refusal names the argument).
_UNSUPPORTED = {
    "bias": "a dense bias is [T, S]: every device would hold all of it (a score_mod can "
            "express it at global positions)",
    "mask": "a dense mask is [T, S]: every device would hold all of it (pass mask_mod= or "
            "block_mask=, which each device reads for its own blocks)",
    "dropout_rate": "dropout's draw is made per block of one device's grid, not across "
                    "devices",
    "broadcast_dropout": "dropout's draw is made per block of one device's grid",
    "return_weights": "the weights are [B, N, T, S]: every device would hold all of them",
    "implementation": "each device runs the blockwise loop (the flex_tpu kernel on TPU, "
                      "where it takes the step); choose how devices share the work with "
                      "strategy=",
}


def check_strategy(strategy) -> None:
  if strategy is not None and strategy not in STRATEGIES:
    raise ValueError(f"strategy must be None (chosen per call) or one of "
                     f"{', '.join(map(repr, STRATEGIES))}, got {strategy!r}")


def refuse_unsupported(caller: str, **given) -> None:
  names = [name for name, value in given.items() if value]
  if names:
    raise ValueError(f"{caller} does not support {', '.join(names)}: "
                     + "; ".join(f"{n}: {_UNSUPPORTED[n]}" for n in names))


@dataclasses.dataclass(frozen=True)
class RingStep:
  """What every step of a device's loop runs on one platform (the plan in its report)."""

  implementation: str  # "flex_tpu" (the Pallas kernel) or "blockwise" (the lax loop)
  plan: object  # the kernel's `flex_tpu.Plan`, or the loop's `BlockSizes`

  def __str__(self) -> str:
    return f"each step runs {self.implementation}: {self.plan}"


def context_parallel_attention(
    query, key, value, bias=None, mask=None, *, mesh, axis_name: str = "seq",
    strategy: str | None = None, batch_axis_name: str | None = None,
    head_axis_name: str | None = None, load_balance: bool | ChunkOrder = True,
    scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None, q_segment_ids=None, kv_segment_ids=None, layout="BTNH",
    implementation=None, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=False,
    return_weights=False, block_sizes=None, return_residual=False, return_max_logits=False,
    mask_mod=None, score_mod=None, sinks=None, block_mask=None):
  """`dot_product_attention` with the sequence sharded over mesh axis `axis_name`.

  Takes the arguments of `jattn.dot_product_attention` and gives its result
  (query [B, T, N, H], key [B, S, K, H], value [B, S, K, D] in `layout`), with T
  and S split over the P devices of `axis_name`, by one of three strategies:

    "ring"        each device keeps its queries; K/V chunks go round the ring
                  (`jax.lax.ppermute`), one device's share per step, forward and
                  backward: memory linear in T / P.
    "all_gather"  K/V gathered once (`jax.lax.all_gather`); each device attends its
                  queries to all of S: cheap when K/V is small (GQA/MQA, short S).
    "ulysses"     an all-to-all turns the sequence sharding into head sharding, each
                  device attends all of T for N / P heads, and turns back; needs N
                  and K divisible by P.
    None          chosen from the sizes, heads, mask and mesh (`jattn.explain(...,
                  mesh=mesh)` shows the costs and the reasons).

  Load balance (ring and all_gather): the sequence is cut into P * c chunks and
  dealt to devices so that each computes about the same number of non-empty
  blocks, read from the call's block classes: zig-zag for causal, a greedy
  assignment for documents, windows, prefix-LM or a block mask. The chunks are
  dealt inside the call and the output comes back in the caller's order, so
  arrays and mask_mod keep global positions. The order is static (it fixes the
  communication); masks that depend on traced arrays (document ids inside jit)
  are not read for it: the report says so, and `load_balance=` takes a
  `ChunkOrder` (`jattn.context_parallel_plan(...).order`, made outside jit for
  the batch). load_balance=False: one contiguous chunk per device. Whatever the
  order, the result is the same; each device skips the chunk pairs the mask
  leaves empty (the ring's ppermute still runs).

  batch_axis_name / head_axis_name optionally shard B and the heads over other
  mesh axes (not with mask_mod, score_mod or sinks, which index every row and
  head). The mesh's axes may be Explicit or Auto; on Explicit axes the inputs are
  resharded and the output keeps the query's sharding (D unsharded).

  return_residual and return_max_logits: also return the lse and each row's
  largest visible logit, as `dot_product_attention` (in that order, after out);
  each device keeps a running max over its chunk pairs, and the rows come back
  in the caller's order and the query's layout without H, as the lse does.

  Supported: every layout, GQA, is_causal, local_window_size, lengths, segment
  ids, mask_mod, score_mod, sinks, block_mask, block_sizes, return_residual,
  return_max_logits.
  Refused, naming the argument: bias and mask (dense [T, S]), dropout,
  return_weights, implementation.

  Raises:
    ValueError: T or S not divisible by P (or by P * c for the balance), N or K
      not divisible for "ulysses", an unknown strategy, an unsupported argument,
      or any check of `dot_product_attention`, naming the argument and shapes.

  Examples:
    >>> import jax, jattn
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))   # P = 1 here
    >>> q = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))  # [B, T, N, H]
    >>> jattn.context_parallel_attention(q, q, q, mesh=mesh, is_causal=True,
    ...                                  strategy="ulysses").shape
    (1, 32, 2, 8)
  """
  return run("context_parallel_attention", query, key, value, bias, mask, mesh=mesh,
             axis_name=axis_name, strategy=strategy, batch_axis_name=batch_axis_name,
             head_axis_name=head_axis_name, load_balance=load_balance, scale=scale,
             is_causal=is_causal, query_seq_lengths=query_seq_lengths,
             key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
             q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, layout=layout,
             implementation=implementation, dropout_rate=dropout_rate,
             dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
             return_weights=return_weights, block_sizes=block_sizes,
             return_residual=return_residual, return_max_logits=return_max_logits,
             mask_mod=mask_mod, score_mod=score_mod, sinks=sinks, block_mask=block_mask)


@dataclasses.dataclass(frozen=True, eq=False)
class _Prepared:
  call: object  # the checked `Call`
  plan: _plan.ContextParallelPlan
  mesh: object
  batch_axis_name: str | None
  head_axis_name: str | None
  scale: float


def prepare(caller, query, key, value, bias, mask, *, mesh, axis_name, strategy,
            batch_axis_name, head_axis_name, load_balance, implementation=None,
            dropout_rate=0.0, broadcast_dropout=False, return_weights=False, scale=None,
            **kwargs) -> _Prepared:
  """Every check, then the plan (nothing computed but the static block table)."""
  check_strategy(strategy)
  refuse_unsupported(caller, bias=bias is not None, mask=mask is not None,
                     dropout_rate=bool(dropout_rate), broadcast_dropout=bool(broadcast_dropout),
                     return_weights=bool(return_weights),
                     implementation=implementation is not None)
  if not isinstance(load_balance, (bool, ChunkOrder)):
    raise TypeError(f"load_balance must be a bool or a jattn.ChunkOrder, got {load_balance!r}")
  call = make_call(query, key, value, scale=scale, **kwargs)
  if call.block_sizes is not None and not isinstance(call.block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a jattn.BlockSizes, got {call.block_sizes!r}")
  scale = call.scale
  if not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python float for {caller}, got {scale!r}")
  dims = dataclasses.asdict(call.dims)
  P = check_mesh(mesh, axis_name, batch_axis_name, head_axis_name, dims)
  # the lengths and segment ids whole on every device: the balance and the chunk table read
  # them at any position, which an Explicit sharding of them would not allow
  call = dataclasses.replace(call, modifiers=call.modifiers.replace(
      structure=jax.tree.map(lambda x: replicated(x, mesh), call.structure)))
  for length, letter in ((dims["T"], "T"), (dims["S"], "S")):
    reason = _plan.divisibility(length, letter, 1, P, axis_name)
    if reason:
      raise ValueError(reason)
  mods = call.modifiers.mods
  if mods is not None:
    sharded_axes = [n for n, a in (("batch_axis_name", batch_axis_name),
                                   ("head_axis_name", head_axis_name)) if a is not None]
    if sharded_axes:
      raise ValueError(f"mask_mod, score_mod and sinks in {caller} need the whole batch "
                       f"and every head on each device, got {', '.join(sharded_axes)}; "
                       f"shard only the sequence (a mesh with the 'seq' axis alone)")
  local = local_dims(dims, mesh, batch_axis_name, head_axis_name)
  sizes = _plan.Sizes(B=local["B"], T=dims["T"], S=dims["S"], N=local["N"], K=local["K"],
                      H=dims["H"], D=dims["D"], itemsize=np.dtype(call.dtype).itemsize, P=P)
  chunks, bq, bk = _plan.table_blocks(
      dims["T"], dims["S"], P, load_balance if isinstance(load_balance, ChunkOrder) else None)
  blocks, notes = block_work.static_blocks(call.structure, mods, dims["B"], dims["T"],
                                           dims["S"], bq, bk)
  order, refusal, notes = _plan.order_for(blocks, notes, load_balance, sizes, chunks,
                                          axis_name)
  ulysses = None
  if sizes.N % P or sizes.K % P:
    ulysses = (f"heads N={sizes.N} and K={sizes.K} (per device of the head axis) must be "
               f"divisible by the {P} devices of mesh axis {axis_name!r}: Ulysses shards "
               f"the heads instead of the sequence")
  costs = _plan.costs(sizes, blocks, order, refusal, ulysses)
  if strategy is None:
    strategy, why = _plan.choose(costs)
    if strategy is None:
      raise ValueError(f"no strategy of {caller} can run this call: {why}")
  else:
    if costs[strategy].refused:
      raise ValueError(costs[strategy].refused)
    why = "asked for"
  if order is None:  # ring and all_gather refused: Ulysses runs, with no chunks dealt
    order = contiguous(P)
  plan = _plan.ContextParallelPlan(strategy, why, order, notes, costs, (bq, bk), axis_name, P)
  return _Prepared(call, plan, mesh, batch_axis_name, head_axis_name, float(scale))


def _local_shape(prep: _Prepared) -> tuple[Ring, dict, tuple[int, int]]:
  """The strategy's loop (less block sizes and kernel), one device's B, N, K, H, D,
  and the (T, S) of one chunk pair."""
  call, plan = prep.call, prep.plan
  dims = dataclasses.asdict(call.dims)
  local = local_dims(dims, prep.mesh, prep.batch_axis_name, prep.head_axis_name)
  P, order = plan.P, plan.order
  T, S = dims["T"], dims["S"]
  if plan.strategy == "ring":
    shape = dict(steps=P, q_chunks=order.c, kv_chunks=order.c)
    pair = (T // order.C, S // order.C)
  elif plan.strategy == "all_gather":  # every chunk of K/V local, each pair its own call
    shape, pair = dict(steps=1, q_chunks=order.c, kv_chunks=order.C), (T // order.C,
                                                                        S // order.C)
  else:
    shape, pair = dict(steps=1, q_chunks=1, kv_chunks=1), (T, S)
    local = dict(local, N=local["N"] // P, K=local["K"] // P)
  return shape, local, pair


def _step_kernel(platform, local, pair, dtype, modifiers, block_sizes, max_logits):
  """The flex_tpu plan of one chunk pair at traced global offsets on `platform`, or the
  reason it refuses; None where it is not tried: any platform but TPU, unless inside
  `pallas_interpret()` (tests)."""
  interpreting = interpret.interpreting()
  if platform != "tpu" and not interpreting:
    return None
  return flex_tpu.plan(B=local["B"], T=pair[0], S=pair[1], N=local["N"], K=local["K"],
                       H=local["H"], D=local["D"], dtype=dtype, modifiers=modifiers,
                       block_q=None if block_sizes is None else block_sizes.q,
                       block_kv=None if block_sizes is None else block_sizes.kv,
                       interpret=interpreting, offsets=True, return_max_logits=max_logits)


def run(caller, query, key, value, bias=None, mask=None, *, mesh, axis_name, strategy,
        batch_axis_name, head_axis_name, load_balance, return_residual=False,
        block_sizes=None, layout="BTNH", **kwargs):
  """The call: checks, plan, one shard_map per platform's step -> out, then the lse
  (return_residual) and the max logits (return_max_logits), if asked."""
  prep = prepare(caller, query, key, value, bias, mask, mesh=mesh, axis_name=axis_name,
                 strategy=strategy, batch_axis_name=batch_axis_name,
                 head_axis_name=head_axis_name, load_balance=load_balance,
                 block_sizes=block_sizes, layout=layout, **kwargs)
  call, plan = prep.call, prep.plan
  lay, structure, mods = call.layout, call.structure, call.modifiers.mods
  if (structure_mods.has_lengths_or_segments(structure) and batch_axis_name is None
      and head_axis_name is None):
    # Every device holds the whole batch: the lengths and segment ids go in as mask mods
    # of the global arrays (replicated by `prepare`), read at global positions, as the TPU
    # step's kernel reads masks (it takes no per-chunk ids); else each step's blockwise
    # loop applies them
    whole = structure_mods.as_mask_mods(call.modifiers)
    structure, mods = whole.structure, whole.mods
  shape, local, pair = _local_shape(prep)
  modifiers = Modifiers(structure=structure, mods=mods, scale=prep.scale)
  block_sizes = call.block_sizes
  branches, choices = [], []
  for platform in PLATFORMS:
    sizes = (block_sizes or default_block_sizes(platform)).clipped(*pair)
    kernel = _step_kernel(platform, local, pair, call.dtype, modifiers, block_sizes,
                          call.return_max_logits)
    if isinstance(kernel, flex_tpu.Plan):
      step, passed_over = RingStep("flex_tpu", kernel), ()
    else:  # not tried (None), or refused: the reason goes into the report
      step, passed_over = RingStep("blockwise", sizes), (() if kernel is None else (
          ("flex_tpu", kernel),))
      kernel = None
    choices.append(Choice(platform, plan.strategy, step, passed_over))
    ring = Ring(axis_name, plan.P, scale=prep.scale, is_causal=structure.is_causal,
                local_window=structure.local_window, layout=lay, block_sizes=sizes,
                kernel=kernel, max_logits=call.return_max_logits, **shape)
    branches.append((platform, step, Local(plan.strategy, ring, plan.order)))
  record(choices)
  # the chunk table of the masks each device classifies (not for Ulysses, which runs
  # every position of its heads)
  visible = None
  if plan.strategy != "ulysses" and block_work.has_masks(structure, mods):
    visible = (call.dims.B, call.dims.T, call.dims.S, *pair)
  program = _Program(tuple(branches), mesh, _mesh_key(mesh), batch_axis_name,
                     head_axis_name, parse_layout(layout, query.shape), lay,
                     call.dims.has_batch, return_residual, call.return_max_logits, visible)
  # One jit per static description, so that an eager call compiles once; not for a user's
  # function traced for this call (a jaxpr in the mods, which would never hit the cache),
  # nor on an abstract mesh (the caller's jit places it)
  cached = isinstance(mesh, Mesh) and (mods is None or mods.is_cacheable)
  compute = _compute if cached else _compute.__wrapped__
  return compute(query, call.query, call.key, call.value, structure, mods, program=program)


def _mesh_key(mesh) -> tuple:
  """What tells two meshes apart for the jit's cache: the devices in their places (a
  concrete mesh), the axes' names, sizes and types."""
  devices = tuple(d.id for d in mesh.devices.flat) if isinstance(mesh, Mesh) else None
  return (devices, tuple(mesh.shape.items()), tuple(mesh.axis_types))


@dataclasses.dataclass(frozen=True)
class _Program:
  """The static part of one call's computation, the key of `_compute`'s cache (the mesh
  itself is compared by `mesh_key`)."""

  branches: tuple  # ((platform, RingStep, Local), ...)
  mesh: object = dataclasses.field(compare=False)
  mesh_key: tuple = ()
  batch_axis_name: str | None = None
  head_axis_name: str | None = None
  query_layout: object = None  # the caller's layout (perhaps without B), for `home`
  layout: object = None  # the call's, with B
  has_batch: bool = True
  return_residual: bool = False
  return_max_logits: bool = False
  visible: tuple | None = None  # (B, T, S, bq, bk) of the chunk table, or None: none


@functools.partial(jax.jit, static_argnames=("program",))
def _compute(query, q, k, v, structure, mods, *, program: _Program):
  """The call on every platform (its strategy's shard_map under platform_dependent) -> out,
  and the lse and max logits if asked, in the caller's layout and the query's sharding.
  query: the caller's (its sharding is the output's); q, k, v: the call's, with B."""
  p, mesh = program, program.mesh
  # (the structure's arrays come replicated on the mesh from `prepare`)
  visible = None if p.visible is None else block_work.classes(structure, mods, *p.visible)
  if mods is not None and mods.block_mask is not None:
    mods = dataclasses.replace(mods, block_mask=None)  # each step classifies its range
  branches = {platform: (step, functools.partial(
      sharded, local=local, mesh=mesh, batch_axis_name=p.batch_axis_name,
      head_axis_name=p.head_axis_name)) for platform, step, local in p.branches}
  out, lse, top = per_platform(branches, q, k, v, structure.q_lengths, structure.kv_lengths,
                               structure.q_segment_ids, structure.kv_segment_ids, mods, visible)
  # [B, T, N] for "BTNH"; the max logits keep the logits' float32, as one device's
  rows = tuple(residual_in_layout(x, p.layout, dtype) for x, dtype, asked in (
      (lse, out.dtype, p.return_residual), (top, jnp.float32, p.return_max_logits)) if asked)
  if not p.has_batch:
    out, rows = out[0], tuple(x[0] for x in rows)
  out, *rows = home(query, p.query_layout, mesh)(out, *rows)
  return (out, *rows) if rows else out


def context_parallel_plan(query, key, value, bias=None, mask=None, *, mesh,
                          axis_name: str = "seq", strategy: str | None = None,
                          batch_axis_name: str | None = None, head_axis_name: str | None = None,
                          load_balance: bool | ChunkOrder = True,
                          **kwargs) -> _plan.ContextParallelPlan:
  """The plan `context_parallel_attention` makes for these arguments; nothing is computed.

  Arrays may be `jax.ShapeDtypeStruct`s; arrays that the masks read (document
  ids, prefix lengths) should be concrete for the balance to read them. Its
  `.order` can be passed as `load_balance=` inside jit, where they are traced.
  Equals `jattn.explain(..., mesh=mesh)`.

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> mesh = jax.sharding.AbstractMesh((8,), ("seq",))
    >>> q = jax.ShapeDtypeStruct((1, 32768, 8, 128), jnp.bfloat16)   # [B, T, N, H]
    >>> plan = jattn.context_parallel_plan(q, q, q, mesh=mesh, is_causal=True,
    ...                                    strategy="ring")
    >>> str(plan.order), round(plan.costs["ring"].imbalance, 2)
    ('zig-zag, 2 chunk(s) per device', 1.0)
  """
  structs = {name: x for name, x in kwargs.items() if isinstance(x, jax.ShapeDtypeStruct)}
  rest = {name: x for name, x in kwargs.items() if name not in structs}
  found = []

  def trace(query, key, value, structs):
    found.append(prepare("context_parallel_attention", query, key, value, bias, mask,
                         mesh=mesh, axis_name=axis_name, strategy=strategy,
                         batch_axis_name=batch_axis_name, head_axis_name=head_axis_name,
                         load_balance=load_balance, **rest, **structs))

  jax.eval_shape(trace, query, key, value, structs)
  return found[0].plan
