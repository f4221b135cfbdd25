"""One decoding call of a module over a paged cache: append the new tokens, attend them.

The module projects the new tokens into heads as usual; here their keys and
values are appended to the rows of a `jattn.paged.PagedKVCache` and their
queries attend with `jattn.decode_attention`, which applies the mods at
global positions itself (no shift, unlike the dense cache's call).
Per-head arrays come in the module's layout: [B, T, N, H] (rows) or
[B, N, H, T] (columns).
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn._src.decode import paged_cache as _paged
from jattn._src.decode.decode_attention import decode_attention
from jattn._src.nn import kv_cache as _kv_cache

# The per-head arrays of each module layout, as the letters decode_attention reads.
_IN = {"rows": ("BTNH->BTNH", "BTKH->BTKH"), "columns": ("BNHT->BTNH", "BKHT->BTKH")}
_OUT = {"rows": "BTND->BTND", "columns": "BTND->BNDT"}


def check_call(*, B: int, T: int, new_keys: int, cache, mask, attention_fn, sow_weights,
               dropout, sow_max_logits: bool = False) -> None:
  """Before any work: what a paged decoding call cannot take, named."""
  if new_keys != T:
    raise ValueError(f"decode: queries and keys must be the same new tokens, got "
                     f"T = {T} queries and {new_keys} keys")
  if B != cache.batch_size:
    raise ValueError(f"decode: inputs batch B = {B} does not match the paged cache's "
                     f"block_table {tuple(cache.block_table.shape)}")
  refused = {"mask": mask is not None, "attention_fn": attention_fn is not None,
             "sow_weights": bool(sow_weights), "dropout": dropout}
  if sow_max_logits:
    raise ValueError("sow_max_logits: a module decoding over a paged cache sows no max "
                     "logits (call jattn.decode_attention(..., return_max_logits=True) "
                     "yourself); sow them while training, or decode with the dense cache")
  for name, given in refused.items():
    if given:
      raise ValueError(f"{name}: decoding over a paged cache takes no {name} (a dense mask "
                       f"[B, N, T, S], a flax attention_fn, the [B, N, T, S] weights and "
                       f"dropout need the whole key axis); pass mask_mod / score_mod, "
                       f"and deterministic=True")


def step(cache, query, key, value, lengths, *, layout: str, is_causal: bool, mask_mod,
         score_mod, sinks):
  """-> (cache with row b's first lengths[b] new tokens appended, out in the layout with D)."""
  q_in, kv_in = _IN[layout]
  query = jnp.einsum(q_in, query)
  key, value = jnp.einsum(kv_in, key), jnp.einsum(kv_in, value)
  new = _kv_cache.check_lengths(lengths, key.shape[0], key.shape[1])
  cache = _paged.append(cache, key, value, new)
  # the cache keeps its own dtype (append casts the keys and values to it); the query
  # joins its float pages, as decode_attention takes one dtype (int8 pages: any)
  floats = [p.dtype for p in (cache.key_pages, cache.value_pages) if p.dtype != jnp.int8]
  out = decode_attention(query.astype(floats[0] if floats else query.dtype), cache,
                         query_lengths=new, is_causal=is_causal,
                         mask_mod=mask_mod, score_mod=score_mod, sinks=sinks)
  return cache, jnp.einsum(_OUT[layout], out.astype(query.dtype))
