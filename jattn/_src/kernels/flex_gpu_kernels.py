"""The Pallas (Triton) kernels of "flex_gpu" (the design is in `flex_gpu`): the
forward, the dq and the dk/dv kernels, and a tile's logits with every mask and
mod applied (`_logits`).

On a GPU each program is one thread block: it holds its query (or key) tile in
registers and loops over the other side's tiles with `lax.fori_loop` (a loop in
the kernel, as FlashAttention-2 does), reading them from global memory with
`pl.ds` slices. Captured arrays, block tables, lengths and segment ids are
whole-array inputs: a scalar read is an ordinary load, a table read at a tile
of indices (a relative bias) an ordinary gather.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn._src.core.layout import Layout
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import layout_specs, table_grads, tile_mods
from jattn._src.kernels.kernel_inputs import TileMods as _Mods
from jattn._src.kernels.kernel_inputs import as_int_or_float as _as_int_or_float
from jattn._src.kernels.kernel_inputs import flat as _flat
from jattn._src.kernels.kernel_inputs import from_tiles as _from_tiles
from jattn._src.kernels.kernel_inputs import pad_to as _pad_to
from jattn._src.kernels.kernel_inputs import to_tiles as _to_tiles
from jattn._src.kernels.kernel_vjp import batched, with_batch, without_batch
from jattn._src.kernels.layout_specs import spec
from jattn._src.kernels.tile_classes import both, tile_classes, tile_keep
from jattn._src.masks.closed_form_blocks import EMPTY, FULL

if TYPE_CHECKING:
  from jattn._src.kernels.flex_gpu import Plan


# ---------------------------------------------------------------- inputs


def _whole(x):
  """A BlockSpec that hands every program the whole array."""
  return pl.BlockSpec(x.shape, lambda *grid: (0,) * x.ndim)


def _extras(p: Plan, modifiers, mods):
  """(the static `_Mods`, the whole-array inputs every kernel reads, in `_Reads`' order):
  block tables, lengths, segment ids, the mods' captured arrays (flat), mask_mod's
  per-token arrays [X, Tp] / [X, Sp] (edge-padded: dynamic_slice's clamp)."""
  mask_jaxpr = None if mods is None else mods.mask_jaxpr
  score_jaxpr = None if mods is None else mods.score_jaxpr
  mask_consts = () if mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if score_jaxpr is None else tuple(mods.score_consts)
  tm = _Mods(mask_jaxpr, score_jaxpr, tile_mods.consts_meta(mask_consts),
             tile_mods.consts_meta(score_consts))
  arrays = []
  if p.skip:
    classes = tile_classes(p, mods)  # [Bc, Nc, nq, nk]: Bc, Nc 1 or B, N
    # the non-empty tiles of each row first, in ascending order, then their count
    kv_list = jnp.argsort(classes == EMPTY, axis=3, stable=True).astype(jnp.int32)
    by_kv = jnp.swapaxes(classes, 2, 3)
    q_list = jnp.argsort(by_kv == EMPTY, axis=3, stable=True).astype(jnp.int32)
    arrays += [classes, kv_list, jnp.sum(classes != EMPTY, axis=3, dtype=jnp.int32),
               q_list, jnp.sum(by_kv != EMPTY, axis=3, dtype=jnp.int32)]
  st = modifiers.structure
  for present, lengths in ((p.q_lengths, st.q_lengths), (p.kv_lengths, st.kv_lengths)):
    if present:
      arrays.append(jnp.asarray(lengths, jnp.int32).reshape(p.B))
  if p.segments:
    arrays.append(_pad_to(jnp.asarray(st.q_segment_ids, jnp.int32), 1, p.T_padded))
    arrays.append(_pad_to(jnp.asarray(st.kv_segment_ids, jnp.int32), 1, p.S_padded))
  rows = {ci for ci, _ in p.mask_rows}
  for i, c in enumerate(mask_consts):
    arrays.append(_flat(c) if i not in rows else jnp.zeros((1,), jnp.int32))
  for c in score_consts:
    arrays.append(_flat(c))
  for ci, letter in p.mask_rows:
    x = _as_int_or_float(mask_consts[ci])
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)  # [X, L]
    size = p.T_padded if letter == "t" else p.S_padded
    arrays.append(_pad_to(x[:, :size], 1, size, mode="edge"))
  return tm, arrays


class _Reads:
  """The kernels' view of the whole-array inputs (in `_extras`' order)."""

  def __init__(self, p: Plan, tm: _Mods, refs):
    self.p, self.tm = p, tm
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]
    self.tables = take(5) if p.skip else None
    self.q_len = take(1)[0] if p.q_lengths else None
    self.kv_len = take(1)[0] if p.kv_lengths else None
    self.ids = take(2) if p.segments else None
    self.mask_consts = take(len(tm.mask_meta))
    self.score_consts = take(len(tm.score_meta))
    self.rows = dict(zip(p.mask_rows, take(len(p.mask_rows))))

  def _bn(self, b, n):
    """The tables' row of (b, n): 0 along an axis the mask does not depend on."""
    Bc, Nc = self.tables[0].shape[:2]
    return (b if Bc > 1 else 0), (n if Nc > 1 else 0)

  def kv_count(self, b, n, i):
    """How many kv tiles query tile i visits."""
    if self.tables is None:
      return self.p.S_padded // self.p.block_kv
    return self.tables[2][(*self._bn(b, n), i)]

  def kv_tile(self, b, n, i, step):
    return step if self.tables is None else self.tables[1][(*self._bn(b, n), i, step)]

  def q_count(self, b, n, j):
    if self.tables is None:
      return self.p.T_padded // self.p.block_q
    return self.tables[4][(*self._bn(b, n), j)]

  def q_tile(self, b, n, j, step):
    return step if self.tables is None else self.tables[3][(*self._bn(b, n), j, step)]

  def is_full(self, b, n, i, j):
    return self.tables[0][(*self._bn(b, n), i, j)] == FULL

  def read(self, refs, meta):
    def read(ci, flat):
      x = refs[ci][flat]
      return x != 0 if meta[ci][1] == np.bool_ else x
    return read

  def read_block(self, i, j):
    """x[row, t] or x[row, s] of a per-token array, as a [bq, bk] tile."""
    p = self.p
    tile = (p.block_q, p.block_kv)

    def read_block(ci, letter, row):
      ref = self.rows[ci, letter]
      if letter == "t":
        x = jnp.broadcast_to(ref[row, pl.ds(i * p.block_q, p.block_q)][:, None], tile)
      else:
        x = jnp.broadcast_to(ref[row, pl.ds(j * p.block_kv, p.block_kv)][None, :], tile)
      return x != 0 if self.tm.mask_meta[ci][1] == np.bool_ else x
    return read_block

  def read_table(self, ci, row, index):
    """A table x [W] or [R, W] at a [bq, bk] tile of indices: one gather load."""
    width = self.tm.score_meta[ci][0][-1]
    return self.score_consts[ci][row * width + index]


