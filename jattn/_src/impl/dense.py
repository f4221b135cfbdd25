"""The whole [B, N, T, S] mask and dropout grid, for implementations that hold it.

Implementations that never hold the grid (blockwise) read the same `Modifiers`
block by block instead.
"""

from __future__ import annotations

from jattn._src.masks.structural import combine_masks
from jattn._src.masks.programmable import dense_mask


def dense_mask_and_keep(modifiers, B, N, T, S):
  """A `Modifiers`' user mask ANDed with its structural masks and mask_mod
  ([B|1, N|1, T, S] or None), the dropout multipliers [B, N, T, S] (or None),
  and whether a query row may be left with no key (then its weights must be
  zeroed after the softmax)."""
  spec, has_mod = modifiers.structure, modifiers.has_mask_mod
  may_empty_a_row = modifiers.mask is not None or spec.may_empty_a_row(T, S) or has_mod
  mod_mask = dense_mask(modifiers.mods, B, N, T, S) if has_mod else None
  mask = combine_masks(modifiers.mask, spec.full(T, S), mod_mask)
  dropout = modifiers.dropout
  keep = None if dropout is None else dropout.multipliers((B, N, T, S))
  return mask, keep, may_empty_a_row
