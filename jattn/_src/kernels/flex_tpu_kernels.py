"""The Pallas kernels of "flex_tpu" (see `flex_tpu` for the design): the forward,
the dq and dk/dv backward kernels, and what they share: a tile's logits with the
mods applied (`_tile_logits`), the mods' arrays in SMEM, per-token arrays and
tables in VMEM, and the block tables that drive skipping.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jattn._src.core.layout import Layout
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import table_grads, tile_mods
from jattn._src.kernels.flex_tpu import LANES
from jattn._src.kernels.tile_classes import band_keep, both, grid_widths, tile_classes
from jattn._src.kernels.kernel_vjp import batched, with_batch, without_batch
from jattn._src.masks.closed_form_blocks import EMPTY, FULL, PARTIAL

if TYPE_CHECKING:
  from jattn._src.kernels.flex_tpu import Plan

_LANES = LANES
# The kernels' softmax runs in base 2: a tile's logits are multiplied by log2(e) with the
# scale (one multiply, folded into it where no score_mod runs), and exp2 takes them
# without the multiply by log2(e) that exp would lower to; m and lse convert back.
_LOG2E = float(np.log2(np.e))
_LN2 = float(np.log(2.0))


def _mxu(a, b, contract):
  """a . b over the axes `contract` ((a's,), (b's,)), float32 on the MXU.

  The precision is named, not left to jax_default_matmul_precision: Mosaic compiles no
  "high" or "highest" dot of bfloat16 operands ("Bad lhs type", found by the compile
  tier), and for them the default is exact anyway (bf16 products, float32 sums).
  float32 operands keep the config's precision."""
  precision = jax.lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else None
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)

# ---------------------------------------------------------------- shared pieces


@dataclasses.dataclass(frozen=True, eq=False)
class _TileMods:
  """The mods as the kernels see them: jaxprs (static) and their consts' shapes and dtypes."""

  mask_jaxpr: object
  score_jaxpr: object
  mask_meta: tuple
  score_meta: tuple

  @property
  def count(self) -> int:
    return len(self.mask_meta) + len(self.score_meta)


def _tile_mods(mods, p: Plan, origin=(0, 0)):
  """(the static `_TileMods`, the consts as flat 32-bit arrays for SMEM, mask_mod's
  per-token arrays as row arrays for VMEM blocks (`_row_arrays`) from `origin`)."""
  mask_jaxpr = None if mods is None else mods.mask_jaxpr
  score_jaxpr = None if mods is None else mods.score_jaxpr
  mask_consts = () if mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if score_jaxpr is None else tuple(mods.score_consts)
  tm = _TileMods(mask_jaxpr, score_jaxpr, tile_mods.consts_meta(mask_consts),
                 tile_mods.consts_meta(score_consts))
  rows = {ci for ci, _ in p.mask_rows}
  smem = [jnp.zeros((1,), jnp.int32) if i in rows else _to_smem(c)  # a placeholder
          for i, c in enumerate(mask_consts)]
  smem += [jnp.zeros((1,), jnp.int32) if i in p.score_tables else _to_smem(c)
           for i, c in enumerate(score_consts)]
  return tm, smem, _row_arrays(p, mask_consts, origin) + _table_arrays(p, score_consts)


def _table_arrays(p: Plan, score_consts):
  """A table x [W] or [R, W], W <= block_kv -> [R, 8, block_kv] (rows along the sublanes,
  zero-padded to the tile's width), all in VMEM, for a gather along the lanes (128 lanes
  at a time: `_table_reader`)."""
  arrays = []
  for ci in p.score_tables:
    x = jnp.asarray(score_consts[ci])
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)
    x = jnp.pad(x, ((0, 0), (0, p.block_kv - x.shape[1])))
    arrays.append(jnp.broadcast_to(x[:, None, :], (x.shape[0], 8, p.block_kv)))
  return arrays


def _table_specs(p: Plan, arrays):
  return [pl.BlockSpec(x.shape, lambda *g: (0, 0, 0)) for x in arrays]


def _table_reader(p: Plan, table_refs, meta):
  """read_table for tile_mods.evaluate: x[row, index] gathered along the lanes, one
  128-lane vreg of the table and of the indices at a time (Mosaic gathers from a single
  source vreg: "Multiple source vregs along gather dimension" otherwise, found by the
  TPU compiler at block_kv = 512), the table's chunks merged by where the index falls."""
  refs = dict(zip(p.score_tables, table_refs))
  bq, bk = p.block_q, p.block_kv

  def read_table(ci, row, index):
    x = refs[ci][row]  # [8, bk]: the table along the lanes, zero-padded
    chunks = -(-meta[ci][0][-1] // _LANES)
    out = None
    for c in range(chunks):
      src = jnp.broadcast_to(x[0:1, c * _LANES:(c + 1) * _LANES], (bq, _LANES))
      at = jnp.clip(index - c * _LANES, 0, _LANES - 1)
      got = jnp.concatenate([jnp.take_along_axis(src, at[:, o:o + _LANES], axis=1)
                             for o in range(0, bk, _LANES)], axis=1)  # [bq, bk]
      out = got if out is None else jnp.where(index >= c * _LANES, got, out)
    return out
  return read_table


def _row_arrays(p: Plan, mask_consts, origin):
  """Per-token array x [L] or [X, L] read as x[row, t] -> int32/float32 [X, Tp, 128]
  (each entry along the lanes), as x[row, s] -> [X, 8, Sp] (along the sublanes);
  from the global position of the first query / key (`origin`, (0, 0) or traced);
  positions past L repeat x[.., L - 1], which is dynamic_slice's clamp."""
  arrays = []
  for ci, letter in p.mask_rows:
    x = jnp.asarray(mask_consts[ci])
    x = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)  # [X, L]
    size = p.T_padded if letter == "t" else p.S_padded
    if not p.offsets:
      x = x[:, :size]
      x = jnp.pad(x, ((0, 0), (0, size - x.shape[1])), mode="edge")
    else:  # [X, L + size], then the size entries from the (traced) first position
      x = jnp.pad(x, ((0, 0), (0, size)), mode="edge")
      x = jax.lax.dynamic_slice_in_dim(x, origin[0] if letter == "t" else origin[1], size,
                                       axis=1)
    if letter == "t":
      arrays.append(jnp.broadcast_to(x[:, :, None], x.shape + (_LANES,)))
    else:
      arrays.append(jnp.broadcast_to(x[:, None, :], (x.shape[0], 8, size)))
  return arrays


