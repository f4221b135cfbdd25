"""The warp-specialised forward of "flex_mgpu" (`implementation="flex_mgpu_ws"`): the
FlashAttention-3 design on Pallas Mosaic GPU (Hopper, sm_90a), compiled only.

A program (one thread block, grid (T' / 128, N, B)) has three warpgroups:

  * warpgroup 2, the producer (`setmaxnreg` down to 40 registers): copies by TMA the
    program's side inputs once, then the K and V tiles of the visited kv tiles into a
    ring of `_STAGES` SMEM slots, each slot refilled once both consumers have
    released it (`k_free`, `v_free` barriers, two arrivals);
  * warpgroups 0 and 1, the consumers (`setmaxnreg` up to 232): each owns a 64-row
    query tile (rows 128 i + 64 c), copied once; per kv tile, S = q k^T by `wgmma`
    from SMEM, the tile's mods and masks (`flex_mgpu_kernels._logits`, the shared
    `tile_mods` evaluation: the same contract as the reference kernel), the online
    softmax in base 2 (log2(e) folded into the scale: one multiply, `exp2`), and
    acc += P V by `wgmma` with P from registers into the accumulator carried across
    the loop (`pl.run_state`), no SMEM round trip. A schedule barrier between the
    two consumers alternates their tensor-core phases (one's softmax under the
    other's `wgmma`).

Both consumers visit the same kv tiles: the non-EMPTY tiles of the 128-row span (the
block classes at tiles of 128 x bk); a FULL tile runs without the mask functions.
q, k, v (and the backward's dO) are read and out (dq, dk, dv) written in the caller's
layout by strided TMA boxes where `kernel_inputs.tma_in_place` holds (T, S whole tiles,
H = D = E, features last): no transpose or pad pass; else through `to_tiles` copies.
The backward is the reference kernels' (`flex_mgpu_kernels.backward`, 64 x 64 tiles), or
inside `flex_mgpu.ws_dq()` / `ws_dkv()` the warp-specialised `_dq` / `_dkv` below.

The GPU interpreter runs neither register operands of `wgmma`, an accumulator carried
by `pl.run_state`, nor `setmaxnreg`: in interpret mode (tests on a CPU) the register
operand goes through SMEM into a fresh accumulator and `setmaxnreg` is skipped
(`_mma_from_registers`, `_set_registers`); the warpgroups, barriers, tables and side
inputs are the compiled kernels' own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src import compat
from jattn._src.core.layout import Layout
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import flex_mgpu_kernels as ref
from jattn._src.kernels import fma_exp2
from jattn._src.kernels import layout_specs
from jattn._src.kernels.kernel_inputs import (TILES, Letters, at, letters, pad_to,
                                              tma_in_place, to_tiles)
from jattn._src.kernels.kernel_vjp import batched, with_batch, without_batch

if TYPE_CHECKING:
  from jattn._src.kernels.flex_mgpu import Plan

_BQ = 64  # query rows per consumer warpgroup (one wgmma M tile)
_CONSUMERS = 2
_STAGES = 2  # K/V slots in SMEM
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_WGMMA = plgpu.Layout.WGMMA
# registers per thread after setmaxnreg: 2 x 232 + 40 (x 128 threads) <= 64K
_CONSUMER_REGISTERS = 232
_PRODUCER_REGISTERS = 40
# the dk/dv consumers hold two [64, E] float32 accumulators (dK, dV: 128 registers at
# E = 128) beside a tile's S, P, dP: 240 / 24 (FlashAttention-3's split) keeps ptxas from
# spilling where 232 / 40 spilled 28 to 48 bytes (benchmarks/gpu_static.py, H100 target)
_DKV_CONSUMER_REGISTERS = 240
_DKV_PRODUCER_REGISTERS = 24


def _launch(p: Plan, body, out_type, scratch, grid, names, kernel_name):
  """plgpu.kernel with a producer and two consumer warpgroups; in interpret mode the GPU
  interpreter with race detection."""
  interpret = plgpu.InterpretGPUParams(detect_races=True) if p.interpret else None
  params = None if p.interpret else plgpu.CompilerParams(approx_math=True)
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                      grid_names=names, num_threads=_CONSUMERS + 1, thread_name="wg",
                      kernel_name=kernel_name, compiler_params=params, interpret=interpret)


def _set_registers(p: Plan, n: int, action: str):
  if not p.interpret:  # the interpreter has no register file to divide
    plgpu.set_max_registers(n, action=action)


def _mma_from_registers(p: Plan, acc, a, b, smem, spill_at):
  """acc + a @ b on the tensor cores: a [64, K] 16-bit in registers, b an SMEM ref, acc
  float32 [64, N] carried in registers (`pl.run_state`). The GPU interpreter runs neither
  a register operand nor a carried accumulator: there a goes through SMEM
  (smem["spill"].at[spill_at]) into a fresh accumulator, added in registers
  (`flex_mgpu_kernels._mma_into`)."""
  if p.interpret:
    spill = smem["spill"].at[spill_at]
    spill[...] = a
    plgpu.commit_smem()
    a = spill
  return ref._mma_into(p, acc, a, b)


# ---------------------------------------------------------------- the call


def forward(p: Plan, layout: Layout, query, key, value, modifiers):
  """-> (out in `layout`, lse float32 [B, N, T], max logits float32 [B, N, T] or None).
  q, k, v are read and out written where they lie when `tma_in_place` (T a multiple of
  128, S of the kv tile, H = D = E, features last), else through `to_tiles` copies."""
  lay = batched(layout)
  E, dtype = p.H_padded, query.dtype
  in_place = tma_in_place(p, layout)
  if in_place:
    L, (q, k, v) = letters(layout), (with_batch(x, layout) for x in (query, key, value))
  else:
    L, (q, k, v) = TILES, to_tiles(p, layout, query, key, value)
  tm, where, arrays = ref._prepare(p, modifiers)
  keep = [name != "q_table" for name in where.names]  # the dk/dv kernel's table
  where = dataclasses.replace(where, names=tuple(n for n, x in zip(where.names, keep) if x))
  arrays = [a for a, x in zip(arrays, keep) if x]
  bk = p.block_kv
  scratch = dict(
      qo=ref._tile_smem((_CONSUMERS, _BQ, E), dtype),
      k=ref._tile_smem((_STAGES, bk, E), dtype), v=ref._tile_smem((_STAGES, bk, E), dtype),
      lse=plgpu.SMEM((_CONSUMERS, _BQ), jnp.float32),
      q_bars=plgpu.Barrier(num_barriers=_CONSUMERS),
      k_bars=plgpu.Barrier(num_barriers=_STAGES), v_bars=plgpu.Barrier(num_barriers=_STAGES),
      k_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),
      v_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),
      schedule=plgpu.Barrier(num_arrivals=_CONSUMERS),
      **_side_scratch(where, arrays, bk))
  rows = jax.ShapeDtypeStruct((p.B, p.N, p.T_padded), jnp.float32)
  o_shape = layout_specs.shape(L.o, dict(B=p.B, T=p.T_padded, N=p.N, D=E))
  out_type = (jax.ShapeDtypeStruct(o_shape, dtype), rows)
  if p.max_logits:
    scratch["max"] = plgpu.SMEM((_CONSUMERS, _BQ), jnp.float32)
    out_type += (rows,)
  body = functools.partial(_kernel, p=p, tm=tm, where=where, arrays=arrays, L=L)
  if p.interpret:  # P through SMEM (`_mma_from_registers`)
    scratch["spill"] = ref._tile_smem((_CONSUMERS, _BQ, p.block_kv), dtype)
  out, lse, *max_logits = _launch(
      p, body, out_type, scratch, (p.T_padded // p.block_q, p.N, p.B), ("i", "n", "b"),
      "jattn_flex_mgpu_ws_fwd")(q, k, v, *arrays)
  if not in_place:  # cut the padding, back to the caller's layout
    out = jnp.einsum(f"BNTD->{lay.out}", out[:, :, :p.T, :p.D])
  max_logits = max_logits[0][:, :, :p.T] if max_logits else None
  return without_batch(out, layout), lse[:, :, :p.T], max_logits


def backward(p: Plan, layout: Layout, query, key, value, modifiers, out, lse, d_out):
  """dq, dk, dv: the reference kernels' (64 x 64 tiles), from this forward's out and lse;
  with `p.fast_dq` / `p.fast_dkv` by the warp-specialised `_dq` / `_dkv` instead."""
  slow = dataclasses.replace(p, fast=False, block_q=_BQ, block_kv=_BQ)
  if not (p.fast_dq or p.fast_dkv):
    return ref.backward(slow, layout, query, key, value, modifiers, out, lse, d_out)
  # in place when the fast kernels' 128-row / 128-key programs tile T and S; else every
  # kernel reads zero-padded [B, heads, tokens, E] tiles (64-multiples; 128 for the fast)
  whole = dataclasses.replace(p, block_q=_CONSUMERS * _BQ, block_kv=_CONSUMERS * _BQ)
  L, q, k, v, do, lse, delta = ref.backward_operands(
      slow, layout, query, key, value, out, lse, d_out, in_place=tma_in_place(whole, layout))
  tiles = L is TILES
  rows = lambda x, plan: pad_to(x, 2, plan.T_padded) if tiles else x  # [B, N, T, ..]

  def prepared(plan, drop):
    tm, where, arrays = ref._prepare(plan, modifiers)
    keep = [name != drop for name in where.names]
    where = dataclasses.replace(where, names=tuple(n for n, x in zip(where.names, keep) if x))
    return tm, where, [a for a, x in zip(arrays, keep) if x]

  if p.fast_dq:  # 128-row programs, 64-key tiles
    fast = dataclasses.replace(p, block_q=_CONSUMERS * _BQ, block_kv=_BQ)
    dq = _dq(fast, L, *prepared(fast, "q_table"), rows(q, fast), k, v, rows(do, fast),
             pad_to(lse, 2, fast.T_padded), pad_to(delta, 2, fast.T_padded))
  else:
    dq = ref._dq(slow, L, *ref._prepare(slow, modifiers), q, k, v, do, lse, delta)
  if p.fast_dkv:  # 64- or 32-row query tiles, 128-key programs (whatever the forward's)
    fast = dataclasses.replace(p, block_q=p.dkv_rows, block_kv=_CONSUMERS * _BQ)
    keys = lambda x: pad_to(x, 2, fast.S_padded) if tiles else x  # [B, K, S, ..]
    dk, dv = _dkv(fast, L, *prepared(fast, "kv_table"), q, keys(k), keys(v), do, lse, delta)
  else:
    dk, dv = ref._dkv(slow, L, *ref._prepare(slow, modifiers), q, k, v, do, lse, delta)
  return (*ref.gradients_out(p, layout, L, dq, dk, dv), None)


def _dq(p: Plan, L: Letters, tm, where, arrays, q, k, v, do, lse, delta):
  """dq (q's letters, shape and dtype) by the warp-specialised kernel: a program per 128
  query rows (two consumers of 64), the producer streaming K, V tiles of 64 keys."""
  E, dtype, bk = p.H_padded, q.dtype, p.block_kv
  scratch = dict(
      q=ref._tile_smem((_CONSUMERS, _BQ, E), dtype), do=ref._tile_smem((_CONSUMERS, _BQ, E), dtype),
      k=ref._tile_smem((_STAGES, bk, E), dtype), v=ref._tile_smem((_STAGES, bk, E), dtype),
      lse=plgpu.SMEM((_CONSUMERS, _BQ), jnp.float32),
      delta=plgpu.SMEM((_CONSUMERS, _BQ), jnp.float32),
      own_bars=plgpu.Barrier(num_barriers=4 * _CONSUMERS),
      k_bars=plgpu.Barrier(num_barriers=_STAGES), v_bars=plgpu.Barrier(num_barriers=_STAGES),
      k_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),
      v_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),
      **_side_scratch(where, arrays, bk))
  body = functools.partial(_dq_kernel, p=p, tm=tm, where=where, arrays=arrays, L=L)
  if p.interpret:  # dS through SMEM (`_mma_from_registers`)
    scratch["spill"] = ref._tile_smem((_CONSUMERS, _BQ, bk), dtype)
  return _launch(p, body, jax.ShapeDtypeStruct(q.shape, dtype), scratch,
                 (p.T_padded // p.block_q, p.N, p.B), ("i", "n", "b"),
                 "jattn_flex_mgpu_ws_dq")(q, k, v, do, lse, delta, *arrays)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm, where,
               arrays, L: Letters, **smem):
  kv_at = lambda x, b, h, rows: (at(k_ref, L.k, B=b, K=h, S=rows) if x == "k"
                                 else at(v_ref, L.v, B=b, K=h, S=rows))
  gmem, outs, (i, n, b, wg), side, wait_side, count = _program(
      p, tm, where, arrays, refs, smem, kv_at)
  (dq_ref,) = outs
  bk, E = p.block_kv, p.H_padded

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    _set_registers(p, _CONSUMER_REGISTERS, "increase")
    rows = pl.ds(i * p.block_q + wg * _BQ, _BQ)
    bars = smem["own_bars"]
    for x, (src, axes, name) in enumerate(((q_ref, L.q, "q"), (do_ref, L.o, "do"),
                                           (lse_ref, "BNT", "lse"),
                                           (delta_ref, "BNT", "delta"))):
      plgpu.copy_gmem_to_smem(at(src, axes, B=b, N=n, T=rows), smem[name].at[wg],
                              bars.at[x * _CONSUMERS + wg])
    wait_side()
    for x in range(4):
      plgpu.barrier_wait(bars.at[x * _CONSUMERS + wg])
    side_c = _consumer_side(p, tm, where, gmem, smem, wg)
    view = dataclasses.replace(p, block_q=_BQ)
    tile = i * _CONSUMERS + wg
    q_s, do_s = smem["q"].at[wg], smem["do"].at[wg]
    lse = compat.mgpu_load(smem["lse"].at[wg], _WGMMA.reduce(1))
    delta = compat.mgpu_load(smem["delta"].at[wg], _WGMMA.reduce(1))

    def body(k, dq):
      slot = lax.rem(k, jnp.int32(_STAGES))
      j, full = side_c.step(k)
      plgpu.barrier_wait(smem["k_bars"].at[slot])
      plgpu.barrier_wait(smem["v_bars"].at[slot])

      def products(s_ref, dp_ref):
        plgpu.wgmma(s_ref, q_s, smem["k"].at[slot].T)
        plgpu.wgmma(dp_ref, do_s, smem["v"].at[slot].T)  # dP = dO v^T
        return s_ref[...], dp_ref[...]

      s, dp = pl.run_scoped(products, plgpu.ACC((_BQ, bk), jnp.float32),
                            plgpu.ACC((_BQ, bk), jnp.float32))
      if "rows_bars" in smem:
        plgpu.barrier_wait(smem["rows_bars"].at[slot])
      _, ds = ref._by_class(full, lambda full: ref._tile_grads(
          view, side_c, b, n, tile, j, s * p.scale, dp, lse, delta, slot, False, full))
      plgpu.barrier_arrive(smem["v_free"].at[slot])  # V and the key-side rows read
      ds = ds.astype(q_s.dtype)

      dq = _mma_from_registers(p, dq, ds, smem["k"].at[slot], smem, (wg,))  # dQ += dS k
      plgpu.barrier_arrive(smem["k_free"].at[slot])
      return dq

    dq = lax.fori_loop(0, count(), body,
                       plgpu.layout_cast(jnp.zeros((_BQ, E), jnp.float32), _WGMMA))
    q_s[...] = dq.astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, at(dq_ref, L.q, B=b, N=n, T=rows))
    plgpu.wait_smem_to_gmem(0)


def _side_scratch(where, arrays, bk: int) -> dict:
  """SMEM for the side inputs: the table row and scalars once, each consumer's query rows
  [2, X, 64], the key-side rows per stage [stages, X, bk]."""
  shapes = dict(zip(where.names, (a.shape for a in arrays)))
  out = {}
  if "kv_table" in shapes:
    out["table"] = plgpu.SMEM(shapes["kv_table"][3:], jnp.int32)
  for name, dtype in (("ints", jnp.int32), ("floats", jnp.float32)):
    if name in shapes:
      out[name] = plgpu.SMEM(shapes[name], dtype)
  if "q_rows" in shapes:
    out["q_rows"] = plgpu.SMEM((_CONSUMERS, shapes["q_rows"][0], _BQ), jnp.int32)
  if "kv_rows" in shapes:
    out["kv_rows"] = plgpu.SMEM((_STAGES, shapes["kv_rows"][0], bk), jnp.int32)
    out["rows_bars"] = plgpu.Barrier(num_barriers=_STAGES)
  out["side_bars"] = plgpu.Barrier(num_barriers=5)
  return out


# ---------------------------------------------------------------- the kernel


def _program(p: Plan, tm, where, arrays, refs, smem, kv_at):
  """What a program of the forward and dq kernels shares: its indices, the side inputs'
  copies, and the producer warpgroup (K, V tiles by `kv_at(ref, b, h, rows)`).

  -> (gmem side refs, the rest of refs, (i, n, b, wg), the program's `_Side`,
  wait_side(), count()). Programs run heaviest first: i counts down (causal rows)."""
  gmem = dict(zip(where.names, refs[:len(where.names)]))
  i = (p.T_padded // p.block_q - 1) - lax.axis_index("i")
  n, b, wg = (lax.axis_index(a) for a in ("n", "b", "wg"))
  h = lax.div(n, jnp.int32(p.N // p.K))
  bc, nc = ref._bc_nc(p, where, arrays, b, n)
  side_copies = []  # (source, destination) of the side inputs, copied once
  if "kv_table" in gmem:
    side_copies.append((gmem["kv_table"].at[bc, nc, i], smem["table"]))
  for name in ("ints", "floats"):
    if name in gmem:
      side_copies.append((gmem[name], smem[name]))
  if "q_rows" in gmem:
    for c in range(_CONSUMERS):
      side_copies.append((gmem["q_rows"].at[:, pl.ds(i * p.block_q + c * _BQ, _BQ)],
                          smem["q_rows"].at[c]))
  side_bars = smem["side_bars"]

  def wait_side():
    for x in range(len(side_copies)):
      plgpu.barrier_wait(side_bars.at[x])

  side = ref._Side(p, tm, where, gmem, smem, "t")
  count = lambda: side.count(p.S_padded // p.block_kv)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    _set_registers(p, _PRODUCER_REGISTERS, "decrease")
    for x, (src, dst) in enumerate(side_copies):
      plgpu.copy_gmem_to_smem(src, dst, side_bars.at[x])
    wait_side()
    _produce(p, side, smem, gmem, kv_at, b, h, count())

  return gmem, refs[len(where.names):], (i, n, b, wg), side, wait_side, count


def _consumer_side(p, tm, where, gmem, smem, wg):
  """A consumer's `_Side`: its own 64 query rows' per-token rows."""
  mine = dict(smem)
  if "q_rows" in smem:
    mine["q_rows"] = smem["q_rows"].at[wg]
  return ref._Side(p, tm, where, gmem, mine, "t")


def _kernel(q_ref, k_ref, v_ref, *refs, p: Plan, tm, where, arrays, L: Letters, **smem):
  kv_at = lambda x, b, h, rows: (at(k_ref, L.k, B=b, K=h, S=rows) if x == "k"
                                 else at(v_ref, L.v, B=b, K=h, S=rows))
  gmem, outs, (i, n, b, wg), side, wait_side, count = _program(
      p, tm, where, arrays, refs, smem, kv_at)
  o_ref, lse_ref, *max_ref = outs

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    _set_registers(p, _CONSUMER_REGISTERS, "increase")
    row0 = i * p.block_q + wg * _BQ
    qo = smem["qo"].at[wg]
    rows = pl.ds(row0, _BQ)
    plgpu.copy_gmem_to_smem(at(q_ref, L.q, B=b, N=n, T=rows), qo, smem["q_bars"].at[wg])
    wait_side()
    plgpu.barrier_wait(smem["q_bars"].at[wg])
    side_c = _consumer_side(p, tm, where, gmem, smem, wg)
    acc, m, l = _consume(p, side_c, smem, qo, b, n, i * _CONSUMERS + wg, wg, count())
    seen = l > 0.0
    safe_l = jnp.where(seen, l, 1.0)
    inv = jnp.where(seen, 1.0 / safe_l, 0.0)
    qo[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(qo.dtype)
    # m, l are in base 2: lse = ln 2 * (m + log2 l)
    smem["lse"].at[wg][...] = jnp.where(seen, _LN2 * m + jnp.log(safe_l), LARGE_NEGATIVE)
    if max_ref:  # a row with no visible key keeps LARGE_NEGATIVE
      smem["max"].at[wg][...] = jnp.where(m > LARGE_NEGATIVE, _LN2 * m, LARGE_NEGATIVE)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo, at(o_ref, L.o, B=b, N=n, T=rows))
    plgpu.copy_smem_to_gmem(smem["lse"].at[wg], lse_ref.at[b, n, rows])
    if max_ref:
      plgpu.copy_smem_to_gmem(smem["max"].at[wg], max_ref[0].at[b, n, rows])
    plgpu.wait_smem_to_gmem(0)


def _produce(p: Plan, side, smem, gmem, kv_at, b, h, count):
  """The producer: the visited kv tiles' K, V (and key-side rows) into the stage ring."""
  bk = p.block_kv

  def copy_k(k, slot):
    rows = pl.ds(side.step(k)[0] * bk, bk)
    plgpu.copy_gmem_to_smem(kv_at("k", b, h, rows), smem["k"].at[slot],
                            smem["k_bars"].at[slot])

  def copy_v(k, slot):  # the key-side rows are read before P V: released with V
    rows = pl.ds(side.step(k)[0] * bk, bk)
    plgpu.copy_gmem_to_smem(kv_at("v", b, h, rows), smem["v"].at[slot],
                            smem["v_bars"].at[slot])
    if "kv_rows" in gmem:
      plgpu.copy_gmem_to_smem(gmem["kv_rows"].at[:, rows], smem["kv_rows"].at[slot],
                              smem["rows_bars"].at[slot])

  # without block tables every tile is visited: count is static, and a copy past the
  # last tile must not be traced (its slice would be out of bounds)
  first = _STAGES if "table" in side.smem else min(_STAGES, p.S_padded // bk)
  for k in range(first):
    @pl.when(k < count)
    def _():
      copy_k(k, k)
      copy_v(k, k)

  def refill(k, carry):  # a slot once both consumers released it
    slot = lax.rem(k, jnp.int32(_STAGES))
    plgpu.barrier_wait(smem["k_free"].at[slot])
    copy_k(k, slot)
    plgpu.barrier_wait(smem["v_free"].at[slot])
    copy_v(k, slot)
    return carry

  stages = jnp.int32(_STAGES)  # int32 bounds, also under jax_enable_x64
  lax.fori_loop(stages, jnp.maximum(count, stages), refill, None)


def _consume(p: Plan, side, smem, qo, b, n, tile, wg, count):
  """A consumer's loop over the visited kv tiles -> (acc [64, E] float32, m, l in base 2)."""
  bk, E = p.block_kv, p.H_padded
  view = dataclasses.replace(p, block_q=_BQ)  # positions of this consumer's 64-row tile
  schedule = smem["schedule"]

  def take_turn():  # both consumers pass: their tensor-core phases alternate
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  # with no score_mod, the masks alone: log2(e) joins the scale (where() keeps
  # LARGE_NEGATIVE as is); a score_mod sees natural logits, scaled after
  has_score = side.tm.score_jaxpr is not None
  first = p.scale if has_score else p.scale * _LOG2E

  def body(k, carry):
    acc, m, l = carry
    slot = lax.rem(k, jnp.int32(_STAGES))
    j, full = side.step(k)
    plgpu.barrier_wait(smem["k_bars"].at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, qo, smem["k"].at[slot].T)
      take_turn()
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((_BQ, bk), jnp.float32)) * first
    plgpu.barrier_arrive(smem["k_free"].at[slot])
    if "rows_bars" in smem:
      plgpu.barrier_wait(smem["rows_bars"].at[slot])
    s = ref._by_class(full, lambda full: ref._logits(
        view, side, b, n, tile, j, s, slot, transposed=False, full=full)[0])
    if has_score:
      s = s * _LOG2E
    m_next = jnp.maximum(m, s.max(axis=1))
    # a row with no visible key yet keeps m = LARGE_NEGATIVE: shift it by 0
    shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
    probs = _exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]), p.exp2_fma)
    alpha = jnp.exp2(m - m_next)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = alpha * l + probs.sum(axis=1)
    probs = probs.astype(qo.dtype)
    plgpu.barrier_arrive(schedule)  # softmax done
    plgpu.barrier_wait(smem["v_bars"].at[slot])
    plgpu.barrier_wait(schedule)  # the other consumer's P V issued: the tensor cores free

    acc = _mma_from_registers(p, acc, probs, smem["v"].at[slot], smem, (wg,))  # acc += P V
    plgpu.barrier_arrive(smem["v_free"].at[slot])
    return acc, m_next, l

  init = (plgpu.layout_cast(jnp.zeros((_BQ, E), jnp.float32), _WGMMA),
          plgpu.layout_cast(jnp.full((_BQ,), LARGE_NEGATIVE, jnp.float32), _WGMMA.reduce(1)),
          plgpu.layout_cast(jnp.zeros((_BQ,), jnp.float32), _WGMMA.reduce(1)))
  pl.when(wg == 1)(take_turn)
  out = lax.fori_loop(0, count, body, init)
  pl.when(wg == 0)(take_turn)
  return out


