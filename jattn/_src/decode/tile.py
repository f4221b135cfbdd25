"""One tile of decoding: W pages of keys against their rows' queries, and the lse merge.

The letters, as everywhere, plus W: the pages (work items) read at once, each
of some row r[w]; S is the keys of one page (its slots). Every query head of
a kv head is a row of the same matmul ('WTKGH,WKSH->WKGTS'), so each kv head's
page is read once for its G query heads.

`tile` returns the page's partial softmax (m, l, o) relative to its own max;
`merge` folds W such partials into per-row running ones (flash-decoding's
log-sum-exp merge, with the rows as segments); `finish` normalises and adds sinks.
Masks and mods are applied at global positions: the mods see (b, n, t, s)
exactly as a full pass over the sequence would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core.softmax import LARGE_NEGATIVE, logits_dtype


def on_entries(fn, shape, *args):
  """fn(*scalars) over every entry of `shape`, args broadcastable to it (one flat vmap)."""
  flat = [jnp.broadcast_to(a, shape).reshape(-1) for a in args]
  return jax.vmap(fn)(*flat).reshape(shape)


def visible(mods, *, rows, heads, q_pos, q_valid, s_pos, s_valid, causal: bool, window):
  """bool [W, K|1, G|1, T, S]: every mask at global positions.

  rows int [W]; heads int [K, G] (n = k G + g); q_pos, q_valid [W, T]; s_pos,
  s_valid [W, S]; window None or (left, right).
  """
  t = q_pos[:, None, None, :, None]  # [W, 1, 1, T, 1]
  s = s_pos[:, None, None, None, :]  # [W, 1, 1, 1, S]
  keep = q_valid[:, None, None, :, None] & s_valid[:, None, None, None, :]
  if causal:
    keep = keep & (s <= t)
  if window is not None:
    keep = keep & (s >= t - window[0]) & (s <= t + window[1])
  if mods is not None and mods.has_mask:
    n = heads[None, :, :, None, None] if mods.mask_uses(1) else jnp.zeros((1,) * 5, jnp.int32)
    W, T, S = q_pos.shape[0], q_pos.shape[1], s_pos.shape[1]
    shape = (W,) + n.shape[1:3] + (T, S)
    keep = keep & on_entries(mods.mask, shape, rows[:, None, None, None, None], n, t, s)
  return keep


def tile(q, k, v, mods, *, rows, q_pos, q_valid, s_pos, s_valid, causal, window, scale):
  """q [W, T, K, G, H], k [W, K, S, H], v [W, K, S, D] -> (m, l [W, K, G, T], o [W, K, G, T, D]).

  m: the max visible logit (LARGE_NEGATIVE where none); l, o: sum of exp(logit
  - m) and of its weighted values, float32 (float64 for a float64 query).
  """
  W, T, K, G, H = q.shape
  acc = logits_dtype(q.dtype)
  heads = jnp.arange(K * G, dtype=jnp.int32).reshape(K, G)
  # logits [W, K, G, T, S] in float32: one matmul per (page, kv head) for its G heads
  logits = jnp.einsum("WTKGH,WKSH->WKGTS", q, k, preferred_element_type=acc)
  logits = logits * jnp.asarray(scale, acc)
  keep = visible(mods, rows=rows, heads=heads, q_pos=q_pos, q_valid=q_valid, s_pos=s_pos,
                 s_valid=s_valid, causal=causal, window=window)
  if mods is not None and mods.has_score:
    b, n = rows[:, None, None, None, None], heads[None, :, :, None, None]
    t, s = q_pos[:, None, None, :, None], s_pos[:, None, None, None, :]
    logits = on_entries(mods.score, logits.shape, logits, b, n, t, s)
    keep = keep & (logits != -jnp.inf)  # a score_mod may drop a key with -inf
  logits = jnp.where(keep, logits, LARGE_NEGATIVE)
  m = logits.max(axis=-1)
  # A row with no visible key keeps m = LARGE_NEGATIVE; shifting it by 0 keeps p = 0.
  shift = jnp.where(m > LARGE_NEGATIVE, m, 0.0)
  p = jnp.where(keep, jnp.exp(logits - shift[..., None]), 0.0)
  # Slots past a row's length may hold a freed row's stale values: zero them, since
  # 0 * NaN would not be 0.
  v = jnp.where(s_valid[:, None, :, None], v, jnp.zeros((), v.dtype))
  o = jnp.einsum("WKGTS,WKSD->WKGTD", p.astype(v.dtype), v, preferred_element_type=acc)
  return m, p.sum(axis=-1), o


def merge(carry, m_w, l_w, o_w, rows, B: int):
  """Running (m, l [B, K, G, T], o [B, K, G, T, D]) with W partials of rows `rows` folded in."""
  m, l, o = carry
  m_new = jnp.maximum(m, jax.ops.segment_max(m_w, rows, num_segments=B))
  alpha = jnp.exp(m - m_new)  # <= 1: the old partial rescaled to the new max
  f = jnp.exp(m_w - m_new[rows])  # [W, K, G, T]: each page's partial likewise
  l = l * alpha + jax.ops.segment_sum(l_w * f, rows, num_segments=B)
  o = o * alpha[..., None] + jax.ops.segment_sum(o_w * f[..., None], rows, num_segments=B)
  return m_new, l, o


def empty(B: int, K: int, G: int, T: int, D: int, dtype=jnp.float32):
  """The running (m, l, o) of rows that have seen no key, in `dtype` (the logits')."""
  rows = (B, K, G, T)
  return (jnp.full(rows, LARGE_NEGATIVE, dtype), jnp.zeros(rows, dtype),
          jnp.zeros(rows + (D,), dtype))


def finish(carry, sinks, dtype):
  """(m, l, o) -> out [B, T, N, D] in dtype: o / l, each head's sink in the denominator.

  A row with no visible key (l = 0) gives zeros, also with sinks.
  """
  m, l, o = carry
  B, K, G, T, D = o.shape
  seen = l > 0.0
  out = o / jnp.where(seen, l, 1.0)[..., None]
  if sinks is not None:
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), LARGE_NEGATIVE)
    sink = sinks.astype(o.dtype).reshape(K, G)[None, :, :, None]  # [1, K, G, 1]
    out = out * jnp.exp(lse - jnp.logaddexp(lse, sink))[..., None]
  return jnp.einsum("BKGTD->BTKGD", out).reshape(B, T, K * G, D).astype(dtype)
