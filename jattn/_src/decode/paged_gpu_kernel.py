"""The Pallas Triton kernel of "paged_gpu": one program per (chunk c, kv head k), its
pages read from the pool by the block table, never a gathered copy.

Inputs (whole-array refs in global memory, read with scalar or gather loads): each
chunk's row, first list entry and number of entries (`chunk_row`, `chunk_lo`,
`chunk_n` int32 [chunks]: 0 entries past the last real chunk), the rows' listed
pool pages and their table slots, row by row (`pages`, `slots` int32 [B * M],
the first counts[b] of row b's M entries real), lengths,
the first query's position and the number of queries per row, the scale, then
the mods' captured arrays (flat). The queries q [B, K, R, H] are read at
(b, k), a tile [R, H]: the G query heads of kv head k and their T queries are the rows of one
tile (row r = g T + t_, rows past G T padding up to R, a power of two >= 16 for
Triton's dot), so each page of kv head k is read once for its G heads.

Chunk c of row b takes the row's list entries [lo, lo + n) (n <= C = `per_split`
pages) and walks them W pages a step: the step's W pool page ids are loaded
from the list, and its [W S, H] keys and [W S, D] values are gathered straight
from the pool (`_at_page`: the one place that knows the pool's layout), masked
so that nothing past the list or the row's length is read. The mods are
evaluated on each [R, W S] tile by `tile_mods` at global positions: t of tile
row r is q_first[b] + r % T, s = slot * S + column % S.

int8 pools arrive as int8 (a step's HBM reads are the int8 bytes) followed by
their float32 scales [P, K] (`k_scales`, `v_scales`, only for an int8 pool):
each key's scale is gathered by the same page id as the key, the int8 tile is
cast to the query's dtype (exact: |q| <= 127), the key scale multiplies the
logits column by column (s = scale_k (q . k_int8)) and the value scale the
probabilities before P V (sum_s p_s scale_s v_s); l sums the unscaled
probabilities. An unread key's scale loads as 0 (its page id is always one of the
row's listed pages, never a free page's NaN scale, so this is belt and braces).

Outputs: the chunk's partial softmax, relative to its own max, float32: m, l
[R] and o [R, D], written only by a chunk that read a page (the caller keeps
the others out of the log-sum-exp merge); `paged_gpu` merges and adds sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn._src import compat
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import tile_mods


def _at_page(pool, page, slot, k):
  """The pool's rows of kv head k at (page[i], slot[i]) for each i: a ref view [W S, X].

  pool [P, K, S, X] (keys X = H, values X = D: each kv head's tokens of a page
  contiguous, S X elements). The one function that knows the pool's layout. Every
  index an int array (a gather: interpret mode takes no slice beside them)."""
  feature = jnp.arange(pool.shape[-1], dtype=jnp.int32)[None, :]
  return pool.at[page[:, None], k, slot[:, None], feature]


def _page_scales(scales, page, k, read):
  """float32 [W S]: scales [P, K] of kv head k at each key's page id; 0 where unread."""
  plgpu = compat.load("pallas_triton")
  return plgpu.load(scales.at[page, k], mask=read, other=0.0)


