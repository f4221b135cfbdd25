"""The attention step of the Flax modules, written once for `jattn.nnx` and `jattn.linen`.

After projecting into heads (and, when decoding, reading the KV cache), both
modules attend the same way: through the user's flax `attention_fn` if they
were given one (each module calls it with its own flax protocol), else through
`jattn.dot_product_attention`, sowing the weights when asked.
"""

from __future__ import annotations

from typing import Callable

from jattn._src.dot_product_attention import dot_product_attention
from jattn._src.masks.structural import combine_masks, padding_mask
from jattn._src.nn import heads as _heads


def attend(query, key, value, *, layout: str, mask, is_causal: bool, kv_lengths,
           mask_mod, score_mod, sinks, dropout_rng, dropout_rate: float,
           broadcast_dropout: bool, implementation, sow_weights: bool,
           sow: Callable, attention_fn: Callable | None):
  """query [B, T, N, H] | [B, N, H, T] (module layout "rows" | "columns"), key/value likewise.

  attention_fn: None, or the module's call of the user's flax function,
    (query, key, value, mask, is_causal) -> out, rows layout only; jattn's
    kv lengths reach it as a padding mask, and mods and sinks are refused.
  sow: the module's way to keep the weights (called with [B, N, T, S]).
  dropout_rng: None when deterministic (no dropout).
  """
  if attention_fn is not None:
    _heads.refuse_mods_with_attention_fn(mask_mod=mask_mod, score_mod=score_mod,
                                         use_sinks=sinks is not None)
    if kv_lengths is not None:  # jattn's lengths, as a mask flax's functions understand
      T, S = query.shape[1], key.shape[1]  # [B, T, N, H] and [B, S, K, H]
      mask = combine_masks(mask, padding_mask(None, kv_lengths, T, S))
    return attention_fn(query, key, value, mask, is_causal)
  out = dot_product_attention(
      query, key, value, mask=mask, is_causal=is_causal, key_value_seq_lengths=kv_lengths,
      layout=_heads.HEADS_LAYOUT[layout], implementation=implementation,
      dropout_rate=dropout_rate if dropout_rng is not None else 0.0,
      dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
      return_weights=sow_weights, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks)
  if sow_weights:
    out, weights = out
    sow(weights)
  return out
