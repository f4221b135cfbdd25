"""Softmax over attention logits in float32, safe for rows that see no key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite, not -inf: a row whose every key is masked then gives a finite softmax
# (and finite gradients) instead of NaN from exp(-inf - -inf). 0.7 of the
# float32 maximum leaves head-room for adding a bias or subtracting the row max.
LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)


def masked_softmax(logits: jax.Array, mask: jax.Array | None, axis: int, *,
                   may_empty_a_row: bool = True, sinks: jax.Array | None = None) -> jax.Array:
  """Softmax of float32 `logits` along `axis`; entries where `mask` is False get 0.

  A row with no True entry in `mask` returns all zeros. may_empty_a_row=False
  promises there is no such row, and saves a pass over the logits.
  sinks: logits of a key with no value, broadcastable to the logits with
  `axis` of size 1: exp(sink) joins every row's denominator.
  """
  if sinks is not None:
    return _softmax_with_sinks(logits, mask, axis, sinks)
  if mask is None:
    return jax.nn.softmax(logits, axis=axis)
  weights = jax.nn.softmax(jnp.where(mask, logits, LARGE_NEGATIVE), axis=axis)
  if not may_empty_a_row:
    return weights
  # Zeroing after the softmax is what makes a fully masked row zero; elsewhere
  # the masked entries are already exactly 0 after exp underflows.
  return jnp.where(mask, weights, 0.0)


def scored_mask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  """`mask` ANDed with logits != -inf, for logits that a score_mod returned.

  A score_mod may drop a key by returning -inf; a row of only -inf must then
  give zeros and finite gradients, as a fully masked row does, not the NaN of
  exp(-inf - -inf).
  """
  finite = logits != -jnp.inf
  return finite if mask is None else mask & finite


def _softmax_with_sinks(logits, mask, axis, sinks):
  """exp(l) / (exp(sink) + sum exp(l)); the sink keeps the denominator positive,
  so a row with no visible key gets zeros without a division by zero."""
  if mask is not None:
    logits = jnp.where(mask, logits, LARGE_NEGATIVE)
  # The shift cancels, so no gradient flows through it (as in jax.nn.softmax). Its
  # gradient through the max is 0 only in exact arithmetic: jax's rule for max divides
  # by the count of entries equal to it, and on jax 0.10.2's XLA:CPU at optimisation
  # level 0 some rows' gradients came out NaN through it (test_plan_completeness found one).
  m = jax.lax.stop_gradient(jnp.maximum(logits.max(axis=axis, keepdims=True), sinks))
  e = jnp.exp(logits - m)
  if mask is not None:
    e = jnp.where(mask, e, 0.0)
  return e / (e.sum(axis=axis, keepdims=True) + jnp.exp(sinks - m))


def logits_dtype(dtype) -> np.dtype:
  """float32 for half precision inputs; float64 stays float64."""
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
