"""The "flex_tpu" kernel: flash attention in Pallas for TPU (Mosaic), with the
user's mask_mod and score_mod evaluated inside the kernel on each tile.

`plan(...)` looks only at static facts of a call and returns a hashable
`Plan`, or a reason in words for what the kernel cannot take. `run(plan, ...)`
has the contract of `blockwise_attention`: -> (out, None, lse float32 [B, N, T]).

Grid (B, N, T / block_q, S / block_kv), the last axis sequential: each program
holds one query tile [block_q, H] of head n and streams the key/value tiles of
kv head n // G (the index map reads the shared kv head: K and V are never
repeated per group). Online softmax in float32 in VMEM scratch (running max m
and sum l lane-replicated [block_q, 128], accumulator [block_q, D]); the last
kv step writes out and lse = m + log l. T and S are padded to the tiles, and
the padded keys masked. Positions t, s are iota tiles; b and n the program's
indices; the mods' captured arrays are in SMEM (scalar prefetch), see
`tile_mods`. Sinks are applied to (out, lse) after the kernel, as blockwise does.

Backward: a custom VJP whose backward is jattn's blockwise backward (pure JAX,
recomputing each block from out and lse); the Pallas backward is not written yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jattn._src.core.layout import Layout
from jattn._src.core.modifiers import Modifiers
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.impl import blockwise_loop as _blockwise
from jattn._src.impl.block_sizes import BlockSizes
from jattn._src.kernels import tile_mods
from jattn._src.masks.programmable import add_sinks, sinks_grad

_LANES = 128  # TPU vector lanes: the row statistics m, l and lse are kept this wide
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static the kernel is built from (hashable)."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  D: int
  block_q: int
  block_kv: int
  scale: float
  is_causal: bool
  window: tuple | None
  has_mask_mod: bool
  has_score_mod: bool
  interpret: bool

  @property
  def T_padded(self) -> int:
    return _round_up(self.T, self.block_q)

  @property
  def S_padded(self) -> int:
    return _round_up(self.S, self.block_kv)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def plan(*, B: int, T: int, S: int, N: int, K: int, H: int, D: int, dtype,
         modifiers: Modifiers, return_weights: bool = False,
         block_q: int | None = None, block_kv: int | None = None,
         interpret: bool = False) -> Plan | str:
  """A `Plan` for this call, or the reason (a sentence) the kernel cannot take it.

  modifiers: the call's `Modifiers` (its arrays may be tracers or
  ShapeDtypeStructs: only shapes, dtypes and the mods' jaxprs are read).
  block_q (a multiple of 8) and block_kv (a multiple of 128): the tiles, by
  default 128 and up to 512, clipped to the padded T and S.
  interpret: run the Pallas kernel in interpret mode (any backend, for tests).
  """
  m = modifiers
  if return_weights:
    return "return_weights: the kernel forms no [T, S] weights"
  if np.dtype(dtype) not in _DTYPES:
    return f"dtype {np.dtype(dtype)}: the kernel takes float32 and bfloat16"
  if N % K:
    return f"N = {N} is not a multiple of K = {K}"
  if not (1 <= H <= 256 and 1 <= D <= 256):
    return f"head sizes H = {H}, D = {D}: the kernel takes 1 to 256"
  if min(B, T, S, N) < 1:
    return "an empty axis (B, T, S or N is 0)"
  if m.bias is not None:
    return "a dense bias [.., T, S]: not read by the kernel (score_mod is)"
  if m.mask is not None:
    return "a dense mask [.., T, S]: not read by the kernel (mask_mod is)"
  st = m.structure
  if st.q_lengths is not None or st.kv_lengths is not None:
    return "sequence lengths: not in the kernel yet"
  if st.q_segment_ids is not None or st.kv_segment_ids is not None:
    return "segment ids: not in the kernel yet"
  if m.dropout is not None:
    return "dropout: not in the kernel (no TPU PRNG path written yet)"
  if not isinstance(m.scale, (int, float)):
    return "a traced scale: the kernel takes a Python number"
  mods = m.mods
  has_mask = has_score = False
  if mods is not None:
    if mods.block_mask is not None and not mods.has_mask:
      return "a block_mask without its mask_mod"
    mods = mods.traced()
    for kind, jaxpr, consts in (("mask_mod", mods.mask_jaxpr, mods.mask_consts),
                                ("score_mod", mods.score_jaxpr, mods.score_consts)):
      if jaxpr is None:
        continue
      reason = tile_mods.check_consts(consts) or tile_mods.check(
          jaxpr, tile_mods.consts_meta(consts), 4, kind == "score_mod")
      if reason:
        return f"{kind}: {reason}"
    has_mask, has_score = mods.mask_jaxpr is not None, mods.score_jaxpr is not None
  block_q = min(block_q or 128, _round_up(T, 8))
  block_kv = min(block_kv or 512, _round_up(S, _LANES))
  if block_q % 8 or block_kv % _LANES:
    return (f"tiles block_q = {block_q}, block_kv = {block_kv}: block_q must be a "
            "multiple of 8 and block_kv of 128")
  window = None if st.local_window is None else tuple(int(w) for w in st.local_window)
  return Plan(B, T, S, N, K, H, D, block_q, block_kv, float(m.scale), bool(st.is_causal),
              window, has_mask, has_score, bool(interpret))


def run(plan_: Plan, query, key, value, modifiers: Modifiers, layout: Layout):
  """-> (out, None, lse float32 [B, N, T]), as `blockwise_attention`."""
  if modifiers.mods is not None:
    modifiers = modifiers.replace(mods=modifiers.mods.traced())
  out, lse = _attention(plan_, layout, query, key, value, modifiers)
  if not layout.has_batch:
    lse = lse[0]
  return out, None, lse


# ---------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan_, layout, query, key, value, modifiers):
  return _forward(plan_, layout, query, key, value, modifiers)[0]


def _forward(plan_, layout, query, key, value, modifiers):
  out, lse = forward(plan_, layout, query, key, value, modifiers.mods)
  if modifiers.sinks is not None:
    out, lse = add_sinks(out, lse, modifiers.sinks, _batched(layout).out)
  return (out, lse), (query, key, value, modifiers, out, lse)


def _backward(plan_, layout, residuals, cotangents):
  d_out, _ = cotangents  # the lse carries no gradient (as jax.nn, as blockwise)
  query, key, value, modifiers, out, lse = residuals
  q, k, v, o, d_o = (_with_batch(x, layout) for x in (query, key, value, out, d_out))
  blayout = _batched(layout)
  block_sizes = BlockSizes(plan_.block_q, plan_.block_kv)
  d_q, d_k, d_v, _, d_consts = _blockwise.backward_with_score_grads(
      q, k, v, modifiers, blayout, 0, 0, block_sizes, o, lse, d_o)
  mods = modifiers.mods
  d_mods = None
  if mods is not None:
    d_sinks = None if mods.sinks is None else sinks_grad(
        o, lse, d_o, mods.sinks, blayout.out).astype(mods.sinks.dtype)
    d_mods = mods.gradients(sinks=d_sinks, score_consts=d_consts)
  d_q, d_k, d_v = (_without_batch(x, layout) for x in (d_q, d_k, d_v))
  return (d_q.astype(query.dtype), d_k.astype(key.dtype), d_v.astype(value.dtype),
          modifiers.gradients(bias=None, mods=d_mods))


_attention.defvjp(_forward, _backward)


def _batched(layout: Layout) -> Layout:
  return layout if layout.has_batch else Layout("B" + layout.query)


def _with_batch(x, layout):
  return x if layout.has_batch else x[None]


def _without_batch(x, layout):
  return x if layout.has_batch else x[0]


# ---------------------------------------------------------------- forward kernel


def forward(plan_: Plan, layout: Layout, query, key, value, mods):
  """-> (out in the query's layout with D, lse float32 [B, N, T]); no sinks."""
  p = plan_
  lay = _batched(layout)
  # [B, N, T, H], [B, K, S, H], [B, K, S, D]: the tile's last two axes are (rows, features)
  q = jnp.einsum(f"{lay.query}->BNTH", _with_batch(query, layout))
  k = jnp.einsum(f"{lay.key}->BKSH", _with_batch(key, layout))
  v = jnp.einsum(f"{lay.value}->BKSD", _with_batch(value, layout))
  Tp, Sp = p.T_padded, p.S_padded
  q = jnp.pad(q, ((0, 0), (0, 0), (0, Tp - p.T), (0, 0)))
  k = jnp.pad(k, ((0, 0), (0, 0), (0, Sp - p.S), (0, 0)))
  v = jnp.pad(v, ((0, 0), (0, 0), (0, Sp - p.S), (0, 0)))
  mask_consts = () if mods is None or mods.mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if mods is None or mods.score_jaxpr is None else tuple(mods.score_consts)
  smem = [_to_smem(c) for c in mask_consts + score_consts]
  kernel = functools.partial(
      _kernel, p=p,
      mask_jaxpr=None if mods is None else mods.mask_jaxpr,
      score_jaxpr=None if mods is None else mods.score_jaxpr,
      mask_meta=tile_mods.consts_meta(mask_consts),
      score_meta=tile_mods.consts_meta(score_consts))
  G = p.N // p.K
  bq, bk = p.block_q, p.block_kv
  grid = (p.B, p.N, Tp // bq, Sp // bk)
  in_specs = [
      pl.BlockSpec((None, None, bq, p.H), lambda b, n, i, j, *_: (b, n, i, 0)),
      pl.BlockSpec((None, None, bk, p.H), lambda b, n, i, j, *_: (b, jax.lax.div(n, G), j, 0)),
      pl.BlockSpec((None, None, bk, p.D), lambda b, n, i, j, *_: (b, jax.lax.div(n, G), j, 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, None, bq, p.D), lambda b, n, i, j, *_: (b, n, i, 0)),
      pl.BlockSpec((None, None, bq, _LANES), lambda b, n, i, j, *_: (b, n, i, 0)),
  ]
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(smem), grid=grid, in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, p.D), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((p.B, p.N, Tp, p.D), query.dtype),
                 jax.ShapeDtypeStruct((p.B, p.N, Tp, _LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=p.interpret,
      name="jattn_flex_tpu_fwd",
  )(*smem, q, k, v)
  out = out[:, :, :p.T]
  lse = lse[:, :, :p.T, 0]
  out = jnp.einsum(f"BNTD->{lay.out}", out)
  return _without_batch(out, layout), lse


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


def _kernel(*refs, p: Plan, mask_jaxpr, score_jaxpr, mask_meta, score_meta):
  n_mask, n_score = len(mask_meta), len(score_meta)
  mask_refs, score_refs = refs[:n_mask], refs[n_mask:n_mask + n_score]
  q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[n_mask + n_score:]
  b, n, i, j = (pl.program_id(a) for a in range(4))
  bq, bk = p.block_q, p.block_kv
  tile = (bq, bk)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, LARGE_NEGATIVE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  q = q_ref[...]
  k = k_ref[...]
  # [bq, bk] = q k^T, float32 on the MXU
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * p.scale
  t_pos = i * bq + jax.lax.broadcasted_iota(jnp.int32, tile, 0)
  s_pos = j * bk + jax.lax.broadcasted_iota(jnp.int32, tile, 1)
  if score_jaxpr is not None:
    s = tile_mods.evaluate(score_jaxpr, score_meta, _reader(score_refs, score_meta),
                           [s, b, n, t_pos, s_pos], tile)[0]
    s = jnp.broadcast_to(s, tile).astype(jnp.float32)
  keep = None

  def both(a, c):
    return c if a is None else a & c

  if p.S_padded != p.S:
    keep = both(keep, s_pos < p.S)
  if p.is_causal:
    keep = both(keep, s_pos <= t_pos)
  if p.window is not None:
    left, right = p.window
    keep = both(keep, (s_pos >= t_pos - left) & (s_pos <= t_pos + right))
  if mask_jaxpr is not None:
    mm = tile_mods.evaluate(mask_jaxpr, mask_meta, _reader(mask_refs, mask_meta),
                            [b, n, t_pos, s_pos], tile)[0]
    keep = both(keep, jnp.broadcast_to(mm, tile))
  if keep is not None:
    s = jnp.where(keep, s, LARGE_NEGATIVE)

  m_prev, l_prev = m_sc[...], l_sc[...]  # [bq, 128]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
  # A row that has seen no visible key keeps m = LARGE_NEGATIVE: shift it by 0
  # instead, so that its masked logits give exp(LARGE_NEGATIVE) = 0, not 1.
  shift = jnp.where(m_next > LARGE_NEGATIVE, m_next, 0.0)
  p_ = jnp.exp(s - _lanes(shift, bk))  # [bq, bk]
  alpha = jnp.exp(m_prev - m_next)  # [bq, 128]
  l_sc[...] = alpha * l_prev + jnp.sum(p_, axis=1, keepdims=True)
  m_sc[...] = m_next
  v = v_ref[...]
  pv = jax.lax.dot_general(p_.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # [bq, D]
  acc_sc[...] = acc_sc[...] * _lanes(alpha, p.D) + pv

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    l, m = l_sc[...], m_sc[...]
    seen = l > 0.0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    o_ref[...] = (acc_sc[...] * _lanes(inv, p.D)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), LARGE_NEGATIVE)


def _lanes(x, width: int):
  """[rows, 128] lane-replicated -> [rows, width]."""
  reps = -(-width // _LANES)
  y = jnp.tile(x, (1, reps)) if reps > 1 else x
  return y if width == y.shape[1] else y[:, :width]
