"""BlockSpecs over arrays in the caller's layout, so that a GPU kernel reads its tiles
where q, k, v and d_out lie and writes out, dq, dk and dv there: no transpose before or
after the kernel.

On an H100 the transposes to and from [B, N, T, H] around "flex_gpu" took 0.10 ms of its
0.61 ms causal forward and more than the kernel itself on 16 documents (the GPU check's
profile stage, benchmarks/results/gpu_h100_check.json). A tile of "BTNH" is block_q rows of
H contiguous elements, N * H apart: as coalesced as a tile of "BNTH".

A spec is written by letter: `spec("BTNH", dict(T=bq, H=Hp), dict(B=b, T=i, N=n))` is
the [bq, Hp] tile of row block i of head n of batch b, whatever the order of the
letters; a letter given no block size is squeezed (one element: its index is the
element's), one given no index is at block 0.
"""

from __future__ import annotations

from jax.experimental import pallas as pl

from jattn._src.core.layout import Layout
from jattn._src.kernels.kernel_vjp import batched


def applies(p, layout: Layout) -> bool:
  """Whether the kernels can take q, k, v and d_out as they lie: tokens before features
  (the tile is [tokens, features], as the kernels' dots take it) and nothing to pad
  (T and S whole tiles, H and D the tiles' widths)."""
  lay = batched(layout).query
  return (lay.index("T") < lay.index("H") and p.T == p.T_padded and p.S == p.S_padded
          and p.H == p.H_padded and p.D == p.D_padded)


def spec(letters: str, block: dict, index: dict) -> pl.BlockSpec:
  """The BlockSpec of an array whose axes are `letters`; block: letter -> block size
  (absent: squeezed); index: letter -> fn(*program ids) -> block index (absent: 0)."""
  shape = tuple(block.get(letter) for letter in letters)
  return pl.BlockSpec(
      shape, lambda *ids: tuple(index[letter](*ids) if letter in index else 0
                                for letter in letters))


def shape(letters: str, sizes: dict) -> tuple:
  """An array's shape in the order of `letters`, from letter -> size."""
  return tuple(sizes[letter] for letter in letters)


def group_first(layout: Layout) -> bool:
  """Whether a block of G heads of the query is [G, T, H] (heads before tokens in the
  layout) rather than [T, G, H]."""
  lay = batched(layout).query
  return lay.index("N") < lay.index("T")
