"""The "vmap" implementation: single-head `attention` mapped over groups, kv heads, batch.

The same computation as the einsum formulation in `_xla.py`, built the other
way: from the one-head matrix version (itself the vector version under vmap)
by three more `jax.vmap`s. The G query heads that share a kv head are one
vmap with the key and value unmapped, so K/V are never copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core.attention import attention_with_weights
from jattn._src.impl.dense import dense_mask_and_keep
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.core.heads import grouped_logical, split_heads
from jattn._src.impl.xla import xla_attention


def _full(x, shape):
  """Logical [B|1, K|1, G|1, T, S] broadcast to the full grid, or None."""
  return None if x is None else jnp.broadcast_to(x, shape)


def vmapped_attention(query, key, value, modifiers: Modifiers, layout: Layout):
  """Batched multi-head attention from single-head attention and jax.vmap.

  Arguments and results as `_xla.xla_attention`. The lse and max logits are the
  einsum formulation's (one head has no use for them); under jit they are
  computed only when used.
  """
  _, _, lse, max_logits = xla_attention(query, key, value,
                                        modifiers.replace(dropout=None), layout)
  K = key.shape[layout.axis("K")]
  N = query.shape[layout.axis("N")]
  B = query.shape[layout.axis("B")]
  T, S = query.shape[layout.axis("T")], key.shape[layout.axis("S")]
  mask, keep, _ = dense_mask_and_keep(modifiers, B, N, T, S)
  bias, scale, mods = modifiers.bias, modifiers.scale, modifiers.mods
  query = split_heads(query, layout.axis("N"), K)
  q_sub, k_sub, v_sub = layout.grouped(layout.query), layout.key, layout.value
  out_sub = layout.grouped(layout.out)
  # One head sees [T, H] (tokens as rows) or [H, T] (tokens as columns).
  single_layout = "rows" if q_sub.index("T") < q_sub.index("H") else "columns"

  logical = [_full(grouped_logical(x, K), (B, K, N // K, T, S)) for x in (mask, bias, keep)]
  if single_layout == "columns":
    logical = [None if x is None else jnp.swapaxes(x, -1, -2) for x in logical]

  has_score = modifiers.has_score_mod
  sinks = None if modifiers.sinks is None else modifiers.sinks.reshape(K, N // K)

  def one_head(q, k, v, m, b, d, batch, head, sink):
    score = None
    if has_score:  # this head's score_mod: batch and head are its b and n
      score = lambda x, t, s: mods.score(x, batch, head, t, s)
    return attention_with_weights(q, k, v, m, b, d, scale, single_layout,
                                  score=score, sink=sink)

  fn = one_head
  sink_axis = lambda level: None if sinks is None or level == "B" else 0
  # Innermost map first: groups (G), then kv heads (K), then batch (B). Each
  # level's axes are positions in the subscripts with the outer letters removed.
  for letter, outer in (("G", "BK"), ("K", "B"), ("B", "")):
    strip = lambda s: "".join(c for c in s if c not in outer)
    axis = lambda s: strip(s).index(letter) if letter in s else None
    fn = jax.vmap(fn,
                  in_axes=(axis(q_sub), axis(k_sub), axis(v_sub), 0, 0, 0,
                           axis("B"), axis("KG"), sink_axis(letter)),
                  out_axes=(axis(out_sub), 0))
  batch = jnp.arange(B, dtype=jnp.int32)
  heads = jnp.arange(N, dtype=jnp.int32).reshape(K, N // K)  # n = k G + g
  # weights [B, K, G, T|S, S|T]
  out, weights = fn(query, key, value, *logical, batch, heads, sinks)

  if single_layout == "columns":
    weights = jnp.swapaxes(weights, -1, -2)
  n = layout.axis("N")
  out = out.reshape(out.shape[:n] + (N,) + out.shape[n + 2:])
  return out, weights.reshape((B, N, T, S)), lse, max_logits
