"""Boolean attention masks, True = may attend, broadcastable to [B, N, T, S].

Each structural mask is a predicate on query and key positions, so a block of
the [T, S] grid can be built from the positions of its rows and columns alone
(`MaskSpec.block`) without ever building the whole grid.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


def _window(window) -> tuple[int, int]:
  """An int w means (w, w): w keys to the left and w to the right."""
  if isinstance(window, int):
    return (window, window)
  left, right = window
  return (int(left), int(right))


def causal_mask(T: int, S: int) -> jax.Array:
  """bool [T, S]: query i attends key j when j <= i (aligned at the start, as jax.nn).

  Examples:
    >>> import jattn
    >>> jattn.causal_mask(2, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
  """
  return jnp.arange(S, dtype=jnp.int32)[None, :] <= jnp.arange(T, dtype=jnp.int32)[:, None]


def local_mask(T: int, S: int, window) -> jax.Array:
  """bool [T, S]: query i attends keys i - left <= j <= i + right.

  window: int w for (w, w), or (left, right), as jax.nn's local_window_size.

  Examples:
    >>> import jattn
    >>> jattn.local_mask(3, 3, (1, 0)).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  """
  left, right = _window(window)
  # j - i
  offset = jnp.arange(S, dtype=jnp.int32)[None, :] - jnp.arange(T, dtype=jnp.int32)[:, None]
  return (offset >= -left) & (offset <= right)


def padding_mask(q_lengths, kv_lengths, T: int, S: int) -> jax.Array:
  """bool [B, 1, T, S]: query i < q_lengths[b] attends key j < kv_lengths[b].

  Either length may be None (no padding on that side): lengths are int [B].

  Examples:
    >>> import jattn
    >>> jattn.padding_mask([1, 2], None, 2, 2).astype(int).tolist()
    [[[[1, 1], [0, 0]]], [[[1, 1], [1, 1]]]]
  """
  q_valid = _valid_positions(q_lengths, T)  # [B or 1, T]
  kv_valid = _valid_positions(kv_lengths, S)  # [B or 1, S]
  return q_valid[:, None, :, None] & kv_valid[:, None, None, :]


def _valid_positions(lengths, L: int) -> jax.Array:
  """bool [B, L]: position < length; [1, L] all True when lengths is None."""
  if lengths is None:
    return jnp.ones((1, L), bool)
  return jnp.arange(L, dtype=jnp.int32)[None, :] < jnp.asarray(lengths)[:, None]


def segment_mask(q_segment_ids, kv_segment_ids) -> jax.Array:
  """bool [B, 1, T, S]: query attends key only within the same segment id.

  q_segment_ids int [B, T], kv_segment_ids int [B, S]: packed sequences.

  Examples:
    >>> import jattn
    >>> jattn.segment_mask([[0, 0, 1]], [[0, 0, 1]])[0, 0].astype(int).tolist()
    [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
  """
  q_ids = jnp.asarray(q_segment_ids)
  kv_ids = jnp.asarray(kv_segment_ids)
  return q_ids[:, None, :, None] == kv_ids[:, None, None, :]


def combine_masks(*masks) -> jax.Array | None:
  """Logical AND of the masks that are not None; None when all are None.

  The masks broadcast against each other (e.g. [T, S] with [B, 1, T, S]).

  Examples:
    >>> import jattn
    >>> m = jattn.combine_masks(jattn.causal_mask(2, 2), None, jattn.padding_mask(None, [1], 2, 2))
    >>> m.astype(int).tolist()
    [[[[1, 0], [1, 0]]]]
  """
  present = [jnp.asarray(m) for m in masks if m is not None]
  if not present:
    return None
  return functools.reduce(jnp.logical_and, present)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The structural masks of one call, applied lazily to any block of [T, S].

  A pytree: the arrays (lengths [B], segment ids [B, T] / [B, S], jax arrays
  or None) are its leaves, is_causal and local_window static.
  """

  is_causal: bool = False
  local_window: tuple[int, int] | None = None
  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None

  def tree_flatten(self):
    return ((self.q_lengths, self.kv_lengths, self.q_segment_ids, self.kv_segment_ids),
            (self.is_causal, self.local_window))

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*aux, *children)

  @property
  def is_empty(self) -> bool:
    """No structural mask (mods aside: they are applied by each implementation)."""
    return (not self.is_causal and self.local_window is None
            and self.q_lengths is None and self.kv_lengths is None
            and self.q_segment_ids is None)

  def may_empty_a_row(self, T: int, S: int) -> bool:
    """Whether some query may be left with no key to attend to.

    Causal alone always leaves key 0 (S >= 1); a window leaves key i to every
    query i < S + left; lengths and segment ids are data, so they may.
    """
    if self.q_lengths is not None or self.kv_lengths is not None:
      return True
    if self.q_segment_ids is not None or S == 0:
      return True
    return self.local_window is not None and T > S + self.local_window[0]

  def block(self, q_pos: jax.Array, kv_pos: jax.Array,
            q_ids: jax.Array | None = None,
            kv_ids: jax.Array | None = None) -> jax.Array | None:
    """bool [B or 1, 1, t, s] for query positions q_pos [t] and key positions kv_pos [s].

    q_ids [B, t] / kv_ids [B, s]: the segment ids of those positions (the
    whole arrays by default, for a block covering all of T and S).
    """
    if self.is_empty:
      return None
    offset = kv_pos[None, :] - q_pos[:, None]  # [t, s], j - i
    grid = jnp.ones(offset.shape, bool)
    if self.is_causal:
      grid &= offset <= 0
    if self.local_window is not None:
      left, right = self.local_window
      grid &= (offset >= -left) & (offset <= right)
    mask = grid[None, None]  # [1, 1, t, s]
    if self.q_lengths is not None:
      mask = mask & (q_pos[None, :] < self.q_lengths[:, None])[:, None, :, None]
    if self.kv_lengths is not None:
      mask = mask & (kv_pos[None, :] < self.kv_lengths[:, None])[:, None, None, :]
    if self.q_segment_ids is not None:
      q_ids = self.q_segment_ids if q_ids is None else q_ids
      kv_ids = self.kv_segment_ids if kv_ids is None else kv_ids
      mask = mask & segment_mask(q_ids, kv_ids)
    return mask

  def full(self, T: int, S: int) -> jax.Array | None:
    """bool [B or 1, 1, T, S] over the whole grid."""
    return self.block(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32))
