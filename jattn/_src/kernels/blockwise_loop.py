"""Blockwise (flash) attention primitives: one query range against one key/value range.

Never holds a [T, S] array: queries are taken bq at a time, and for each query
block the keys/values bk at a time, with an online softmax (running max m and
sum l, float32). The backward pass recomputes each block's weights from the
saved log-sum-exp instead of storing them. Blocks that the causal, window,
length or segment masks rule out entirely are skipped (`_block_plan`), and
blocks they show entirely are computed without a mask.

These two functions are raw (no custom_vjp), so that a caller can combine
partial results over several key/value ranges (a ring across devices) and
define its own gradient. `_blockwise_attention.py` builds the public path
from them.

    forward(query, key, value, modifiers, layout, q_offset, kv_offset,
            block_sizes) -> (out, lse)
    backward(query, key, value, modifiers, layout, q_offset, kv_offset,
             block_sizes, out, lse, d_out) -> (d_query, d_key, d_value, d_bias)

  query, key, value: one range of T queries and S keys/values, in `layout`
    (a `Layout` with B): e.g. query [B, T, N, H], key [B, S, K, H],
    value [B, S, K, D] for "BTNH". K divides N; K/V are not copied per group.
  modifiers: `Modifiers` of this range pair:
    bias, mask: None or logical [B|1, N|1, T|1, S|1] over this range (local).
    structure: `MaskSpec`; its lengths [B] are global (compared with global
      positions), its segment ids local: q [B, T] and kv [B, S] of this range.
    mods: mask_mod and score_mod see global positions.
    dropout: None or `Dropout`; block (i, j) draws from
      fold_in(fold_in(rng, global first query), global first key), so a result
      is reproducible from the rng and the block sizes (not "xla"'s draw).
    scale: multiplies the logits.
  q_offset, kv_offset: global position of the
    first query / key of this range (ints or int32 scalars, may be traced).
  block_sizes: `BlockSizes`; clipped to T and S, remainders padded and masked.

  out: in the layout with D for H, value's dtype; this range's normalised
    output. Rows that see no key here are 0.
  lse: float32 [B, N, T], log sum_j exp(logit_ij) over the keys of this range;
    LARGE_NEGATIVE (finite) for rows that see no key here, so partial results
    combine as out = sum_r exp(lse_r - lse) out_r with lse = logsumexp_r lse_r.
  backward: out and lse are the combined (final) ones, d_out the cotangent of
    out; returns this range's contribution to every gradient: d_query (layout
    of query), d_key, d_value, d_bias (bias's shape, None without bias), all
    float32. Summed over ranges they give the full gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.masks import block_plan as _block_plan
from jattn._src.masks.block_mask import EMPTY, FULL, PARTIAL, classify
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.masks.closed_form_blocks import closed_form_classes
from jattn._src.core.dropout import Dropout
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import on_grid
from jattn._src.core.softmax import LARGE_NEGATIVE, logits_dtype
from jattn._src.core.heads import grouped_logical, split_heads

# Inside the loops a block is one matmul per (batch, kv head): the G query heads
# that share a kv head are stacked with the bq queries as R = G * bq rows. Every
# operand is laid out once, before the loops, in the order its matmul reads it
# ([I|J, ...] with block i or j first), so no block is transposed or gathered
# inside a loop: XLA:CPU's matmuls take row-major operands only, and a strided
# copy per (q block, kv block) pair cost up to a third of the time (profiled).
#   R  rows of a block: G query heads x bq queries
#   I, J  index of a query block, of a key/value block
_ROWS = "BKR"  # per-row statistics of a block: running max, sum, lse, delta
_LOGITS = "BKRS"  # forward: one block of logits, rows by keys
_LOGITS_T = "BKSR"  # backward: one block of logits transposed, keys by rows


def forward(query, key, value, modifiers: Modifiers, layout: Layout, q_offset, kv_offset,
            block_sizes: BlockSizes):
  """One query range against one key/value range; see the module docstring."""
  return _forward(query, key, value, modifiers, layout, q_offset, kv_offset, block_sizes)[:2]


def forward_with_max(query, key, value, modifiers: Modifiers, layout: Layout, q_offset,
                     kv_offset, block_sizes: BlockSizes, accumulator_out: bool = False):
  """`forward`, and also each row's largest visible logit, float32 [B, N, T]: the
  online softmax's running max m (LARGE_NEGATIVE for a row that sees no key here).

  accumulator_out: out in the accumulator's dtype (float32; float64 for float64
  inputs), not value's: the backward's row term rowsum(out * d_out) taken from a
  16-bit out is off by its rounding, which the gradients of score_mod's arrays
  (sums over every logit) amplify.
  """
  return _forward(query, key, value, modifiers, layout, q_offset, kv_offset, block_sizes,
                  accumulator_out)[:3]


def forward_with_count(query, key, value, modifiers: Modifiers, layout: Layout, q_offset,
                       kv_offset, block_sizes: BlockSizes):
  """`forward`, and also the number of (q block, kv block) pairs computed (int32)."""
  out, lse, _, count = _forward(query, key, value, modifiers, layout, q_offset, kv_offset,
                                block_sizes)
  return out, lse, count


def _forward(query, key, value, modifiers: Modifiers, layout: Layout, q_offset, kv_offset,
             block_sizes: BlockSizes, accumulator_out: bool = False):
  """-> (out, lse, max logits, count); under jit what is not used is not computed."""
  g = _Grid(query, key, value, modifiers, layout, q_offset, kv_offset, block_sizes)
  classes = g.classes  # [nq, nk] or None: once, before the loops (not per query block)
  D = value.shape[layout.axis("D")]
  q_rows, k_cols, v_rows = g.q_rows, g.k_cols, g.v_rows
  # With float arrays in score_mod, the residual out is P V with the float32 weights
  # (not rounded to value's dtype): the backward's row term dO . out must equal its
  # rowsum(P dP), or the gradients of those arrays (sums over every logit, whose
  # d logits cancel along each row) keep the rounding's bias.
  pv = g.acc if accumulator_out and g.float_consts else g.dtype
  v_rows = v_rows.astype(pv)

  def q_block(count, i):
    qb = _at(q_rows, i)  # [B, K, R, H]
    q_first = g.q_offset + i * g.bq
    q_last = jnp.minimum(q_first + g.bq, g.q_offset + g.T) - 1
    lo, hi, vis_lo, vis_hi = _block_plan.kv_blocks(
        g.spec, q_first, q_last, g.kv_offset, g.S, g.bk)

    def step(masked, with_mod=True):
      def body(j, carry):
        m, l, o, n = carry
        # s [B, K, R, bk]: the scaled logits (qb carries the scale) plus bias
        s = jnp.einsum(f"BKRH,BKHS->{_LOGITS}", qb, _at(k_cols, j),
                       preferred_element_type=g.acc)
        if g.logit_scale is not None:
          s = s * g.logit_scale
        if g.bias is not None:
          s = s + g.rows(g.bias_block(i, j)).astype(g.acc)
        if g.has_score:
          s = g.from_block(g.score_block(g.to_block(s), i, j))
        keep = g.rows(g.mask(i, j, with_mod)) if masked else None
        s = s if keep is None else jnp.where(keep, s, LARGE_NEGATIVE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        shift = m_new
        if keep is not None:
          # A masked logit is LARGE_NEGATIVE, so exp(s - m_new) is 0 there unless
          # the row has no visible key yet (m_new = LARGE_NEGATIVE). Shifting such
          # a row by 0 keeps its weights 0 (and l = 0) without a pass to zero them.
          shift = jnp.where(m_new > LARGE_NEGATIVE, m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        used = p if g.dropout is None else p * g.rows(g.dropout_multipliers(i, j))
        o = o * alpha[..., None] + jnp.einsum(
            f"{_LOGITS},BKSD->BKRD", used.astype(pv), _at(v_rows, j),
            preferred_element_type=g.acc)
        return m_new, l, o, n + 1
      return g.skip_unless_segments_meet(body, i)

    rows = (g.B, g.K, g.R)
    carry = (jnp.full(rows, LARGE_NEGATIVE, g.acc), jnp.zeros(rows, g.acc),
             jnp.zeros(rows + (D,), g.acc), count)
    if classes is None:
      carry = lax.fori_loop(lo, vis_lo, step(True), carry)
      carry = lax.fori_loop(vis_lo, vis_hi, step(g.needs_mask), carry)
      m, l, o, count = lax.fori_loop(vis_hi, hi, step(True), carry)
    else:  # the mask_mod's classes: full blocks first (no mask_mod), then partial
      order, n_full, n_unmodded, n_some = _by_class(
          classes[i], _plan_classes(g, g.nk, lo, hi, vis_lo, vis_hi))
      carry = lax.fori_loop(0, n_full, _gathered(step(g.needs_mask, False), order), carry)
      carry = lax.fori_loop(n_full, n_unmodded, _gathered(step(True, False), order), carry)
      m, l, o, count = lax.fori_loop(n_unmodded, n_some, _gathered(step(True), order), carry)
    seen = l > 0.0
    o = o / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), LARGE_NEGATIVE)
    return count, (o if accumulator_out else o.astype(g.dtype), lse, m)

  # int32 block indices, as the plan's bounds, also under jax_enable_x64
  count, (o, lse, m) = lax.scan(q_block, jnp.int32(0), jnp.arange(g.nq, dtype=jnp.int32))
  # o [I, B, K, R, D] -> out in the layout; lse and m [I, B, K, R] -> [B, N, T]
  out = g.ungroup(g.from_row_blocks(o, "BKRD", g.out_sub), g.out_sub)
  lse, m = (g.from_row_blocks(x, _ROWS, "BKGT").reshape(g.B, g.N, g.T) for x in (lse, m))
  return out, lse, m, count


def backward(query, key, value, modifiers: Modifiers, layout: Layout, q_offset, kv_offset,
             block_sizes: BlockSizes, out, lse, d_out):
  """Gradients of one range pair's share; see the module docstring."""
  return backward_with_score_grads(query, key, value, modifiers, layout, q_offset, kv_offset,
                                   block_sizes, out, lse, d_out)[:4]


