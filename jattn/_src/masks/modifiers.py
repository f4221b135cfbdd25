"""`Modifiers`: everything a call adds to plain softmax(q k^T) v, in one value.

`dot_product_attention` checks its arguments, then builds one `Modifiers` and
hands it to the implementation it chose, which reads from it what it needs:

  bias      float [B|1, N|1, T, S] or None, added to the logits
  mask      bool [B|1, N|1, T, S] or None, the user's dense mask
  structure `MaskSpec`: is_causal, local window, lengths, segment ids
  mods      `Mods` or None: mask_mod / score_mod (traced), sinks, block_mask
  dropout   `Dropout` or None
  scale     multiplies the logits: a Python number (static) or an array

It is a pytree: arrays are leaves, flags and sizes are static (part of the
tree structure), so it passes through `jax.jit` and `jax.custom_vjp` as it
is, and a custom VJP returns the gradients of bias, sinks and score_mod's
arrays in a `Modifiers` of the same shape (None for the rest).
"""

from __future__ import annotations

import dataclasses

import jax

from jattn._src.core.dropout import Dropout
from jattn._src.masks.structural import MaskSpec


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Modifiers:
  """The bias, masks, mods, dropout and scale of one attention call (see module docstring)."""

  bias: jax.Array | None = None
  mask: jax.Array | None = None
  structure: MaskSpec = MaskSpec()
  mods: object = None  # `_programmable.Mods` or None
  dropout: Dropout | None = None
  scale: object = 1.0

  def tree_flatten(self):
    children = (self.bias, self.mask, self.structure, self.mods, self.dropout)
    if _is_number(self.scale):  # static: cuDNN takes it as a number
      return children, (self.scale,)
    return children + (self.scale,), ()

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  @property
  def has_mask_mod(self) -> bool:
    return self.mods is not None and self.mods.has_mask

  @property
  def has_score_mod(self) -> bool:
    return self.mods is not None and self.mods.has_score

  @property
  def sinks(self) -> jax.Array | None:
    return None if self.mods is None else self.mods.sinks

  def replace(self, **changes) -> "Modifiers":
    return dataclasses.replace(self, **changes)

  def gradients(self, *, bias=None, mods=None) -> "Modifiers":
    """A cotangent of this value: the given gradients, None (zero) everywhere else."""
    return Modifiers(bias=bias, mask=None, structure=None, mods=mods, dropout=None,
                     scale=self.scale if _is_number(self.scale) else None)


def _is_number(scale) -> bool:
  """A Python int or float, static in the pytree. Not its subclasses: jax's literals
  (`TypedFloat`) stand for a traced scale in residuals (the backward pass of a shard_map
  folds constants), and a cotangent must keep the primal's structure."""
  return type(scale) in (int, float)
