"""The matrix version: all queries of one head, tokens as rows or as columns."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core import checks as _checks
from jattn._src.core.attend import attend_with_weights, default_scale
from jattn._src.core.softmax import logits_dtype, masked_softmax, scored_mask

LAYOUTS = ("rows", "columns")


def _rows(q, k, v, mask, bias, keep, scale, score=None, sink=None):
  """softmax(Q K^T * scale) V: q [T, H], k [S, H], v [S, D] -> [T, D], weights [T, S].

  Literally the vector version mapped over the queries.
  """
  per_query = lambda a: None if a is None else 0
  attend = lambda *a: attend_with_weights(*a, score=score, sink=sink)
  return jax.vmap(
      attend,
      in_axes=(0, None, None, per_query(mask), per_query(bias), per_query(keep), None, 0),
  )(q, k, v, mask, bias, keep, scale, jnp.arange(q.shape[0], dtype=jnp.int32))


def _columns(q, k, v, mask, bias, keep, scale, score=None, sink=None):
  """V softmax(K^T Q * scale): q [H, T], k [H, S], v [D, S] -> [D, T], weights [S, T].

  Each column of the logits is one query, so the softmax runs over axis 0.
  """
  dtype = logits_dtype(q.dtype)
  # logits [S, T] = K^T Q
  logits = jnp.einsum("HS,HT->ST", k, q, preferred_element_type=dtype) * scale
  if bias is not None:
    logits = logits + bias.astype(dtype)
  if score is not None:  # logits [S, T]: keys s down, queries t across
    positions = lambda n: jnp.arange(n, dtype=jnp.int32)
    per_key = jax.vmap(score, in_axes=(0, None, 0))
    logits = jax.vmap(per_key, in_axes=(1, 0, None), out_axes=1)(
        logits, positions(logits.shape[1]), positions(logits.shape[0]))
    mask = scored_mask(logits, mask)
  sink = None if sink is None else jnp.reshape(sink, (1, 1)).astype(dtype)
  weights = masked_softmax(logits, mask, axis=0, sinks=sink)
  used = weights if keep is None else weights * keep.astype(dtype)
  # out [D, T] = V W
  out = jnp.einsum("DS,ST->DT", v, used.astype(v.dtype),
                   preferred_element_type=dtype)
  return out.astype(v.dtype), weights


def attention_with_weights(q, k, v, mask, bias, keep, scale, layout, *, score=None,
                           sink=None):
  """Positional-array form of `attention`, returning (out, weights); no checks.

  score(logit, t, s) -> logit and sink (a float scalar): see `attend_with_weights`.
  """
  single_head = _rows if layout == "rows" else _columns
  return single_head(q, k, v, mask, bias, keep, scale, score, sink)


def attention(q, k, v, *, mask=None, bias=None, scale=None, layout="rows",
              return_weights=False):
  """Single-head attention of a whole sequence of queries.

  layout="rows" (tokens are rows): q [T, H], k [S, H], v [S, D] -> out [T, D],
    softmax(Q K^T * scale + bias) V, with mask, bias and weights [T, S].
  layout="columns" (tokens are columns): q [H, T], k [H, S], v [D, S] -> out [D, T],
    V softmax(K^T Q * scale + bias) with the softmax over axis 0, and mask,
    bias and weights [S, T].

  mask is bool, True = may attend; scale defaults to 1 / sqrt(H). A query that
  may attend to no key gets zeros. With return_weights=True, returns
  (out, weights). It is `jattn.attend` under `jax.vmap` over the queries.

  Args:
    q, k, v: one head's queries, keys and values, in the shapes above.
    mask: optional bool [T, S] (rows) or [S, T] (columns), True = may attend.
    bias: optional float, same shape as mask, added to the scaled logits.
    scale: the logits' factor; None for 1 / sqrt(H).
    layout: "rows" or "columns".
    return_weights: also return the softmax weights.

  Returns:
    out [T, D] (rows) or [D, T] (columns); with return_weights, (out, weights).

  Raises:
    ValueError: an unknown layout, or shapes that do not fit each other or the
      layout (the message names the argument and the shapes).
    TypeError: non-floating inputs or a non-bool mask.

  Examples:
    >>> import jax, jattn
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (5, 8)) for i in range(3))
    >>> rows = jattn.attention(q, k, v)                                   # [T, D]
    >>> cols = jattn.attention(q.T, k.T, v.T, layout="columns")           # [D, T]
    >>> bool(jax.numpy.allclose(rows, cols.T, atol=1e-5))
    True
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  q, k, v = _checks.single_head_arrays(q, k, v, q_rank=2, layout=layout)
  T = q.shape[0] if layout == "rows" else q.shape[1]
  S = k.shape[0] if layout == "rows" else k.shape[1]
  logical = (T, S) if layout == "rows" else (S, T)
  legend = "[T, S]" if layout == "rows" else "[S, T]"
  mask = _checks.same_shape("mask", mask, logical, legend)
  bias = _checks.same_shape("bias", bias, logical, legend)
  H = q.shape[1] if layout == "rows" else q.shape[0]
  scale = default_scale(H) if scale is None else scale
  scale = _checks.scale(scale)
  out, weights = attention_with_weights(q, k, v, mask, bias, None, scale, layout)
  return (out, weights) if return_weights else out


def project_qkv(x, w_q, w_k, w_v, *, layout="rows"):
  """Projects token features to queries, keys and values.

  rows: x [T, P], w_q/w_k [P, H], w_v [P, D] -> q [T, H], k [T, H], v [T, D].
  columns: x [P, T], w_q/w_k [H, P], w_v [D, P] -> q [H, T], k [H, T], v [D, T].
  (P is the token features, F elsewhere.)

  Args:
    x: the tokens' features.
    w_q, w_k, w_v: the projection matrices, in the layout's orientation.
    layout: "rows" or "columns".

  Returns:
    (q, k, v), ready for `jattn.attention` with the same layout.

  Raises:
    ValueError: an unknown layout or shapes that do not fit, named.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> q, k, v = jattn.project_qkv(jnp.ones((5, 4)), jnp.ones((4, 3)), jnp.ones((4, 3)),
    ...                             jnp.ones((4, 2)))
    >>> q.shape, v.shape
    ((5, 3), (5, 2))
  """
  x, w_q, w_k, w_v = _checks.projection_arrays(x, w_q, w_k, w_v, layout=layout)
  if layout == "rows":
    project = lambda w: jnp.einsum("TP,PH->TH", x, w)
  else:
    project = lambda w: jnp.einsum("HP,PT->HT", w, x)
  return project(w_q), project(w_k), project(w_v)