def _dot(a, b, contract):
  """float32 a . b; float32 inputs at full precision (Triton's default for them is TF32)."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _reader(refs, meta):
  def read(i, flat):
    x = refs[i][flat]
    return x != 0 if meta[i][1] == jnp.bool_ else x
  return read


def _per_head(evaluate, uses_n: bool, k, G: int, rows_g, tile):
  """evaluate(n) on the tile, each row with its own head n = k G + g (rows_g [R, W S]):
  once if the function ignores n, else once per g, rows picked by g."""
  if not uses_n or G == 1:
    return jnp.broadcast_to(evaluate(k * G), tile)
  out = None
  for g in range(G):
    y = jnp.broadcast_to(evaluate(k * G + g), tile)
    out = y if out is None else jnp.where(rows_g == g, y, out)
  return out


def kernel(*refs, p, tm):
  """p: the `paged_gpu.Plan`; tm: (mask jaxpr, mask meta, score jaxpr, score meta)."""
  plgpu = compat.load("pallas_triton")
  mask_jaxpr, mask_meta, score_jaxpr, score_meta = tm
  refs = list(refs)
  (q_ref, chunk_row, chunk_lo, chunk_n, pages, slots, lengths, q_first, q_lengths, scale_ref,
   k_pool, v_pool) = refs[:12]
  del refs[:12]
  k_scales = refs.pop(0) if p.key_int8 else None
  v_scales = refs.pop(0) if p.value_int8 else None
  n_consts = len(mask_meta) + len(score_meta)
  mask_refs, score_refs = refs[:len(mask_meta)], refs[len(mask_meta):n_consts]
  m_ref, l_ref, o_ref = refs[n_consts:]
  G, T, S, M, W, R = p.G, p.T, p.page_size, p.max_pages, p.pages_per_step, p.rows
  BK = W * S
  tile = (R, BK)
  c, k = pl.program_id(0), pl.program_id(1)

  b, lo, n_items = chunk_row[c], chunk_lo[c], chunk_n[c]
  length, first, n_queries = lengths[b], q_first[b], q_lengths[b]
  scale = scale_ref[0]
  rows = jax.lax.broadcasted_iota(jnp.int32, tile, 0)
  rows_t = jax.lax.rem(rows, jnp.int32(T))
  rows_g = jax.lax.div(rows, jnp.int32(T))
  t_pos = first + rows_t
  row_ok = (rows < G * T) & (rows_t < n_queries)
  column = jnp.arange(BK, dtype=jnp.int32)  # [W S]: page w = column // S, slot column % S
  in_page = jax.lax.rem(column, jnp.int32(S))
  q = q_ref[b, k, :, :]  # [R, H]

  def body(step, carry):
    acc, m, l = carry
    # [W S]: this chunk's list entry of each key
    item = step * W + jax.lax.div(column, jnp.int32(S))
    listed = item < n_items
    entry = b * M + lo + jnp.where(listed, item, 0)  # an entry of the list, read or not
    page = pages[entry]
    s_pos = slots[entry] * S + in_page  # [W S]: global key positions
    read = listed & (s_pos < length)  # slots past the length may hold stale NaN: unread
    keys = plgpu.load(_at_page(k_pool, page, in_page, k), mask=read[:, None],
                      other=0 if p.key_int8 else 0.0)
    values = plgpu.load(_at_page(v_pool, page, in_page, k), mask=read[:, None],
                        other=0 if p.value_int8 else 0.0)
    column_scale = scale  # the logits' scale, times each key's page scale for int8 keys
    if p.key_int8:  # exact in the query's dtype: the page scale goes on the logits
      keys = keys.astype(q.dtype)
      column_scale = scale * _page_scales(k_scales, page, k, read)[None, :]  # [1, W S]
    if p.value_int8:
      values = values.astype(q.dtype)
    x = _dot(q, keys, ((1,), (1,))) * column_scale  # [R, W S]
    s_tile = jnp.broadcast_to(s_pos[None, :], tile)
    keep = row_ok & read[None, :]
    if p.causal:
      keep = keep & (s_tile <= t_pos)
    if p.window is not None:
      keep = keep & (s_tile >= t_pos - p.window[0]) & (s_tile <= t_pos + p.window[1])
    if score_jaxpr is not None:
      x = _per_head(lambda n: tile_mods.evaluate(
          score_jaxpr, score_meta, _reader(score_refs, score_meta), [x, b, n, t_pos, s_tile],
          tile, positions={3: "t", 4: "s"})[0].astype(jnp.float32), p.score_uses_n, k, G,
          rows_g, tile)
      keep = keep & (x != -jnp.inf)  # a score_mod may drop a key with -inf
    if mask_jaxpr is not None:
      keep = keep & _per_head(lambda n: tile_mods.evaluate(
          mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta), [b, n, t_pos, s_tile], tile,
          positions={2: "t", 3: "s"})[0], p.mask_uses_n, k, G, rows_g, tile)
    x = jnp.where(keep, x, LARGE_NEGATIVE)
    m_next = jnp.maximum(m, jnp.max(x, axis=1))
    # a row that has seen no visible key keeps m = LARGE_NEGATIVE: shift it by 0
    shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
    probs = jnp.where(keep, jnp.exp(x - shift[:, None]), 0.0)
    alpha = jnp.exp(m - m_next)
    weights = probs  # sum_s p_s (scale_s v_s): an int8 page's scale on the probabilities
    if p.value_int8:
      weights = probs * _page_scales(v_scales, page, k, read)[None, :]
    acc = acc * alpha[:, None] + _dot(weights.astype(values.dtype), values, ((1,), (0,)))
    return acc, m_next, alpha * l + jnp.sum(probs, axis=1)

  init = (jnp.zeros((R, p.D), jnp.float32), jnp.full((R,), LARGE_NEGATIVE, jnp.float32),
          jnp.zeros((R,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, jax.lax.div(n_items + W - 1, jnp.int32(W)), body, init)

  @pl.when(n_items > 0)  # an empty chunk writes nothing: the merge leaves it out
  def _():
    m_ref[...] = m
    l_ref[...] = l
    o_ref[...] = acc
