"""Sequence lengths and segment ids as mask mods, for a kernel with no path of its own for
them ("flex_tpu").

`dot_product_attention` takes query_seq_lengths, key_value_seq_lengths and segment ids
as structural masks (`MaskSpec`). A kernel that reads mask mods already has all it needs
for them: `as_mask_mods` moves them into the call's mods as the ready-made
`mods.Document` and `mods.Lengths`, ANDed with the user's mask_mod. The kernel then
reads the ids per tile as it reads any per-token array, the lengths as scalars, and
classifies the tiles in closed form (`closed_form_blocks`), so the tiles past a length or
between documents are skipped. Nothing else changes: is_causal and the window stay
structural, and the integer arrays take no gradient.
"""

from __future__ import annotations

import dataclasses

from jattn._src.masks import mods as _mods
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import Mods, trace_mask_mod
from jattn._src.masks.structural import MaskSpec


def has_lengths_or_segments(structure: MaskSpec) -> bool:
  return any(x is not None for x in (structure.q_lengths, structure.kv_lengths,
                                     structure.q_segment_ids, structure.kv_segment_ids))


def as_mask_mods(modifiers: Modifiers) -> Modifiers:
  """modifiers with the structure's lengths and segment ids moved into the mods' mask.

  A ready-made mask_mod (or none) stays ready-made: And(mask_mod, Document, Lengths),
  its block classes in closed form. A user's function is traced once with the parts
  into one jaxpr (its classes then come from evaluating it block by block, as its own
  did). A block_mask is dropped: it classifies the user's mask alone, and a tile it calls
  FULL may be cut by a document or a length."""
  st = modifiers.structure
  if not has_lengths_or_segments(st):
    return modifiers
  parts = []
  if st.q_segment_ids is not None:
    parts.append(_mods.Document(st.q_segment_ids, st.kv_segment_ids))
  if st.q_lengths is not None or st.kv_lengths is not None:
    parts.append(_mods.Lengths(st.q_lengths, st.kv_lengths))
  mods = modifiers.mods if modifiers.mods is not None else Mods()
  if mods.mask_mod is not None:  # ready-made: traced later, with the parts (`Mods.traced`)
    fields = dict(mask_mod=_mods.And((mods.mask_mod, *parts)), mask_jaxpr=None,
                  mask_consts=())
  elif mods.mask_jaxpr is not None:  # a user's function, or a block_mask's

    def mask(b, n, t, s):
      return mods.mask(b, n, t, s) & _mods.And(tuple(parts))(b, n, t, s)
    jaxpr, consts = trace_mask_mod(mask)
    fields = dict(mask_jaxpr=jaxpr, mask_consts=consts)
  else:
    fields = dict(mask_mod=_mods.And(tuple(parts)))
  return modifiers.replace(
      structure=MaskSpec(is_causal=st.is_causal, local_window=st.local_window),
      mods=dataclasses.replace(mods, block_mask=None, **fields))
