"""A kernel plan's built-in masks per tile, for jattn's own kernels: the block classes
(EMPTY / PARTIAL / FULL per (query tile, kv tile)) that drive block skipping (closed
forms for is_causal, windows and the ready-made `jattn.mods` masks, a `block_mask`
made with the same tiles, else mask_mod evaluated block by block (`classify`), ANDed
by the least class), the same masks entry by entry inside one tile (`tile_keep`, and
`band_keep`: causal and the window as one band of s - t), and the grid's widths when
it runs only the non-empty tiles (`grid_widths`, narrowed by a ready-made mask_mod's
band: `mask_band`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.masks import mods as jattn_mods
from jattn._src.masks.block_mask import classify
from jattn._src.masks.closed_form_blocks import closed_form_classes


def tile_classes(p, mods, origin=(0, 0)):
  """int32 [B|1, N|1, nq, nk]: the classes of the plan's tiles (1 along an axis the masks
  do not depend on); origin: the global position of the first query and key (traced
  under `p.offsets`, a ring step's). p: a kernel plan (block_q, block_kv, T, S, B, N,
  is_causal, window, has_mask_mod, offsets, T_padded, S_padded); mods: traced `Mods`."""
  bq, bk = p.block_q, p.block_kv
  parts = []
  at = () if not p.offsets else origin  # closed_form_classes / classify: offsets 0 by default
  if p.is_causal:
    parts.append(closed_form_classes(jattn_mods.Causal(), 1, p.T, p.S, bq, bk, *at))
  if p.window is not None:
    parts.append(closed_form_classes(jattn_mods.SlidingWindow(*p.window), 1, p.T, p.S, bq, bk,
                                     *at))
  if p.has_mask_mod:
    if classes_given(p, mods):
      classes = mods.block_mask.classes
    else:
      classes = None
      if mods.mask_mod is not None:
        classes = closed_form_classes(mods.mask_mod, p.B, p.T, p.S, bq, bk, *at)
      if classes is None:
        classes = classify(mods, p.B, p.N, p.T, p.S, bq, bk, *at)
        classes = classes[:None if mods.mask_uses(0) else 1, :None if mods.mask_uses(1) else 1]
    parts.append(classes)
  classes = parts[0].astype(jnp.int32)
  for part in parts[1:]:  # AND of masks: the least class (EMPTY < PARTIAL < FULL)
    classes = jnp.minimum(classes, part.astype(jnp.int32))
  return classes


def classes_given(p, mods) -> bool:
  """Whether the call's block_mask gives the classes of the plan's tiles (made for its T,
  S and tiles, no ring offsets): the kernels then follow it as given, FULL tiles
  unmasked, and no band narrows the grid (`grid_widths`)."""
  bm = None if mods is None else mods.block_mask
  nq, nk = p.T_padded // p.block_q, p.S_padded // p.block_kv
  return (not p.offsets and bm is not None and bm.T == p.T and bm.S == p.S
          and tuple(bm.classes.shape[2:]) == (nq, nk)
          and (bm.block_sizes.q, bm.block_sizes.kv) == (p.block_q, p.block_kv))


def both(keep, more):
  """keep & more, where keep None means nothing is masked yet."""
  return more if keep is None else keep & more


def tile_keep(p, t_loc, s_loc, t_pos, s_pos, full: bool):
  """bool [bq, bk] (or None: nothing masked): the tile's entries that padding, is_causal
  and the window leave visible. t_loc, s_loc: positions in the padded arrays; t_pos,
  s_pos: global positions (the same but under `p.offsets`). full: a FULL tile, where
  causal and window hide nothing: only the padding is masked."""
  keep = None
  if p.S_padded != p.S:
    keep = both(keep, s_loc < p.S)
  if p.T_padded != p.T:  # padded queries: zero rows, but score_mod may make them large
    keep = both(keep, t_loc < p.T)
  if p.is_causal and not full:
    keep = both(keep, s_pos <= t_pos)
  if p.window is not None and not full:
    left, right = p.window
    keep = both(keep, (s_pos >= t_pos - left) & (s_pos <= t_pos + right))
  return keep


def band_keep(p, i, j, origin, full: bool):
  """bool [bq, bk] (or None: nothing masked): `tile_keep` for tile (i, j), causal and the
  window as one band of offsets lo <= s - t <= hi, compared as a column of query
  positions [bq, 1] against a row of key positions [1, bk]. Where the band is at least
  as wide as a tile's offsets (hi - lo >= bq + bk - 2), a tile can cut only one of its
  bounds: the one it cuts is picked by scalars and tested by one compare
  (s <= t + hi, or -s <= -t - lo), so a PARTIAL tile of a window costs what a causal one
  does (benchmarks/tpu_schedule.py). origin: the first query's and key's global
  positions (int32 scalars under `p.offsets`, else (0, 0))."""
  bq, bk = p.block_q, p.block_kv
  keep = None
  if p.S_padded != p.S:
    keep = both(keep, jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) < p.S - j * bk)
  if p.T_padded != p.T:  # padded queries: zero rows, but score_mod may make them large
    keep = both(keep, jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0) < p.T - i * bq)
  lo, hi = band(p)
  if full or (lo is None and hi is None):
    return None if keep is None else jnp.broadcast_to(keep, (bq, bk))
  t = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)  # [bq, 1]
  s = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # [1, bk]
  if p.offsets:
    t, s = t + origin[0], s + origin[1]
  if lo is not None and hi is not None and hi - lo >= bq + bk - 2:
    # the tile's least offset s - t: at or past lo, only hi can cut it; else only lo
    upper = (j * bk - i * bq - (bq - 1)) + (
        (origin[1] - origin[0]) if p.offsets else 0) >= lo
    sign = jnp.where(upper, 1, -1).astype(jnp.int32)
    bound = jnp.where(upper, hi, -lo).astype(jnp.int32)
    return jnp.broadcast_to(both(keep, sign * s <= sign * t + bound), (bq, bk))
  if hi is not None:
    keep = both(keep, s <= t + hi)
  if lo is not None:
    keep = both(keep, s >= t + lo)
  return jnp.broadcast_to(keep, (bq, bk))


def band(p):
  """(lo, hi): the offsets s - t that causal and the window leave visible, lo <= s - t <=
  hi (None: unbounded on that side)."""
  lo = hi = None
  if p.window is not None:
    lo, hi = -p.window[0], p.window[1]
  if p.is_causal:
    hi = 0 if hi is None else min(hi, 0)
  return lo, hi


def mask_band(mask_mod) -> tuple[int | None, int | None]:
  """(lo, hi): the offsets s - t outside which a ready-made mask_mod hides every entry,
  lo <= s - t <= hi (None: unbounded on that side), from its static fields: causal and
  sliding_window as `band`, chunked(c) within c - 1 either way, and_masks the
  intersection, or_masks the hull; any other mask (documents, prefix_lm, lengths, a
  hand-written function) bounds nothing."""
  if isinstance(mask_mod, jattn_mods.Causal):
    return None, 0
  if isinstance(mask_mod, jattn_mods.SlidingWindow):
    return -mask_mod.left, mask_mod.right
  if isinstance(mask_mod, jattn_mods.Chunked):
    return -(mask_mod.size - 1), mask_mod.size - 1
  if isinstance(mask_mod, jattn_mods.And):
    return functools.reduce(_intersect, map(mask_band, mask_mod.mask_mods), (None, None))
  if isinstance(mask_mod, jattn_mods.Or):
    los, his = zip(*map(mask_band, mask_mod.mask_mods))
    return (None if None in los else min(los), None if None in his else max(his))
  return None, None


def _intersect(a, b):
  """The intersection of two bands (lo, hi), None unbounded."""
  lo = [x for x in (a[0], b[0]) if x is not None]
  hi = [x for x in (a[1], b[1]) if x is not None]
  return (max(lo) if lo else None), (min(hi) if hi else None)


def grid_widths(p) -> tuple[int, int]:
  """(kv width, q width), static: the most non-empty kv tiles a query tile's row can
  have (the forward's and dq's grid runs only those, `flex_tpu_kernels`), and the most
  non-empty query tiles a kv tile's column can have (dk/dv's). Bounded by causal, the
  window and the band of a ready-made mask_mod (`p.mask_band`, set where no block_mask
  gives the classes; a mask can only remove tiles); exact from the tile edges, or, under
  `p.offsets` (positions traced), the most tiles a band of that width can touch."""
  nq, nk = p.T_padded // p.block_q, p.S_padded // p.block_kv
  lo, hi = _intersect(band(p), p.mask_band)
  if lo is None and hi is None:
    return nk, nq
  if p.offsets:
    if lo is None or hi is None:
      return nk, nq
    span = hi - lo  # a query tile's keys span bq + span positions; a kv tile's queries bk + span
    return (min(nk, -(-(p.block_q + span - 1) // p.block_kv) + 1),
            min(nq, -(-(p.block_kv + span - 1) // p.block_q) + 1))
  qf = np.arange(nq)[:, None] * p.block_q
  ql = np.minimum(qf + p.block_q, p.T) - 1
  kf = np.arange(nk)[None, :] * p.block_kv
  kl = np.minimum(kf + p.block_kv, p.S) - 1
  seen = np.ones((nq, nk), bool)  # some (t, s) of the tile has lo <= s - t <= hi
  if hi is not None:
    seen &= kf - ql <= hi
  if lo is not None:
    seen &= kl - qf >= lo
  return max(int(seen.sum(1).max()), 1), max(int(seen.sum(0).max()), 1)
