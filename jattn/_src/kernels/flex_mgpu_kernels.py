"""The Pallas Mosaic GPU kernels of "flex_mgpu" (the design is in `flex_mgpu`): the
forward, the dq and the dk/dv kernels, and a tile's logits with every mask and mod
applied (`_logits`).

Each program is one thread block with one warpgroup (128 threads). Its own tile (a
query tile, or a key/value tile) is copied once by TMA into shared memory (SMEM);
the other side's tiles are copied by TMA into two SMEM slots, the next while the
current one computes. Products run on the tensor cores by `wgmma` from SMEM; a
probability (or dS) tile goes to SMEM and is read back by the next `wgmma`, never as a
register operand. A tile's S and dP each take a fresh float32 accumulator
(`pl.run_scoped(..., plgpu.ACC)`); the products summed over the loop (out, dq, dk, dv)
accumulate, compiled, into the carried accumulator itself (`pl.run_state`, `_mma_into`).
The GPU interpreter runs no carried accumulator: interpreted, those go into a fresh one,
added in registers. That is the one place the two paths differ.

Side inputs reach the tile through SMEM (export refuses loads from global memory):
  * a program's row of the block tables: [count, tile * 2 + FULL, ...] as [R, 32];
  * scalars (lengths, captured arrays read one element at a time), packed into one
    int32 and one float32 array [R, 32], copied whole;
  * per-token rows (segment ids, mask_mod's x[t] / x[s]) stacked per side, [X, tokens]:
    the [X, tile] box of each visited tile, loaded as a row of the tile's layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src import compat
from jattn._src.core.layout import Layout
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import layout_specs, tile_mods
from jattn._src.kernels.kernel_inputs import (TILES, Letters, TileMods, at, flat, from_tiles,
                                              letters, pad_to, tma_in_place, to_tiles)
from jattn._src.kernels.kernel_plan import round_up
from jattn._src.kernels.kernel_vjp import batched, with_batch, without_batch
from jattn._src.kernels.tile_classes import both, tile_classes, tile_keep
from jattn._src.masks.closed_form_blocks import EMPTY, FULL

if TYPE_CHECKING:
  from jattn._src.kernels.flex_mgpu import Plan

LANES = 32  # side arrays are [R, 32]: 128-byte rows, whole TMA boxes
_WGMMA = plgpu.Layout.WGMMA


# ---------------------------------------------------------------- side inputs


@dataclasses.dataclass(frozen=True)
class _Where:
  """Where each side input sits (static): scalars {key: ("i" or "f", offset)}, rows
  {key: ("t" or "s", first row)}; key "q_len", "kv_len", ("mask", ci), ("score", ci),
  "ids", or (ci, letter) for mask_mod's per-token arrays."""

  scalars: dict
  rows: dict
  names: tuple  # the side arrays handed to every kernel, in order


def _side_arrays(p: Plan, modifiers, mods):
  """(_Where, [arrays]): the block tables, scalars and per-token rows (see the module doc)."""
  mask_consts = () if mods is None or mods.mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if mods is None or mods.score_jaxpr is None else tuple(mods.score_consts)
  pieces = {"i": [], "f": []}
  scalars = {}

  def put(key, x):
    x = flat(x)
    kind = "f" if jnp.issubdtype(x.dtype, jnp.floating) else "i"
    scalars[key] = (kind, sum(int(a.size) for a in pieces[kind]))
    pieces[kind].append(x.astype(jnp.float32 if kind == "f" else jnp.int32))

  st = modifiers.structure
  if p.q_lengths:
    put("q_len", jnp.asarray(st.q_lengths).reshape(p.B))
  if p.kv_lengths:
    put("kv_len", jnp.asarray(st.kv_lengths).reshape(p.B))
  rows_of = {ci for ci, _ in p.mask_rows}
  for ci, c in enumerate(mask_consts):
    if ci not in rows_of:
      put(("mask", ci), c)
  for ci, c in enumerate(score_consts):
    put(("score", ci), c)
  side = {"t": [], "s": []}
  rows = {}

  def stack(key, letter, x):
    rows[key] = (letter, sum(a.shape[0] for a in side[letter]))
    size = p.T_padded if letter == "t" else p.S_padded
    side[letter].append(pad_to(x[:, :size], 1, size, mode="edge").astype(jnp.int32))

  if p.segments:
    stack(("ids", "t"), "t", jnp.asarray(st.q_segment_ids).reshape(p.B, p.T))
    stack(("ids", "s"), "s", jnp.asarray(st.kv_segment_ids).reshape(p.B, p.S))
  for ci, letter in p.mask_rows:
    x = jnp.asarray(mask_consts[ci])
    stack((ci, letter), letter, x.reshape((1,) * (2 - x.ndim) + x.shape))
  names, arrays = [], []
  if p.skip:
    classes = tile_classes(p, mods)  # [Bc, Nc, nq, nk]
    names += ["kv_table", "q_table"]
    arrays += [_table(classes), _table(jnp.swapaxes(classes, 2, 3))]
  for kind, name in (("i", "ints"), ("f", "floats")):
    if pieces[kind]:
      x = jnp.concatenate(pieces[kind])
      names.append(name)
      arrays.append(pad_to(x, 0, round_up(x.size, LANES)).reshape(-1, LANES))
  for letter, name in (("t", "q_rows"), ("s", "kv_rows")):
    if side[letter]:
      names.append(name)
      arrays.append(jnp.concatenate(side[letter]))
  return _Where(scalars, rows, tuple(names)), arrays


