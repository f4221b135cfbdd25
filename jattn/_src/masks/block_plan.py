"""Which blocks of the [T, S] grid a blockwise pass computes, and which need a mask.

The causal, local-window and length masks are intervals in the key position
for a fixed query (and in the query position for a fixed key), so for a block
of queries [q_first, q_last] the keys that some query may see form one
interval, and the keys that every query sees form another. Blocks outside the
first are skipped; blocks inside the second are computed without a mask.
Segment ids are tested per block by the range of ids on each side.

Positions are global (a block's offset included); results are block indices
(jax int32 scalars, since offsets and lengths may be traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.masks.structural import MaskSpec

_BIG = 2**30  # "no bound": beyond any position, and safe from int32 overflow.


def _floor_div(a, b):
  return jnp.floor_divide(a, b)


def _ceil_div(a, b):
  return -jnp.floor_divide(-a, b)


def _max_or_big(lengths):
  return _BIG if lengths is None else jnp.max(lengths)


def _min_or_big(lengths):
  return _BIG if lengths is None else jnp.min(lengths)


def kv_blocks(spec: MaskSpec, q_first, q_last, kv_offset, kv_size: int,
              block: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(lo, hi, visible_lo, visible_hi): kv block indices, local to this kv range.

  Blocks [lo, hi) hold every key some query in [q_first, q_last] may see;
  [visible_lo, visible_hi) (inside it) the blocks every such query sees
  entirely, so they need no mask. kv_size is the true (unpadded) number of keys.
  """
  kv_min, kv_end = jnp.int32(0), jnp.int32(_BIG)  # some query sees [kv_min, kv_end)
  vis_min, vis_end = jnp.int32(0), jnp.int32(_BIG)  # every query sees [vis_min, vis_end)
  if spec.is_causal:
    kv_end = jnp.minimum(kv_end, q_last + 1)
    vis_end = jnp.minimum(vis_end, q_first + 1)
  if spec.local_window is not None:
    left, right = spec.local_window
    kv_min = jnp.maximum(kv_min, q_first - left)
    kv_end = jnp.minimum(kv_end, q_last + right + 1)
    vis_min = jnp.maximum(vis_min, q_last - left)
    vis_end = jnp.minimum(vis_end, q_first + right + 1)
  kv_end = jnp.minimum(kv_end, _max_or_big(spec.kv_lengths))
  vis_end = jnp.minimum(vis_end, _min_or_big(spec.kv_lengths))
  # No key for queries past every length; not every query is valid past the least.
  kv_end = jnp.where(q_first >= _max_or_big(spec.q_lengths), kv_min, kv_end)
  vis_end = jnp.where(q_last >= _min_or_big(spec.q_lengths), vis_min, vis_end)
  return _block_range(spec, kv_min, kv_end, vis_min, vis_end, kv_offset, kv_size, block)


def q_blocks(spec: MaskSpec, kv_first, kv_last, q_offset, q_size: int,
             block: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The transpose of `kv_blocks`: q block indices for keys [kv_first, kv_last]."""
  q_min, q_end = jnp.int32(0), jnp.int32(_BIG)
  vis_min, vis_end = jnp.int32(0), jnp.int32(_BIG)
  if spec.is_causal:  # query i sees key j when j <= i
    q_min = jnp.maximum(q_min, kv_first)
    vis_min = jnp.maximum(vis_min, kv_last)
  if spec.local_window is not None:  # i - left <= j <= i + right
    left, right = spec.local_window
    q_min = jnp.maximum(q_min, kv_first - right)
    q_end = jnp.minimum(q_end, kv_last + left + 1)
    vis_min = jnp.maximum(vis_min, kv_last - right)
    vis_end = jnp.minimum(vis_end, kv_first + left + 1)
  q_end = jnp.minimum(q_end, _max_or_big(spec.q_lengths))
  vis_end = jnp.minimum(vis_end, _min_or_big(spec.q_lengths))
  q_end = jnp.where(kv_first >= _max_or_big(spec.kv_lengths), q_min, q_end)
  vis_end = jnp.where(kv_last >= _min_or_big(spec.kv_lengths), vis_min, vis_end)
  return _block_range(spec, q_min, q_end, vis_min, vis_end, q_offset, q_size, block)


def _block_range(spec, first, end, vis_first, vis_end, offset, size: int, block: int):
  """Global position ranges -> (lo, hi, visible_lo, visible_hi) block indices of a
  range of `size` positions starting at `offset`: [first, end) some position
  needs, [vis_first, vis_end) every position sees whole."""
  count = _ceil_div(size, block)
  lo = jnp.clip(_floor_div(first - offset, block), 0, count)
  hi = jnp.clip(_ceil_div(end - offset, block), lo, count)
  # Only whole blocks of real positions are visible: the last one may hold padding.
  vis_lo = jnp.clip(_ceil_div(vis_first - offset, block), lo, hi)
  vis_hi = jnp.clip(_floor_div(jnp.minimum(vis_end - offset, size), block), vis_lo, hi)
  if spec.q_segment_ids is not None:
    vis_lo = vis_hi = hi  # segments are tested block by block, always masked
  return lo, hi, vis_lo, vis_hi


def segment_ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """int [B, L] (L a multiple of block) -> (min, max) per block, each [B, L // block]."""
  blocks = ids.reshape(ids.shape[0], -1, block)
  return blocks.min(axis=-1), blocks.max(axis=-1)


def segments_meet(q_range, kv_range, i, j) -> jax.Array:
  """bool: some batch row's q block i and kv block j share an id range.

  Exact for sorted (packed) segment ids; for unsorted ids it only skips
  blocks whose id ranges are disjoint, which is still safe.
  """
  q_min, q_max = (r[:, i] for r in q_range)
  kv_min, kv_max = (r[:, j] for r in kv_range)
  return jnp.any((q_max >= kv_min) & (q_min <= kv_max))
