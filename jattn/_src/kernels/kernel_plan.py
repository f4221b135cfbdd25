"""What jattn's own kernels ("flex_tpu", "flex_gpu") decide alike before any work: the
refusals every tile kernel shares, and what the mods need from a kernel (which captured
arrays are read where), from one evaluation of the mods on an abstract tile.

Each kernel's `plan` adds its own hardware's reasons (SMEM, tile multiples, ...).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import tile_mods


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """What both tile kernels' plans hold (sizes as in jattn/__init__.py's legend, the
  tiles, the call's static modifiers); each kernel's `Plan` adds its own fields."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  D: int
  block_q: int
  block_kv: int
  scale: float
  is_causal: bool
  window: tuple | None
  has_mask_mod: bool
  has_score_mod: bool
  interpret: bool

  @property
  def T_padded(self) -> int:
    return round_up(self.T, self.block_q)

  @property
  def S_padded(self) -> int:
    return round_up(self.S, self.block_kv)


def common_refusal(*, B: int, T: int, S: int, N: int, K: int, H: int, D: int, dtype,
                   dtypes: tuple, modifiers: Modifiers, return_weights: bool,
                   platform: str) -> str | None:
  """The reason (a sentence) a tile kernel cannot take this call, or None."""
  m = modifiers
  if return_weights:
    return "return_weights: the kernel forms no [T, S] weights"
  if np.dtype(dtype) not in dtypes:
    names = [str(d) for d in dtypes]
    names = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return f"dtype {np.dtype(dtype)}: the kernel takes {names}"
  if N % K:
    return f"N = {N} is not a multiple of K = {K}"
  if not (1 <= H <= 256 and 1 <= D <= 256):
    return f"head sizes H = {H}, D = {D}: the kernel takes 1 to 256"
  if min(B, T, S, N) < 1:
    return "an empty axis (B, T, S or N is 0)"
  if m.bias is not None:
    return "a dense bias [.., T, S]: not read by the kernel (score_mod is)"
  if m.mask is not None:
    return "a dense mask [.., T, S]: not read by the kernel (mask_mod is)"
  if m.dropout is not None:
    return f"dropout: not in the kernel (no {platform} PRNG path written yet)"
  if not isinstance(m.scale, (int, float)):
    return "a traced scale: the kernel takes a Python number"
  return None


@dataclasses.dataclass(frozen=True)
class ModsFacts:
  """What a kernel needs to know of the mods (see `tile_mods.check`).

  score_reads: const index of each read of a float array captured by score_mod, in
  evaluation order; mask_rows: ((const index, "t" or "s"), ...), mask_mod's per-token
  arrays; score_tables: score_mod's tables read at positions; table_width: the widest
  of those; table_reads: const index of each read of a float table at positions, in
  evaluation order (the dq kernels return one gradient row per read).
  """

  has_mask: bool = False
  has_score: bool = False
  score_reads: tuple = ()
  mask_rows: tuple = ()
  score_tables: tuple = ()
  table_width: int = 0
  table_reads: tuple = ()
  mask_uses_b: bool = False
  mask_uses_n: bool = False


def mods_facts(mods, *, smem: bool) -> ModsFacts | str:
  """The `ModsFacts` of `mods` (a `Mods` or None), or the reason a tile kernel cannot
  evaluate them. smem: the captured arrays read one element at a time go to SMEM
  (TPU: 32-bit and small), else to global memory (GPU)."""
  if mods is None:
    return ModsFacts()
  if mods.block_mask is not None and not mods.has_mask:
    return "a block_mask without its mask_mod"
  mods = mods.traced()
  facts = {}
  for kind, jaxpr, consts in (("mask_mod", mods.mask_jaxpr, mods.mask_consts),
                              ("score_mod", mods.score_jaxpr, mods.score_consts)):
    if jaxpr is None:
      continue
    got = tile_mods.check(jaxpr, tile_mods.consts_meta(consts), kind == "score_mod")
    if isinstance(got, str):
      return f"{kind}: {got}"
    reads, rows, tables, table_reads = got
    if smem:
      reason = tile_mods.check_consts(consts, skip={ci for ci, _ in rows} | set(tables))
      if reason:
        return f"{kind}: {reason}"
    if kind == "score_mod":
      facts.update(score_reads=reads, score_tables=tables, table_reads=table_reads,
                   table_width=max([np.shape(consts[ci])[-1] for ci in tables], default=0))
    else:
      facts.update(mask_rows=rows)
  has_mask = mods.mask_jaxpr is not None
  return ModsFacts(has_mask=has_mask, has_score=mods.score_jaxpr is not None,
                   mask_uses_b=has_mask and mods.mask_uses(0),
                   mask_uses_n=has_mask and mods.mask_uses(1), **facts)


def for_trace(plan, mods):
  """The plan with the const indices of the trace of the mods that runs.

  A plan made from one trace may number the captured arrays otherwise than the trace
  that runs (`tile_mods.const_indices`); a plan carries score_reads, mask_rows,
  score_tables and table_reads (a kernel without one of them ignores it)."""
  if mods is None:
    return plan
  reads, rows, tables, table_reads = tile_mods.const_indices(mods)
  changes = dict(score_reads=reads, mask_rows=rows, score_tables=tables,
                 table_reads=table_reads)
  fields = {f.name for f in dataclasses.fields(plan)}
  return dataclasses.replace(plan, **{k: v for k, v in changes.items() if k in fields})