def _exp2(x, fma_columns: int):
  """2**x of a [64, bk] tile: the last `fma_columns` columns by `fma_exp2` (FP32 pipe), the
  others by exp2 (`MUFU.EX2`), so both units share the softmax's exponentials."""
  split = x.shape[1] - fma_columns
  if fma_columns == 0:
    return jnp.exp2(x)
  if split == 0:
    return fma_exp2.exp2(x)
  return jnp.concatenate([jnp.exp2(x[:, :split]), fma_exp2.exp2(x[:, split:])], axis=1)


# ---------------------------------------------------------------- dk, dv


def _dkv(p: Plan, L: Letters, tm, where, arrays, q, k, v, do, lse, delta):
  """(dk, dv) in k's and v's letters and shapes (k's dtype) by the warp-specialised
  kernel: a program per 128 keys of kv head h (two consumers of 64), the producer
  streaming, for each of the G query heads of h, its non-EMPTY 64-row query tiles (q, dO,
  lse, delta and the query-side rows) through the stage ring; dV += P^T dO and dK += dS^T
  q with P^T, dS^T from registers.
  p: block_q 64 or 32 (query tiles: `flex_mgpu._ws_dkv_rows`), block_kv 128 (the
  program's keys)."""
  E, dtype, bq, G = p.H_padded, q.dtype, p.block_q, p.N // p.K
  shapes = dict(zip(where.names, (a.shape for a in arrays)))
  Gt = G if "q_table" in shapes and shapes["q_table"][1] > 1 else 1  # table rows held
  # a wgmma's K runs in swizzle-wide groups, and K is bq in dV += P^T dO, dK += dS^T q:
  # 32-row tiles take 64-byte swizzles, on k and v too (a wgmma's SMEM operands share one)
  tile = lambda shape: ref._tile_smem(shape, dtype, swizzle=min(128, bq * dtype.itemsize))
  scratch = dict(
      k=tile((_CONSUMERS, _BQ, E)), v=tile((_CONSUMERS, _BQ, E)),
      q=tile((_STAGES, bq, E)), do=tile((_STAGES, bq, E)),
      lse=plgpu.SMEM((_STAGES, bq), jnp.float32), delta=plgpu.SMEM((_STAGES, bq), jnp.float32),
      own_bars=plgpu.Barrier(num_barriers=2 * _CONSUMERS),
      in_bars=plgpu.Barrier(num_barriers=5 * _STAGES),  # q, dO, lse, delta, rows per slot
      free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),
      side_bars=plgpu.Barrier(num_barriers=5))
  if "q_table" in shapes:
    scratch["tables"] = plgpu.SMEM((Gt, *shapes["q_table"][3:]), jnp.int32)
  for name, kind in (("ints", jnp.int32), ("floats", jnp.float32)):
    if name in shapes:
      scratch[name] = plgpu.SMEM(shapes[name], kind)
  if "kv_rows" in shapes:
    scratch["kv_rows"] = plgpu.SMEM((_CONSUMERS, shapes["kv_rows"][0], _BQ), jnp.int32)
  if "q_rows" in shapes:
    scratch["q_rows"] = plgpu.SMEM((_STAGES, shapes["q_rows"][0], bq), jnp.int32)
  body = functools.partial(_dkv_kernel, p=p, tm=tm, where=where, Gt=Gt, L=L)
  shapes = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  if p.interpret:  # P^T and dS^T through SMEM (`_mma_from_registers`)
    scratch["spill"] = tile((_CONSUMERS, 2, _BQ, bq))
  return _launch(p, body, shapes, scratch, (p.S_padded // p.block_kv, p.K, p.B),
                 ("j", "h", "b"), "jattn_flex_mgpu_ws_dkv")(q, k, v, do, lse, delta, *arrays)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p: Plan, tm, where,
                Gt, L: Letters, **smem):
  gmem = dict(zip(where.names, refs[:len(where.names)]))
  dk_ref, dv_ref = refs[len(where.names):]
  j = (p.S_padded // p.block_kv - 1) - lax.axis_index("j")  # heaviest first (causal)
  h, b, wg = (lax.axis_index(a) for a in ("h", "b", "wg"))
  G, bq = p.N // p.K, p.block_q
  copies = []  # the side inputs, copied once
  if "q_table" in gmem:
    Bc = gmem["q_table"].shape[0]
    heads = pl.ds(h * G if Gt > 1 else 0, Gt)
    copies.append((gmem["q_table"].at[b if Bc > 1 else 0, heads, j], smem["tables"]))
  for name in ("ints", "floats"):
    if name in gmem:
      copies.append((gmem[name], smem[name]))
  if "kv_rows" in gmem:
    for c in range(_CONSUMERS):
      copies.append((gmem["kv_rows"].at[:, pl.ds(j * p.block_kv + c * _BQ, _BQ)],
                     smem["kv_rows"].at[c]))
  side_bars, bars = smem["side_bars"], smem["in_bars"]

  def wait_side():
    for x in range(len(copies)):
      plgpu.barrier_wait(side_bars.at[x])

  def head_side(g, rows_view=None):
    mine = dict(smem)
    if "tables" in smem:
      mine["table"] = smem["tables"].at[g if Gt > 1 else 0]
    if rows_view is not None:
      mine["kv_rows"] = rows_view
    return ref._Side(p, tm, where, gmem, mine, "s")

  count = lambda side: side.count(p.T_padded // bq)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    _set_registers(p, _DKV_PRODUCER_REGISTERS, "decrease")
    for x, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, side_bars.at[x])
    wait_side()

    def head(g, t0):
      n, side = h * G + g, head_side(g)

      def step(kk, carry):
        t = t0 + kk
        slot = lax.rem(t, jnp.int32(_STAGES))

        @pl.when(t >= _STAGES)
        def _():
          plgpu.barrier_wait(smem["free"].at[slot])

        rows = pl.ds(side.step(kk)[0] * bq, bq)
        for x, (src, axes, name) in enumerate(((q_ref, L.q, "q"), (do_ref, L.o, "do"),
                                               (lse_ref, "BNT", "lse"),
                                               (delta_ref, "BNT", "delta"))):
          plgpu.copy_gmem_to_smem(at(src, axes, B=b, N=n, T=rows), smem[name].at[slot],
                                  bars.at[x * _STAGES + slot])
        if "q_rows" in gmem:
          plgpu.copy_gmem_to_smem(gmem["q_rows"].at[:, rows], smem["q_rows"].at[slot],
                                  bars.at[4 * _STAGES + slot])
        return carry

      cnt = count(side)
      lax.fori_loop(0, cnt, step, None)
      return t0 + cnt

    lax.fori_loop(0, G, head, jnp.int32(0))

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    _set_registers(p, _DKV_CONSUMER_REGISTERS, "increase")
    keys = pl.ds(j * p.block_kv + wg * _BQ, _BQ)
    k_s, v_s = smem["k"].at[wg], smem["v"].at[wg]
    plgpu.copy_gmem_to_smem(at(k_ref, L.k, B=b, K=h, S=keys), k_s, smem["own_bars"].at[wg])
    plgpu.copy_gmem_to_smem(at(v_ref, L.v, B=b, K=h, S=keys), v_s,
                            smem["own_bars"].at[_CONSUMERS + wg])
    wait_side()
    plgpu.barrier_wait(smem["own_bars"].at[wg])
    plgpu.barrier_wait(smem["own_bars"].at[_CONSUMERS + wg])
    view = dataclasses.replace(p, block_kv=_BQ)  # positions of this consumer's 64 keys
    tile = j * _CONSUMERS + wg
    rows_view = smem["kv_rows"].at[wg] if "kv_rows" in smem else None

    def head(g, carry):
      dk, dv, t0 = carry
      n, side = h * G + g, head_side(g, rows_view)

      def body(kk, carry):
        dk, dv = carry
        t = t0 + kk
        slot = lax.rem(t, jnp.int32(_STAGES))
        i, full = side.step(kk)
        for x in range(5 if "q_rows" in smem else 4):
          plgpu.barrier_wait(bars.at[x * _STAGES + slot])

        # [64 keys, bq queries] tiles: S^T = k q^T, dP^T = v dO^T
        s = ref._mma(k_s, smem["q"].at[slot].T, (_BQ, bq)) * p.scale
        lse = compat.mgpu_load(smem["lse"].at[slot], _WGMMA.reduce(0))
        # Registers: P^T, then dV += P^T dO, then dP^T, then dS^T, so that S^T and dP^T
        # are never live together (`flex_mgpu_kernels.weighted_probs`)
        probs, weighted = ref.weighted_probs(view, side, b, n, i, tile, s, lse, slot, True,
                                             full)
        dv = _mma_from_registers(p, dv, probs.astype(k_s.dtype), smem["do"].at[slot], smem,
                                 (wg, 0))  # dV += P^T dO
        dp = ref._mma(v_s, smem["do"].at[slot].T, (_BQ, bq))
        # (delta loaded here, not beside lse: live across dV's wgmma it spilled 4 bytes
        # with grouped heads under jax 0.12.1's ptxas)
        delta = compat.mgpu_load(smem["delta"].at[slot], _WGMMA.reduce(0))
        ds = weighted * (dp - lax.broadcast_in_dim(delta, dp.shape, [1]))
        dk = _mma_from_registers(p, dk, ds.astype(k_s.dtype), smem["q"].at[slot], smem,
                                 (wg, 1))  # dK += dS^T q
        plgpu.barrier_arrive(smem["free"].at[slot])
        return dk, dv

      cnt = count(side)
      dk, dv = lax.fori_loop(0, cnt, body, (dk, dv))
      return dk, dv, t0 + cnt

    zeros = lambda: plgpu.layout_cast(jnp.zeros((_BQ, p.H_padded), jnp.float32), _WGMMA)
    dk, dv, _ = lax.fori_loop(0, G, head, (zeros(), zeros(), jnp.int32(0)))
    k_s[...] = dk.astype(k_s.dtype)
    v_s[...] = dv.astype(v_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_s, at(dk_ref, L.k, B=b, K=h, S=keys))
    plgpu.copy_smem_to_gmem(v_s, at(dv_ref, L.v, B=b, K=h, S=keys))
    plgpu.wait_smem_to_gmem(0)
