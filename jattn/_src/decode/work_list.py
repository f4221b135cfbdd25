"""Which pages a decoding call reads: the work list, before any key or value is touched.

Row b's queries sit at positions q_first[b] .. q_first[b] + q_lengths[b] - 1.
A page (b, j) holds keys j * page_size .. (j + 1) * page_size - 1 of row b and
is needed unless one of these rules it out, all computed from positions and
block classes alone (int arrays of [B, max_pages]):

  * it starts at or past the row's length (or the row has no query);
  * causal: it starts after the last query; window (left, right): it ends
    before first query - left or starts after last query + right;
  * mask_mod leaves it EMPTY for every query and head: in closed form for the
    ready-made jattn.mods masks (`closed_form_blocks`), else by evaluating
    mask_mod on the page's positions (no key or value read).

The needed pages of all rows are listed, row by row, as (row, table slot)
pairs; `items` pads the list to a multiple of the step size W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.decode import tile as _tile
from jattn._src.masks.closed_form_blocks import EMPTY, closed_form_classes, is_closed_form


def in_range(cache, *, q_first, q_lengths, causal: bool, window) -> jax.Array:
  """bool [B, max_pages]: pages holding keys that the structural masks leave visible."""
  ps = cache.page_size
  first = jnp.arange(cache.max_pages, dtype=jnp.int32)[None, :] * ps  # [1, M]
  last = first + ps - 1
  q_last = q_first + q_lengths - 1  # [B]
  lo = jnp.zeros_like(q_first)
  hi = cache.lengths - 1  # [B]: last key, inclusive
  if causal:
    hi = jnp.minimum(hi, q_last)
  if window is not None:
    lo = jnp.maximum(lo, q_first - window[0])
    hi = jnp.minimum(hi, q_last + window[1])
  return (first <= hi[:, None]) & (last >= lo[:, None]) & (q_lengths > 0)[:, None]


def closed_form_fits(mask_mod, *, B: int, T: int, page_size: int, max_pages: int) -> bool:
  """Whether `closed_form_nonempty` classifies this cache's pages in closed form (a
  ready-made mask whose arrays fit the max_pages * page_size keys: e.g. document ids
  max_length long that are no whole number of pages do not), from static shapes only."""
  if not is_closed_form(mask_mod):
    return False
  one = lambda offset: closed_form_classes(mask_mod, B, T, max_pages * page_size, T,
                                           page_size, offset, 0)
  return jax.eval_shape(one, jnp.zeros((), jnp.int32)) is not None


def closed_form_nonempty(mask_mod, cache, *, q_first, T: int):
  """bool [B, max_pages]: pages the ready-made mask leaves non-EMPTY for row b's T
  queries from q_first[b]; None if its classes have no closed form for this cache.

  Query slots past a row's real queries only widen the range classified, so an
  EMPTY page is EMPTY for the real queries too.
  """
  B, ps, M = cache.batch_size, cache.page_size, cache.max_pages
  if not closed_form_fits(mask_mod, B=B, T=T, page_size=ps, max_pages=M):
    return None
  one = lambda offset: closed_form_classes(mask_mod, B, T, M * ps, T, ps, offset, 0)
  classes = jax.vmap(one)(q_first)[:, :, 0, 0, :]  # [B (offsets), B|1, M]
  own = jnp.arange(B, dtype=jnp.int32) if classes.shape[1] == B else jnp.zeros((B,), jnp.int32)
  return classes[jnp.arange(B, dtype=jnp.int32), own] != EMPTY


def items(needed: jax.Array, W: int):
  """needed bool [B, M] -> (rows, slots int32 [L], count): the needed pages, row by row,
  padded to L = a multiple of W (the padding past `count` is never used as is)."""
  B, M = needed.shape
  L = -(-(B * M) // W) * W
  flat = jnp.nonzero(needed.reshape(-1), size=L, fill_value=0)[0].astype(jnp.int32)
  return flat // M, flat % M, jnp.sum(needed, dtype=jnp.int32)


def steps(count, W: int):
  """The number of steps of W items (traced: the loops run only over the needed pages)."""
  return (count + W - 1) // W


def at_step(rows, slots, count, i, W: int):
  """Step i's W items (rows, slots int32 [W]) and which are real (bool [W]).

  Padding items repeat the step's first item, a page the step reads anyway,
  so no page outside the list is ever read; `valid` masks them out.
  """
  r = lax.dynamic_slice_in_dim(rows, i * W, W)
  j = lax.dynamic_slice_in_dim(slots, i * W, W)
  valid = i * W + jnp.arange(W, dtype=jnp.int32) < count
  return jnp.where(valid, r, r[0]), jnp.where(valid, j, j[0]), valid


def mask_nonempty(mods, cache, needed, *, q_pos, q_valid, causal, window, N: int, W: int):
  """needed bool [B, M] with the pages mask_mod leaves EMPTY removed: mask_mod evaluated
  on the positions of the pages in `needed` only, W at a time (no key or value read)."""
  B, M, ps = cache.batch_size, cache.max_pages, cache.page_size
  rows, slots, count = items(needed, W)
  heads = jnp.arange(N, dtype=jnp.int32).reshape(N, 1)

  def step(i, seen):
    r, j, valid = at_step(rows, slots, count, i, W)
    s_pos = j[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]  # [W, S]
    s_valid = (s_pos < cache.lengths[r][:, None]) & valid[:, None]
    keep = _tile.visible(mods, rows=r, heads=heads, q_pos=q_pos[r], q_valid=q_valid[r],
                         s_pos=s_pos, s_valid=s_valid, causal=causal, window=window)
    some = jnp.any(keep, axis=(1, 2, 3, 4))  # [W]
    return seen.at[jnp.where(valid, r * M + j, B * M)].set(some, mode="drop")

  seen = lax.fori_loop(0, steps(count, W), step, jnp.zeros((B * M,), bool))
  return needed & seen.reshape(B, M)