def backward_with_score_grads(query, key, value, modifiers: Modifiers, layout: Layout,
                              q_offset, kv_offset, block_sizes: BlockSizes, out, lse, d_out):
  """`backward`, and the gradients of the arrays score_mod captured (a tuple:
  float32 for the floating ones, None for the others; () without score_mod).

  Each block is computed transposed, keys by rows (s^T = K Q^T), so that the
  products summed over rows (dV = P^T dO, dK = dS^T Q) and dQ^T = K^T dS^T
  all read row-major operands; dQ is accumulated transposed, [I, B, K, H, R].
  """
  g = _Grid(query, key, value, modifiers, layout, q_offset, kv_offset, block_sizes)
  classes = g.classes  # [nq, nk] or None: once, before the loops (not per kv block)
  H = query.shape[layout.axis("H")]
  out_sub = g.out_sub
  # delta[b, k, g, t] = sum_d d_out * out: the row term of the softmax gradient.
  d_out = split_heads(d_out, layout.axis("N"), g.K)
  delta = jnp.einsum(f"{out_sub},{out_sub}->BKGT", d_out.astype(g.acc),
                     split_heads(out, layout.axis("N"), g.K).astype(g.acc))
  do_rows = g.row_blocks(d_out, out_sub, "BKRD")
  do_cols = g.row_blocks(d_out, out_sub, "BKDR")
  delta = g.row_blocks(delta, "BKGT", _ROWS)
  # Padded rows get lse = +inf, so their weights exp(s - lse) are exactly 0.
  lse = g.row_blocks(lse.astype(g.acc).reshape(g.B, g.K, g.G, g.T), "BKGT", _ROWS,
                     pad_value=jnp.inf)
  q_rows, q_cols, k_rows, k_cols, v_rows = g.q_rows, g.q_cols, g.k_rows, g.k_cols, g.v_rows
  over_keys = lambda x: x[:, :, None, :]  # per-row [B, K, R] against [B, K, bk, R]

  def kv_block(carry, j):
    dq_t, d_bias, d_consts = carry
    kb, kb_t, vb = _at(k_rows, j), _at(k_cols, j), _at(v_rows, j)
    kv_first = g.kv_offset + j * g.bk
    kv_last = jnp.minimum(kv_first + g.bk, g.kv_offset + g.S) - 1
    lo, hi, vis_lo, vis_hi = _block_plan.q_blocks(
        g.spec, kv_first, kv_last, g.q_offset, g.T, g.bq)
    # A kv block holding padded keys is masked throughout (p must be 0 there).
    padded = (j + 1) * g.bk > g.S
    vis_lo, vis_hi = jnp.where(padded, hi, vis_lo), jnp.where(padded, hi, vis_hi)

    def step(masked, with_mod=True):
      def body(i, carry):
        dq_t, d_bias, d_consts, dk, dv = carry
        # q carries the scale. With a score_mod, XLA:CPU runs this batched dot in a
        # DotThunk, which takes no BF16 x BF16 = F32: the operands go in as float32
        # (the same values: a product of two 16-bit floats is exact in float32).
        up = (lambda x: x.astype(g.acc)) if g.has_score else (lambda x: x)
        s_t = jnp.einsum(f"BKSH,BKHR->{_LOGITS_T}", up(kb), up(_at(q_cols, i)),
                         preferred_element_type=g.acc)
        if g.logit_scale is not None:
          s_t = s_t * g.logit_scale
        if g.bias is not None:
          s_t = s_t + g.cols(g.bias_block(i, j)).astype(g.acc)
        if g.has_score:  # keys by rows -> the [B, K, G, bq, bk] block and back
          score = lambda x, c: g.score_block(x, i, j, c)
          s_mod, pullback = jax.vjp(score, g.to_block(jnp.swapaxes(s_t, 2, 3)), g.float_consts)
          s_t = jnp.swapaxes(g.from_block(s_mod), 2, 3)
        p_t = jnp.exp(s_t - over_keys(_at(lse, i)))  # the final weights, transposed
        if masked:
          p_t = jnp.where(g.cols(g.mask(i, j, with_mod)), p_t, 0.0)
        dp_t = jnp.einsum(f"BKSD,BKDR->{_LOGITS_T}", vb, _at(do_cols, i),
                          preferred_element_type=g.acc)
        used_t = p_t
        if g.dropout is not None:
          keep_t = g.cols(g.dropout_multipliers(i, j))
          used_t, dp_t = p_t * keep_t, dp_t * keep_t
        dv = dv + jnp.einsum(f"{_LOGITS_T},BKRD->BKSD", used_t.astype(g.dtype),
                             _at(do_rows, i), preferred_element_type=g.acc)
        ds_t = p_t * (dp_t - over_keys(_at(delta, i)))  # d logits, before the scale
        if g.has_score:  # through score_mod: d of its input logits, d of its arrays
          ds_block, d_c = pullback(g.to_block(jnp.swapaxes(ds_t, 2, 3)))
          ds_t = jnp.swapaxes(g.from_block(ds_block), 2, 3)
          d_consts = jax.tree.map(jnp.add, d_consts, d_c)
        if d_bias is not None:
          d_bias = g.add_bias_grad(d_bias, ds_t, i, j)
        ds_t = ds_t.astype(g.dtype)
        dk = dk + jnp.einsum(f"{_LOGITS_T},BKRH->BKSH", ds_t, _at(q_rows, i),
                             preferred_element_type=g.acc)
        dq_i = jnp.einsum(f"BKHS,{_LOGITS_T}->BKHR", kb_t, ds_t,
                          preferred_element_type=g.acc) * jnp.asarray(g.scale, g.acc)
        dq_t = lax.dynamic_update_index_in_dim(dq_t, _at(dq_t, i) + dq_i, i, 0)
        return dq_t, d_bias, d_consts, dk, dv
      return g.skip_unless_segments_meet(body, j, kv_outer=True)

    carry = (dq_t, d_bias, d_consts, jnp.zeros((g.B, g.K, g.bk, H), g.acc),
             jnp.zeros(vb.shape, g.acc))
    if classes is None:
      carry = lax.fori_loop(lo, vis_lo, step(True), carry)
      carry = lax.fori_loop(vis_lo, vis_hi, step(g.needs_mask), carry)
      dq_t, d_bias, d_consts, dk, dv = lax.fori_loop(vis_hi, hi, step(True), carry)
    else:
      order, n_full, n_unmodded, n_some = _by_class(
          classes[:, j], _plan_classes(g, g.nq, lo, hi, vis_lo, vis_hi))
      carry = lax.fori_loop(0, n_full, _gathered(step(g.needs_mask, False), order), carry)
      carry = lax.fori_loop(n_full, n_unmodded, _gathered(step(True, False), order), carry)
      dq_t, d_bias, d_consts, dk, dv = lax.fori_loop(
          n_unmodded, n_some, _gathered(step(True), order), carry)
    if g.logit_scale is not None:  # q did not carry the scale: d logits / d k = q scale
      dk = dk * g.logit_scale
    return (dq_t, d_bias, d_consts), (dk, dv)

  d_bias0 = None if g.bias is None else jnp.zeros(g.bias.shape, g.acc)
  dq_t0 = jnp.zeros((g.nq, g.B, g.K, H, g.R), g.acc)
  d_consts0 = jax.tree.map(jnp.zeros_like, g.float_consts)
  (dq_t, d_bias, d_consts), (dk, dv) = lax.scan(
      kv_block, (dq_t0, d_bias0, d_consts0), jnp.arange(g.nk, dtype=jnp.int32))
  d_query = g.ungroup(g.from_row_blocks(dq_t, "BKHR", g.q_sub), g.q_sub)
  d_key, d_value = (_unblock(x, f"JBKS{c}", sub, g.S) for x, sub, c in (
      (dk, g.k_sub, "H"), (dv, g.v_sub, "D")))
  if d_bias is not None:
    d_bias = d_bias[tuple(slice(0, n) for n in modifiers.bias.shape)]
  return d_query, d_key, d_value, d_bias, g.all_consts_grads(d_consts)


