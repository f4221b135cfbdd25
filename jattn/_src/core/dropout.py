"""Dropout on the attention weights: the draw every implementation shares.

One `Dropout` (rate, rng) describes the draw; implementations that hold the
whole grid (dense) and those that go block by block (blockwise) read the same
multipliers, so the same rng drops the same weights everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
