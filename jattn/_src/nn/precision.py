"""flax's `precision` argument, honoured as the matmul precision of a whole call."""

from __future__ import annotations

import contextlib

import jax
from jax import lax


def matmul_precision(precision):
  """A context in which every matmul traced inside runs at `precision`.

  precision: None (the default), a `jax.lax.Precision`, its name ("highest",
  "float32", ...), a pair of two equal ones (flax's PrecisionLike), or a
  `jax.lax.DotAlgorithmPreset`. jattn's einsums carry no precision of their
  own, so the context reaches all of them, in every implementation.
  """
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2 or precision[0] != precision[1]:
      raise ValueError(f"precision: jattn runs all its matmuls at one precision, so a "
                       f"pair must hold the same one twice, got {precision!r}")
    precision = precision[0]
  try:
    if isinstance(precision, str):
      precision = lax.Precision(precision)
    if isinstance(precision, lax.DotAlgorithmPreset):
      return jax.default_matmul_precision(precision.name)
    if not isinstance(precision, lax.Precision):
      raise ValueError
    return jax.default_matmul_precision(precision.name.lower())
  except ValueError:
    raise ValueError(f"precision must be None, a jax.lax.Precision, its name or a "
                     f"jax.lax.DotAlgorithmPreset, got {precision!r}") from None
