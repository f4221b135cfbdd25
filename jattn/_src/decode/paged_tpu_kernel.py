"""The Pallas TPU kernel of "paged_tpu": one program per (row b, split), its pages
DMA'd from the pool in HBM into VMEM, `depth` steps of pages in flight.

Each loop step takes U = step_pages pages of the row's list into one buffer
slot [U, K, S, H] (kv head k's keys kbuf[slot, :, k] read as one [U S, H]), so a kv head's step is one [G T, U S] tile of logits (more
keys per matmul, the softmax bookkeeping once per U pages). A step whose keys
all lie within the row's length and every query's causal range and window
(the bulk of a long row) runs with no mask and no zeroing; the others build
each column's position and mask it.

Scalar-prefetched into SMEM: the row's listed pages (pool ids) and their table
slots, row by row (`pages`, `slots` int32 [B * M], the first counts[b] of row
b's M entries real), counts, lengths, the first query's position and the
number of queries per row, the scale, then the mods' captured arrays. The pool
stays in HBM (memory space ANY): a page of key_pages [P, K, S, H] (S the page
size) is one contiguous copy of every kv head's keys, and kbuf[slot, k] is kv
head k's [S, H] tile, whole TPU tiles with no relayout. The queries of row
b arrive as a VMEM block [K, G T, H]: the G query heads of kv head k and their
T queries are the rows of one tile, so each kv head's page is read once for its
G heads. The mods are evaluated on each [G T, U S] tile by `tile_mods` at global
positions: t of tile row r = g T + t_ is q_first[b] + t_, s = j S + column % S
for the column's page u = column // S of table slot j.

int8 pages arrive as int8 (the HBM and DMA bytes are the int8 ones) with their
scales, per listed page and kv head, scalar-prefetched after the scale
(`k_scales`, `v_scales` float32 [B * M * K], list order): the int8 tile is
cast to the query's dtype (exact: |q| <= 127), the key scale multiplies the
logits column by column (s = scale_k (q . k_int8)) and the value scale the
probabilities before P V, so no dequantized page is ever written.

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


def _each(copies, method: str):
  for c in copies:
    getattr(c, method)()


def kernel(*refs, p, tm):
  """p: the `paged_tpu.Plan`; tm: (mask jaxpr, mask meta, score jaxpr, score meta)."""
  mask_jaxpr, mask_meta, score_jaxpr, score_meta = tm
  pages, slots, counts, lengths, q_first, q_lengths, scale_ref = refs[:7]
  refs = list(refs[7:])
  k_scales = refs.pop(0) if p.key_int8 else None
  v_scales = refs.pop(0) if p.value_int8 else None
  n_smem = len(mask_meta) + len(score_meta)
  mask_refs, score_refs = refs[:len(mask_meta)], refs[len(mask_meta):n_smem]
  (q_ref, rows_t_ref, rows_g_ref, k_hbm, v_hbm, m_ref, l_ref, o_ref, kbuf, vbuf, sem,
   m_sc, l_sc, acc_sc) = refs[n_smem:]
  K, G, T, H, D, S, M = p.K, p.G, p.T, p.H, p.D, p.page_size, p.max_pages
  U = p.step_pages
  GT, depth, C = G * T, p.depth, U * S  # C: the keys of one step (U pages)
  tile = (GT, C)
  b, split = pl.program_id(0), pl.program_id(1)

  count = counts[b]
  per = jax.lax.div(count + p.splits - 1, jnp.int32(p.splits))  # lax.div: // lowers through sign
  lo = jnp.minimum(split * per, count)
  n_items = jnp.minimum(lo + per, count) - lo
  n_steps = jax.lax.div(n_items + U - 1, jnp.int32(U))

  m_sc[...] = jnp.full(m_sc.shape, LARGE_NEGATIVE, jnp.float32)
  l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def copies(item, slot, u):
    """The DMAs of item `item` of this split (row b's list entry lo + item; past the
    split's last item, that item again) into page u of buffer `slot` (one contiguous
    [K, S, H] page of every kv head)."""
    page = pages[b * M + lo + jnp.minimum(item, n_items - 1)]
    return (pltpu.make_async_copy(k_hbm.at[page], kbuf.at[slot, u], sem.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[page], vbuf.at[slot, u], sem.at[1, slot]))

  # A step always copies U pages: the last step of a split repeats its last page
  # rather than branch per page (at most U - 1 pages more a split; masked below).
  def start(i, slot):
    @pl.when(i < n_steps)
    def _():
      for u in range(U):
        _each(copies(i * U + u, slot, u), "start")

  def wait(i, slot):
    if p.num_pages >= U:  # one wait per semaphore for the U pages' bytes (wait reads
      for hbm, buf, kind in ((k_hbm, kbuf, 0), (v_hbm, vbuf, 1)):  # only the size)
        pltpu.make_async_copy(hbm.at[pl.ds(0, U)], buf.at[slot], sem.at[kind, slot]).wait()
    else:
      for u in range(U):
        _each(copies(i * U + u, slot, u), "wait")

  for d in range(depth - 1):  # the first steps in flight before the loop
    start(d, d)

  length, first, n_queries = lengths[b], q_first[b], q_lengths[b]
  last = first + n_queries - 1  # the last query's position
  scale = scale_ref[0]

  def visible_whole(i):
    """Step i needs no mask: all U pages listed, every key in the row's length and
    visible to every query (the pages' table slots rise, so the first and last tell)."""
    lo_j = slots[b * M + lo + i * U]
    hi_j = slots[b * M + lo + jnp.minimum(i * U + U, n_items) - 1]
    ok = (i * U + U <= n_items) & (hi_j * S + S <= length) & (n_queries == T)
    if p.causal:
      ok = ok & (hi_j * S + S - 1 <= first)
    if p.window is not None:
      ok = ok & (lo_j * S >= last - p.window[0]) & (hi_j * S + S - 1 <= first + p.window[1])
    return ok

  def column_scales(ref, i, k):
    """float32 [1, C]: the int8 scale of kv head k for each column of step i (its page's)."""
    col = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)
    out = jnp.zeros((1, C), jnp.float32)
    for u in range(U):
      item = lo + jnp.minimum(i * U + u, jnp.maximum(n_items - 1, 0))
      out = jnp.where((col >= u * S) & (col < u * S + S), ref[(b * M + item) * K + k], out)
    return out

  def attend(i, slot, keep, s_pos, valid_keys):
    """Folds step i's keys in buffer `slot` into (m, l, acc) of every kv head; keep
    None: every key visible (no mask, no zeroing); else bool [GT, C] and the keys
    that hold data (columns < valid_keys; stale slots may hold NaN)."""
    rows_g = rows_g_ref[...] if keep is not None else None
    t_pos = first + rows_t_ref[...] if keep is not None else None
    mask = None
    if mask_jaxpr is not None and not p.mask_uses_n:
      mask = _per_head(lambda n: tile_mods.evaluate(
          mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta), [b, n, t_pos, s_pos], tile,
          positions={2: "t", 3: "s"})[0], False, 0, G, rows_g, tile)
    for k in range(K):
      q = q_ref[k]  # [GT, H]
      keys = kbuf[slot, :, k].reshape(C, H)  # [U, S, H] -> [C, H]
      values = vbuf[slot, :, k].reshape(C, D)
      if p.key_int8:  # exact in bfloat16: the scale goes on the logits below
        keys = keys.astype(jnp.float32).astype(q.dtype)
      if p.value_int8:  # int8 holds no NaN: no zeroing needed below
        values = values.astype(jnp.float32).astype(q.dtype)
      x = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=_precision(q),
                              preferred_element_type=jnp.float32)
      x = x * (scale * column_scales(k_scales, i, k) if p.key_int8 else scale)
      keep_k = keep
      if keep is not None:
        # 0 * NaN is not 0: the slots past the length and the pages not fetched
        rows = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
        if not p.value_int8:
          values = jnp.where(rows < valid_keys, values, jnp.zeros((), values.dtype))
        if score_jaxpr is not None:
          x = _per_head(lambda n: tile_mods.evaluate(
              score_jaxpr, score_meta, _reader(score_refs, score_meta),
              [x, b, n, t_pos, s_pos], tile, positions={3: "t", 4: "s"})[0].astype(
                  jnp.float32), p.score_uses_n, k, G, rows_g, tile)
          keep_k = keep_k & (x != -jnp.inf)  # a score_mod may drop a key with -inf
        if mask_jaxpr is not None:
          mk = mask if mask is not None else _per_head(lambda n: tile_mods.evaluate(
              mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta), [b, n, t_pos, s_pos],
              tile, positions={2: "t", 3: "s"})[0], True, k, G, rows_g, tile)
          keep_k = keep_k & mk
        x = jnp.where(keep_k, x, LARGE_NEGATIVE)
      m_prev = m_sc[k]  # [GT, 128]
      m_new = jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))  # [GT, 128]
      alpha = jnp.exp(m_prev - m_new)
      prob = jnp.exp(x - m_new[:, :1])
      if keep is not None:
        prob = jnp.where(keep_k, prob, 0.0)
      l_sc[k] = alpha * l_sc[k] + jnp.sum(prob, axis=1, keepdims=True)
      if p.value_int8:  # sum_s p_s (scale_s v_s): the scale on the probabilities
        prob = prob * column_scales(v_scales, i, k)
      prob = prob.astype(values.dtype)
      pv = jax.lax.dot_general(prob, values, (((1,), (0,)), ((), ())),
                               precision=_precision(prob),
                               preferred_element_type=jnp.float32)  # [GT, D]
      acc_sc[k] = acc_sc[k] * alpha[:, :1] + pv
      m_sc[k] = m_new

  def attend_masked(i, slot):
    """The general step: positions of every column, its page's table slot j and the
    row's causal range, window, length and the mods."""
    col = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)
    s_pos = col % S  # [1, C], then + j S of each column's page
    valid_keys = jnp.int32(0)  # columns holding keys: a prefix (positions rise with u)
    for u in range(U):
      there = i * U + u < n_items
      j = slots[b * M + lo + jnp.minimum(i * U + u, jnp.maximum(n_items - 1, 0))]
      s_pos = s_pos + jnp.where((col >= u * S) & (col < u * S + S), j * S, 0)
      valid_keys = valid_keys + jnp.where(there, jnp.clip(length - j * S, 0, S), 0)
    s_pos = jnp.broadcast_to(s_pos, tile)
    rows_t = rows_t_ref[...]
    t_pos = first + rows_t
    keep = (jnp.broadcast_to(col, tile) < valid_keys) & (rows_t < n_queries)
    if p.causal:
      keep = keep & (s_pos <= t_pos)
    if p.window is not None:
      keep = keep & (s_pos >= t_pos - p.window[0]) & (s_pos <= t_pos + p.window[1])
    attend(i, slot, keep, s_pos, valid_keys)

  def body(i, carry):
    slot = jax.lax.rem(i, jnp.int32(depth))
    start(i + depth - 1, jax.lax.rem(i + depth - 1, jnp.int32(depth)))
    wait(i, slot)
    if mask_jaxpr is not None or score_jaxpr is not None:  # the mods see every position
      attend_masked(i, slot)
    else:
      whole = visible_whole(i)
      pl.when(whole)(lambda: attend(i, slot, None, None, None))
      pl.when(~whole)(lambda: attend_masked(i, slot))
    return carry

  jax.lax.fori_loop(0, n_steps, body, 0)
  m_ref[...] = m_sc[...]
  l_ref[...] = l_sc[...]
  o_ref[...] = acc_sc[...]
