"""The vector version: one query against all keys of one head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jattn._src.core import checks as _checks
from jattn._src.core.softmax import logits_dtype, masked_softmax, scored_mask


def default_scale(depth: int) -> float:
  return 1.0 / math.sqrt(depth)


def attend_with_weights(q, k, v, mask, bias, keep, scale, t=None, *, score=None,
                        sink=None):
  """`attend` with arrays positional, so `jax.vmap` can address each of them.

  keep: optional float [S] of dropout multipliers (0 or 1 / (1 - rate)).
  score: optional score_mod of one head, score(logit, t, s) -> logit, with t
  this query's position and s each key's. sink: optional float scalar, the
  logit of a key with no value (attention sink).
  Returns (out [D], weights [S]); weights are taken before dropout.
  """
  dtype = logits_dtype(q.dtype)
  # logits[s] = q . k[s]
  logits = jnp.einsum("H,SH->S", q, k, preferred_element_type=dtype) * scale
  if bias is not None:
    logits = logits + bias.astype(dtype)
  if score is not None:
    positions = jnp.arange(k.shape[0], dtype=jnp.int32)
    logits = jax.vmap(score, in_axes=(0, None, 0))(logits, t, positions)
    mask = scored_mask(logits, mask)
  sink = None if sink is None else jnp.reshape(sink, (1,)).astype(dtype)
  weights = masked_softmax(logits, mask, axis=-1, sinks=sink)
  used = weights if keep is None else weights * keep.astype(dtype)
  out = jnp.einsum("S,SD->D", used.astype(v.dtype), v,
                   preferred_element_type=dtype)
  return out.astype(v.dtype), weights


def attend(q: Float[Array, "H"], k: Float[Array, "S H"], v: Float[Array, "S D"],
           *, mask: Bool[Array, "S"] | None = None,
           bias: Float[Array, "S"] | None = None,
           scale: float | None = None) -> Float[Array, "D"]:
  """One query q [H] against keys k [S, H] and values v [S, D] -> out [D].

  out = sum_s softmax_s(q . k[s] * scale + bias[s]) v[s], over the keys where
  mask [S] is True; scale defaults to 1 / sqrt(H). A query that may attend to
  no key returns zeros.

  Args:
    q: the query, [H].
    k: the keys, [S, H].
    v: the values, [S, D].
    mask: optional bool [S], True = may attend.
    bias: optional float [S], added to the scaled logits.
    scale: the logits' factor; None for 1 / sqrt(H).

  Returns:
    out [D], in q's dtype (logits and softmax in float32 for half precision).

  Raises:
    ValueError: a rank or shape that does not fit (the message names the
      argument and the shapes).
    TypeError: an input that is not a floating array, or a non-bool mask.

  Examples:
    >>> import jax, jattn
    >>> q, k, v = jax.numpy.ones(8), jax.numpy.ones((6, 8)), jax.numpy.ones((6, 4))
    >>> jattn.attend(q, k, v).shape
    (4,)
  """
  q, k, v = _checks.single_head_arrays(q, k, v, q_rank=1, layout="rows")
  S = k.shape[0]
  mask = _checks.same_shape("mask", mask, (S,), "[S]")
  bias = _checks.same_shape("bias", bias, (S,), "[S]")
  scale = default_scale(q.shape[-1]) if scale is None else scale
  scale = _checks.scale(scale)
  out, _ = attend_with_weights(q, k, v, mask, bias, None, scale)
  return out
