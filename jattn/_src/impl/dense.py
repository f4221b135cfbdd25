"""The whole [B, N, T, S] mask and dropout grid, for implementations that hold it.

Implementations that never hold the grid (blockwise) read the same `Modifiers`
block by block instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn._src.masks.structural import combine_masks
from jattn._src.masks.programmable import dense_mask


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Dropout:
  """Dropout on the attention weights: keep each with probability 1 - rate.

  A pytree: rng is its leaf, rate and broadcast static."""

  rate: float
  rng: jax.Array
  broadcast: bool = False  # one draw for all batch elements and heads, as flax's default

  def tree_flatten(self):
    return (self.rng,), (self.rate, self.broadcast)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], children[0], aux[1])

  def multipliers(self, shape) -> jax.Array:
    """float32 0 or 1 / (1 - rate), so that the expectation of each weight is kept.

    shape is [B, N, ...]; with broadcast the draw is [1, 1, ...], broadcast to it."""
    drawn = (1, 1) + tuple(shape[2:]) if self.broadcast else shape
    kept = jnp.broadcast_to(jax.random.bernoulli(self.rng, 1.0 - self.rate, drawn), shape)
    return jnp.where(kept, jnp.float32(1.0 / (1.0 - self.rate)), jnp.float32(0.0))


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