def _any_and_every(per_head):
  """int8 [B, N, nq, nk] -> [nq, nk]: EMPTY for every row and head, FULL for every
  one, else PARTIAL."""
  some, every = per_head.max(axis=(0, 1)), per_head.min(axis=(0, 1))
  return jnp.where(some == EMPTY, EMPTY, jnp.where(every == FULL, FULL, PARTIAL)).astype(
      jnp.int8)


def _plan_classes(g, count: int, lo, hi, vis_lo, vis_hi):
  """int8 [count]: the structural plan's ranges as block classes (visible = FULL)."""
  at = jnp.arange(count, dtype=jnp.int32)
  full = (at >= vis_lo) & (at < vis_hi) & (g.q_ids is None)
  return jnp.where(full, FULL, jnp.where((at >= lo) & (at < hi), PARTIAL, EMPTY)).astype(jnp.int8)


def _by_class(table, plan):
  """Block indices in the order the loops visit them, and where each group ends.

  table: the block mask's (or mask_mod's) classes; plan: the structural ones
  (padding, causal, ...). Groups, each ascending: FULL in both (no mask at all);
  FULL in the table only (the structural mask, but no mask_mod: a block the block
  mask calls full never calls mask_mod, whatever padding or block size the other
  pass has, so that forward and backward agree); PARTIAL in the table (every mask).
  Returns (order, end of the first group, of the second, of the third).
  """
  some = (table != EMPTY) & (plan != EMPTY)
  no_mod = some & (table == FULL)
  group = jnp.where(no_mod & (plan == FULL), 3, jnp.where(no_mod, 2, jnp.where(some, 1, 0)))
  # int32 throughout, as the loops' indices, also under jax_enable_x64
  order = jnp.argsort(-group, stable=True).astype(jnp.int32)
  n_full = jnp.sum(group == 3, dtype=jnp.int32)
  return (order, n_full, n_full + jnp.sum(group == 2, dtype=jnp.int32),
          jnp.sum(some, dtype=jnp.int32))


