"""Rotary position embeddings (RoPE, Su et al. 2021) for queries and keys.

Each pair of features (x[i], x[i + H/2]) of a token at position p is rotated by
the angle p * base**(-2i / H), so the logit q_t . k_s depends on the positions
only through t - s. `rope` is the pure function on one head of one example;
`rope_heads` applies it to the per-head arrays of either module layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jattn._src.core.explicit_axes import explicit_sharding

DEFAULT_BASE = 10_000.0


def rope(x: jax.Array, positions: jax.Array, *, base: float = DEFAULT_BASE) -> jax.Array:
  """x [T, H], positions int [T] -> x rotated, [T, H] (H even; the "rotate half"
  pairing of GPT-NeoX and gemma). Computed in float32, returned in x's dtype.

  Args:
    x: one head's queries or keys, [T, H].
    positions: int [T], each token's position.
    base: the frequencies' base (10000).

  Raises:
    ValueError: x not [T, H], H odd, or positions not [T].

  Examples:
    >>> import jax.numpy as jnp, jattn.rope
    >>> jattn.rope.rope(jnp.ones((3, 4)), jnp.arange(3)).shape
    (3, 4)
  """
  if x.ndim != 2:
    raise ValueError(f"x: expected rank 2 [T, H], got shape {x.shape}")
  T, H = x.shape
  if H % 2:
    raise ValueError(f"x: expected an even depth H to rotate in pairs, got shape {x.shape}")
  if positions.shape != (T,):
    raise ValueError(f"positions: expected shape [T] = {(T,)}, got shape {positions.shape}")
  inv_freq = base ** (-jnp.arange(H // 2, dtype=jnp.float32) * 2 / H)  # [H/2]
  angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [T, H/2] each
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# the per-head arrays of jattn.nnx.MultiHeadAttention: x axes (B, T, N|K, H) or
# (B, N|K, H, T); vmap over N|K then B down to rope's [T, H]
_HEADS_AXES = {"rows": (2, 0), "columns": (1, 0)}


def rope_heads(x: jax.Array, positions: jax.Array, *, layout: str,
               base: float = DEFAULT_BASE) -> jax.Array:
  """x [B, T, N, H] (rows) or [B, N, H, T] (columns), positions int [B, T]
  (each batch element its own) -> x rotated, same shape.

  `jattn.rope.rope` on every batch element and head; layout is "rows" or
  "columns", as the modules' (its ValueErrors are rope's).

  Examples:
    >>> import jax.numpy as jnp, jattn.rope
    >>> jattn.rope.rope_heads(jnp.ones((2, 3, 4, 8)), jnp.zeros((2, 3), int), layout="rows").shape
    (2, 3, 4, 8)
  """
  one = lambda x, p: rope(x, p, base=base)  # noqa: E731
  if layout == "columns":
    one = lambda x, p: rope(x.T, p, base=base).T  # noqa: E731  [H, T] <-> [T, H]
  heads_axis, batch_axis = _HEADS_AXES[layout]
  sharding = explicit_sharding(x)
  if sharding is not None:  # Explicit axes: vmap pairs rows only of arrays sharded alike
    positions = jax.sharding.reshard(
        positions, NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[batch_axis], None)))
  per_example = jax.vmap(one, in_axes=(heads_axis - 1, None), out_axes=heads_axis - 1)
  return jax.vmap(per_example, in_axes=(batch_axis, 0), out_axes=batch_axis)(x, positions)
