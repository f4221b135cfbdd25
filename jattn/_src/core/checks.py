"""Argument checks that run before any work, with messages naming the argument and shapes."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def as_array(name: str, x) -> jax.Array:
  """Converts an array-like to a jax array; anything else is a TypeError."""
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return jnp.asarray(x)
  if isinstance(x, (list, tuple, int, float)) and not isinstance(x, bool):
    try:
      return jnp.asarray(x)
    except (TypeError, ValueError) as e:
      raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None
  raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def float_array(name: str, x) -> jax.Array:
  x = as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype} "
                    f"with shape {x.shape}")
  return x


def rank(name: str, x: jax.Array, expected: int, legend: str) -> None:
  if x.ndim != expected:
    raise ValueError(f"{name}: expected rank {expected} {legend}, got shape {x.shape}")


def same_dtype(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"query, key and value must share one dtype, got "
                    f"query {q.dtype} {q.shape}, key {k.dtype} {k.shape}, "
                    f"value {v.dtype} {v.shape}")


def equal_dim(what: str, a_name: str, a_shape, a_axis: int,
              b_name: str, b_shape, b_axis: int) -> None:
  if a_shape[a_axis] != b_shape[b_axis]:
    raise ValueError(
        f"{what} of {a_name} and {b_name} must match: {a_name} has shape {a_shape} "
        f"({a_shape[a_axis]}), {b_name} has shape {b_shape} ({b_shape[b_axis]})")


def single_head_arrays(q, k, v, *, q_rank: int, layout: str):
  """Checks one head's q, k, v in the rows or columns layout."""
  q, k, v = float_array("q", q), float_array("k", k), float_array("v", v)
  if layout == "rows":
    legends = ("[T, H]", "[S, H]", "[S, D]") if q_rank == 2 else ("[H]", "[S, H]", "[S, D]")
    depth, tokens = -1, 0
  else:
    legends = ("[H, T]", "[H, S]", "[D, S]")
    depth, tokens = 0, 1
  rank("q", q, q_rank, legends[0])
  rank("k", k, 2, legends[1])
  rank("v", v, 2, legends[2])
  q_depth = depth if q_rank == 2 else 0
  equal_dim("depth H", "q", q.shape, q_depth, "k", k.shape, depth)
  some_depth("q", q.shape, "k", k.shape, q.shape[q_depth])
  equal_dim("length S", "k", k.shape, tokens, "v", v.shape, tokens)
  same_dtype(q, k, v)
  return q, k, v


def some_depth(q_name: str, q_shape, k_name: str, k_shape, H: int) -> None:
  """H = 0 has no logit to compute and no default scale 1 / sqrt(H): refused by name."""
  if H == 0:
    raise ValueError(f"depth H: {q_name} and {k_name} need at least one feature, got "
                     f"{q_name} shape {tuple(q_shape)} and {k_name} shape {tuple(k_shape)} "
                     f"(H = 0)")


def scale(x):
  """A real number: a Python or NumPy one (returned as a Python number, weakly typed), or a
  float scalar array (traced or not); not a bool."""
  if isinstance(x, np.generic) and isinstance(x, (np.integer, np.floating)):
    return x.item()
  number = isinstance(x, (int, float)) and not isinstance(x, bool)
  array = (hasattr(x, "dtype") and hasattr(x, "shape") and x.shape == ()
           and jnp.issubdtype(x.dtype, jnp.floating))
  if not (number or array):
    raise TypeError(f"scale must be a real number or a float scalar array, got "
                    f"{type(x).__name__} {x!r}")
  return x


def broadcastable(name: str, x, target: Sequence[int], legend: str,
                  dtype_kind: str) -> jax.Array | None:
  """Checks that an optional mask or bias broadcasts to `target` ([B, N, T, S] etc.)."""
  if x is None:
    return None
  x = as_array(name, x)
  if dtype_kind == "bool" and x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a bool array (True = may attend), got dtype "
                    f"{x.dtype} with shape {x.shape}; pass additive masks as bias")
  if dtype_kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype} "
                    f"with shape {x.shape}")
  target = tuple(target)
  ok = x.ndim <= len(target) and all(
      d in (1, t) for d, t in zip(x.shape[::-1], target[::-1]))
  if not ok:
    raise ValueError(f"{name}: expected a shape broadcastable to {legend} = {target}, "
                     f"got shape {x.shape}")
  return x


def same_shape(name: str, x, target: Sequence[int], legend: str):
  """Single-head masks and biases: broadcastable to exactly the logits' shape."""
  kind = "bool" if name == "mask" else "float"
  x = broadcastable(name, x, target, legend, kind)
  return None if x is None else jnp.broadcast_to(x, tuple(target))


def projection_arrays(x, w_q, w_k, w_v, *, layout: str):
  if layout not in ("rows", "columns"):
    raise ValueError(f"layout must be one of ('rows', 'columns'), got {layout!r}")
  x = float_array("x", x)
  ws = [float_array(n, w) for n, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v))]
  rank("x", x, 2, "[T, P]" if layout == "rows" else "[P, T]")
  for name, w in zip(("w_q", "w_k", "w_v"), ws):
    rank(name, w, 2, "[P, H|D]" if layout == "rows" else "[H|D, P]")
    if layout == "rows":
      equal_dim("features P", "x", x.shape, 1, name, w.shape, 0)
    else:
      equal_dim("features P", "x", x.shape, 0, name, w.shape, 1)
  equal_dim("depth H", "w_q", ws[0].shape, 1 if layout == "rows" else 0,
            "w_k", ws[1].shape, 1 if layout == "rows" else 0)
  return (x, *ws)