def _gathered(body, order):
  """A loop body over positions in `order` run on the block indices it lists."""
  return lambda at, carry: body(order[at], carry)


def _at(blocks, index):
  """Block `index` of [I|J, ...] blocks (a contiguous slab: no copy of a strided view)."""
  return lax.dynamic_index_in_dim(blocks, index, keepdims=False)


def _kv_blocks(x, sub: str, size: int, block_sub: str):
  """x (subscripts sub, S a multiple of size) -> [J, *block_sub], block j first."""
  at = sub.index("S")
  x = x.reshape(x.shape[:at] + (x.shape[at] // size, size) + x.shape[at + 1:])
  return jnp.einsum(f"{sub.replace('S', 'JS')}->J{block_sub}", x)


def _unblock(x, blocked: str, sub: str, size: int):
  """x with subscripts blocked ("J" blocks of "S") -> sub's order, S = J * bk cut to size."""
  y = jnp.einsum(f"{blocked}->{sub.replace('S', 'JS')}", x)
  y = y.reshape(_merge_blocks_at(y.shape, sub, "S"))
  return lax.slice_in_dim(y, 0, size, axis=sub.index("S"))


def _merge_blocks_at(shape, sub, letter):
  at = sub.index(letter)  # the block index sits just before the letter
  return shape[:at] + (shape[at] * shape[at + 1],) + shape[at + 2:]


def _pad_axis(x, axis: int, size: int, value=0):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


class _Grid:
  """The padded, pre-laid-out operands and block accessors shared by forward and backward."""

  def __init__(self, query, key, value, modifiers: Modifiers, layout, q_offset, kv_offset,
               block_sizes):
    bias, mask, spec = modifiers.bias, modifiers.mask, modifiers.structure
    dropout, scale = modifiers.dropout, modifiers.scale
    ax = layout.axis
    self.B, self.T, self.N = (query.shape[ax(c)] for c in "BTN")
    self.S, self.K = (key.shape[ax(c)] for c in "SK")
    self.G = self.N // self.K
    bs = block_sizes.clipped(self.T, self.S)
    self.bq, self.bk = bs.q, bs.kv
    self.R = self.G * self.bq
    self.nq, self.nk = -(-self.T // self.bq), -(-self.S // self.bk)
    self.Tp, self.Sp = self.nq * self.bq, self.nk * self.bk
    self.q_sub, self.k_sub, self.v_sub = layout.grouped(layout.query), layout.key, layout.value
    self.out_sub = layout.grouped(layout.out)
    self.dtype, self.acc = value.dtype, logits_dtype(query.dtype)
    self.dropout, self.scale = dropout, scale
    self.q_offset = jnp.asarray(q_offset, jnp.int32)
    self.kv_offset = jnp.asarray(kv_offset, jnp.int32)
    # The scale is folded into the queries once (for float32 exactly what
    # scaling each block of logits gives, to rounding), saving a pass per block.
    # A 16-bit q * scale is rounded (unless the scale is a power of two): a logit
    # error that the gradients of score_mod's float arrays (sums over every logit)
    # carry, so with those the logits are scaled in float32 instead (logit_scale).
    mods = modifiers.mods
    exact = (mods is not None and mods.has_score and jnp.finfo(query.dtype).bits < 32
             and any(jnp.issubdtype(jnp.result_type(c), jnp.inexact)
                     for c in mods.score_consts))
    self.logit_scale = jnp.asarray(scale, self.acc) if exact else None
    if not exact:
      query = (query.astype(self.acc) * jnp.asarray(scale, self.acc)).astype(query.dtype)
    self._query = split_heads(query, ax("N"), self.K)
    self._key = _pad_axis(key, ax("S"), self.Sp)
    self._value = _pad_axis(value, ax("S"), self.Sp)
    self.bias = None if bias is None else self._pad_logical(bias, 0)
    self.user_mask = None if mask is None else self._pad_logical(mask, False)
    ids = (None, None)
    if spec.q_segment_ids is not None:  # edge padding keeps the per-block id ranges
      ids = (jnp.pad(spec.q_segment_ids, ((0, 0), (0, self.Tp - self.T)), mode="edge"),
             jnp.pad(spec.kv_segment_ids, ((0, 0), (0, self.Sp - self.S)), mode="edge"))
      self.q_ranges = _block_plan.segment_ranges(ids[0], self.bq)
      self.kv_ranges = _block_plan.segment_ranges(ids[1], self.bk)
    self.q_ids, self.kv_ids = ids
    self.spec = spec
    # Even fully visible blocks need a mask for the user's mask or segment ids
    # (the plan leaves no visible blocks with segment ids).
    self.needs_mask = mask is not None
    self.mods = modifiers.mods
    self.has_score = self.mods is not None and self.mods.has_score
    self.has_mask_mod = self.mods is not None and self.mods.has_mask
    # The score_mod's captured arrays that can take a gradient, in place (None elsewhere).
    consts = self.mods.score_consts if self.has_score else ()
    self._inexact = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in consts]
    self.float_consts = tuple(c for c, f in zip(consts, self._inexact) if f)
    self._consts = consts

  @functools.cached_property
  def classes(self):
    """int8 [nq, nk]: per block pair, EMPTY / PARTIAL / FULL for every batch row and
    head together, from the block mask or the mask_mod; None when there is neither."""
    mods = self.mods
    if mods is None or (mods.block_mask is None and not mods.has_mask):
      return None
    if mods.block_mask is not None and self.T == mods.block_mask.T:
      return _any_and_every(mods.block_mask.classes)  # made for this call (offsets 0)
    # a ready-made mask's classes in closed form, else mask_mod on every block
    per_head = None if mods.mask_mod is None else closed_form_classes(
        mods.mask_mod, self.B, self.T, self.S, self.bq, self.bk, self.q_offset,
        self.kv_offset)
    if per_head is None:
      per_head = classify(mods, self.B, self.N, self.T, self.S, self.bq, self.bk,
                          self.q_offset, self.kv_offset)
    return _any_and_every(per_head)

  def all_consts_grads(self, d_float):
    """The gradients of every captured array: d_float in place of the inexact ones."""
    d_float = iter(d_float)
    return tuple(next(d_float) if f else None for f in self._inexact)

  def _block_index(self, i, j):
    """Global positions of block (i, j) for the mods (padding clipped to the last real one)."""
    t = self.q_offset + jnp.minimum(i * self.bq + jnp.arange(self.bq, dtype=jnp.int32), self.T - 1)
    s = self.kv_offset + jnp.minimum(j * self.bk + jnp.arange(self.bk, dtype=jnp.int32), self.S - 1)
    return {"B": jnp.arange(self.B, dtype=jnp.int32), "K": jnp.arange(self.K, dtype=jnp.int32),
            "G": jnp.arange(self.G, dtype=jnp.int32), "T": t.astype(jnp.int32),
            "S": s.astype(jnp.int32)}

  def score_block(self, x, i, j, float_consts=None):
    """score_mod on block (i, j): x [B, K, G, bq, bk] float32; float_consts replace
    the captured inexact arrays (for their gradient)."""
    consts = self._consts
    if float_consts is not None:
      it = iter(float_consts)
      consts = tuple(next(it) if f else c for c, f in zip(consts, self._inexact))
    G = self.G
    entry = lambda v, at: self.mods.score(v, at["B"], at["K"] * G + at["G"], at["T"], at["S"],
                                          consts)
    return on_grid(entry, "BKGTS", self._block_index(i, j), x)

  def mask_mod_block(self, i, j):
    """bool [B|1, K|1, G|1, bq, bk]: mask_mod on block (i, j), once for all batch
    rows (heads) when it does not read b (n)."""
    G = self.G
    entry = lambda at: self.mods.mask(at["B"], at["K"] * G + at["G"], at["T"], at["S"])
    index = self._block_index(i, j)
    if not self.mods.mask_uses(0):
      index["B"] = index["B"][:1]
    if not self.mods.mask_uses(1):
      index["K"], index["G"] = index["K"][:1], index["G"][:1]
    return on_grid(entry, "BKGTS", index)

  def to_block(self, x):
    """[B, K, R, bk] -> [B, K, G, bq, bk]."""
    return x.reshape(x.shape[:2] + (self.G, self.bq) + x.shape[3:])

  def from_block(self, x):
    """[B, K, G, bq, bk] -> [B, K, R, bk]."""
    return x.reshape(x.shape[:2] + (self.R,) + x.shape[4:])

  # The operands in block order, built on first use (forward and backward
  # read different ones). Rows: [I, B, K, R, H]; columns: the transpose.
  @functools.cached_property
  def q_rows(self):
    return self.row_blocks(self._query, self.q_sub, "BKRH")

  @functools.cached_property
  def q_cols(self):
    return self.row_blocks(self._query, self.q_sub, "BKHR")

  @functools.cached_property
  def k_rows(self):  # [J, B, K, bk, H]
    return _kv_blocks(self._key, self.k_sub, self.bk, "BKSH")

  @functools.cached_property
  def k_cols(self):  # [J, B, K, H, bk]
    return _kv_blocks(self._key, self.k_sub, self.bk, "BKHS")

  @functools.cached_property
  def v_rows(self):  # [J, B, K, bk, D]
    return _kv_blocks(self._value, self.v_sub, self.bk, "BKSD")

  def row_blocks(self, x, sub: str, block_sub: str, pad_value=0):
    """x (subscripts sub, with K, G and T) -> [I, *block_sub], R = (G, bq) merged.

    T is padded to Tp with pad_value. block_sub names R where G, T go.
    """
    at = sub.index("T")
    x = _pad_axis(x, at, self.Tp, pad_value)
    x = x.reshape(x.shape[:at] + (self.nq, self.bq) + x.shape[at + 1:])
    y = jnp.einsum(f"{sub.replace('T', 'IT')}->I{block_sub.replace('R', 'GT')}", x)
    r = block_sub.index("R") + 1
    return y.reshape(y.shape[:r] + (self.R,) + y.shape[r + 2:])

  def from_row_blocks(self, x, block_sub: str, sub: str):
    """The inverse of `row_blocks`, cut back to T (K and G stay split in sub)."""
    r = block_sub.index("R") + 1
    x = x.reshape(x.shape[:r] + (self.G, self.bq) + x.shape[r + 1:])
    y = jnp.einsum(f"I{block_sub.replace('R', 'GT')}->{sub.replace('T', 'IT')}", x)
    y = y.reshape(_merge_blocks_at(y.shape, sub, "T"))
    return lax.slice_in_dim(y, 0, self.T, axis=sub.index("T"))

  def rows(self, x):
    """[B|1, K|1, G|1, bq|1, bk|1] -> [B|1, K|1, R|1, bk|1], to meet a rows block."""
    if x.shape[2] == 1 and x.shape[3] == 1:
      return x[:, :, 0]
    x = jnp.broadcast_to(x, x.shape[:2] + (self.G, self.bq) + x.shape[4:])
    return x.reshape(x.shape[:2] + (self.R,) + x.shape[4:])

  def cols(self, x):
    """[B|1, K|1, G|1, bq|1, bk|1] -> [B|1, K|1, bk|1, R|1], to meet a transposed block."""
    return jnp.swapaxes(self.rows(x), 2, 3)

  def _pad_logical(self, x, value):
    """[B|1, N|1, T|1, S|1] padded to Tp and Sp where it is not broadcast."""
    if x.shape[2] != 1:
      x = _pad_axis(x, 2, self.Tp, value)
    if x.shape[3] != 1:
      x = _pad_axis(x, 3, self.Sp, value)
    return x

  def _logical_block(self, x, i, j):
    """[B|1, N|1, T|1, S|1] -> block (i, j), grouped [B|1, K|1, G|1, bq|1, bk|1]."""
    if x.shape[2] != 1:
      x = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=2)
    if x.shape[3] != 1:
      x = lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=3)
    return grouped_logical(x, self.K)

  def bias_block(self, i, j):
    """The bias of block (i, j), grouped [B|1, K|1, G|1, bq|1, bk|1]."""
    return self._logical_block(self.bias, i, j)

  def mask(self, i, j, with_mod=True):
    """bool [B|1, K|1, G|1, bq, bk] of block (i, j): user mask, structure, padding,
    and mask_mod unless with_mod is False (a block it leaves full)."""
    q_pos = self.q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
    kv_local = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
    ids = (None, None)
    if self.q_ids is not None:
      ids = (lax.dynamic_slice_in_dim(self.q_ids, i * self.bq, self.bq, axis=1),
             lax.dynamic_slice_in_dim(self.kv_ids, j * self.bk, self.bk, axis=1))
    structure = self.spec.block(q_pos, self.kv_offset + kv_local, *ids)  # [B|1, 1, bq, bk]
    keep = (kv_local < self.S)[None, None, None, :]  # [1, 1, 1, bk]: padded keys
    if structure is not None:
      keep = keep & structure
    keep = grouped_logical(keep, self.K)  # [B|1, 1, 1, bq|1, bk]
    if self.user_mask is not None:
      keep = keep & self._logical_block(self.user_mask, i, j)
    if with_mod and self.has_mask_mod:
      keep = keep & self.mask_mod_block(i, j)
    return keep

  def skip_unless_segments_meet(self, body, outer, kv_outer=False):
    """body(inner, carry) run only for blocks whose segment id ranges meet."""
    if self.q_ids is None:
      return body

    def guarded(inner, carry):
      i, j = (inner, outer) if kv_outer else (outer, inner)
      meet = _block_plan.segments_meet(self.q_ranges, self.kv_ranges, i, j)
      return lax.cond(meet, lambda c: body(inner, c), lambda c: c, carry)
    return guarded

  def dropout_multipliers(self, i, j):
    """float32 [B, K, G, bq, bk]: this block's dropout draw, from global positions."""
    rng = jax.random.fold_in(self.dropout.rng, self.q_offset + i * self.bq)
    rng = jax.random.fold_in(rng, self.kv_offset + j * self.bk)
    keep = Dropout(self.dropout.rate, rng, self.dropout.broadcast).multipliers(
        (self.B, self.N, self.bq, self.bk))
    return split_heads(keep, 1, self.K)

  def add_bias_grad(self, d_bias, ds_t, i, j):
    """Adds ds_t [B, K, bk, R] (transposed) into d_bias (bias's padded shape) at block (i, j)."""
    ds = jnp.swapaxes(ds_t, 2, 3).reshape(self.B, self.N, self.bq, self.bk)
    start = [jnp.int32(0)] * 4  # int32, as the block offsets, also under jax_enable_x64
    for axis in range(4):
      if d_bias.shape[axis] == 1:
        ds = ds.sum(axis=axis, keepdims=True)
    if d_bias.shape[2] != 1:
      start[2] = i * self.bq
    if d_bias.shape[3] != 1:
      start[3] = j * self.bk
    return lax.dynamic_update_slice(
        d_bias, lax.dynamic_slice(d_bias, start, ds.shape) + ds, start)

  def ungroup(self, x, sub):
    """Merges the K and G axes of x (subscripts sub) back into N."""
    at = sub.index("K")
    return x.reshape(x.shape[:at] + (self.K * self.G,) + x.shape[at + 2:])
