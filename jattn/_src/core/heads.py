"""Grouped heads: N query heads as K key/value heads of G = N // K queries each.

Implementations broadcast K/V against the queries of their group by viewing
the heads axis N as (K, G) in place, never by repeating K/V.
"""

from __future__ import annotations

import jax


def split_heads(x: jax.Array, axis: int, num_kv_heads: int) -> jax.Array:
  """Reshapes the heads axis N into (K, G) in place."""
  N = x.shape[axis]
  return x.reshape(x.shape[:axis] + (num_kv_heads, N // num_kv_heads) + x.shape[axis + 1:])


def grouped_logical(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
  """[B|1, N|1, T, S] -> [B|1, K|1, G|1, T, S], to broadcast against the logits."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return split_heads(x, 1, num_kv_heads)