# ---------------------------------------------------------------- one tile


def _dot(a, b, contract, dtype_in):
  """float32 a . b over the axes `contract` ((a's,), (b's,)); float32 inputs at full
  precision (Triton's default for them is TF32)."""
  precision = jax.lax.Precision.HIGHEST if dtype_in == jnp.float32 else None
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _logits(p: Plan, r: _Reads, b, n, i, j, q, k, *, full, with_vjp=False):
  """One tile's logits: q k^T, scale, score_mod, then every mask.

  -> (s float32 [bq, bk], LARGE_NEGATIVE where masked; keep bool [bq, bk] or None;
  d_score). full: causal, window and mask_mod hide nothing in this tile (its block
  class): only lengths, segments and padding apply. with_vjp: d_score(ds) -> (ds
  through score_mod, (d each float read of a captured array: scalars, in the order
  of `Plan.score_reads`), (its flat index in its array: int32 scalars), (d each float
  table read: [bq, bk] tiles), ((its table row: an int32 scalar, its indices: int32
  [bq, bk]), ...), in the order of `Plan.table_reads`).
  """
  tm, bq, bk = r.tm, p.block_q, p.block_kv
  tile = (bq, bk)
  s = _dot(q, k, ((1,), (1,)), q.dtype) * p.scale  # [bq, bk]
  t_pos = jnp.broadcast_to(i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None], tile)
  s_pos = jnp.broadcast_to(j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :], tile)
  d_score = lambda ds: (ds, (), (), (), ())
  if tm.score_jaxpr is not None:
    R = len(p.score_reads)

    def score(x, *eps):
      # each float read plus its own zero eps: d loss / d eps = the read's gradient
      base, flats, at = r.read(r.score_consts, tm.score_meta), [], []

      def read(ci, flat):
        value = base(ci, flat)
        if eps and jnp.issubdtype(tm.score_meta[ci][1], jnp.floating):
          value = value + eps[len(flats)]
          flats.append(flat)
        return value

      read_table = r.read_table
      if eps:  # a zero tile per table read: d loss / d it = the read's gradient
        read_table = table_grads.perturbed(read_table, tm.score_meta, eps[R:], at)
      y = tile_mods.evaluate(tm.score_jaxpr, tm.score_meta, read, [x, b, n, t_pos, s_pos],
                             tile, positions={3: "t", 4: "s"}, read_table=read_table)[0]
      return jnp.broadcast_to(y, tile).astype(jnp.float32), (tuple(flats), tuple(at))
    if with_vjp:
      eps = tuple(jnp.zeros((), jnp.float32) for _ in p.score_reads) + table_grads.zeros(
          tm.score_meta, p.table_reads, tile)
      s, vjp, (flats, at) = jax.vjp(score, s, *eps, has_aux=True)
      d_score = lambda ds: (lambda g: (g[0], g[1:1 + R], flats, g[1 + R:], at))(vjp(ds))
    else:
      s = score(s)[0]
  keep = tile_keep(p, t_pos, s_pos, t_pos, s_pos, full)  # no offsets on GPU yet
  if r.q_len is not None:
    keep = both(keep, t_pos < r.q_len[b])
  if r.kv_len is not None:
    keep = both(keep, s_pos < r.kv_len[b])
  if r.ids is not None:
    q_ids = r.ids[0][b, pl.ds(i * bq, bq)]
    kv_ids = r.ids[1][b, pl.ds(j * bk, bk)]
    keep = both(keep, q_ids[:, None] == kv_ids[None, :])
  if tm.mask_jaxpr is not None and not full:
    mm = tile_mods.evaluate(tm.mask_jaxpr, tm.mask_meta, r.read(r.mask_consts, tm.mask_meta),
                            [b, n, t_pos, s_pos], tile, positions={2: "t", 3: "s"},
                            read_block=r.read_block(i, j))[0]
    keep = both(keep, jnp.broadcast_to(mm, tile))
  if keep is not None:
    s = jnp.where(keep, s, LARGE_NEGATIVE)
  return s, keep, d_score


