"""Block classes of jattn.mods' ready-made masks in closed form: no [T, S] evaluation.

For a (query block, key block) pair the ready-made masks need only the first
and last position of each block (causal, sliding window, chunked, prefix-LM)
or the least and greatest segment id in each block (document), so a whole
[nq, nk] table costs O(nq nk) instead of O(T S) mask_mod calls:

  causal          FULL if last key <= first query, EMPTY if first key > last query
  sliding_window  the offsets s - t of a block span [kf - ql, kl - qf]: EMPTY if
                  that misses [-left, right], FULL if it lies inside
  chunked         chunk ranges [qf // c, ql // c] and [kf // c, kl // c]: EMPTY if
                  disjoint, FULL if both are the same single chunk
  prefix_lm       key s visible to t iff s < max(t + 1, prefix[b])
  lengths         (query_seq_lengths, key_value_seq_lengths; jattn's own, not public)
                  EMPTY if a block starts at or past a length, FULL if it ends before
                  both
  document        id ranges per block: EMPTY if disjoint, FULL if both hold one
                  and the same id (exact for packed documents numbered 0, 1, 2..;
                  a range that skips an id may leave a block PARTIAL that is
                  EMPTY: more work, never a wrong result)
  and_masks       the least class of its parts; or_masks the greatest
                  (EMPTY < PARTIAL < FULL; PARTIAL where the parts cannot tell)

`closed_form_classes` returns None for anything else (a user's function, or a
ready-made mask whose arrays do not fit the call): the caller then evaluates
mask_mod block by block (`_block_mask.classify`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.masks import mods as _mods

EMPTY, PARTIAL, FULL = 0, 1, 2


def is_closed_form(mask_mod) -> bool:
  """Whether mask_mod is a ready-made jattn.mods mask, all of whose parts are too."""
  if isinstance(mask_mod, (_mods.And, _mods.Or)):
    return all(is_closed_form(m) for m in mask_mod.mask_mods)
  return isinstance(mask_mod, (_mods.Causal, _mods.SlidingWindow, _mods.Chunked,
                               _mods.PrefixLM, _mods.Document, _mods.Lengths))


class _Blocks:
  """First and last global position of each query and key block (padding cut off)."""

  def __init__(self, T, S, bq, bk, q_offset, kv_offset):
    self.T, self.S, self.bq, self.bk = T, S, bq, bk
    self.q_offset = jnp.asarray(q_offset, jnp.int32)
    self.kv_offset = jnp.asarray(kv_offset, jnp.int32)
    nq, nk = -(-T // bq), -(-S // bk)
    i, j = jnp.arange(nq, dtype=jnp.int32), jnp.arange(nk, dtype=jnp.int32)
    # [nq, 1] and [1, nk], so that every comparison gives [nq, nk]
    self.qf = (self.q_offset + i * bq)[:, None]
    self.ql = (self.q_offset + jnp.minimum((i + 1) * bq, T) - 1)[:, None]
    self.kf = (self.kv_offset + j * bk)[None, :]
    self.kl = (self.kv_offset + jnp.minimum((j + 1) * bk, S) - 1)[None, :]


def _classes(empty, full) -> jax.Array:
  """bool empty/full -> int8 [B|1, 1, nq, nk]."""
  classes = jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)
  return classes.reshape((-1, 1) + classes.shape[-2:])


def _id_ranges(ids, offset, length: int, block: int):
  """ids [B, L] at global positions offset.. offset+length -> (min, max) [B, n blocks]."""
  ids = lax.dynamic_slice_in_dim(ids, offset, length, axis=1)
  n = -(-length // block)
  ids = jnp.pad(ids, ((0, 0), (0, n * block - length)), mode="edge")  # keeps min, max
  ids = ids.reshape(ids.shape[0], n, block)
  return ids.min(axis=-1), ids.max(axis=-1)


def _of(mask_mod, g: _Blocks, B: int):
  """int8 [B|1, 1, nq, nk], or None when this mask cannot be classified here."""
  if isinstance(mask_mod, _mods.Causal):
    return _classes(g.kf > g.ql, g.kl <= g.qf)
  if isinstance(mask_mod, _mods.SlidingWindow):
    left, right = mask_mod.left, mask_mod.right
    empty = (g.kf - g.ql > right) | (g.kl - g.qf < -left)
    return _classes(empty, (g.kf - g.ql >= -left) & (g.kl - g.qf <= right))
  if isinstance(mask_mod, _mods.Chunked):
    c = mask_mod.size
    qa, qb, ka, kb = g.qf // c, g.ql // c, g.kf // c, g.kl // c
    return _classes((ka > qb) | (kb < qa), (qa == qb) & (ka == kb) & (qa == ka))
  if isinstance(mask_mod, _mods.PrefixLM):
    prefix = jnp.asarray(mask_mod.prefix_lengths)
    if prefix.ndim != 1 or prefix.shape[0] not in (1, B):
      return None
    p = prefix.astype(jnp.int32)[:, None, None]  # [B, 1, 1]
    return _classes(g.kf >= jnp.maximum(g.ql + 1, p), g.kl < jnp.maximum(g.qf + 1, p))
  if isinstance(mask_mod, _mods.Lengths):
    empty, full = False, True
    for lengths, first, last in ((mask_mod.q_lengths, g.qf, g.ql),
                                 (mask_mod.kv_lengths, g.kf, g.kl)):
      if lengths is None:
        continue
      lengths = jnp.asarray(lengths)
      if lengths.ndim != 1 or lengths.shape[0] not in (1, B):
        return None
      n = lengths.astype(jnp.int32)[:, None, None]  # [B, 1, 1]
      empty, full = empty | (first >= n), full & (last < n)
    grid = g.qf + g.kf  # [nq, nk]: a length on one side alone still spans both axes
    return _classes(*jnp.broadcast_arrays(empty, full, grid)[:2])
  if isinstance(mask_mod, _mods.Document):
    q_ids, kv_ids = (jnp.asarray(x) for x in (mask_mod.q_segment_ids, mask_mod.kv_segment_ids))
    if (q_ids.ndim != 2 or kv_ids.ndim != 2 or q_ids.shape[0] not in (1, B)
        or kv_ids.shape[0] not in (1, B) or q_ids.shape[1] < g.T or kv_ids.shape[1] < g.S):
      return None
    q_min, q_max = (x[:, :, None] for x in _id_ranges(q_ids, g.q_offset, g.T, g.bq))
    kv_min, kv_max = (x[:, None, :] for x in _id_ranges(kv_ids, g.kv_offset, g.S, g.bk))
    empty = (q_max < kv_min) | (kv_max < q_min)
    return _classes(empty, (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min))
  if isinstance(mask_mod, (_mods.And, _mods.Or)):
    parts = [_of(m, g, B) for m in mask_mod.mask_mods]
    if not parts or any(p is None for p in parts):
      return None
    combine = jnp.minimum if isinstance(mask_mod, _mods.And) else jnp.maximum
    out = parts[0]
    for p in parts[1:]:
      out = combine(out, p)
    return out
  return None


def closed_form_classes(mask_mod, B: int, T: int, S: int, bq: int, bk: int, q_offset=0,
                        kv_offset=0) -> jax.Array | None:
  """int8 [B|1, 1, nq, nk] EMPTY / PARTIAL / FULL of a ready-made mask over T queries
  from global position q_offset and S keys from kv_offset; None if not ready-made."""
  if not is_closed_form(mask_mod):
    return None
  return _of(mask_mod, _Blocks(T, S, bq, bk, q_offset, kv_offset), B)
