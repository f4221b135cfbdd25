"""The "flex_tpu" kernel: flash attention in Pallas for TPU (Mosaic), with the
user's mask_mod and score_mod evaluated inside the kernel on each tile.

`plan(...)` looks only at static facts of a call and returns a hashable `Plan`, or a
reason in words for what the kernel cannot take. `flex_tpu_call.run(plan, ...)` has the
contract of `blockwise_attention`: -> (out, None, lse float32 [B, N, T], max logits
float32 [B, N, T] or None).

Grid (B, N, T / block_q, W), the last axis sequential: each program holds one
query tile [block_q, H] of head n and streams the non-empty key/value tiles of its
row (W: the most a row has, S / block_kv without skipping), of kv head n // G
(the index map reads the shared kv head: K and V are never repeated per group). Online softmax in float32 in VMEM scratch (running max m
and sum l lane-replicated [block_q, 128], accumulator [block_q, D]); the last
kv step writes out and lse = m + log l (and m itself, the row's largest visible
logit, when the plan asks for max logits). T and S are padded to the tiles, and
the padded keys masked. Positions t, s are iota tiles; b and n the program's
indices; the mods' captured arrays are in SMEM (scalar prefetch), see
`tile_mods`. Sequence lengths and segment ids are read as mask mods
(`structure_mods`). Sinks are applied to (out, lse) after the kernel, as blockwise does.
The kernels are in `flex_tpu_kernels`; docs/tpu_kernel.md has the whole design.

Backward: a custom VJP with two Pallas kernels recomputing the weights from
out and lse (`backward`); gradients into sinks by XLA from (out, lse, d out);
gradients into score_mod's captured float arrays: the dq kernel writes, per
program, the gradient of each SMEM read and the read's index, and per query tile a
row of each table read at positions (`table_grads`); XLA sums them.
"""

from __future__ import annotations

import contextvars
import dataclasses

import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.masks import structure_mods
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import kernel_plan
from jattn._src.kernels.kernel_plan import round_up
from jattn._src.kernels.tile_classes import classes_given, grid_widths, mask_band

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
LANES = 128  # TPU vector lanes: the row statistics m, l and lse are kept this wide
# The block tables' SMEM budget (int32 entries, 256 KiB): past it the kernel runs
# every tile (the same values, no skipping). Not measured against a TPU's SMEM.
_MAX_TABLE_ENTRIES = 1 << 16
# jax's TPU interpreter (a `pltpu.InterpretParams`: DMAs, semaphores, race detection,
# uninitialised memory as NaN) for plans made in interpret mode, set by
# `pallas_interpret(tpu=...)`; None: Pallas's generic interpreter (interpret=True).
TPU_INTERPRETER = contextvars.ContextVar("jattn_tpu_interpreter", default=None)


@dataclasses.dataclass(frozen=True)
class Plan(kernel_plan.TilePlan):
  """Everything static the kernel is built from (hashable): the shared
  fields of `kernel_plan.TilePlan`, then these."""

  # const index of each read of a floating array captured by score_mod, in the order
  # the tile evaluation reads them: the backward returns one gradient per read
  score_reads: tuple = ()
  # block-sparse skipping: EMPTY tiles neither fetched nor computed, FULL ones unmasked
  skip: bool = False
  # ((const index, "t" or "s"), ...): mask_mod's per-token arrays, read as blocks
  mask_rows: tuple = ()
  # (const index, ...): score_mod's tables read at a tile of indices (a relative bias),
  # in VMEM, gathered along the lanes
  score_tables: tuple = ()
  # the queries and keys start at traced global positions (a ring step's ranges),
  # passed to the kernels as two int32 scalars by scalar prefetch (`step_forward`)
  offsets: bool = False
  # const index of each read of a float table at positions, in evaluation order: the
  # dq kernel returns one gradient row per read and query tile (`table_grads`)
  table_reads: tuple = ()
  # the forward also writes each row's running max m (return_max_logits)
  max_logits: bool = False
  # (lo, hi): the offsets s - t a ready-made mask_mod keeps, lo <= s - t <= hi (None:
  # unbounded), which narrow the grids as causal and the window do (`mask_band`); not
  # where a block_mask gives the classes (the kernel follows it as given, FULL unmasked)
  mask_band: tuple = (None, None)


