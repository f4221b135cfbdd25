"""Plain NumPy float64 gradients of attention: the softmax backward written out.

Independent of jattn (no jax): out = P V with P = softmax(Q K^T * scale + bias)
over the allowed keys, so for a cotangent dO
  dV = P^T dO,  dP = dO V^T,  dL = P * (dP - rowsum(dP * P)),
  dQ = dL K * scale,  dK = dL^T Q * scale,  dbias = dL.
Letters as in API.md: B T S N K G H D.
"""

import numpy as np

from reference import _masked_softmax, reference_mask


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
