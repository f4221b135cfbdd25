"""Plain NumPy float64 reference for scaled dot-product attention.

Written independently of jattn: loops and explicit comparisons instead of
einsum tricks, so a shared mistake is unlikely. Letters as in API.md:
B T S N K G H D.
"""

import numpy as np


def reference_mask(
    B, N, T, S, *, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
    window=None, q_segment_ids=None, kv_segment_ids=None,
):
  """Boolean [B, N, T, S]: True where query t of head n may attend key s."""
  allowed = np.ones((B, N, T, S), dtype=bool)
  t = np.arange(T)[:, None]
  s = np.arange(S)[None, :]
  if mask is not None:
    allowed &= np.broadcast_to(np.asarray(mask, dtype=bool), (B, N, T, S))
  if is_causal:
    allowed &= (s <= t)[None, None]
  if window is not None:
    left, right = (window, window) if np.isscalar(window) else window
    allowed &= ((t - left <= s) & (s <= t + right))[None, None]
  for b in range(B):
    if q_lengths is not None:
      allowed[b, :, int(q_lengths[b]):, :] = False
    if kv_lengths is not None:
      allowed[b, :, :, int(kv_lengths[b]):] = False
    if q_segment_ids is not None:
      same = (np.asarray(q_segment_ids)[b][:, None]
              == np.asarray(kv_segment_ids)[b][None, :])
      allowed[b] &= same[None]
  return allowed


def _masked_softmax(logits, allowed):
  """Softmax over the last axis; rows with no allowed entry give zeros."""
  logits = np.where(allowed, logits, -np.inf)
  row_max = np.max(logits, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(allowed, np.exp(logits - row_max), 0.0)
  total = e.sum(axis=-1, keepdims=True)
  return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def reference_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
    q_segment_ids=None, kv_segment_ids=None, return_weights=False,
):
  """Float64 attention in the BTNH layout (or TNH without batch).

  query [B, T, N, H], key [B, S, K, H], value [B, S, K, D]; mask/bias
  broadcastable to [B, N, T, S]. Head n uses key/value head n // (N // K).
  Returns out [B, T, N, D] (and weights [B, N, T, S]).
  """
  q = np.asarray(query, dtype=np.float64)
  k = np.asarray(key, dtype=np.float64)
  v = np.asarray(value, dtype=np.float64)
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  B, T, N, H = q.shape
  _, S, K, D = v.shape
  G = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else float(scale)

  logits = np.zeros((B, N, T, S))
  for n in range(N):
    kn = k[:, :, n // G, :]  # [B, S, H]
    logits[:, n] = np.matmul(q[:, :, n, :], kn.transpose(0, 2, 1)) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, dtype=np.float64)
  allowed = reference_mask(
      B, N, T, S, mask=mask, is_causal=is_causal, q_lengths=query_seq_lengths,
      kv_lengths=key_value_seq_lengths, window=local_window_size,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  weights = _masked_softmax(logits, allowed)

  out = np.zeros((B, T, N, D))
  for n in range(N):
    out[:, :, n, :] = np.matmul(weights[:, n], v[:, :, n // G, :])
  if unbatched:
    out, weights = out[0], weights[0]
  return (out, weights) if return_weights else out


def reference_single(q, k, v, *, mask=None, bias=None, scale=None):
  """Single head, rows layout: q [T, H], k [S, H], v [S, D] -> out, weights."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  v = np.asarray(v, np.float64)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
  logits = q @ k.T * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  allowed = (np.ones(logits.shape, bool) if mask is None
             else np.broadcast_to(np.asarray(mask, bool), logits.shape))
  w = _masked_softmax(logits, allowed)
  return w @ v, w


def numerical_grad(f, x, eps=1e-6):
  """Central-difference gradient of scalar f at float64 array x."""
  x = np.array(x, dtype=np.float64)
  g = np.zeros_like(x)
  flat, gflat = x.reshape(-1), g.reshape(-1)
  for i in range(flat.size):
    old = flat[i]
    flat[i] = old + eps
    up = f(x)
    flat[i] = old - eps
    down = f(x)
    flat[i] = old
    gflat[i] = (up - down) / (2 * eps)
  return g


def reference_mods(q, k, v, *, allowed=None, score=None, sinks=None, scale=None, bias=None):
  """float64 attention over the dense grid with a score function and sinks; BTNH layout.

  allowed: bool, broadcastable to [B, N, T, S]; score: a NumPy function of the logits
  [B, N, T, S]; sinks: [N]. Returns (out [B, T, N, D], weights [B, N, T, S]).
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("BTNH,BSNH->BNTS", q, kk) * scale
  if bias is not None:
    logits = logits + bias
  if score is not None:
    logits = score(logits)
  allowed = np.ones(logits.shape, bool) if allowed is None else np.broadcast_to(allowed, logits.shape)
  sink = -np.inf if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
  m = np.maximum(np.where(allowed, logits, -np.inf).max(-1, keepdims=True), sink)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(allowed, np.exp(logits - m), 0.0)
  denom = e.sum(-1, keepdims=True) + np.exp(sink - m)
  w = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
  return np.einsum("BNTS,BSND->BTND", w, vv), w


def reference_max_logits(q, k, *, allowed=None, score=None, bias=None, scale=None):
  """float64 [B, N, T]: each row's largest logit over its allowed keys, BTNH layout;
  -inf for a row with none. Logits as `reference_mods`: q . k * scale + bias, then
  score; allowed broadcastable to [B, N, T, S]. Sinks are no key's logit: not here."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  kk = np.repeat(k, q.shape[2] // k.shape[2], axis=2)  # kv head n // G for query head n
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("BTNH,BSNH->BNTS", q, kk) * scale
  if bias is not None:
    logits = logits + bias
  if score is not None:
    logits = score(logits)
  if allowed is not None:
    logits = np.where(np.broadcast_to(allowed, logits.shape), logits, -np.inf)
  return logits.max(-1)
