"""A kernel plan's built-in masks per tile, for jattn's own kernels: the block classes
(EMPTY / PARTIAL / FULL per (query tile, kv tile)) that drive block skipping (closed
forms for is_causal, windows and the ready-made `jattn.mods` masks, a `block_mask`
made with the same tiles, else mask_mod evaluated block by block (`classify`), ANDed
by the least class), and the same masks entry by entry inside one tile (`tile_keep`).
"""

from __future__ import annotations

import jax.numpy as jnp

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
    nq, nk = p.T_padded // bq, p.S_padded // bk
    bm = mods.block_mask
    if not p.offsets and bm is not None and bm.T == p.T and bm.S == p.S and tuple(
        bm.classes.shape[2:]) == (nq, nk) and (bm.block_sizes.q, bm.block_sizes.kv) == (bq, bk):
      classes = bm.classes
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