def _table(classes):
  """int32 [Bc, Nc, rows, R, 32]: per row of tiles, [count, tile * 2 + (class == FULL),
  ...] over its non-EMPTY tiles in ascending order (the kernel loops over them)."""
  order = jnp.argsort(classes == EMPTY, axis=3, stable=True).astype(jnp.int32)
  full = jnp.take_along_axis(classes, order, axis=3) == FULL
  count = jnp.sum(classes != EMPTY, axis=3, dtype=jnp.int32)
  row = jnp.concatenate([count[..., None], order * 2 + full.astype(jnp.int32)], axis=3)
  row = pad_to(row, 3, round_up(row.shape[3], LANES))
  return row.reshape(*row.shape[:3], -1, LANES)


def _side_scratch(p: Plan, where: _Where, arrays, mine: str, slots: str) -> dict:
  """The SMEM buffers for the side arrays: the program's table row and the scalars
  once; the rows of `mine` ("t" or "s") once, the other side's rows per slot."""
  shapes = dict(zip(where.names, (a.shape for a in arrays)))
  out = {}
  table = "kv_table" if mine == "t" else "q_table"
  if table in shapes:
    out["table"] = plgpu.SMEM(shapes[table][3:], jnp.int32)
  for name in ("ints", "floats"):
    if name in shapes:
      out[name] = plgpu.SMEM(shapes[name], jnp.int32 if name == "ints" else jnp.float32)
  tiles = {"t": p.block_q, "s": p.block_kv}
  for letter, name in (("t", "q_rows"), ("s", "kv_rows")):
    if name in shapes:
      shape = (shapes[name][0], tiles[letter])
      out[name] = plgpu.SMEM(shape if letter == mine else (2, *shape), jnp.int32)
  out["side_bars"] = plgpu.Barrier(num_barriers=max(1, len(out)))
  return out


