"""The gradient of a table that score_mod reads at a tile of positions (a relative
bias: table [N, 2M + 1] at clip(s - t, -M, M) + M), inside the dq kernels.

Each float table read gets its own zero tile added to what it reads (`perturbed`):
`jax.vjp` of the tile's score then gives d tile [bq, bk], the gradient at every
entry's read. A dq program adds it into one row of the table's width
(`add_by_index`), over its kv tiles, and writes that row and the table row it read
(a scalar of b and n). XLA sums the programs' rows by a one-hot contraction over the
table's rows (`sum_partials`): no scatter, no atomics, the same bits every run, as
for the scalars read one element at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def perturbed(read_table, meta, eps, seen: list):
  """read_table for `tile_mods.evaluate` that adds eps[k] (a zero tile of the table's
  dtype) to the k-th read of a float table and appends its (row, index) to seen."""

  def read(ci, row, index):
    x = read_table(ci, row, index)
    if jnp.issubdtype(meta[ci][1], jnp.floating):
      x = x + eps[len(seen)]
      seen.append((row, index))
    return x
  return read


def zeros(meta, table_reads, tile) -> tuple:
  """The zero tiles `perturbed` adds: one per float table read, in the table's dtype."""
  return tuple(jnp.zeros(tile, meta[ci][1]) for ci in table_reads)


def add_by_index(acc, slots, d, index):
  """acc + at each position whose slot is w, the sum of d over the entries where index
  is w: a scatter-add of d into a row, without scatter.

  acc float32 and slots int32 of one shape (the table entry a position holds, -1 for
  none); d float32 [bq, bk]; index int32 [bq, bk], within the table."""

  def add(w, acc):
    return acc + jnp.where(slots == w, jnp.sum(jnp.where(index == w, d, 0.0)), 0.0)
  # only the entries the tile reads: one for a tile that clip(s - t) holds at +-M
  return jax.lax.fori_loop(jnp.min(index), jnp.max(index) + 1, add, acc)


def sum_partials(meta, table_reads, parts, rows) -> dict:
  """{const index: float32 gradient of that table} from the programs' rows.

  parts float32 [B, N, P, R, W'] (W' >= the tables' widths) and rows int32
  [B, N, P, R]: table read r's gradient row in program p of head n, and the table
  row it read (-1 where the program read nothing); R = len(table_reads)."""
  grads = {}
  for ci in sorted(set(table_reads)):
    shape = meta[ci][0]
    height, width = (shape[0] if len(shape) == 2 else 1), shape[-1]
    mine = np.asarray([c == ci for c in table_reads])  # [R]
    # [B, N, P, R, height]: which table row each program's row adds to
    onehot = (rows[..., None] == jnp.arange(height, dtype=jnp.int32)) & mine[:, None]
    grads[ci] = jnp.einsum("bnprw,bnprx->xw", parts[..., :width],
                           onehot.astype(jnp.float32)).reshape(shape)
  return grads
