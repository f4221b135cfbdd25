"""The arrays jattn's GPU kernels ("flex_gpu" on Triton, "flex_mgpu" on Mosaic GPU)
are handed, built alike in JAX before the kernel: q, k, v as zero-padded [B, heads,
tokens, features] tiles where the kernel cannot read them where they lie, and the mods'
jaxprs with their captured arrays' shapes; and, for the TMA kernels, the letters of the
arrays they address (`Letters`, `at`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax.numpy as jnp

from jattn._src.core.layout import Layout
from jattn._src.kernels import layout_specs
from jattn._src.kernels.kernel_vjp import batched, with_batch, without_batch


@dataclasses.dataclass(frozen=True, eq=False)
class TileMods:
  """The mods as the kernels see them: jaxprs (static), their consts' shapes and dtypes."""

  mask_jaxpr: object
  score_jaxpr: object
  mask_meta: tuple
  score_meta: tuple


def pad_to(x, axis: int, size: int, mode="constant"):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, mode=mode)


def to_tiles(p, layout: Layout, query, key, value):
  """-> q [B, N, Tp, Hp], k [B, K, Sp, Hp], v [B, K, Sp, Dp], zero-padded (zero features
  add nothing to q k^T; padded rows are masked). p: a plan with T_padded, S_padded,
  H_padded, D_padded."""
  lay = batched(layout)
  q = jnp.einsum(f"{lay.query}->BNTH", with_batch(query, layout))
  k = jnp.einsum(f"{lay.key}->BKSH", with_batch(key, layout))
  v = jnp.einsum(f"{lay.value}->BKSD", with_batch(value, layout))
  q = pad_to(pad_to(q, 2, p.T_padded), 3, p.H_padded)
  k = pad_to(pad_to(k, 2, p.S_padded), 3, p.H_padded)
  v = pad_to(pad_to(v, 2, p.S_padded), 3, p.D_padded)
  return q, k, v


def from_tiles(p, layout: Layout, dq, dk, dv):
  """to_tiles' inverse for the gradients: dq [B, N, Tp, Hp], dk [B, K, Sp, Hp], dv [B, K,
  Sp, Dp] -> the query's, key's and value's layouts, padding cut."""
  lay = batched(layout)
  dq = jnp.einsum(f"BNTH->{lay.query}", dq[:, :, :p.T, :p.H])
  dk = jnp.einsum(f"BKSH->{lay.key}", dk[:, :, :p.S, :p.H])
  dv = jnp.einsum(f"BKSD->{lay.value}", dv[:, :, :p.S, :p.D])
  return tuple(without_batch(x, layout) for x in (dq, dk, dv))


@dataclasses.dataclass(frozen=True)
class Letters:
  """The axes of the arrays a TMA kernel reads and writes: q (and dq), k (and dk), v (and
  dv), out (and d_out); "BNTH"-style strings."""

  q: str
  k: str
  v: str
  o: str


# to_tiles' arrays: [B, heads, tokens, features]
TILES = Letters("BNTH", "BKSH", "BKSD", "BNTD")


def tma_in_place(p, layout: Layout) -> bool:
  """Whether a TMA kernel can read q, k, v, d_out and write out, dq, dk, dv where they
  lie: `layout_specs.applies` (tokens before features, nothing to pad) and features last
  (a TMA box's innermost axis must be contiguous; its 128-byte rows are a tile's); not
  inside `through_tiles()`."""
  return (not _THROUGH_TILES.get() and batched(layout).query[-1] == "H"
          and layout_specs.applies(p, layout))


_THROUGH_TILES = contextvars.ContextVar("jattn_through_tiles", default=False)


@contextlib.contextmanager
def through_tiles():
  """Mosaic GPU kernels traced inside read and write through `to_tiles` copies even where
  they could work in place: the GPU check times both."""
  token = _THROUGH_TILES.set(True)
  try:
    yield
  finally:
    _THROUGH_TILES.reset(token)


def letters(layout: Layout) -> Letters:
  """The batched layout's letters: the arrays as the caller gave them (B added)."""
  lay = batched(layout)
  return Letters(lay.query, lay.key, lay.value, lay.out)


def at(ref, axes: str, **index):
  """ref.at[...] of an array whose axes are `axes`, indexed by letter (B=b, T=pl.ds(..));
  the letters not given (the features) must trail: they are taken whole."""
  given = [a for a in axes if a in index]
  if axes[:len(given)] != "".join(given):
    raise ValueError(f"at: letters {sorted(index)} must lead the axes {axes!r}")
  return ref.at[tuple(index[a] for a in given)]


def as_int_or_float(c):
  c = jnp.asarray(c)
  return c.astype(jnp.int32) if c.dtype == jnp.bool_ else c


def flat(c):
  return as_int_or_float(c).reshape(-1)