class _Side:
  """A program's view of its side inputs (SMEM refs) and their placement."""

  def __init__(self, p: Plan, tm: TileMods, where: _Where, gmem: dict, smem: dict,
               mine: str):
    self.p, self.tm, self.where, self.gmem, self.smem, self.mine = p, tm, where, gmem, smem, mine

  def start(self, bc, nc, tile):
    """Copies the program's table row, the scalars and its own tile's rows; waits."""
    copies = []
    table = "kv_table" if self.mine == "t" else "q_table"
    if table in self.gmem:
      copies.append((self.gmem[table].at[bc, nc, tile], self.smem["table"]))
    for name in ("ints", "floats"):
      if name in self.gmem:
        copies.append((self.gmem[name], self.smem[name]))
    own = "q_rows" if self.mine == "t" else "kv_rows"
    if own in self.gmem:
      size = self.p.block_q if self.mine == "t" else self.p.block_kv
      copies.append((self.gmem[own].at[:, pl.ds(tile * size, size)], self.smem[own]))
    bars = self.smem["side_bars"]
    for k, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, bars.at[k])
    for k in range(len(copies)):
      plgpu.barrier_wait(bars.at[k])

  def other_rows(self):
    """(gmem, smem [2, X, tile], tile size) of the other side's rows, or None."""
    name = "kv_rows" if self.mine == "t" else "q_rows"
    if name not in self.gmem:
      return None
    return self.gmem[name], self.smem[name], (self.p.block_kv if self.mine == "t"
                                              else self.p.block_q)

  def count(self, default: int):
    """How many tiles this program visits."""
    if "table" not in self.smem:
      return jnp.int32(default)
    return self.smem["table"][0, 0]

  def step(self, k):
    """(tile index, FULL) of this program's k-th visited tile."""
    if "table" not in self.smem:
      return k, False
    x = self.smem["table"][(k + 1) // LANES, (k + 1) % LANES]
    return x // 2, x % 2 == 1

  def scalar(self, key, flat_index):
    kind, offset = self.where.scalars[key]
    at = offset + flat_index
    return self.smem["ints" if kind == "i" else "floats"][at // LANES, at % LANES]

  def reader(self, kind: str, meta):
    """read(ci, flat) for tile_mods: an element of a captured array, in its dtype."""
    def read(ci, flat_index):
      x = self.scalar((kind, ci), flat_index)
      return x != 0 if meta[ci][1] == np.bool_ else x.astype(meta[ci][1])
    return read

  def row_tile(self, key, row, tile, slot, transposed: bool):
    """x[row, t] or x[row, s] of a stacked per-token array, broadcast to the tile."""
    letter, first = self.where.rows[key]
    name = "q_rows" if letter == "t" else "kv_rows"
    ref = self.smem[name] if letter == self.mine else self.smem[name].at[slot]
    axis = int((letter == "t") == transposed)  # the tile's axis of this side's tokens
    vec = compat.mgpu_load(ref.at[first + row], _WGMMA.reduce(1 - axis))
    return lax.broadcast_in_dim(vec, tile, [axis])


# ---------------------------------------------------------------- one tile


def _logits(p: Plan, side: _Side, b, n, i, j, s, slot, *, transposed: bool, full: bool):
  """One tile's logits from s = scale * q k^T [bq, bk] (k q^T [bk, bq] when transposed):
  score_mod, then every mask.

  -> (logits float32, LARGE_NEGATIVE where masked; keep bool or None; d_score: the
  cotangent of the logits -> that of s, through score_mod). full: the tile's class is
  FULL (causal, window and mask_mod hide nothing: only lengths, segments, padding).
  slot: the pipeline slot holding the other side's rows.
  """
  s, d_score = scored(p, side, b, n, i, j, s, transposed=transposed)
  s, keep = masked(p, side, b, n, i, j, s, slot, transposed=transposed, full=full)
  return s, keep, d_score


def _positions(p: Plan, i, j, tile, transposed: bool):
  """(t, s) int32 tiles: each entry's query and key position."""
  q_axis = 1 if transposed else 0
  t_pos = plgpu.broadcasted_iota(jnp.int32, tile, q_axis, layout=_WGMMA) + i * p.block_q
  s_pos = plgpu.broadcasted_iota(jnp.int32, tile, 1 - q_axis, layout=_WGMMA) + j * p.block_kv
  return t_pos, s_pos


def scored(p: Plan, side: _Side, b, n, i, j, s, *, transposed: bool):
  """score_mod on a tile of scaled scores -> (logits float32, d_score: the cotangent of
  the logits -> that of s); without a score_mod, s and the identity."""
  tm, tile = side.tm, s.shape
  if tm.score_jaxpr is None:
    return s, lambda ds: ds
  t_pos, s_pos = _positions(p, i, j, tile, transposed)

  def score(x):
    y = tile_mods.evaluate(tm.score_jaxpr, tm.score_meta, side.reader("score", tm.score_meta),
                           [x, b, n, t_pos, s_pos], tile, positions={3: "t", 4: "s"})[0]
    return jnp.broadcast_to(y, tile).astype(jnp.float32)

  s, vjp = jax.vjp(score, s)
  return s, lambda ds: _without_add_any(lambda ds: vjp(ds)[0], ds)


def masked(p: Plan, side: _Side, b, n, i, j, s, slot, *, transposed: bool, full: bool):
  """Every mask on a tile of logits -> (logits, LARGE_NEGATIVE where masked; keep bool
  or None)."""
  tm, tile = side.tm, s.shape
  t_pos, s_pos = _positions(p, i, j, tile, transposed)
  keep = tile_keep(p, t_pos, s_pos, t_pos, s_pos, full)
  if p.q_lengths:
    keep = both(keep, t_pos < side.scalar("q_len", b))
  if p.kv_lengths:
    keep = both(keep, s_pos < side.scalar("kv_len", b))
  if p.segments:
    keep = both(keep, side.row_tile(("ids", "t"), b, tile, slot, transposed)
                == side.row_tile(("ids", "s"), b, tile, slot, transposed))
  if tm.mask_jaxpr is not None and not full:
    def read_block(ci, letter, row):
      x = side.row_tile((ci, letter), row, tile, slot, transposed)
      return x != 0 if tm.mask_meta[ci][1] == np.bool_ else x
    mm = tile_mods.evaluate(tm.mask_jaxpr, tm.mask_meta, side.reader("mask", tm.mask_meta),
                            [b, n, t_pos, s_pos], tile, positions={2: "t", 3: "s"},
                            read_block=read_block)[0]
    keep = both(keep, jnp.broadcast_to(mm, tile))
  if keep is not None:
    s = jnp.where(keep, s, LARGE_NEGATIVE)
  return s, keep


def _without_add_any(fn, *args):
  """fn(*args), its `add_any` equations (the sums of cotangents a VJP makes) run as `add`:
  jax 0.10's Mosaic GPU lowering has no rule for add_any."""
  closed = jax.make_jaxpr(fn)(*args)
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  get = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
  for eqn in closed.jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    if eqn.primitive.name == "add_any":
      outs = [lax.add(*ins)]
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return get(closed.jaxpr.outvars[0])


def _by_class(full, step):
  """step(full) on a tile: a FULL tile without the mask functions, else with them."""
  if isinstance(full, bool):  # no block classes: no tile is FULL
    return step(full)
  return lax.cond(full, lambda: step(True), lambda: step(False))


def _mma(a, b, shape):
  """float32 a @ b [shape] on the tensor cores (a, b: SMEM refs), into a fresh accumulator."""
  def run(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _mma_into(p: Plan, acc, a, b):
  """acc + a @ b on the tensor cores (b an SMEM ref; a one too, or compiled a 16-bit array
  in registers: flex_mgpu_ws._mma_from_registers; acc float32 in registers). Compiled,
  the `wgmma` accumulates into acc itself (`pl.run_state`): no second [rows, E] float32
  tile live beside it, which made the dk/dv kernel spill (benchmarks/gpu_static.py). The
  GPU interpreter runs no carried accumulator: there a fresh one, added in registers."""
  if p.interpret:
    return acc + _mma(a, b, acc.shape)

  def step(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
  return pl.run_state(step)(plgpu.ACC.init(acc))


def _tile_smem(shape, dtype, swizzle=128):
  """An SMEM buffer laid out for wgmma: rows of `swizzle` bytes (8 x 64 tiles of 16-bit
  values at the default 128-byte swizzle), swizzled."""
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, swizzle // np.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle)))


def _pipelined(count, fetch, wait, body, carry):
  """carry = body(k, slot, carry) for k < count, the inputs of step k fetched into
  slot k % 2 (fetch(k, slot)) while step k - 1 computes; wait(slot) before use."""
  @pl.when(count > 0)
  def _():
    fetch(0, 0)

  def step(k, carry):
    slot = lax.rem(k, jnp.int32(2))

    @pl.when(k + 1 < count)
    def _():
      fetch(k + 1, 1 - slot)

    wait(slot)
    return body(k, slot, carry)

  return lax.fori_loop(0, count, step, carry)


def _kv_tiles(side, smem, k_ref, v_ref, b, h, bk, L: Letters):
  """(fetch, wait) for `_pipelined` over a query tile's kv tiles (forward and dq kernels):
  the k, v tile of kv head h and the key-side side inputs into slot 0 or 1 of SMEM."""
  other = side.other_rows()
  bars = smem["kv_bars"]

  def fetch(k, slot):
    j = side.step(k)[0]
    rows = pl.ds(j * bk, bk)
    plgpu.copy_gmem_to_smem(at(k_ref, L.k, B=b, K=h, S=rows), smem["k"].at[slot],
                            bars.at[slot])
    plgpu.copy_gmem_to_smem(at(v_ref, L.v, B=b, K=h, S=rows), smem["v"].at[slot],
                            bars.at[2 + slot])
    if other is not None:
      plgpu.copy_gmem_to_smem(other[0].at[:, rows], other[1].at[slot], bars.at[4 + slot])

  def wait(slot):
    for first in (0, 2, 4) if other is not None else (0, 2):
      plgpu.barrier_wait(bars.at[first + slot])

  return fetch, wait


def _kernel(body, out_type, scratch, grid, names, p: Plan, name: str):
  interpret = None
  if p.interpret:
    interpret = plgpu.InterpretGPUParams(detect_races=True)
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                      grid_names=names, kernel_name=name, interpret=interpret)


def _bc_nc(p: Plan, where: _Where, arrays, b, n):
  """The tables' (b, n) row: 0 along an axis the masks do not depend on."""
  if "kv_table" not in where.names:
    return 0, 0
  Bc, Nc = arrays[where.names.index("kv_table")].shape[:2]
  return (b if Bc > 1 else 0), (n if Nc > 1 else 0)


def _prepare(p: Plan, modifiers):
  mods = modifiers.mods
  mask_jaxpr = None if mods is None else mods.mask_jaxpr
  score_jaxpr = None if mods is None else mods.score_jaxpr
  tm = TileMods(mask_jaxpr, score_jaxpr,
                tile_mods.consts_meta(() if mask_jaxpr is None else mods.mask_consts),
                tile_mods.consts_meta(() if score_jaxpr is None else mods.score_consts))
  where, arrays = _side_arrays(p, modifiers, mods)
  return tm, where, arrays


# ---------------------------------------------------------------- forward


def forward(p: Plan, layout: Layout, query, key, value, modifiers):
  """-> (out in the batched layout's out order [.., T, .., D], the value's dtype; lse
  float32 [B, N, Tp]; max logits float32 [B, N, Tp] when `p.max_logits`, else None); no
  sinks. q, k, v are read and out written where they lie when `tma_in_place`, else
  through zero-padded [B, heads, tokens, E] copies (`to_tiles`)."""
  in_place = tma_in_place(p, layout)
  if in_place:
    L, (q, k, v) = letters(layout), (with_batch(x, layout) for x in (query, key, value))
  else:
    L, (q, k, v) = TILES, to_tiles(p, layout, query, key, value)
  tm, where, arrays = _prepare(p, modifiers)
  bq, bk, E, dtype = p.block_q, p.block_kv, p.H_padded, q.dtype
  scratch = dict(q=_tile_smem((bq, E), dtype), k=_tile_smem((2, bk, E), dtype),
                 v=_tile_smem((2, bk, E), dtype), probs=_tile_smem((bq, bk), dtype),
                 lse=plgpu.SMEM((bq,), jnp.float32), q_bar=plgpu.Barrier(),
                 kv_bars=plgpu.Barrier(num_barriers=6),
                 **_side_scratch(p, where, arrays, "t", "s"))
  rows = jax.ShapeDtypeStruct((p.B, p.N, p.T_padded), jnp.float32)
  o_shape = layout_specs.shape(L.o, dict(B=p.B, N=p.N, T=p.T_padded, D=E))
  out_type = (jax.ShapeDtypeStruct(o_shape, dtype), rows)
  if p.max_logits:  # the running max m, through its own SMEM row
    scratch["max"] = plgpu.SMEM((bq,), jnp.float32)
    out_type += (rows,)
  body = functools.partial(_forward_kernel, p=p, tm=tm, where=where, arrays=arrays, L=L)
  out, lse, *max_logits = _kernel(body, out_type, scratch, (p.T_padded // bq, p.N, p.B),
                                  ("i", "n", "b"), p, "jattn_flex_mgpu_fwd")(q, k, v, *arrays)
  if not in_place:  # cut the padding, back to the caller's layout
    out = jnp.einsum(f"BNTD->{batched(layout).out}", out[:, :, :p.T, :p.D])
  return out, lse, max_logits[0] if max_logits else None


def _forward_kernel(q_ref, k_ref, v_ref, *refs, p: Plan, tm, where, arrays, L: Letters,
                    **smem):
  gmem = dict(zip(where.names, refs[:len(where.names)]))
  o_ref, lse_ref, *max_ref = refs[len(where.names):]
  i, n, b = (lax.axis_index(a) for a in ("i", "n", "b"))
  h = lax.div(n, jnp.int32(p.N // p.K))
  bq, bk, E = p.block_q, p.block_kv, p.H_padded
  side = _Side(p, tm, where, gmem, smem, "t")
  rows = pl.ds(i * bq, bq)
  plgpu.copy_gmem_to_smem(at(q_ref, L.q, B=b, N=n, T=rows), smem["q"], smem["q_bar"])
  side.start(*_bc_nc(p, where, arrays, b, n), i)
  plgpu.barrier_wait(smem["q_bar"])
  fetch, wait = _kv_tiles(side, smem, k_ref, v_ref, b, h, bk, L)

  def body(k, slot, carry):
    acc, m, l = carry
    j, full = side.step(k)
    s = _mma(smem["q"], smem["k"].at[slot].T, (bq, bk)) * p.scale
    s = _by_class(full, lambda full: _logits(p, side, b, n, i, j, s, slot, transposed=False,
                                             full=full)[0])
    m_next = jnp.maximum(m, s.max(axis=1))
    # A row that has seen no visible key keeps m = LARGE_NEGATIVE: shift it by 0
    # instead, so that its masked logits give exp(LARGE_NEGATIVE) = 0, not 1.
    shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
    probs = jnp.exp(s - lax.broadcast_in_dim(shift, s.shape, [0]))
    alpha = jnp.exp(m - m_next)
    smem["probs"][...] = probs.astype(smem["probs"].dtype)
    plgpu.commit_smem()  # the registers' stores, visible to the tensor cores
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    acc = _mma_into(p, acc, smem["probs"], smem["v"].at[slot])  # acc += P v
    return acc, m_next, alpha * l + probs.sum(axis=1)

  init = (plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), _WGMMA),
          plgpu.layout_cast(jnp.full((bq,), LARGE_NEGATIVE, jnp.float32), _WGMMA.reduce(1)),
          plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), _WGMMA.reduce(1)))
  acc, m, l = _pipelined(side.count(p.S_padded // bk), fetch, wait, body, init)
  seen = l > 0.0
  safe_l = jnp.where(seen, l, 1.0)
  scale = jnp.where(seen, 1.0 / safe_l, 0.0)
  smem["q"][...] = (acc * lax.broadcast_in_dim(scale, acc.shape, [0])).astype(o_ref.dtype)
  smem["lse"][...] = jnp.where(seen, m + jnp.log(safe_l), LARGE_NEGATIVE)
  if max_ref:  # masked logits are LARGE_NEGATIVE: a row with none keeps it
    smem["max"][...] = m
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem["q"], at(o_ref, L.o, B=b, N=n, T=rows))
  plgpu.copy_smem_to_gmem(smem["lse"], lse_ref.at[b, n, rows])
  if max_ref:
    plgpu.copy_smem_to_gmem(smem["max"], max_ref[0].at[b, n, rows])
  plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------- backward


def backward(p: Plan, layout: Layout, query, key, value, modifiers, out, lse, d_out):
  """-> (dq, dk, dv in the inputs' layouts and dtypes, None: score_mod's captured arrays
  get their gradients from the blockwise backward); out, d_out in the query's layout
  (with D), lse float32 [B, N, T]. Read and written where they lie when `tma_in_place`."""
  L, q, k, v, do, lse, delta = backward_operands(p, layout, query, key, value, out, lse,
                                                 d_out)
  tm, where, arrays = _prepare(p, modifiers)
  dq = _dq(p, L, tm, where, arrays, q, k, v, do, lse, delta)
  dk, dv = _dkv(p, L, tm, where, arrays, q, k, v, do, lse, delta)
  return (*gradients_out(p, layout, L, dq, dk, dv), None)


def backward_operands(p: Plan, layout: Layout, query, key, value, out, lse, d_out,
                      in_place: bool | None = None):
  """-> (Letters, q, k, v, dO, lse [B, N, Tp], delta = rowsum(out * dO) float32 [B, N,
  Tp]): q, k, v, dO where they lie when in_place (default: `tma_in_place`), else
  zero-padded tiles."""
  lay = batched(layout)
  o, do = with_batch(out, layout), with_batch(d_out, layout)
  rowsum = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=lay.out.index("D"))
  delta = pad_to(jnp.einsum(f"{lay.out.replace('D', '')}->BNT", rowsum), 2, p.T_padded)
  lse = pad_to(lse, 2, p.T_padded)
  if tma_in_place(p, layout) if in_place is None else in_place:
    q, k, v = (with_batch(x, layout) for x in (query, key, value))
    return letters(layout), q, k, v, do.astype(q.dtype), lse, delta
  q, k, v = to_tiles(p, layout, query, key, value)
  do = jnp.einsum(f"{lay.out}->BNTD", do).astype(q.dtype)
  return TILES, q, k, v, pad_to(pad_to(do, 2, p.T_padded), 3, p.H_padded), lse, delta


def gradients_out(p: Plan, layout: Layout, L: Letters, dq, dk, dv):
  """The kernels' dq, dk, dv (in `L`'s letters) -> the caller's layouts, unpadded."""
  if L is TILES:
    return from_tiles(p, layout, dq, dk, dv)
  return tuple(without_batch(x, layout) for x in (dq, dk, dv))


def tile_probs(p: Plan, side: _Side, b, n, i, j, s, lse, slot, *, transposed: bool,
               full: bool):
  """P float32 in s's orientation from the logits s (score_mod applied), masked entries 0:
  a row with no visible key has lse = LARGE_NEGATIVE too."""
  s, keep = masked(p, side, b, n, i, j, s, slot, transposed=transposed, full=full)
  axis = 0 if transposed else 1  # the axis lse is broadcast along
  probs = jnp.exp(s - lax.broadcast_in_dim(lse, s.shape, [1 - axis]))
  return probs if keep is None else jnp.where(keep, probs, 0.0)


def _tile_grads(p, side, b, n, i, j, s, dp, lse, delta, slot, transposed, full):
  """-> (probs, dS = d (q k^T) with the scale): float32 tiles in s's orientation."""
  s, d_score = scored(p, side, b, n, i, j, s, transposed=transposed)
  probs = tile_probs(p, side, b, n, i, j, s, lse, slot, transposed=transposed, full=full)
  stat = lax.broadcast_in_dim(delta, s.shape, [1 if transposed else 0])
  return probs, d_score(probs * (dp - stat)) * p.scale


def weighted_probs(p: Plan, side: _Side, b, n, i, j, s, lse, slot, transposed, full):
  """(P, scale * g P) from s = scale * q k^T, g the derivative of score_mod: dS = g P (dP -
  delta) once dP is known. score_mod acts entry by entry, so its VJP is a product by g and
  d_score(P) (dP - delta) = d_score(P (dP - delta)); forming g P first lets S and dP never
  be live together (with both, the dk/dv kernels spilled), and score_mod's residual dies
  with P's float32 copy. It runs outside the FULL / PARTIAL branch (the same in both)."""
  s, d_score = scored(p, side, b, n, i, j, s, transposed=transposed)
  probs = _by_class(full, lambda full: tile_probs(p, side, b, n, i, j, s, lse, slot,
                                                  transposed=transposed, full=full))
  return probs, d_score(probs) * p.scale


def _dq(p: Plan, L: Letters, tm, where, arrays, q, k, v, do, lse, delta):
  """dq (q's letters, shape and dtype): a program per query tile, over its kv tiles."""
  bq, bk, E, dtype = p.block_q, p.block_kv, p.H_padded, q.dtype
  scratch = dict(q=_tile_smem((bq, E), dtype), do=_tile_smem((bq, E), dtype),
                 k=_tile_smem((2, bk, E), dtype), v=_tile_smem((2, bk, E), dtype),
                 ds=_tile_smem((bq, bk), dtype), lse=plgpu.SMEM((bq,), jnp.float32),
                 delta=plgpu.SMEM((bq,), jnp.float32), own_bars=plgpu.Barrier(num_barriers=4),
                 kv_bars=plgpu.Barrier(num_barriers=6),
                 **_side_scratch(p, where, arrays, "t", "s"))
  body = functools.partial(_dq_kernel, p=p, tm=tm, where=where, arrays=arrays, L=L)
  return _kernel(body, jax.ShapeDtypeStruct(q.shape, dtype), scratch,
                 (p.T_padded // bq, p.N, p.B), ("i", "n", "b"), p, "jattn_flex_mgpu_dq")(
                     q, k, v, do, lse, delta, *arrays)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm, where,
               arrays, L: Letters, **smem):
  gmem = dict(zip(where.names, refs[:len(where.names)]))
  dq_ref = refs[len(where.names)]
  i, n, b = (lax.axis_index(a) for a in ("i", "n", "b"))
  h = lax.div(n, jnp.int32(p.N // p.K))
  bq, bk, E = p.block_q, p.block_kv, p.H_padded
  side = _Side(p, tm, where, gmem, smem, "t")
  rows, own = pl.ds(i * bq, bq), smem["own_bars"]
  for k, (src, name) in enumerate(((at(q_ref, L.q, B=b, N=n, T=rows), "q"),
                                   (at(do_ref, L.o, B=b, N=n, T=rows), "do"),
                                   (lse_ref.at[b, n, rows], "lse"),
                                   (delta_ref.at[b, n, rows], "delta"))):
    plgpu.copy_gmem_to_smem(src, smem[name], own.at[k])
  side.start(*_bc_nc(p, where, arrays, b, n), i)
  for k in range(4):
    plgpu.barrier_wait(own.at[k])
  lse = compat.mgpu_load(smem["lse"], _WGMMA.reduce(1))
  delta = compat.mgpu_load(smem["delta"], _WGMMA.reduce(1))
  fetch, wait = _kv_tiles(side, smem, k_ref, v_ref, b, h, bk, L)

  def body(k, slot, dq):
    j, full = side.step(k)
    s = _mma(smem["q"], smem["k"].at[slot].T, (bq, bk)) * p.scale
    _, weighted = weighted_probs(p, side, b, n, i, j, s, lse, slot, False, full)
    dp = _mma(smem["do"], smem["v"].at[slot].T, (bq, bk))  # dP = dO v^T
    ds = weighted * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
    smem["ds"][...] = ds.astype(smem["ds"].dtype)
    plgpu.commit_smem()
    return _mma_into(p, dq, smem["ds"], smem["k"].at[slot])  # dQ += dS k

  dq = _pipelined(side.count(p.S_padded // bk), fetch, wait, body,
                  plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), _WGMMA))
  smem["q"][...] = dq.astype(dq_ref.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem["q"], at(dq_ref, L.q, B=b, N=n, T=rows))
  plgpu.wait_smem_to_gmem(0)


def _dkv(p: Plan, L: Letters, tm, where, arrays, q, k, v, do, lse, delta):
  """(dk, dv) in k's and v's letters and shapes (k's dtype): a program per kv tile of kv
  head h, over the G query heads of h and their non-EMPTY query tiles, summed in
  registers (no atomics)."""
  bq, bk, E, dtype = p.block_q, p.block_kv, p.H_padded, q.dtype
  scratch = dict(k=_tile_smem((bk, E), dtype), v=_tile_smem((bk, E), dtype),
                 q=_tile_smem((2, bq, E), dtype), do=_tile_smem((2, bq, E), dtype),
                 lse=plgpu.SMEM((2, bq), jnp.float32), delta=plgpu.SMEM((2, bq), jnp.float32),
                 probs=_tile_smem((bk, bq), dtype), ds=_tile_smem((bk, bq), dtype),
                 own_bars=plgpu.Barrier(num_barriers=2),
                 q_bars=plgpu.Barrier(num_barriers=10),
                 **_side_scratch(p, where, arrays, "s", "t"))
  body = functools.partial(_dkv_kernel, p=p, tm=tm, where=where, arrays=arrays, L=L)
  shapes = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  return _kernel(body, shapes, scratch, (p.S_padded // bk, p.K, p.B),
                 ("j", "h", "b"), p, "jattn_flex_mgpu_dkv")(q, k, v, do, lse, delta, *arrays)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm, where,
                arrays, L: Letters, **smem):
  gmem = dict(zip(where.names, refs[:len(where.names)]))
  dk_ref, dv_ref = refs[len(where.names):]
  j, h, b = (lax.axis_index(a) for a in ("j", "h", "b"))
  G, bq, bk, E = p.N // p.K, p.block_q, p.block_kv, p.H_padded
  side = _Side(p, tm, where, gmem, smem, "s")
  rows, own = pl.ds(j * bk, bk), smem["own_bars"]
  plgpu.copy_gmem_to_smem(at(k_ref, L.k, B=b, K=h, S=rows), smem["k"], own.at[0])
  plgpu.copy_gmem_to_smem(at(v_ref, L.v, B=b, K=h, S=rows), smem["v"], own.at[1])
  other = side.other_rows()
  bars = smem["q_bars"]

  def head(g, carry):
    n = h * G + g
    side.start(*_bc_nc(p, where, arrays, b, n), j)

    def fetch(k, slot):
      i = side.step(k)[0]
      q_rows = pl.ds(i * bq, bq)
      for x, (src, axes, name) in enumerate(((q_ref, L.q, "q"), (do_ref, L.o, "do"),
                                             (lse_ref, "BNT", "lse"),
                                             (delta_ref, "BNT", "delta"))):
        plgpu.copy_gmem_to_smem(at(src, axes, B=b, N=n, T=q_rows), smem[name].at[slot],
                                bars.at[2 * x + slot])
      if other is not None:
        plgpu.copy_gmem_to_smem(other[0].at[:, q_rows], other[1].at[slot], bars.at[8 + slot])

    def wait(slot):
      for x in range(5 if other is not None else 4):
        plgpu.barrier_wait(bars.at[2 * x + slot])

    def body(k, slot, carry):
      dk, dv = carry
      i, full = side.step(k)
      # [bk, bq] tiles, S^T = k q^T first, dV += P^T dO, then dP^T = v dO^T: S^T and dP^T
      # are never live together
      s = _mma(smem["k"], smem["q"].at[slot].T, (bk, bq)) * p.scale
      lse = compat.mgpu_load(smem["lse"].at[slot], _WGMMA.reduce(0))
      probs, weighted = weighted_probs(p, side, b, n, i, j, s, lse, slot, True, full)
      smem["probs"][...] = probs.astype(smem["probs"].dtype)
      plgpu.commit_smem()
      dv = _mma_into(p, dv, smem["probs"], smem["do"].at[slot])  # dV += P^T dO
      delta = compat.mgpu_load(smem["delta"].at[slot], _WGMMA.reduce(0))
      dp = _mma(smem["v"], smem["do"].at[slot].T, (bk, bq))
      smem["ds"][...] = (weighted * (dp - lax.broadcast_in_dim(delta, dp.shape, [1]))).astype(
          smem["ds"].dtype)
      plgpu.commit_smem()
      dk = _mma_into(p, dk, smem["ds"], smem["q"].at[slot])  # dK += dS^T q
      return dk, dv

    return _pipelined(side.count(p.T_padded // bq), fetch, wait, body, carry)

  zeros = lambda: plgpu.layout_cast(jnp.zeros((bk, E), jnp.float32), _WGMMA)
  plgpu.barrier_wait(own.at[0])
  plgpu.barrier_wait(own.at[1])
  dk, dv = lax.fori_loop(0, G, head, (zeros(), zeros()))
  smem["k"][...] = dk.astype(dk_ref.dtype)
  smem["v"][...] = dv.astype(dv_ref.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem["k"], at(dk_ref, L.k, B=b, K=h, S=rows))
  plgpu.copy_smem_to_gmem(smem["v"], at(dv_ref, L.v, B=b, K=h, S=rows))
  plgpu.wait_smem_to_gmem(0)
