"""The Pallas TPU kernel of "paged_tpu": one program per (row b, split), its pages
DMA'd from the pool in HBM into VMEM, `depth` pages in flight.

Scalar-prefetched into SMEM: the row's listed pages (pool ids) and their table
slots, row by row (`pages`, `slots` int32 [B * M], the first counts[b] of row
b's M entries real), counts, lengths, the first query's position and the
number of queries per row, the scale, then the mods' captured arrays. The pool
stays in HBM (memory space ANY): a page of key_pages [P, K, S, H] (S the page
size) is one contiguous copy of every kv head's keys, and kbuf[slot, k] is kv
head k's [S, H] tile, whole TPU tiles with no relayout. The queries of row
b arrive as a VMEM block [K, G T, H]: the G query heads of kv head k and their
T queries are the rows of one tile, so each kv head's page is read once for its
G heads. The mods are evaluated on each [G T, S] tile by `tile_mods` at global
positions: t of tile row r = g T + t_ is q_first[b] + t_, s = slot * S + column.

Outputs: the split's partial softmax, relative to its own max, float32:
m, l [K, G T, 128] (lane-replicated) and o [K, G T, D]; `paged_tpu` merges the
splits by log-sum-exp and adds the sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import tile_mods

LANES = 128


def _reader(refs, meta):
  def read(i, flat):
    x = refs[i][flat]
    return x != 0 if meta[i][1] == jnp.bool_ else x
  return read


def _precision(x):
  """Stated, not left to jax_default_matmul_precision: Mosaic takes no HIGHEST on bfloat16."""
  return (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else
          jax.lax.Precision.DEFAULT)


def _per_head(evaluate, uses_n: bool, k: int, G: int, rows_g, tile):
  """evaluate(n) on the tile, each row with its own head n = k G + g (rows_g [GT, S]):
  once if the function ignores n, else once per g, rows picked by g."""
  if not uses_n or G == 1:
    return jnp.broadcast_to(evaluate(jnp.int32(k * G)), tile)
  out = None
  for g in range(G):
    y = jnp.broadcast_to(evaluate(jnp.int32(k * G + g)), tile)
    out = y if out is None else jnp.where(rows_g == g, y, out)
  return out


def kernel(*refs, p, tm):
  """p: the `paged_tpu.Plan`; tm: (mask jaxpr, mask meta, score jaxpr, score meta)."""
  mask_jaxpr, mask_meta, score_jaxpr, score_meta = tm
  pages, slots, counts, lengths, q_first, q_lengths, scale_ref = refs[:7]
  n_smem = len(mask_meta) + len(score_meta)
  mask_refs, score_refs = refs[7:7 + len(mask_meta)], refs[7 + len(mask_meta):7 + n_smem]
  (q_ref, rows_t_ref, rows_g_ref, k_hbm, v_hbm, m_ref, l_ref, o_ref, kbuf, vbuf, sem,
   m_sc, l_sc, acc_sc) = refs[7 + n_smem:]
  K, G, T, H, D, S, M = p.K, p.G, p.T, p.H, p.D, p.page_size, p.max_pages
  GT, depth = G * T, p.depth
  tile = (GT, S)
  b, split = pl.program_id(0), pl.program_id(1)

  count = counts[b]
  per = jax.lax.div(count + p.splits - 1, p.splits)  # lax.div: // lowers through sign
  lo = jnp.minimum(split * per, count)
  n_items = jnp.minimum(lo + per, count) - lo

  m_sc[...] = jnp.full(m_sc.shape, LARGE_NEGATIVE, jnp.float32)
  l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def copies(i, slot):
    """The DMAs of item i of this split (row b's list entry lo + i) into buffer `slot`."""
    page = pages[b * M + lo + i]
    return (pltpu.make_async_copy(k_hbm.at[page], kbuf.at[slot], sem.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[page], vbuf.at[slot], sem.at[1, slot]))

  def start(i, slot):
    for c in copies(i, slot):
      c.start()

  for d in range(depth - 1):  # the first pages in flight before the loop
    pl.when(d < n_items)(lambda d=d: start(d, d))

  rows_t = rows_t_ref[...]  # [GT, S]: each tile row's query t_
  rows_g = rows_g_ref[...]  # [GT, S]: its head within the group, g
  length, first, n_queries = lengths[b], q_first[b], q_lengths[b]
  scale = scale_ref[0]
  t_pos = first + rows_t

  def body(i, carry):
    slot = jax.lax.rem(i, depth)
    ahead = i + depth - 1

    @pl.when(ahead < n_items)
    def _():
      start(ahead, jax.lax.rem(ahead, depth))

    for c in copies(i, slot):
      c.wait()
    j = slots[b * M + lo + i]
    s_pos = j * S + jax.lax.broadcasted_iota(jnp.int32, tile, 1)
    keep = (s_pos < length) & (rows_t < n_queries)
    if p.causal:
      keep = keep & (s_pos <= t_pos)
    if p.window is not None:
      keep = keep & (s_pos >= t_pos - p.window[0]) & (s_pos <= t_pos + p.window[1])
    mask = None
    if mask_jaxpr is not None and not p.mask_uses_n:
      mask = _per_head(lambda n: tile_mods.evaluate(
          mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta), [b, n, t_pos, s_pos], tile,
          positions={2: "t", 3: "s"})[0], False, 0, G, rows_g, tile)
    # Slots past the row's length may hold a freed row's stale values (NaN):
    # zeroed, since 0 * NaN is not 0.
    s_valid = j * S + jax.lax.broadcasted_iota(jnp.int32, (S, 1), 0) < length
    for k in range(K):
      q = q_ref[k]  # [GT, H]
      keys = kbuf[slot, k]  # [S, H]
      values = vbuf[slot, k]
      values = jnp.where(s_valid, values, jnp.zeros((), values.dtype))
      x = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=_precision(q),
                              preferred_element_type=jnp.float32) * scale
      keep_k = keep
      if score_jaxpr is not None:
        x = _per_head(lambda n: tile_mods.evaluate(
            score_jaxpr, score_meta, _reader(score_refs, score_meta), [x, b, n, t_pos, s_pos],
            tile, positions={3: "t", 4: "s"})[0].astype(jnp.float32), p.score_uses_n, k, G,
            rows_g, tile)
        keep_k = keep_k & (x != -jnp.inf)  # a score_mod may drop a key with -inf
      if mask_jaxpr is not None:
        mk = mask if mask is not None else _per_head(lambda n: tile_mods.evaluate(
            mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta), [b, n, t_pos, s_pos], tile,
            positions={2: "t", 3: "s"})[0], True, k, G, rows_g, tile)
        keep_k = keep_k & mk
      x = jnp.where(keep_k, x, LARGE_NEGATIVE)
      m_prev = m_sc[k]  # [GT, 128]
      m_new = jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))  # [GT, 128]
      alpha = jnp.exp(m_prev - m_new)
      prob = jnp.where(keep_k, jnp.exp(x - m_new[:, :1]), 0.0)
      l_sc[k] = alpha * l_sc[k] + jnp.sum(prob, axis=1, keepdims=True)
      prob = prob.astype(values.dtype)
      pv = jax.lax.dot_general(prob, values, (((1,), (0,)), ((), ())),
                               precision=_precision(prob),
                               preferred_element_type=jnp.float32)  # [GT, D]
      acc_sc[k] = acc_sc[k] * alpha[:, :1] + pv
      m_sc[k] = m_new
    return carry

  jax.lax.fori_loop(0, n_items, body, 0)
  m_ref[...] = m_sc[...]
  l_ref[...] = l_sc[...]
  o_ref[...] = acc_sc[...]
