"""The block classes (EMPTY / PARTIAL / FULL per (query tile, kv tile)) that drive block
skipping in jattn's own kernels, from a plan's tiles and masks: closed forms for
is_causal, windows and the ready-made `jattn.mods` masks, a `block_mask` made with the
same tiles, else mask_mod evaluated block by block (`classify`), ANDed by the least class.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn import mods as jattn_mods
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
