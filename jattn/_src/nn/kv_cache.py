"""The key/value cache of autoregressive decoding, as pure functions of positions.

Each batch element b has its own cache position index[b]: the number of tokens
already in its cache. A call writes its lengths[b] new tokens at positions
index[b], index[b] + 1, ... and its queries attend causally to everything
cached up to their own position. Prompts of different lengths therefore share
one batch, and decoding one token at a time continues each from its own end.

flax's protocol keeps one position for the whole batch, a scalar index: the
same functions take it (every row then writes all its tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core.explicit_axes import laid_out_as


def _along(x: jax.Array, ndim: int, axis: int) -> jax.Array:
  """[B, L] -> rank-`ndim` array with B on axis 0, L on `axis`, size 1 elsewhere."""
  shape = [1] * ndim
  shape[0], shape[axis] = x.shape
  return x.reshape(shape)


def write(cache: jax.Array, new: jax.Array, index: jax.Array, lengths: jax.Array,
          *, token_axis: int) -> jax.Array:
  """Writes new[b, t] at cache position index[b] + t for each t < lengths[b].

  cache: [B, S, K, H] (rows) or [B, K, H, S] (columns); new: the same with T for S;
  index, lengths: int [B]. Positions past S are dropped. No transpose: the new
  tokens are gathered along the token axis of either layout.
  """
  token_axis = token_axis % cache.ndim
  S = cache.shape[token_axis]
  t = jnp.arange(S, dtype=jnp.int32)[None, :] - index[:, None]  # [B, S]: the new token landing on s
  written = (t >= 0) & (t < lengths[:, None])  # [B, S]
  # [B, S, K, H] or [B, K, H, S]: new tokens moved to their cache positions; where t is
  # out of [0, T) nothing is written, so whichever token mode="clip" reads there is dropped
  moved = jnp.take_along_axis(new, _along(t, cache.ndim, token_axis), axis=token_axis,
                              mode="clip")
  moved = laid_out_as(moved.astype(cache.dtype), cache)  # Explicit axes: the cache's type
  return jnp.where(_along(written, cache.ndim, token_axis), moved, cache)


def decode_mask(index: jax.Array, T: int, S: int) -> jax.Array:
  """bool [B, 1, T, S]: query t, at position index[b] + t, attends cached keys s <= it."""
  q_pos = index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  return jnp.arange(S, dtype=jnp.int32)[None, None, None, :] <= q_pos[:, None, :, None]


def check_lengths(lengths, B: int, T: int) -> jax.Array:
  """lengths: int [B] tokens in each row of the inputs (None: all T)."""
  if lengths is None:
    return jnp.full((B,), T, jnp.int32)
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be an integer array [B], got dtype {lengths.dtype} "
                    f"with shape {lengths.shape}")
  if lengths.shape != (B,):
    raise ValueError(f"lengths: expected shape [B] = {(B,)}, got shape {lengths.shape}")
  return lengths.astype(jnp.int32)


def step(cached_key, cached_value, index, key, value, lengths, *, token_axis: int):
  """One decoding call: writes key/value into the caches and builds the mask.

  cached_*: [B, S, K, H] or [B, K, H, S]; key/value: the same with T for S;
  index, lengths: int [B], or index a scalar (flax's protocol, lengths all T).
  Returns (cached_key, cached_value, index + lengths, mask bool [B, 1, T, S]).
  """
  T, S = key.shape[token_axis], cached_key.shape[token_axis]
  if index.ndim == 0:  # flax's one position: every row at index, the new index a scalar
    rows = jnp.broadcast_to(index, lengths.shape)
    k, v, _, mask = step(cached_key, cached_value, rows, key, value, lengths,
                         token_axis=token_axis)
    return k, v, index + T, mask
  cached_key = write(cached_key, key, index, lengths, token_axis=token_axis)
  cached_value = write(cached_value, value, index, lengths, token_axis=token_axis)
  return cached_key, cached_value, index + lengths, decode_mask(index, T, S)


def check_call(is_causal: bool, *, T: int, new_keys: int, per_row: bool = True,
               lengths=None) -> None:
  """decode=True is causal attention over the cache; anything else is refused.

  A call's T queries and its new keys and values are the same T tokens: computed
  from inputs_q, or from inputs_k / inputs_v when given, as flax writes them.
  flax's protocol (per_row=False, a scalar cache index) is causal by
  construction and needs no is_causal, as in flax; it has one position for
  the batch, so no lengths."""
  if new_keys != T:
    raise ValueError(f"decode: queries and keys must be the same new tokens, got "
                     f"T = {T} queries and {new_keys} keys")
  if not per_row:
    if lengths is not None:
      raise ValueError("lengths: a cache made by flax's init_cache(input_shape) keeps one "
                       "position for the batch; for a length per row use "
                       "init_cache(batch_size, max_length)")
    return
  if not is_causal:
    raise ValueError("decode=True attends causally over the cache: pass "
                     "is_causal=True")


def check_batch(B: int, cache_shape: tuple[int, ...]) -> None:
  """The inputs' batch B is the cache's (its axis 0)."""
  if cache_shape[0] != B:
    raise ValueError(f"decode: inputs batch B = {B} does not match the cache, shape "
                     f"{tuple(cache_shape)}")


def mods_from_positions(start, mask_mod, score_mod):
  """mask_mod / score_mod for queries that start at position start[b] (int [B]) of the
  cache: decoding calls them with t the query's position in the cache, as a full pass would."""
  if mask_mod is not None:
    inner_mask = mask_mod
    mask_mod = lambda b, n, t, s: inner_mask(b, n, start[b] + t, s)
  if score_mod is not None:
    inner_score = score_mod
    score_mod = lambda x, b, n, t, s: inner_score(x, b, n, start[b] + t, s)
  return mask_mod, score_mod
