"""The "xla" implementation: two einsums whose subscripts are the layout's letters.

For layout "BTNH" the logits are 'BTKGH,BSKH->BKGTS' and the output
'BKGTS,BSKD->BTKGD': the N query heads are split into K kv heads of G groups
by a reshape (no copy of K/V), and no input is transposed to a canonical layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core.heads import grouped_logical, split_heads
from jattn._src.impl.dense import dense_mask_and_keep
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import apply_score, sinks_like
from jattn._src.core.softmax import LARGE_NEGATIVE, logits_dtype, masked_softmax, scored_mask

_LOGICAL = "BKGTS"  # mask, bias and weights: logical order, N split


def xla_attention(query, key, value, modifiers: Modifiers, layout: Layout):
  """Batched multi-head attention; the modifiers' bias and mask in logical [B|1, N|1, T, S].

  Returns (out in the layout with D for H, weights [B, N, T, S], lse float32
  [B, N, T], max_logits float32 [B, N, T]); under jit an unused output costs nothing.
  """
  B, N, T = (query.shape[layout.axis(c)] for c in "BNT")
  S, K = (key.shape[layout.axis(c)] for c in "SK")
  mask, keep, may_empty_a_row = dense_mask_and_keep(modifiers, B, N, T, S)
  bias, scale, mods = modifiers.bias, modifiers.scale, modifiers.mods
  q_sub = layout.grouped(layout.query)
  out_sub = layout.grouped(layout.out)
  logits_sub = _logits_subscripts(q_sub)
  to_logits = lambda x: None if x is None else jnp.transpose(
      grouped_logical(x, K), [_LOGICAL.index(c) for c in logits_sub])
  dtype = logits_dtype(query.dtype)
  query = split_heads(query, layout.axis("N"), K)

  # logits, e.g. [B, K, T, G, S] for "BTNH"
  logits = jnp.einsum(f"{q_sub},{layout.key}->{logits_sub}", query, key,
                      preferred_element_type=dtype) * scale
  if bias is not None:
    logits = logits + to_logits(bias).astype(dtype)
  sinks = None
  mask = to_logits(mask)
  if modifiers.has_score_mod:
    logits = apply_score(mods, logits, logits_sub, N // K)
    mask, may_empty_a_row = scored_mask(logits, mask), True
  if modifiers.sinks is not None:
    sinks = sinks_like(modifiers.sinks, logits_sub, K, dtype)
  weights = masked_softmax(logits, mask, axis=-1,
                           may_empty_a_row=may_empty_a_row, sinks=sinks)
  lse = _row_lse(logits, mask, logits_sub)  # [B, K, G, T]
  if sinks is not None:  # the sink is a term of every row's denominator
    lse = jnp.logaddexp(lse, modifiers.sinks.astype(dtype).reshape(1, K, N // K, 1))
  lse = lse.reshape((B, N, T))
  max_logits = _row_max(logits, mask, logits_sub).reshape((B, N, T))  # no sink: no key
  used = weights if keep is None else weights * to_logits(keep).astype(dtype)
  out = jnp.einsum(f"{logits_sub},{layout.value}->{out_sub}", used.astype(value.dtype),
                   value, preferred_element_type=dtype)
  out = out.reshape(out.shape[:layout.axis("N")] + (N,) + out.shape[layout.axis("N") + 2:])
  # weights [B, K, G, T, S] -> [B, N, T, S]
  weights = jnp.transpose(weights, [logits_sub.index(c) for c in _LOGICAL])
  return out.astype(value.dtype), weights.reshape((B, N, T, S)), lse, max_logits


def _row_max(logits, mask, logits_sub: str) -> jax.Array:
  """[B, K, G, T]: the largest visible logit of each row; LARGE_NEGATIVE for a row
  with no visible key, as its lse without sinks."""
  if mask is not None:
    logits = jnp.where(mask, logits, LARGE_NEGATIVE)
  # a row of score_mod's -inf alone is masked by scored_mask: it gets the constant too
  return jnp.einsum(f"{logits_sub[:-1]}->BKGT", logits.max(axis=-1))


def _row_lse(logits, mask, logits_sub: str) -> jax.Array:
  """[B, K, G, T]: log sum_s exp(logit), masked logits counted as LARGE_NEGATIVE,
  as jax.nn's residual (a row with no key: LARGE_NEGATIVE, finite)."""
  if mask is not None:
    logits = jnp.where(mask, logits, LARGE_NEGATIVE)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.einsum(f"{logits_sub[:-1]}->BKGT", lse)


def _logits_subscripts(q_sub: str) -> str:
  """The logits' letters in the order dot_general produces them: batch letters
  (B, K) and the query's free letters (T, G) as they stand in the query, then S.
  Asking einsum for any other order costs a transpose of the whole [T, S] grid."""
  return ("".join(c for c in q_sub if c in "BK") + "".join(c for c in q_sub if c in "TG")
          + "S")
