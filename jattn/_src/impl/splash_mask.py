"""jattn's mask expressions as one splash-attention mask: computed in the kernel,
classified per block in closed form on the host.

A `SplashPlan.mask` is a nested expression of ("causal",), ("local", left,
right), ("chunk", size), ("full",) under ("and", ...) / ("or", ...). splash
builds its block tables (`MaskInfo`) by evaluating the mask on every
[block_q, block_kv] block in NumPy: for causal at T = 32k that is 4 s of host
work inside every trace, also on a CPU host that will never lower for TPU
(the TPU branch of `implementation=None` is traced everywhere). Here a block
that the expression leaves wholly full or wholly empty is answered from its
corners in O(1) (a broadcast view, no array is formed), and only the partial
blocks are evaluated. In the kernel the same expression is the
`mask_function` of a computable mask, so no [T, S] array exists anywhere
(splash's own `NumpyMask`, which chunks used before, holds T x S bools).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import compat

FULL, EMPTY, PARTIAL = "full", "empty", "partial"


class _Uniform(np.ndarray):
  """A block of one value (a broadcast view): any() and all() in O(1), not a scan."""

  def any(self, *args, **kwargs):
    return self.flat[0] if not (args or kwargs) else np.asarray(self).any(*args, **kwargs)

  def all(self, *args, **kwargs):
    return self.flat[0] if not (args or kwargs) else np.asarray(self).all(*args, **kwargs)


@functools.lru_cache(maxsize=64)
def _uniform(value: bool, shape: tuple[int, int]) -> _Uniform:
  """One read-only block per (value, shape): splash asks for thousands of them."""
  return np.broadcast_to(np.bool_(value), shape).view(_Uniform)


def evaluate(expr: tuple, t, s):
  """The expression at query positions t and key positions s (NumPy or jax arrays)."""
  kind = expr[0]
  if kind == "causal":
    return s <= t
  if kind == "local":
    return (t - expr[1] <= s) & (s <= t + expr[2])
  if kind == "chunk":
    return _quotient(t, expr[1]) == _quotient(s, expr[1])
  if kind == "full":
    return (t >= 0) & (s >= 0)  # True, broadcast over the grid of t and s
  parts = [evaluate(e, t, s) for e in expr[1:]]
  if not parts:  # and of nothing: every key; or of nothing: none (as mods.and_masks / or_masks)
    every = evaluate(("full",), t, s)
    return every if kind == "and" else ~every
  out = parts[0]
  for p in parts[1:]:
    out = (out & p) if kind == "and" else (out | p)
  return out


def _quotient(x, size: int):
  """x // size for positions x >= 0 (where it truncates). In the kernel, lax.div: jnp's
  floor division lowers through Mosaic's sign rule, which asks the TPU generation, and
  a host without a TPU cannot say when exporting for one."""
  if isinstance(x, (int, np.integer, np.ndarray)):
    return x // size
  return jax.lax.div(x, jnp.full((), size, x.dtype))


def block_class(expr: tuple, t0: int, t1: int, s0: int, s1: int) -> str:
  """FULL / EMPTY when every (t, s) in [t0, t1) x [s0, s1) is True / False, else PARTIAL.

  PARTIAL may be conservative (the block is then evaluated exactly); FULL and
  EMPTY are exact. t1 and s1 are exclusive.
  """
  kind, tl, sl = expr[0], t1 - 1, s1 - 1
  if kind == "causal":  # s <= t
    return FULL if sl <= t0 else EMPTY if s0 > tl else PARTIAL
  if kind == "local":  # t - left <= s <= t + right
    left, right = expr[1], expr[2]
    if s0 >= tl - left and sl <= t0 + right:
      return FULL
    if sl < t0 - left or s0 > tl + right:
      return EMPTY
    return PARTIAL
  if kind == "chunk":  # t // size == s // size
    size = expr[1]
    tc, sc = (t0 // size, tl // size), (s0 // size, sl // size)
    if tc[0] == tc[1] == sc[0] == sc[1]:
      return FULL
    return EMPTY if tc[1] < sc[0] or sc[1] < tc[0] else PARTIAL
  if kind == "full":
    return FULL
  classes = [block_class(e, t0, t1, s0, s1) for e in expr[1:]]
  if kind == "and":
    return EMPTY if EMPTY in classes else FULL if all(c == FULL for c in classes) else PARTIAL
  return FULL if FULL in classes else EMPTY if all(c == EMPTY for c in classes) else PARTIAL


@functools.lru_cache(maxsize=None)
def _mask_class():
  """The splash mask class, made on first use (splash is imported only then)."""
  computable_mask = compat.load("splash_computable_mask")  # private: splash's in-kernel masks

  class ExpressionMask(computable_mask):
    """A jattn mask expression over a [T, S] grid, as splash's computable mask."""

    def __init__(self, expr: tuple, shape: tuple[int, int]):
      self.expr = expr
      super().__init__(shape=shape, mask_function=functools.partial(evaluate, expr))

    def __getitem__(self, idx) -> np.ndarray:
      t, s = idx
      if not (isinstance(t, slice) and isinstance(s, slice)):
        return super().__getitem__(idx)
      t0, t1, _ = t.indices(self.shape[0])
      s0, s1, _ = s.indices(self.shape[1])
      cls = block_class(self.expr, t0, t1, s0, s1)
      if cls == PARTIAL:
        return super().__getitem__(idx)
      return _uniform(cls == FULL, (t1 - t0, s1 - s0))

    def __eq__(self, other):
      return (isinstance(other, ExpressionMask) and self.expr == other.expr
              and self.shape == other.shape)

    def __hash__(self):
      return hash((ExpressionMask, self.expr, self.shape))

  return ExpressionMask


def splash_mask(expr: tuple, T: int, S: int):
  """The splash mask (a computable `_ComputableMask`) of expression `expr` on [T, S]."""
  return _mask_class()(expr, (T, S))
