"""Plain NumPy float64 gradients of attention: the softmax backward written out.

Independent of jattn (no jax): out = P V with P = softmax(Q K^T * scale + bias)
over the allowed keys, so for a cotangent dO
  dV = P^T dO,  dP = dO V^T,  dL = P * (dP - rowsum(dP * P)),
  dQ = dL K * scale,  dK = dL^T Q * scale,  dbias = dL.
Letters as in API.md: B T S N K G H D.
"""

import numpy as np

from tests.reference import _masked_softmax, reference_mask


def reference_vjp(query, key, value, d_out, bias=None, *, scale=None, **masks):
  """(out [B,T,N,D], d_query, d_key, d_value, d_bias [B,N,T,S]) in float64, layout BTNH.

  masks: mask, is_causal, query_seq_lengths, key_value_seq_lengths,
  local_window_size, q_segment_ids, kv_segment_ids, as dot_product_attention.
  """
  q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, d_out))
  B, T, N, H = q.shape
  _, S, K, D = v.shape
  G = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
  heads = [n // G for n in range(N)]  # the kv head of each query head
  kn, vn = k[:, :, heads], v[:, :, heads]  # [B, S, N, H|D]: fine in a test
  logits = np.einsum("btnh,bsnh->bnts", q, kn) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  allowed = reference_mask(
      B, N, T, S, mask=masks.get("mask"), is_causal=masks.get("is_causal", False),
      q_lengths=masks.get("query_seq_lengths"), kv_lengths=masks.get("key_value_seq_lengths"),
      window=masks.get("local_window_size"), q_segment_ids=masks.get("q_segment_ids"),
      kv_segment_ids=masks.get("kv_segment_ids"))
  p = _masked_softmax(logits, allowed)  # [B, N, T, S]
  out = np.einsum("bnts,bsnd->btnd", p, vn)
  dp = np.einsum("btnd,bsnd->bnts", do, vn)
  dl = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
  dq = np.einsum("bnts,bsnh->btnh", dl, kn) * scale
  dk_n = np.einsum("bnts,btnh->bsnh", dl, q) * scale
  dv_n = np.einsum("bnts,btnd->bsnd", p, do)
  # the G query heads of a kv head all add to its gradient
  dk, dv = np.zeros(k.shape), np.zeros(v.shape)
  for n in range(N):
    dk[:, :, heads[n]] += dk_n[:, :, n]
    dv[:, :, heads[n]] += dv_n[:, :, n]
  return out, dq, dk, dv, dl


def reference_mods_vjp(query, key, value, d_out, *, allowed=None, score=None, d_score=None,
                       sinks=None, scale=None):
  """(out, d_query, d_key, d_value) in float64, layout BTNH, for a score function and sinks.

  allowed: bool broadcastable to [B, N, T, S]; score(x) a NumPy function of the logits
  [B, N, T, S] and d_score(x) its elementwise derivative; sinks [N] (a logit per head
  in the softmax's denominator, with no value). With P the weights over the visible keys
  (sinks in the denominator): dV = P^T dO, dP = dO V^T, dX = P * (dP - rowsum(dP * P)),
  then through the score function, dQ = dX K * scale, dK = dX^T Q * scale.
  """
  q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, d_out))
  B, T, N, H = q.shape
  K = k.shape[2]
  heads = [n // (N // K) for n in range(N)]
  kn, vn = k[:, :, heads], v[:, :, heads]
  scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
  x = np.einsum("btnh,bsnh->bnts", q, kn) * scale
  logits = x if score is None else score(x)
  shape = logits.shape
  allowed = np.ones(shape, bool) if allowed is None else np.broadcast_to(allowed, shape)
  sink = -np.inf if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
  m = np.maximum(np.where(allowed, logits, -np.inf).max(-1, keepdims=True), sink)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(allowed, np.exp(logits - m), 0.0)
  denom = e.sum(-1, keepdims=True) + np.exp(sink - m)
  p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
  out = np.einsum("bnts,bsnd->btnd", p, vn)
  dp = np.einsum("btnd,bsnd->bnts", do, vn)
  dx = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
  if d_score is not None:
    dx = dx * d_score(x)
  dq = np.einsum("bnts,bsnh->btnh", dx, kn) * scale
  dk_n = np.einsum("bnts,btnh->bsnh", dx, q) * scale
  dv_n = np.einsum("bnts,btnd->bsnd", p, do)
  dk, dv = np.zeros(k.shape), np.zeros(v.shape)
  for n in range(N):
    dk[:, :, heads[n]] += dk_n[:, :, n]
    dv[:, :, heads[n]] += dv_n[:, :, n]
  return out, dq, dk, dv


def table_grad(d_bias, index, width):
  """float64 [N, width]: the gradient of a table read as table[n, index[t, s]], from the
  gradient of the bias it adds, d_bias [B, N, T, S]: summed over b and every (t, s)
  that reads entry w."""
  onehot = np.asarray(index)[..., None] == np.arange(width)  # [T, S, width]
  return np.einsum("bnts,tsw->nw", np.asarray(d_bias, np.float64), onehot)
