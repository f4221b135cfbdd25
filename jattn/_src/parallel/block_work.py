"""Which block pairs of a call's [T, S] grid are empty: for the balance and for skipping.

The classes come from what jattn can read without evaluating the mask on the
grid: the structural masks (causal, window, lengths, segment ids) and the
ready-made `jattn.mods` masks in closed form (`closed_form_blocks`), and a
`BlockMask` reduced to the table's blocks. A hand-written mask_mod without a
block mask is not evaluated here: its blocks count as non-empty (each device's
blockwise loop still classifies and skips them inside).

Two uses with different needs:
  `classes`  the table inside the program, traced where the masks' arrays are
             (document ids under jit): a device skips the chunk pairs it marks EMPTY.
  `static_blocks`  the table at trace time, for the load balance, which fixes the
             communication pattern and so must be static: only the parts whose
             arrays are concrete count; each traced part is named in a note.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.masks import mods as _mods
from jattn._src.masks.block_mask import EMPTY, FULL, PARTIAL
from jattn._src.masks.closed_form_blocks import closed_form_classes
from jattn._src.masks.structural import MaskSpec


def _lengths(q_len, kv_len, T, S, bq, bk):
  """int8 [B, 1, nq, nk] of query and key/value lengths [B] (None: no limit)."""
  qf, kf = jnp.arange(0, T, bq, dtype=jnp.int32), jnp.arange(0, S, bk, dtype=jnp.int32)
  ql, kl = jnp.minimum(qf + bq, T) - 1, jnp.minimum(kf + bk, S) - 1
  big = jnp.int32(2**30)
  q_len = jnp.full((1,), big) if q_len is None else jnp.asarray(q_len)
  kv_len = jnp.full((1,), big) if kv_len is None else jnp.asarray(kv_len)
  some = (qf[None, :, None] < q_len[:, None, None]) & (kf[None, None, :] < kv_len[:, None, None])
  every = (ql[None, :, None] < q_len[:, None, None]) & (kl[None, None, :] < kv_len[:, None, None])
  out = jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)
  return out[:, None]


def _reduce_block_mask(block_mask, bq: int, bk: int):
  """A BlockMask's classes [B|1, N|1, ., .] at (bq, bk) blocks, or None if they do not nest."""
  sizes = block_mask.block_sizes
  if bq % sizes.q or bk % sizes.kv or block_mask.T % bq or block_mask.S % bk:
    return None
  c = block_mask.classes
  c = c.reshape(c.shape[:2] + (block_mask.T // bq, bq // sizes.q, block_mask.S // bk,
                               bk // sizes.kv))
  some, every = c.max(axis=(3, 5)), c.min(axis=(3, 5))
  return jnp.where(some == EMPTY, EMPTY, jnp.where(every == FULL, FULL, PARTIAL)).astype(
      jnp.int8)


def has_masks(structure: MaskSpec, mods) -> bool:
  """Whether any mask may leave a block empty (else every pair is computed, no table)."""
  return not structure.is_empty or (mods is not None and (mods.has_mask or
                                                          mods.block_mask is not None))


def parts(structure: MaskSpec, mods, B: int, T: int, S: int, bq: int,
          bk: int) -> list[tuple[str, object]]:
  """(name, int8 [B|1, N|1, T / bq, S / bk] or None when unknown) for each mask of the call."""
  out = []
  closed = lambda name, mask: out.append((name, closed_form_classes(mask, B, T, S, bq, bk)))
  if structure.is_causal:
    closed("is_causal", _mods.causal())
  if structure.local_window is not None:
    closed("local_window_size", _mods.sliding_window(*structure.local_window))
  if structure.q_lengths is not None or structure.kv_lengths is not None:
    out.append(("sequence lengths", _lengths(structure.q_lengths, structure.kv_lengths, T, S,
                                             bq, bk)))
  if structure.q_segment_ids is not None:
    closed("segment ids", _mods.document(structure.q_segment_ids, structure.kv_segment_ids))
  if mods is not None and mods.block_mask is not None:
    out.append(("block_mask", _reduce_block_mask(mods.block_mask, bq, bk)))
  elif mods is not None and mods.mask_mod is not None:
    closed(f"mask_mod {type(mods.mask_mod).__name__}", mods.mask_mod)
  elif mods is not None and mods.has_mask:
    out.append(("a hand-written mask_mod", None))
  return out


def _combine(tables, nq: int, nk: int):
  """The AND of the masks (the least class) -> int8 [nq, nk] over every batch row and head:
  EMPTY where every row is, FULL where every row is."""
  if not tables:
    return jnp.full((nq, nk), FULL, jnp.int8)
  least = tables[0]
  for t in tables[1:]:
    least = jnp.minimum(least, t)
  some, every = least.max(axis=(0, 1)), least.min(axis=(0, 1))
  return jnp.where(some == EMPTY, EMPTY, jnp.where(every == FULL, FULL, PARTIAL)).astype(
      jnp.int8)


def classes(structure: MaskSpec, mods, B: int, T: int, S: int, bq: int, bk: int):
  """int8 [T / bq, S / bk]: every known mask's classes ANDed (traced where they are);
  unknown parts count as PARTIAL."""
  found = [t for _, t in parts(structure, mods, B, T, S, bq, bk)]
  table = _combine([t for t in found if t is not None], T // bq, S // bk)
  if any(t is None for t in found):
    table = jnp.minimum(table, PARTIAL).astype(jnp.int8)
  return table


def static_blocks(structure: MaskSpec, mods, B: int, T: int, S: int, bq: int,
                  bk: int) -> tuple[np.ndarray, tuple[str, ...]]:
  """(bool [T / bq, S / bk] non-empty blocks from the masks known at trace time,
  notes naming each mask that could not be read and so counts as non-empty)."""
  # Evaluated now, on the host: with no mesh in context, as jax >= 0.11 runs no eager op
  # under an abstract mesh alone (`use_abstract_mesh`, e.g. exporting for a pod), nor on
  # a set mesh of compile-only devices (a deviceless compile for a slice)
  with compat.host_eval(), jax.ensure_compile_time_eval():
    found = parts(structure, mods, B, T, S, bq, bk)
    static, notes = [], []
    for name, table in found:
      if table is None:
        notes.append(f"{name} cannot be classified by block here: its blocks count as "
                     f"non-empty (a block_mask made for the batch outside jit can be read)")
      elif isinstance(table, jax.core.Tracer):
        notes.append(f"{name} depends on traced arrays (inside jit): the balance reads "
                     f"the other masks only (pass load_balance=jattn.context_parallel_plan("
                     f"...).order computed outside jit for the batch to balance by it)")
      else:
        static.append(table)
    table = np.asarray(_combine(static, T // bq, S // bk))
  return table != EMPTY, tuple(notes)