def _by_class(r: _Reads, b, n, i, j, step):
  """step(full) on this tile: a FULL tile without the mask functions, else with them."""
  if r.tables is None:
    return step(False)
  return jax.lax.cond(r.is_full(b, n, i, j), lambda: step(True), lambda: step(False))


def _call(kernel, grid, in_specs, out_specs, out_shape, p: Plan, name: str):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      interpret=p.interpret, name=name)


# ---------------------------------------------------------------- forward


def forward(p: Plan, layout: Layout, query, key, value, modifiers,
            accumulator_out: bool = False):
  """-> (out in the batched `layout`'s out order [.., T, .., D], lse float32 [B, N, Tp],
  max logits float32 [B, N, Tp] when `p.max_logits`, else None); no sinks. out is in the
  value's dtype, or float32 when accumulator_out and score_mod reads float arrays (the
  VJP's residual for their gradients; P V then takes the float32 weights). Tiles are
  read and written where they lie when `layout_specs.applies`, else from zero-padded
  [B, N, Tp, Hp] copies."""
  tm, extras = _extras(p, modifiers, modifiers.mods)
  G = p.N // p.K
  bq = p.block_q
  lay = batched(layout)
  in_place = layout_specs.applies(p, layout)
  if in_place:
    q, k, v = (with_batch(x, layout) for x in (query, key, value))
    q_spec = spec(lay.query, dict(T=bq, H=p.H), dict(B=_b, T=_i, N=_n))
    k_spec = spec(lay.key, dict(S=p.S, H=p.H), dict(B=_b, K=lambda b, n, i: n // G))
    v_spec = spec(lay.value, dict(S=p.S, D=p.D), dict(B=_b, K=lambda b, n, i: n // G))
    o_spec = spec(lay.out, dict(T=bq, D=p.D), dict(B=_b, T=_i, N=_n))
    o_shape = layout_specs.shape(lay.out, dict(B=p.B, T=p.T, N=p.N, D=p.D))
  else:
    q, k, v = _to_tiles(p, layout, query, key, value)
    q_spec = pl.BlockSpec((None, None, bq, p.H_padded), lambda b, n, i: (b, n, i, 0))
    k_spec = pl.BlockSpec((None, None, p.S_padded, p.H_padded), lambda b, n, i: (b, n // G, 0, 0))
    v_spec = pl.BlockSpec((None, None, p.S_padded, p.D_padded), lambda b, n, i: (b, n // G, 0, 0))
    o_spec = pl.BlockSpec((None, None, bq, p.D_padded), lambda b, n, i: (b, n, i, 0))
    o_shape = (p.B, p.N, p.T_padded, p.D_padded)
  # only a call whose score_mod reads float arrays pays for a float32 out and P V
  wide = accumulator_out and bool(p.score_reads or p.score_tables)
  row_stats = 2 if p.max_logits else 1  # lse, and the running max m when asked
  out_specs = [o_spec, *[pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))] * row_stats]
  out_shape = [jax.ShapeDtypeStruct(o_shape, jnp.float32 if wide else value.dtype),
               *[jax.ShapeDtypeStruct((p.B, p.N, p.T_padded), jnp.float32)] * row_stats]
  out, lse, *max_logits = _call(
      functools.partial(_forward_kernel, p=p, tm=tm, exact_pv=wide),
      (p.B, p.N, p.T_padded // bq), [q_spec, k_spec, v_spec] + [_whole(x) for x in extras],
      out_specs, out_shape, p, "jattn_flex_gpu_fwd")(q, k, v, *extras)
  if not in_place:  # cut the padding, back to the caller's layout
    out = jnp.einsum(f"BNTD->{lay.out}", out[:, :, :p.T, :p.D])
  return out, lse, max_logits[0] if max_logits else None


# program ids (b, n or h, i or j) -> the block index of one letter, for `layout_specs.spec`
_b = lambda b, n, i: b
_n = lambda b, n, i: n
_i = lambda b, n, i: i


def _forward_kernel(q_ref, k_ref, v_ref, *refs, p: Plan, tm: _Mods, exact_pv: bool = False):
  """exact_pv: P V with the float32 weights (score_mod's float arrays get gradients: the
  backward's row term dO . out must equal its rowsum(P dP); see blockwise_loop)."""
  outputs = 3 if p.max_logits else 2
  r = _Reads(p, tm, refs[:-outputs])
  o_ref, lse_ref, *max_ref = refs[-outputs:]
  b, n, i = (pl.program_id(a) for a in range(3))
  bq, bk = p.block_q, p.block_kv
  q = q_ref[...]

  def body(step, carry):
    acc, m, l = carry
    j = r.kv_tile(b, n, i, step)
    k = k_ref[pl.ds(j * bk, bk), :]
    s = _by_class(r, b, n, i, j, lambda full: _logits(p, r, b, n, i, j, q, k, full=full)[0])
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen no visible key keeps m = LARGE_NEGATIVE: shift it by 0
    # instead, so that its masked logits give exp(LARGE_NEGATIVE) = 0, not 1.
    shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
    probs = jnp.exp(s - shift[:, None])
    alpha = jnp.exp(m - m_next)
    v = v_ref[pl.ds(j * bk, bk), :]
    pv = jnp.float32 if exact_pv else v.dtype
    acc = acc * alpha[:, None] + _dot(probs.astype(pv), v.astype(pv), ((1,), (0,)), pv)
    return acc, m_next, alpha * l + jnp.sum(probs, axis=1)

  init = (jnp.zeros((bq, p.D_padded), jnp.float32), jnp.full((bq,), LARGE_NEGATIVE, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, r.kv_count(b, n, i), body, init)
  seen = l > 0.0
  safe_l = jnp.where(seen, l, 1.0)
  o_ref[...] = (acc * jnp.where(seen, 1.0 / safe_l, 0.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), LARGE_NEGATIVE)
  if max_ref:  # masked logits are LARGE_NEGATIVE: a row with none keeps it
    max_ref[0][...] = m


# ---------------------------------------------------------------- backward


def backward(p: Plan, layout: Layout, query, key, value, modifiers, out, lse, d_out):
  """-> (dq, dk, dv) in the inputs' layouts and dtypes; out, d_out in the query's layout
  (with D), lse float32 [B, N, T]. Read and written where they lie when
  `layout_specs.applies`, else through zero-padded [B, heads, tokens, features] copies."""
  lay = batched(layout)
  in_place = layout_specs.applies(p, layout)
  o, do = with_batch(out, layout), with_batch(d_out, layout)
  # delta = rowsum(out * d_out) [B, N, Tp]
  delta = _pad_to(jnp.einsum(f"{lay.out},{lay.out}->BNT", o.astype(jnp.float32),
                             do.astype(jnp.float32)), 2, p.T_padded)
  lse = _pad_to(lse, 2, p.T_padded)
  tm, extras = _extras(p, modifiers, modifiers.mods)
  G, bq, bk = p.N // p.K, p.block_q, p.block_kv
  Hp, Dp, Tp, Sp = p.H_padded, p.D_padded, p.T_padded, p.S_padded
  nq = Tp // bq
  stat = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
  reads = pl.BlockSpec((None, None, None, p.reads_padded), lambda b, n, i: (b, n, i, 0))
  by_kv = lambda b, n, i: n // G
  if in_place:  # every tile where it lies: the query's, key's and value's layouts
    q, k, v = (with_batch(x, layout) for x in (query, key, value))
    do = do.astype(query.dtype)
    q_row, do_row = (spec(lay.query, dict(T=bq, H=Hp), dict(B=_b, T=_i, N=_n)),
                     spec(lay.out, dict(T=bq, D=Dp), dict(B=_b, T=_i, N=_n)))
    k_all, v_all = (spec(lay.key, dict(S=Sp, H=Hp), dict(B=_b, K=by_kv)),
                    spec(lay.value, dict(S=Sp, D=Dp), dict(B=_b, K=by_kv)))
    dq_shape = layout_specs.shape(lay.query, dict(B=p.B, T=Tp, N=p.N, H=Hp))
    # the dk/dv kernel: the G query heads of kv head h, every query token
    q_group, do_group = (spec(lay.query, dict(T=Tp, N=G, H=Hp), dict(B=_b, N=_n)),
                         spec(lay.out, dict(T=Tp, N=G, D=Dp), dict(B=_b, N=_n)))
    k_row, v_row = (spec(lay.key, dict(S=bk, H=Hp), dict(B=_b, S=_i, K=_n)),
                    spec(lay.value, dict(S=bk, D=Dp), dict(B=_b, S=_i, K=_n)))
    dk_shape = layout_specs.shape(lay.key, dict(B=p.B, S=Sp, K=p.K, H=Hp))
    dv_shape = layout_specs.shape(lay.value, dict(B=p.B, S=Sp, K=p.K, D=Dp))
    group, group_first = (lambda x: x), layout_specs.group_first(layout)
  else:
    q, k, v = _to_tiles(p, layout, query, key, value)
    do = _pad_to(_pad_to(jnp.einsum(f"{lay.out}->BNTD", do).astype(query.dtype), 2, Tp), 3, Dp)
    row = lambda width: pl.BlockSpec((None, None, bq, width), lambda b, n, i: (b, n, i, 0))
    kv_all = lambda width: pl.BlockSpec((None, None, Sp, width),
                                        lambda b, n, i: (b, n // G, 0, 0))
    q_row, do_row, k_all, v_all = row(Hp), row(Dp), kv_all(Hp), kv_all(Dp)
    dq_shape = (p.B, p.N, Tp, Hp)
    q_all = lambda width: pl.BlockSpec((None, None, G, Tp, width),
                                       lambda b, h, j: (b, h, 0, 0, 0))
    q_group, do_group = q_all(Hp), q_all(Dp)
    kv_row = lambda width: pl.BlockSpec((None, None, bk, width), lambda b, h, j: (b, h, j, 0))
    k_row, v_row = kv_row(Hp), kv_row(Dp)
    dk_shape, dv_shape = (p.B, p.K, Sp, Hp), (p.B, p.K, Sp, Dp)
    group = lambda x: x.reshape(p.B, p.K, G, *x.shape[2:])
    group_first = True

  # dq: a program per query tile, over its kv tiles
  out_specs = [q_row, reads, reads]
  # dq, dk, dv leave the kernels in the inputs' dtypes: a float32 copy converted after them
  # cost 0.1 ms of a 0.5 ms backward on the H100 (16 documents, T = 4k)
  out_shape = [jax.ShapeDtypeStruct(dq_shape, query.dtype),
               jax.ShapeDtypeStruct((p.B, p.N, nq, p.reads_padded), jnp.float32),
               jax.ShapeDtypeStruct((p.B, p.N, nq, p.reads_padded), jnp.int32)]
  if p.table_reads:  # per program: a gradient row per table read, the table rows read
    TRp, Wp = _table_rows(p, tm)
    out_specs += [pl.BlockSpec((None, None, None, TRp, Wp), lambda b, n, i: (b, n, i, 0, 0)),
                  pl.BlockSpec((None, None, None, p.table_reads_padded),
                               lambda b, n, i: (b, n, i, 0))]
    out_shape += [jax.ShapeDtypeStruct((p.B, p.N, nq, TRp, Wp), jnp.float32),
                  jax.ShapeDtypeStruct((p.B, p.N, nq, p.table_reads_padded), jnp.int32)]
  dq, d_reads, flats, *table_parts = _call(
      functools.partial(_dq_kernel, p=p, tm=tm), (p.B, p.N, nq),
      [q_row, k_all, v_all, do_row, stat, stat] + [_whole(x) for x in extras],
      out_specs, out_shape, p, "jattn_flex_gpu_dq")(q, k, v, do, lse, delta, *extras)

  # dk, dv: a program per kv tile of kv head h, over the G query heads of h and their
  # query tiles; the group is summed in registers (no atomics). lse and delta [B, K, G, Tp]
  stat_all = pl.BlockSpec((None, None, G, Tp), lambda b, h, j: (b, h, 0, 0))
  by_group = lambda x: x.reshape(p.B, p.K, G, Tp)
  dk, dv = _call(
      functools.partial(_dkv_kernel, p=p, tm=tm, group_first=group_first), (p.B, p.K, Sp // bk),
      [q_group, k_row, v_row, do_group, stat_all, stat_all] + [_whole(x) for x in extras],
      [k_row, v_row],
      [jax.ShapeDtypeStruct(dk_shape, key.dtype), jax.ShapeDtypeStruct(dv_shape, value.dtype)],
      p, "jattn_flex_gpu_dkv",
  )(group(q), k, v, group(do), by_group(lse), by_group(delta), *extras)

  if in_place:
    dq, dk, dv = (without_batch(x, layout) for x in (dq, dk, dv))
  else:  # cut the padding, back to the caller's layouts
    dq, dk, dv = _from_tiles(p, layout, dq, dk, dv)
  return dq, dk, dv, _consts_grads(p, tm, d_reads, flats, table_parts)


def _table_rows(p: Plan, tm: _Mods) -> tuple[int, int]:
  """(rows, width) of a dq program's table gradients: powers of two (Triton's tiles),
  one row per table read, as wide as the widest table it reads."""
  width = max(tm.score_meta[ci][0][-1] for ci in p.table_reads)
  pow2 = lambda x: 1 << max(0, (x - 1).bit_length())
  return pow2(len(p.table_reads)), max(16, pow2(width))


def _consts_grads(p: Plan, tm: _Mods, d_reads, flats, table_parts) -> tuple:
  """float32 gradient of each float array score_mod reads one element at a time or as a
  table at positions (None for the others), from the dq kernel's per-program partials:
  summed by XLA in a fixed order (a one-hot contraction: no scatter, no atomics), the
  same bits every run."""
  grads = [None] * len(tm.score_meta)
  if p.table_reads:
    TR = len(p.table_reads)
    parts, rows = table_parts  # [B, N, nq, TRp, Wp], [B, N, nq, TRp]
    for ci, g in table_grads.sum_partials(tm.score_meta, p.table_reads, parts[..., :TR, :],
                                          rows[..., :TR]).items():
      grads[ci] = g
  R = len(p.score_reads)
  d_reads, flats = d_reads[..., :R], flats[..., :R]  # [B, N, nq, R]; -1: no tile visited
  for ci, (shape, dtype) in enumerate(tm.score_meta):
    if ci not in p.score_reads:
      continue
    size = int(np.prod(shape, dtype=np.int64))
    mine = np.asarray([c == ci for c in p.score_reads])  # [R]
    onehot = (flats[..., None] == jnp.arange(size, dtype=jnp.int32)) & mine[:, None]
    grads[ci] = jnp.einsum("bnir,bnirf->f", d_reads, onehot.astype(jnp.float32)).reshape(shape)
  return tuple(grads)


def _tile_probs(p, r, b, n, i, j, q, k, lse, full):
  """-> (probs [bq, bk] float32, masked entries 0; d_score, `_logits`' VJP)."""
  s, keep, d_score = _logits(p, r, b, n, i, j, q, k, full=full, with_vjp=True)
  probs = jnp.exp(s - lse[:, None])
  if keep is not None:  # a row with no visible key has lse = LARGE_NEGATIVE too
    probs = jnp.where(keep, probs, 0.0)
  return probs, d_score


def _tile_grads(p, r, b, n, i, j, q, k, v, do, lse, delta, full, d_tables=None):
  """-> (probs [bq, bk] float32, d (q k^T) [bq, bk] float32, d reads [Rp], their flat
  indices [Rp] int32 (-1 past the reads)); given d_tables float32 [TRp, Wp] (row r:
  table read r's gradient so far), also (d_tables with this tile's added, the table
  row of each table read [TRp'] int32)."""
  probs, d_score = _tile_probs(p, r, b, n, i, j, q, k, lse, full)
  dp = _dot(do, v, ((1,), (1,)), v.dtype)  # dP [bq, bk] = dO v^T
  ds, d_reads, flats, d_tiles, at = d_score(probs * (dp - delta[:, None]))
  lane = jnp.arange(p.reads_padded, dtype=jnp.int32)
  d_vec = jnp.zeros((p.reads_padded,), jnp.float32)
  f_vec = jnp.full((p.reads_padded,), -1, jnp.int32)
  for slot, (d, f) in enumerate(zip(d_reads, flats)):  # a vector of the scalars
    d_vec = jnp.where(lane == slot, d, d_vec)
    f_vec = jnp.where(lane == slot, f, f_vec)
  if d_tables is None:
    return probs, ds * p.scale, d_vec, f_vec
  read = jax.lax.broadcasted_iota(jnp.int32, d_tables.shape, 0)
  entry = jax.lax.broadcasted_iota(jnp.int32, d_tables.shape, 1)
  slot = jnp.arange(p.table_reads_padded, dtype=jnp.int32)
  rows = jnp.full((p.table_reads_padded,), -1, jnp.int32)
  for t, (d, (row, index)) in enumerate(zip(d_tiles, at)):  # row t of d_tables: read t's
    d_tables = table_grads.add_by_index(d_tables, jnp.where(read == t, entry, -1),
                                        d.astype(jnp.float32), index)
    rows = jnp.where(slot == t, row, rows)
  return probs, ds * p.scale, d_vec, f_vec, d_tables, rows


def _weighted_probs(p, r, b, n, i, j, q, k, lse, full):
  """-> (probs, scale * g probs) [bq, bk] float32, g the derivative of score_mod: dS =
  g P (dP - delta) once dP is known (score_mod acts entry by entry, so its VJP in s is a
  product by g). Without the gradients of score_mod's captured arrays (`_tile_grads`).
  Formed before dP, it keeps S and dP from being live together: with both, ptxas spilled
  (jax 0.11.2) and serialized the kernels' `wgmma`s (C7511, C7514: docs/gpu_kernel.md)."""
  probs, d_score = _tile_probs(p, r, b, n, i, j, q, k, lse, full)
  return probs, d_score(probs)[0] * p.scale


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm: _Mods):
  """dq of one query tile; with score_mod's float reads, also their gradients summed over
  the tile's kv tiles and their flat indices (one [Rp] vector each per program); with
  its float table reads, their gradient rows so summed [TRp, Wp] and the table rows."""
  outs = 5 if p.table_reads else 3  # dq, read gradients and indices, table rows and rows
  r = _Reads(p, tm, refs[:-outs])
  out_refs = refs[-outs:]
  b, n, i = (pl.program_id(a) for a in range(3))
  bk = p.block_kv
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def body(step, carry):
    dq, *reads = carry
    j = r.kv_tile(b, n, i, step)
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    if p.score_reads or p.table_reads:  # score_mod's captured arrays want gradients
      d_reads, _, *d_tables = reads
      _, ds, d_tile, flats, *tables = _by_class(r, b, n, i, j, lambda full: _tile_grads(
          p, r, b, n, i, j, q, k, v, do, lse, delta, full, *d_tables[:1]))
      reads = (d_reads + d_tile, flats, *tables)
    else:  # g P before dP, as in the dk/dv kernel: S and dP are never live together
      _, weighted = _by_class(r, b, n, i, j, lambda full: _weighted_probs(
          p, r, b, n, i, j, q, k, lse, full))
      ds = weighted * (_dot(do, v, ((1,), (1,)), v.dtype) - delta[:, None])  # dP = dO v^T
    # dQ += dS k
    return (dq + _dot(ds.astype(k.dtype), k, ((1,), (0,)), k.dtype), *reads)

  init = (jnp.zeros(out_refs[0].shape, jnp.float32), jnp.zeros(out_refs[1].shape, jnp.float32),
          jnp.full(out_refs[2].shape, -1, jnp.int32))
  if p.table_reads:  # no kv tile visited: table row -1
    init += (jnp.zeros(out_refs[3].shape, jnp.float32), jnp.full(out_refs[4].shape, -1, jnp.int32))
  for ref, x in zip(out_refs, jax.lax.fori_loop(0, r.kv_count(b, n, i), body, init)):
    ref[...] = x.astype(ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm: _Mods,
                group_first: bool):
  """dk, dv of one kv tile. q_ref, do_ref: the G query heads of its kv head, [G, Tp, .]
  (group_first) or [Tp, G, .] (a layout with tokens before heads, read in place)."""
  r = _Reads(p, tm, refs[:-2])
  dk_ref, dv_ref = refs[-2:]
  b, h, j = (pl.program_id(a) for a in range(3))
  G, bq = p.N // p.K, p.block_q
  k, v = k_ref[...], v_ref[...]

  def head(g, carry):
    n = h * G + g

    def body(step, carry):
      dk, dv = carry
      i = r.q_tile(b, n, j, step)
      rows = pl.ds(i * bq, bq)
      if group_first:
        q, do = q_ref[g, rows, :], do_ref[g, rows, :]
      else:
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
      probs, weighted = _by_class(r, b, n, i, j, lambda full: _weighted_probs(
          p, r, b, n, i, j, q, k, lse_ref[g, rows], full))
      dv = dv + _dot(probs.astype(do.dtype), do, ((0,), (0,)), do.dtype)  # dV += P^T dO
      dp = _dot(do, v, ((1,), (1,)), v.dtype)  # dP [bq, bk] = dO v^T
      ds = weighted * (dp - delta_ref[g, rows][:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, ((0,), (0,)), q.dtype)  # dK += dS^T q
      return dk, dv

    return jax.lax.fori_loop(0, r.q_count(b, n, j), body, carry)

  dk, dv = jax.lax.fori_loop(0, G, head, (jnp.zeros(dk_ref.shape, jnp.float32),
                                          jnp.zeros(dv_ref.shape, jnp.float32)))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