def _row_specs(p: Plan, row_arrays, q_tile, kv_tile):
  """BlockSpecs of the row arrays (then the tables): every row X at once, the tile of
  the grid step; q_tile(*grid indices, *scalar prefetch refs) / kv_tile(...) -> the tile
  index."""

  specs = []
  for (ci, letter), x in zip(p.mask_rows, row_arrays):
    if letter == "t":
      specs.append(pl.BlockSpec((x.shape[0], p.block_q, _LANES),
                                lambda *g, f=q_tile: (0, f(*g), 0)))
    else:
      specs.append(pl.BlockSpec((x.shape[0], 8, p.block_kv),
                                lambda *g, f=kv_tile: (0, 0, f(*g))))
  return specs + _table_specs(p, row_arrays[len(p.mask_rows):])


def _block_reader(p: Plan, tm, row_refs):
  """read_block for tile_mods.evaluate: the [bq, bk] tile of x[row, t] or x[row, s]."""
  refs = dict(zip(p.mask_rows, row_refs[:len(p.mask_rows)]))

  def read_block(ci, letter, row):
    x = refs[ci, letter][row]  # [bq, 128] or [8, bk]
    x = _lanes(x, p.block_kv) if letter == "t" else jnp.broadcast_to(
        x[0:1, :], (p.block_q, p.block_kv))
    return x != 0 if tm.mask_meta[ci][1] == np.bool_ else x
  return read_block


def _to_smem(c):
  """A captured array as a flat 32-bit array for SMEM (bool as int32)."""
  c = jnp.asarray(c)
  if c.dtype == jnp.bool_:
    c = c.astype(jnp.int32)
  return c.reshape(-1) if c.ndim != 1 else c


def _reader(refs, meta):
  def read(i, flat):
    x = refs[i][flat]
    return x != 0 if meta[i][1] == np.bool_ else x
  return read