def plan(*, B: int, T: int, S: int, N: int, K: int, H: int, D: int, dtype,
         modifiers: Modifiers, return_weights: bool = False,
         return_max_logits: bool = False,
         block_q: int | None = None, block_kv: int | None = None,
         interpret: bool = False, skip: bool = True, offsets: bool = False) -> Plan | str:
  """A `Plan` for this call, or the reason (a sentence) the kernel cannot take it.

  modifiers: the call's `Modifiers` (its arrays may be tracers or
  ShapeDtypeStructs: only shapes, dtypes and the mods' jaxprs are read).
  block_q (a multiple of 8) and block_kv (a multiple of 128): the tiles, by
  default 512 x 512, clipped to the padded T and S (512 x 512: the TPU
  compiler schedules a FULL forward tile at 1.16x its MXU work on v5e, against 1.9x at
  128 x 512; benchmarks/tpu_schedule.py).
  interpret: run the Pallas kernel in interpret mode (any backend, for tests).
  skip: skip EMPTY tiles and the masks of FULL ones, from the block classes
  (computed in the call: closed forms for causal, windows and jattn.mods masks,
  a given block_mask of these tiles, else mask_mod evaluated block by block).
  offsets: the call covers T queries and S keys from traced global positions (one
  ring step); run it with `step_forward` / `step_backward`.
  return_max_logits: the forward also returns each row's largest visible logit.
  """
  m = modifiers
  reason = compat.missing("pallas_tpu") or kernel_plan.common_refusal(
      B=B, T=T, S=S, N=N, K=K, H=H, D=D, dtype=dtype, dtypes=_DTYPES, modifiers=m,
      return_weights=return_weights, platform="TPU")
  if reason:
    return reason
  if structure_mods.has_lengths_or_segments(m.structure):
    if offsets:  # a chunk pair's ids: the ring passes them as mask mods where it can
      return ("sequence lengths and segment ids of a ring step's chunks, with the batch "
              "or heads sharded: the ring's blockwise step applies them")
    m = structure_mods.as_mask_mods(m)  # read as mask mods, as `flex_tpu_call.run` does
  st = m.structure
  facts = kernel_plan.mods_facts(m.mods, smem=True)
  if isinstance(facts, str):
    return facts
  has_mask, score_reads, score_tables = facts.has_mask, facts.score_reads, facts.score_tables
  if len(score_reads) > LANES:
    return (f"score_mod reads captured float arrays {len(score_reads)} times per entry "
            f"(the backward returns at most {LANES} read gradients per tile)")
  block_q = min(block_q or 512, round_up(T, 8))
  block_kv = min(block_kv or 512, round_up(S, LANES))
  if score_tables and facts.table_width > block_kv:
    return (f"score_mod: a table of width {facts.table_width} read at positions; the kernel "
            f"gathers from at most block_kv = {block_kv} entries")
  if block_q % 8 or block_kv % LANES:
    return (f"tiles block_q = {block_q}, block_kv = {block_kv}: block_q must be a "
            "multiple of 8 and block_kv of 128")
  window = None if st.local_window is None else tuple(int(w) for w in st.local_window)
  skip = bool(skip) and (has_mask or bool(st.is_causal) or window is not None)
  p = Plan(B, T, S, N, K, H, D, block_q, block_kv, float(m.scale), bool(st.is_causal),
           window, has_mask, facts.has_score,
           (TPU_INTERPRETER.get() or True) if interpret else False, score_reads, skip,
           facts.mask_rows, score_tables, bool(offsets), facts.table_reads,
           max_logits=bool(return_max_logits))
  if m.mods is not None and not classes_given(p, m.mods):
    p = dataclasses.replace(p, mask_band=mask_band(m.mods.mask_mod))
  if skip:  # int32 tables [B|1, N|1, nq, W] and [.., nk, Wq], two each, in SMEM: without
    # room, no skipping
    W, Wq = grid_widths(p)
    entries = 2 * (B if facts.mask_uses_b else 1) * (N if facts.mask_uses_n else 1) * (
        p.T_padded // block_q * W + p.S_padded // block_kv * Wq)
    if entries > _MAX_TABLE_ENTRIES:
      p = dataclasses.replace(p, skip=False)
  return p
