"""The attention step of the Flax modules, written once for `jattn.nnx` and `jattn.linen`.

After projecting into heads (and, when decoding, reading the KV cache), both
modules attend the same way: through the user's flax `attention_fn` if they
were given one (each module calls it with its own flax protocol), else through
`jattn.dot_product_attention`, sowing the weights and the max logits when asked.
"""

from __future__ import annotations

from typing import Callable

from jattn._src.dot_product_attention import dot_product_attention
from jattn._src.masks.structural import combine_masks, padding_mask
from jattn._src.nn import heads as _heads


def attend(query, key, value, *, layout: str, mask, is_causal: bool, kv_lengths,
           mask_mod, score_mod, sinks, dropout_rng, dropout_rate: float,
           broadcast_dropout: bool, implementation, sow_weights: bool,
           sow_max_logits: bool, sow: Callable, attention_fn: Callable | None):
  """query [B, T, N, H] | [B, N, H, T] (module layout "rows" | "columns"), key/value likewise.

  attention_fn: None, or the module's call of the user's flax function,
    (query, key, value, mask, is_causal) -> out, rows layout only; jattn's
    kv lengths reach it as a padding mask, and mods and sinks are refused.
  sow: the module's way to keep an intermediate, sow(name, value): the weights
    [B, N, T, S] as "attention_weights" (sow_weights), each head's largest visible
    logit float32 [N] as "max_logits" (sow_max_logits).
  dropout_rng: None when deterministic (no dropout).
  """
  check_sow_max_logits(sow_max_logits, attention_fn)
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
      return_weights=sow_weights, return_max_logits=sow_max_logits, mask_mod=mask_mod,
      score_mod=score_mod, sinks=sinks)
  if not (sow_weights or sow_max_logits):
    return out
  out, *extras = out
  if sow_weights:
    sow("attention_weights", extras.pop(0))
  if sow_max_logits:
    sow("max_logits", per_head_max(extras[0], _heads.HEADS_LAYOUT[layout]))
  return out


def per_head_max(max_logits, layout: str):
  """Rows' max logits in `layout` without H (e.g. [B, T, N]) -> [N]: what QK-clip
  compares with its threshold, one per head, the same shape for every batch and length
  (an empty row's constant never wins over a row that sees a key)."""
  rows = layout.replace("H", "")
  return max_logits.max(axis=tuple(i for i, c in enumerate(rows) if c != "N"))


def check_sow_max_logits(sow_max_logits, attention_fn) -> None:
  if not isinstance(sow_max_logits, bool):
    raise TypeError(f"sow_max_logits must be a bool, got {sow_max_logits!r}")
  if sow_max_logits and attention_fn is not None:
    raise ValueError("sow_max_logits: an attention_fn is called as flax calls it, which "
                     "returns no max logits; drop attention_fn (jattn's attention returns "
                     "them)")