def _tile_logits(p: Plan, tm: _TileMods, smem_refs, b, n, i, j, q, k, *, with_vjp=False,
                 read_grads=False, full=False, row_refs=(), origin=(0, 0)):
  """One tile's logits after scale, score_mod and every mask, in base 2 (times log2 e).

  -> (s float32 [bq, bk]: the logits times log2(e), LARGE_NEGATIVE where masked, keep
  bool [bq, bk] or None when nothing is masked, d_score). d_score(ds) -> d (q k^T) from
  ds = d (logits): through score_mod (with_vjp) and the scale; read_grads also: -> (that, (d every float read: scalars), (its flat
  index into its array: int32 scalars)), in the order of `Plan.score_reads`, (d every
  float table read: float [bq, bk] tiles), ((its table row: an int32 scalar, its
  indices: int32 [bq, bk]), ...), in the order of `Plan.table_reads`.
  full: a FULL tile, where causal, window and mask_mod hide nothing: only the
  padding is masked. origin: global position of the first query and key (int32
  scalars read from SMEM under `Plan.offsets`), added to the tile's positions for the
  mods, causal and window; the padding is masked at local positions.
  """
  bq, bk = p.block_q, p.block_kv
  tile = (bq, bk)
  mask_refs, score_refs = smem_refs[:len(tm.mask_meta)], smem_refs[len(tm.mask_meta):]
  # [bq, bk] = q k^T, float32 on the MXU
  s = _mxu(q, k, ((1,), (1,)))
  t_loc = i * bq + jax.lax.broadcasted_iota(jnp.int32, tile, 0)
  s_loc = j * bk + jax.lax.broadcasted_iota(jnp.int32, tile, 1)
  t_pos, s_pos = (t_loc, s_loc) if not p.offsets else (t_loc + origin[0], s_loc + origin[1])
  d_score = lambda ds: ds * p.scale  # d (q k^T) from d (logits)
  if tm.score_jaxpr is None:
    s = s * (p.scale * _LOG2E)  # the scale and log2(e): one multiply
  else:
    R = len(p.score_reads)

    def score(x, *eps):
      # each float read plus its own zero eps: d loss / d eps = the read's gradient
      base, flats, at = _reader(score_refs, tm.score_meta), [], []

      def read(ci, flat):
        value = base(ci, flat)
        if read_grads and jnp.issubdtype(tm.score_meta[ci][1], jnp.floating):
          value = value + eps[len(flats)]
          flats.append(flat)
        return value

      read_table = _table_reader(p, row_refs[len(p.mask_rows):], tm.score_meta)
      if read_grads:  # a zero tile per table read: d loss / d it = the read's gradient
        read_table = table_grads.perturbed(read_table, tm.score_meta, eps[R:], at)
      # score_mod sees the logits x p.scale; its result times log2(e): both factors fold
      # into the multiplies score_mod makes itself (`tile_mods.Linear`)
      y = tile_mods.evaluate(tm.score_jaxpr, tm.score_meta, read,
                             [tile_mods.Linear.of(x, p.scale), b, n, t_pos, s_pos], tile,
                             positions={3: "t", 4: "s"}, read_table=read_table,
                             out_scale=_LOG2E)[0]
      return jnp.broadcast_to(y, tile).astype(jnp.float32), (tuple(flats), tuple(at))
    if with_vjp:
      eps = ()
      if read_grads:
        eps = tuple(jnp.zeros((), jnp.float32) for _ in p.score_reads) + table_grads.zeros(
            tm.score_meta, p.table_reads, tile)
      s, vjp, (flats, at) = jax.vjp(score, s, *eps, has_aux=True)
      # ds: d (natural logits); score's output is in base 2: ds ln 2 is d (its output)
      if read_grads:
        def d_score(ds):
          grads = vjp(ds * _LN2)
          return grads[0], grads[1:1 + R], flats, grads[1 + R:], at
      else:
        d_score = lambda ds: vjp(ds * _LN2)[0]
    else:
      s = score(s)[0]
  keep = band_keep(p, i, j, origin, full)
  if tm.mask_jaxpr is not None and not full:
    mm = tile_mods.evaluate(tm.mask_jaxpr, tm.mask_meta, _reader(mask_refs, tm.mask_meta),
                            [b, n, t_pos, s_pos], tile, positions={2: "t", 3: "s"},
                            read_block=_block_reader(p, tm, row_refs))[0]
    keep = both(keep, jnp.broadcast_to(mm, tile))
  if keep is not None:
    s = jnp.where(keep, s, LARGE_NEGATIVE)
  return s, keep, d_score


def _to_tiles(p: Plan, layout: Layout, query, key, value):
  """-> q [B, N, Tp, H], k [B, K, Sp, H], v [B, K, Sp, D], padded with zeros."""
  lay = batched(layout)
  q = jnp.einsum(f"{lay.query}->BNTH", with_batch(query, layout))
  k = jnp.einsum(f"{lay.key}->BKSH", with_batch(key, layout))
  v = jnp.einsum(f"{lay.value}->BKSD", with_batch(value, layout))
  return _pad_rows(q, p.T_padded), _pad_rows(k, p.S_padded), _pad_rows(v, p.S_padded)


def _pad_rows(x, size):
  return jnp.pad(x, ((0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)))


def _lanes(x, width: int):
  """[rows, 128] lane-replicated -> [rows, width]."""
  reps = -(-width // _LANES)
  y = jnp.tile(x, (1, reps)) if reps > 1 else x
  return y if width == y.shape[1] else y[:, :width]


_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


@dataclasses.dataclass(frozen=True)
class _Tables:
  """Static shape of the block tables in SMEM, over [Bc, Nc, ...], Bc in (1, B), Nc in
  (1, N) (1 where the mask does not depend on b or n): per query tile its row's
  non-empty kv tiles, compacted to the first W of [nq, W] (`kv_list`, `kv_cls`), and per
  kv tile its column's non-empty query tiles, the first Wq of [nk, Wq] (`q_list`,
  `q_cls`)."""

  Bc: int
  Nc: int
  nq: int
  nk: int
  W: int
  Wq: int

  def at(self, b, n, i, w):
    """Flat index of (b, n, i, w) in kv_list and kv_cls ([Bc, Nc, nq, W])."""
    b = b if self.Bc > 1 else 0
    n = n if self.Nc > 1 else 0
    return ((b * self.Nc + n) * self.nq + i) * self.W + w

  def at_t(self, b, n, j, w):
    """Flat index of (b, n, j, w) in q_list and q_cls ([Bc, Nc, nk, Wq])."""
    b = b if self.Bc > 1 else 0
    n = n if self.Nc > 1 else 0
    return ((b * self.Nc + n) * self.nk + j) * self.Wq + w


def _block_tables(p: Plan, mods, origin=(0, 0)):
  """-> (`_Tables`, [kv_list, kv_cls, q_list, q_cls] flat int32 for SMEM), or (None, []).

  The classes are those of the tiles at global positions from `origin` (the first
  query's and key's, (0, 0) or traced). The grids run over the lists, not over every
  tile: kv_list[b, n, i, w] is the w-th non-empty kv tile of query tile i's row and
  kv_cls its class (PARTIAL or FULL); past the row's count the class is EMPTY (the step
  does nothing) and the tile the last non-empty one, so that Pallas, which copies only
  when the block index changes, fetches nothing. q_list, q_cls: the same per kv tile
  along the query tiles, for the dk/dv kernel. The widths W, Wq are static
  (`grid_widths`: causal, the window and a ready-made mask_mod's band bound them).
  """
  if not p.skip:
    return None, []
  classes = tile_classes(p, mods, origin)
  Bc, Nc, nq, nk = classes.shape
  W, Wq = grid_widths(p)
  tables = _Tables(Bc, Nc, nq, nk, W, Wq)
  kv_list, kv_cls = _compact(classes, W)
  q_list, q_cls = _compact(jnp.swapaxes(classes, 2, 3), Wq)
  return tables, [x.reshape(-1) for x in (kv_list, kv_cls, q_list, q_cls)]


def _compact(classes, width: int):
  """classes int32 [..., m] -> (the indices of the non-empty entries along the last
  axis, in order, then the last of them repeated (0 if none), [..., width]; their
  classes, EMPTY past the count). width: at least the most non-empty entries of a row."""
  m = classes.shape[-1]
  index = jax.lax.broadcasted_iota(jnp.int32, classes.shape, classes.ndim - 1)
  nonempty = classes != EMPTY
  order = jnp.argsort(jnp.where(nonempty, index, m + index), axis=-1)[..., :width]
  order = order.astype(jnp.int32)
  count = jnp.sum(nonempty, axis=-1, keepdims=True, dtype=jnp.int32)
  w = jax.lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
  last = jnp.take_along_axis(order, jnp.clip(count - 1, 0, width - 1), axis=-1)
  listed = w < count
  tiles = jnp.where(listed, order, jnp.where(count > 0, last, 0))
  return tiles, jnp.where(listed, jnp.take_along_axis(classes, order, axis=-1), EMPTY)


def _kv_step(tables, table_refs, b, n, i, w):
  """(the kv tile j of grid step w of query tile i's row, its class; None without
  tables: every tile runs, PARTIAL)."""
  if tables is None:
    return w, None
  at = tables.at(b, n, i, w)
  return table_refs[0][at], table_refs[1][at]


def _q_step(tables, table_refs, b, n, j, w):
  """(the query tile i of step w of kv tile j's column, its class), as `_kv_step`."""
  if tables is None:
    return w, None
  at = tables.at_t(b, n, j, w)
  return table_refs[2][at], table_refs[3][at]


def _gated(cls, step):
  """step(full) on this tile: skipped if EMPTY, step(True) if FULL, step(False) if PARTIAL;
  without tables (cls None), step(False) always."""
  if cls is None:
    step(False)
    return
  pl.when(cls == FULL)(lambda: step(True))
  pl.when(cls == PARTIAL)(lambda: step(False))


# ---------------------------------------------------------------- forward kernel


def forward(plan_: Plan, layout: Layout, query, key, value, mods, offsets=None,
            accumulator_out: bool = False):
  """-> (out in the query's layout with D, lse float32 [B, N, T], max logits float32
  [B, N, T] when `plan_.max_logits`, else None); no sinks.

  accumulator_out: out in float32, not the query's dtype (the VJP's residual: the
  backward's row term must not see a 16-bit output's rounding).

  offsets: int32 [2], the global position of the first query and of the first key
  (traced, e.g. a ring step's), when the plan was made with `offsets=True`."""
  p = plan_
  q, k, v = _to_tiles(p, layout, query, key, value)
  origin, scalars = _origin(p, offsets)
  tm, smem, row_arrays = _tile_mods(mods, p, origin)
  tables, table_arrays = _block_tables(p, mods, origin)
  G = p.N // p.K
  bq, bk = p.block_q, p.block_kv
  Tp, Sp = p.T_padded, p.S_padded
  kv, kv_tile = _kv_index(tables, G)
  in_specs = [
      pl.BlockSpec((None, None, bq, p.H), lambda b, n, i, j, *_: (b, n, i, 0)),
      pl.BlockSpec((None, None, bk, p.H), kv),
      pl.BlockSpec((None, None, bk, p.D), kv),
  ] + _row_specs(p, row_arrays, lambda b, n, i, j, *_: i, kv_tile)
  rows = pl.BlockSpec((None, None, bq, _LANES), lambda b, n, i, j, *_: (b, n, i, 0))
  row_stats = 2 if p.max_logits else 1  # lse, and the running max m when asked
  out_specs = [pl.BlockSpec((None, None, bq, p.D), lambda b, n, i, j, *_: (b, n, i, 0)),
               *[rows] * row_stats]
  out, *stats = pl.pallas_call(
      functools.partial(_forward_kernel, p=p, tm=tm, tables=tables,
                        exact_pv=accumulator_out and bool(p.score_reads or p.score_tables)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(table_arrays) + len(smem) + len(scalars),
          grid=(p.B, p.N, Tp // bq, Sp // bk if tables is None else tables.W),
          in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, p.D), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((p.B, p.N, Tp, p.D),
                                      jnp.float32 if accumulator_out else query.dtype),
                 *[jax.ShapeDtypeStruct((p.B, p.N, Tp, _LANES), jnp.float32)] * row_stats],
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
      interpret=p.interpret,
      name="jattn_flex_tpu_fwd",
  )(*table_arrays, *smem, *scalars, q, k, v, *row_arrays)
  out = jnp.einsum(f"BNTD->{batched(layout).out}", out[:, :, :p.T])
  max_logits = stats[1][:, :, :p.T, 0] if p.max_logits else None
  return without_batch(out, layout), stats[0][:, :, :p.T, 0], max_logits


def _kv_index(tables, G):
  """(the k/v index map: kv head n // G, the kv tile of grid step w (past the row's
  non-empty tiles, the last one, already fetched); the kv tile alone)."""
  def kv_tile(b, n, i, w, *refs):
    return _kv_step(tables, refs, b, n, i, w)[0]
  return (lambda b, n, i, w, *refs: (b, jax.lax.div(n, jnp.int32(G)),
                                     kv_tile(b, n, i, w, *refs), 0),
          kv_tile)


def _origin(p: Plan, offsets):
  """-> (origin: (first query, first key) global positions for the XLA side, the
  scalar-prefetch arrays that carry them into the kernel: [offsets] or [])."""
  if not p.offsets:
    if offsets is not None:
      raise ValueError("offsets given to a plan made without offsets=True")
    return (0, 0), []
  offsets = jnp.asarray(offsets, jnp.int32).reshape(2)
  return (offsets[0], offsets[1]), [offsets]


def _split_refs(refs, tables, tm, p: Plan):
  """-> (block table refs, mods' SMEM refs, origin (int32 scalars or (0, 0)), the rest)."""
  nt = 0 if tables is None else 4
  start = nt + tm.count
  if not p.offsets:
    return refs[:nt], refs[nt:start], (0, 0), refs[start:]
  off = refs[start]
  return refs[:nt], refs[nt:start], (off[0], off[1]), refs[start + 1:]


def _forward_kernel(*refs, p: Plan, tm: _TileMods, tables, exact_pv: bool = False):
  """exact_pv: P V with the float32 weights, or for 16-bit v with the weights split in two
  16-bit parts (score_mod's float arrays get gradients: the backward's row term dO . out
  must equal its rowsum(P dP); see blockwise_loop)."""
  table_refs, smem_refs, origin, rest = _split_refs(refs, tables, tm, p)
  nr = len(p.mask_rows) + len(p.score_tables)
  q_ref, k_ref, v_ref = rest[:3]
  row_refs = rest[3:3 + nr]
  o_ref, lse_ref = rest[3 + nr:5 + nr]
  max_ref = rest[5 + nr] if p.max_logits else None
  m_sc, l_sc, acc_sc = rest[5 + nr + (max_ref is not None):]
  b, n, i, w = (pl.program_id(a) for a in range(4))
  j, cls = _kv_step(tables, table_refs, b, n, i, w)

  @pl.when(w == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, LARGE_NEGATIVE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  _gated(cls, lambda full: _forward_step(
      p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, full, row_refs,
      origin, exact_pv))

  @pl.when(w == pl.num_programs(3) - 1)
  def _finish():
    l, m = l_sc[...], m_sc[...]
    seen = l > 0.0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    o_ref[...] = (acc_sc[...] * _lanes(inv, p.D)).astype(o_ref.dtype)
    # m is in base 2 (`_LOG2E`)
    lse_ref[...] = jnp.where(seen, m * _LN2 + jnp.log(jnp.where(seen, l, 1.0)), LARGE_NEGATIVE)
    if max_ref is not None:  # masked logits are LARGE_NEGATIVE: a row with none keeps it
      max_ref[...] = jnp.where(m > LARGE_NEGATIVE, m * _LN2, LARGE_NEGATIVE)


def _forward_step(p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, full,
                  row_refs, origin, exact_pv=False):
  s, _, _ = _tile_logits(p, tm, smem_refs, b, n, i, j, q_ref[...], k_ref[...], full=full,
                         row_refs=row_refs, origin=origin)
  m_prev, l_prev = m_sc[...], l_sc[...]  # [bq, 128]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
  # A row that has seen no visible key keeps m = LARGE_NEGATIVE: shift it by 0
  # instead, so that its masked logits give exp(LARGE_NEGATIVE) = 0, not 1.
  shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
  probs = jnp.exp2(s - _lanes(shift, p.block_kv))  # [bq, bk]; s and m in base 2
  alpha = jnp.exp2(m_prev - m_next)  # [bq, 128]
  l_sc[...] = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
  m_sc[...] = m_next
  v = v_ref[...]
  if exact_pv and v.dtype == jnp.float32:  # the residual out that score_mod's gradients read
    pv = jax.lax.dot_general(probs, v, (((1,), (0,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)  # [bq, D]
  elif exact_pv:  # 16-bit v is exact: the weights in two 16-bit parts, two MXU passes
    # (Precision.HIGHEST on float32 would take six), error about 2^-17 of each weight
    hi = probs.astype(v.dtype)
    lo = (probs - hi.astype(jnp.float32)).astype(v.dtype)
    pv = _mxu(hi, v, ((1,), (0,))) + _mxu(lo, v, ((1,), (0,)))  # [bq, D]
  else:
    pv = _mxu(probs.astype(v.dtype), v, ((1,), (0,)))  # [bq, D]
  acc_sc[...] = acc_sc[...] * _lanes(alpha, p.D) + pv


# ---------------------------------------------------------------- backward kernels


def backward(plan_: Plan, layout: Layout, query, key, value, mods, out, lse, d_out,
             offsets=None):
  """Gradients into query, key, value (their layouts and dtypes) from the final out and
  lse [B, N, T] (sinks included): the weights are recomputed tile by tile.

  Two kernels: dq on the grid (B, N, T / bq, W), the row's non-empty kv tiles
  sequential; dk and dv on (B, K, S / bk, G Wq), the G query heads of kv head k and
  their column's non-empty query tiles sequential, so that dk and dv are summed over the
  group in VMEM, never by atomics (W, Wq: `_block_tables`; without skipping, every tile).
  offsets: as `forward` (a ring step's range: out, lse and d_out are then the final
  ones, and the gradients this range's share).
  """
  p = plan_
  q, k, v = _to_tiles(p, layout, query, key, value)
  lay = batched(layout)
  o = jnp.einsum(f"{lay.out}->BNTD", with_batch(out, layout)).astype(jnp.float32)
  do = jnp.einsum(f"{lay.out}->BNTD", with_batch(d_out, layout))
  # delta [B, N, T] = sum_D dO * O: the row term of d softmax
  delta = jnp.sum(do.astype(jnp.float32) * o, axis=-1)
  do = _pad_rows(do.astype(query.dtype), p.T_padded)
  rows = lambda x: _pad_rows(jnp.broadcast_to(x[..., None], x.shape + (_LANES,)), p.T_padded)
  # lse in base 2 as the tiles' logits (`_LOG2E`). A row with no visible key (lse =
  # LARGE_NEGATIVE) gets -LARGE_NEGATIVE: its masked logits (LARGE_NEGATIVE) then give
  # exp2 = 0 as every masked logit does, and the tiles need no second select on the weights
  lse2 = lse.astype(jnp.float32)
  lse2 = jnp.where(lse2 > LARGE_NEGATIVE, lse2 * _LOG2E, -LARGE_NEGATIVE)
  lse_l, delta_l = rows(lse2), rows(delta)  # [B, N, Tp, 128]
  origin, scalars = _origin(p, offsets)
  tm, smem, row_arrays = _tile_mods(mods, p, origin)
  tables, table_arrays = _block_tables(p, mods, origin)
  G = p.N // p.K
  bq, bk = p.block_q, p.block_kv
  Tp, Sp = p.T_padded, p.S_padded
  nq, nk = Tp // bq, Sp // bk
  W, Wq = (nk, nq) if tables is None else (tables.W, tables.Wq)  # the grids' inner widths
  row = lambda b, n, i, j, *_: (b, n, i, 0)
  kv, kv_tile = _kv_index(tables, G)
  dq_out_specs = [pl.BlockSpec((None, None, bq, p.H), row)]
  dq_out_shape = [jax.ShapeDtypeStruct((p.B, p.N, Tp, p.H), jnp.float32)]
  if p.score_reads:  # per program (b, n, i, j): an [8, 128] tile of read gradients, indices
    tile8 = pl.BlockSpec((None, None, None, 8, _LANES), lambda b, n, i, j, *_: (b, n, i, j, 0))
    dq_out_specs += [tile8, tile8]
    dq_out_shape += [jax.ShapeDtypeStruct((p.B, p.N, nq, 8 * W, _LANES), jnp.float32),
                     jax.ShapeDtypeStruct((p.B, p.N, nq, 8 * W, _LANES), jnp.int32)]
  TR = len(p.table_reads)
  if TR:  # per program (b, n, i), over its kv tiles: an [8, bk] gradient row per table
    # read (entry w along the lanes), and an [8, 128] tile of the table rows they read
    per_row = lambda b, n, i, j, *_: (b, n, i, 0, 0)
    dq_out_specs += [pl.BlockSpec((None, None, None, 8 * TR, bk), per_row),
                     pl.BlockSpec((None, None, None, 8, _LANES), per_row)]
    dq_out_shape += [jax.ShapeDtypeStruct((p.B, p.N, nq, 8 * TR, bk), jnp.float32),
                     jax.ShapeDtypeStruct((p.B, p.N, nq, 8, _LANES), jnp.int32)]
  dq, *read_parts = pl.pallas_call(
      functools.partial(_dq_kernel, p=p, tm=tm, tables=tables),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(table_arrays) + len(smem) + len(scalars),
          grid=(p.B, p.N, nq, W),
          in_specs=[pl.BlockSpec((None, None, bq, p.H), row),
                    pl.BlockSpec((None, None, bk, p.H), kv),
                    pl.BlockSpec((None, None, bk, p.D), kv),
                    pl.BlockSpec((None, None, bq, p.D), row),
                    pl.BlockSpec((None, None, bq, _LANES), row),
                    pl.BlockSpec((None, None, bq, _LANES), row)]
          + _row_specs(p, row_arrays, lambda b, n, i, j, *_: i, kv_tile),
          out_specs=dq_out_specs,
          scratch_shapes=[pltpu.VMEM((bq, p.H), jnp.float32)]),
      out_shape=dq_out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
      interpret=p.interpret,
      name="jattn_flex_tpu_dq",
  )(*table_arrays, *smem, *scalars, q, k, v, do, lse_l, delta_l, *row_arrays)

  # grid (b, kv head c, kv tile j, r = g Wq + w): query head n = c G + g, query tile i
  # the w-th non-empty one of kv tile j's column (past them, the last: already fetched)
  def q_tile(b, c, j, r, *refs):
    n = c * G + jax.lax.div(r, jnp.int32(Wq))
    return _q_step(tables, refs, b, n, j, jax.lax.rem(r, jnp.int32(Wq)))[0]
  qrow = lambda b, c, j, r, *refs: (b, c * G + jax.lax.div(r, jnp.int32(Wq)),
                                    q_tile(b, c, j, r, *refs), 0)
  kvrow = lambda b, c, j, r, *_: (b, c, j, 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, p=p, tm=tm, Wq=Wq, G=G, tables=tables),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(table_arrays) + len(smem) + len(scalars),
          grid=(p.B, p.K, nk, G * Wq),
          in_specs=[pl.BlockSpec((None, None, bq, p.H), qrow),
                    pl.BlockSpec((None, None, bk, p.H), kvrow),
                    pl.BlockSpec((None, None, bk, p.D), kvrow),
                    pl.BlockSpec((None, None, bq, p.D), qrow),
                    pl.BlockSpec((None, None, bq, _LANES), qrow),
                    pl.BlockSpec((None, None, bq, _LANES), qrow)]
          + _row_specs(p, row_arrays, q_tile, lambda b, c, j, r, *_: j),
          out_specs=[pl.BlockSpec((None, None, bk, p.H), kvrow),
                     pl.BlockSpec((None, None, bk, p.D), kvrow)],
          scratch_shapes=[pltpu.VMEM((bk, p.H), jnp.float32),
                          pltpu.VMEM((bk, p.D), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((p.B, p.K, Sp, p.H), jnp.float32),
                 jax.ShapeDtypeStruct((p.B, p.K, Sp, p.D), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
      interpret=p.interpret,
      name="jattn_flex_tpu_dkv",
  )(*table_arrays, *smem, *scalars, q, k, v, do, lse_l, delta_l, *row_arrays)
  dq = jnp.einsum(f"BNTH->{lay.query}", dq[:, :, :p.T])
  dk = jnp.einsum(f"BKSH->{lay.key}", dk[:, :, :p.S])
  dv = jnp.einsum(f"BKSD->{lay.value}", dv[:, :, :p.S])
  grads = tuple(without_batch(x, layout) for x in (dq, dk, dv))
  return grads + (_consts_grads(p, tm, read_parts, nq, W),)


def _consts_grads(p: Plan, tm: _TileMods, read_parts, nq: int, nk: int) -> tuple:
  """float32 gradient of each float array score_mod captured (None for the others),
  from the dq kernel's per-program read gradients and table rows (nk: the dq grid's
  inner width, a row's kv steps): summed by XLA in a
  fixed order (a one-hot contraction, no scatter, no atomics), so the same bits every run."""
  grads = [None] * len(tm.score_meta)
  if p.table_reads:
    TR = len(p.table_reads)
    parts, rows = read_parts[-2:]
    read_parts = read_parts[:-2]
    parts = parts.reshape(p.B, p.N, nq, TR, 8, p.block_kv)[..., 0, :]  # [B, N, nq, TR, bk]
    for ci, g in table_grads.sum_partials(tm.score_meta, p.table_reads, parts,
                                          rows[..., 0, :TR]).items():
      grads[ci] = g
  if not p.score_reads:
    return tuple(grads)
  R = len(p.score_reads)
  d_reads, flats = (x.reshape(p.B, p.N, nq, nk, 8, _LANES)[..., 0, :R] for x in read_parts)
  d_reads = jnp.sum(d_reads, axis=(2, 3))  # [B, N, R]
  # [B, N, R]: a read's index depends on b and n alone; EMPTY tiles wrote -1
  flats = jnp.max(flats, axis=(2, 3))
  for ci, (shape, dtype) in enumerate(tm.score_meta):
    if ci not in p.score_reads:  # an int array, or a table (its gradient is above)
      continue
    size = int(np.prod(shape, dtype=np.int64))
    mine = np.asarray([r == ci for r in p.score_reads])  # [R]
    # [B, N, R, size] one-hot of each read's flat index
    onehot = (flats[..., None] == jnp.arange(size, dtype=jnp.int32)) & mine[:, None]
    grads[ci] = jnp.einsum("bnr,bnrf->f", d_reads, onehot.astype(jnp.float32)).reshape(shape)
  return tuple(grads)


def _tile_grads(p, tm, smem_refs, b, n, i, j, q, k, v, do, lse, delta, read_grads=False,
                full=False, row_refs=(), origin=(0, 0)):
  """-> (probs [bq, bk] float32, d (q k^T) [bq, bk] float32); read_grads: also the
  gradients of the float reads of score_mod's arrays and their flat indices, and those
  of its table reads (tiles) and where they read (`_tile_logits`)."""
  s, _, d_score = _tile_logits(p, tm, smem_refs, b, n, i, j, q, k, with_vjp=True,
                                  read_grads=read_grads, full=full, row_refs=row_refs,
                                  origin=origin)
  # both in base 2; masked logits are LARGE_NEGATIVE: exp2 gives 0 without a select
  # (the rows with none visible have lse = -LARGE_NEGATIVE, `backward`)
  probs = jnp.exp2(s - _lanes(lse, p.block_kv))
  # dP [bq, bk] = dO v^T
  dp = _mxu(do, v, ((1,), (1,)))
  ds = probs * (dp - _lanes(delta, p.block_kv))
  if read_grads:
    return (probs, *d_score(ds))
  return probs, d_score(ds)


def _dq_kernel(*refs, p: Plan, tm: _TileMods, tables):
  table_refs, smem_refs, origin, rest = _split_refs(refs, tables, tm, p)
  reads = bool(p.score_reads)
  nr = len(p.mask_rows) + len(p.score_tables)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = rest[:6]
  row_refs, rest = rest[6:6 + nr], list(rest[6 + nr:])
  dq_ref, dq_sc = rest.pop(0), rest.pop()
  # one [8, 128] tile per program: lane r holds read r's gradient / flat index
  dr_ref, fr_ref = (rest.pop(0), rest.pop(0)) if reads else (None, None)
  # gradient rows of the table reads [8 TR, bk], the table rows they read [8, 128]
  dt_ref, tr_ref = (rest.pop(0), rest.pop(0)) if p.table_reads else (None, None)
  b, n, i, w = (pl.program_id(a) for a in range(4))
  j, cls = _kv_step(tables, table_refs, b, n, i, w)

  @pl.when(w == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
    if dt_ref is not None:  # summed over j; no tile read: row -1
      dt_ref[...] = jnp.zeros(dt_ref.shape, jnp.float32)
      tr_ref[...] = jnp.full(tr_ref.shape, -1, jnp.int32)

  if reads:  # an EMPTY tile reads nothing: gradient 0 at index -1
    dr_ref[...] = jnp.zeros(dr_ref.shape, jnp.float32)
    fr_ref[...] = jnp.full(fr_ref.shape, -1, jnp.int32)
  _gated(cls, lambda full: _dq_step(
      p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_sc,
      dr_ref, fr_ref, full, row_refs, origin, dt_ref, tr_ref))

  @pl.when(w == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_sc[...]


def _dq_step(p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
             dq_sc, dr_ref, fr_ref, full, row_refs, origin, dt_ref, tr_ref):
  reads = dr_ref is not None
  k = k_ref[...]
  got = _tile_grads(p, tm, smem_refs, b, n, i, j, q_ref[...], k, v_ref[...], do_ref[...],
                    lse_ref[...], delta_ref[...], read_grads=reads or dt_ref is not None,
                    full=full, row_refs=row_refs, origin=origin)
  ds = got[1]
  if dt_ref is not None:
    entry = jax.lax.broadcasted_iota(jnp.int32, (8, p.block_kv), 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, (8, _LANES), 1)
    for r, (d, (row, index)) in enumerate(zip(got[4], got[5])):
      rows = pl.ds(8 * r, 8)
      dt_ref[rows, :] = table_grads.add_by_index(dt_ref[rows, :], entry,
                                                 d.astype(jnp.float32), index)
      tr_ref[...] = jnp.where(lane == r, row, tr_ref[...])
  if reads:
    lane = jax.lax.broadcasted_iota(jnp.int32, (8, _LANES), 1)
    d_tile = jnp.zeros((8, _LANES), jnp.float32)
    f_tile = jnp.zeros((8, _LANES), jnp.int32)
    for r, (d, f) in enumerate(zip(got[2], got[3])):
      d_tile = jnp.where(lane == r, d, d_tile)
      f_tile = jnp.where(lane == r, f, f_tile)
    dr_ref[...] = d_tile
    fr_ref[...] = f_tile
  # dQ [bq, H] += dS k
  dq_sc[...] += _mxu(ds.astype(k.dtype), k, ((1,), (0,)))


def _dkv_kernel(*refs, p: Plan, tm: _TileMods, Wq: int, G: int, tables):
  table_refs, smem_refs, origin, rest = _split_refs(refs, tables, tm, p)
  nr = len(p.mask_rows) + len(p.score_tables)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = rest[:6]
  row_refs = rest[6:6 + nr]
  dk_ref, dv_ref, dk_sc, dv_sc = rest[6 + nr:]
  b, c, j, r = (pl.program_id(a) for a in range(4))
  n = c * G + jax.lax.div(r, jnp.int32(Wq))
  i, cls = _q_step(tables, table_refs, b, n, j, jax.lax.rem(r, jnp.int32(Wq)))

  @pl.when(r == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  _gated(cls, lambda full: _dkv_step(
      p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_sc,
      dv_sc, full, row_refs, origin))

  @pl.when(r == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_sc[...]
    dv_ref[...] = dv_sc[...]


def _dkv_step(p, tm, smem_refs, b, n, i, j, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
              dk_sc, dv_sc, full, row_refs, origin):
  q, do = q_ref[...], do_ref[...]
  probs, ds = _tile_grads(p, tm, smem_refs, b, n, i, j, q, k_ref[...], v_ref[...], do,
                          lse_ref[...], delta_ref[...], full=full, row_refs=row_refs,
                          origin=origin)
  # dV [bk, D] += P^T dO ; dK [bk, H] += dS^T q
  dv_sc[...] += _mxu(probs.astype(do.dtype), do, ((0,), (0,)))
  dk_sc[...] += _mxu(ds.astype(q.dtype), q, ((0,), (0,)))
