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

    forward(query, key, value, bias, mask, spec, dropout, scale, layout,
            q_offset, kv_offset, block_sizes) -> (out, lse)
    backward(query, key, value, bias, mask, spec, dropout, scale, layout,
             q_offset, kv_offset, block_sizes, out, lse, d_out)
        -> (d_query, d_key, d_value, d_bias)

  query, key, value: one range of T queries and S keys/values, in `layout`
    (a `Layout` with B): e.g. query [B, T, N, H], key [B, S, K, H],
    value [B, S, K, D] for "BTNH". K divides N; K/V are not copied per group.
  bias, mask: None or logical [B|1, N|1, T|1, S|1] over this range (local).
  spec: `MaskSpec`; its lengths [B] are global (compared with global
    positions), its segment ids local: q [B, T] and kv [B, S] of this range.
  dropout: None or `Dropout`; block (i, j) draws from
    fold_in(fold_in(rng, global first query), global first key), so a result
    is reproducible from the rng and the block sizes (not equal to "xla"'s draw).
  scale: multiplies the logits. q_offset, kv_offset: global position of the
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

import jax
import jax.numpy as jnp
from jax import lax

from jattn import _block_plan
from jattn._block_sizes import BlockSizes
from jattn._dense import Dropout
from jattn._layout import Layout
from jattn._masks import MaskSpec
from jattn._softmax import LARGE_NEGATIVE, logits_dtype
from jattn._xla import grouped_logical, split_heads

_LOGITS = "BKGTS"  # one block of logits
_ROWS = "BKGT"  # per-query statistics (running max, sum, lse)
_Q_BLOCK = "BKGTH"  # one block of queries


def forward(query, key, value, bias, mask, spec: MaskSpec, dropout: Dropout | None,
            scale, layout: Layout, q_offset, kv_offset, block_sizes: BlockSizes):
  """One query range against one key/value range; see the module docstring."""
  out, lse, _ = forward_with_count(query, key, value, bias, mask, spec, dropout, scale,
                                   layout, q_offset, kv_offset, block_sizes)
  return out, lse


def forward_with_count(query, key, value, bias, mask, spec, dropout, scale, layout,
                       q_offset, kv_offset, block_sizes):
  """`forward`, and also the number of (q block, kv block) pairs computed (int32)."""
  g = _Grid(query, key, value, bias, mask, spec, dropout, scale, layout,
            q_offset, kv_offset, block_sizes)
  D = value.shape[layout.axis("D")]

  def q_block(count, i):
    qb = g.q_block(i)
    q_first = g.q_offset + i * g.bq
    q_last = jnp.minimum(q_first + g.bq, g.q_offset + g.T) - 1
    lo, hi, vis_lo, vis_hi = _block_plan.kv_blocks(
        g.spec, q_first, q_last, g.kv_offset, g.S, g.bk)

    def step(masked):
      def body(j, carry):
        m, l, o, n = carry
        kb, vb = g.kv_block(j)
        s = g.logits(qb, kb, i, j)
        keep = g.mask(i, j) if masked else None
        s = s if keep is None else jnp.where(keep, s, LARGE_NEGATIVE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if keep is not None:  # a row with no key left keeps l = 0
          p = jnp.where(keep, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        used = p if g.dropout is None else p * g.dropout_multipliers(i, j)
        # o [B, K, G, bq, D]
        o = o * alpha[..., None] + jnp.einsum(
            f"{_LOGITS},{g.v_sub}->BKGTD", used.astype(g.dtype), vb,
            preferred_element_type=g.acc)
        return m_new, l, o, n + 1
      return g.skip_unless_segments_meet(body, i)

    rows = (g.B, g.K, g.G, g.bq)
    carry = (jnp.full(rows, LARGE_NEGATIVE, g.acc), jnp.zeros(rows, g.acc),
             jnp.zeros(rows + (D,), g.acc), count)
    carry = lax.fori_loop(lo, vis_lo, step(True), carry)
    carry = lax.fori_loop(vis_lo, vis_hi, step(g.needs_mask), carry)
    m, l, o, count = lax.fori_loop(vis_hi, hi, step(True), carry)
    seen = l > 0.0
    o = o / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), LARGE_NEGATIVE)
    return count, (o.astype(g.dtype), lse)

  count, (o, lse) = lax.scan(q_block, jnp.int32(0), jnp.arange(g.nq))
  # o [nq, B, K, G, bq, D] -> out in the layout; lse [nq, B, K, G, bq] -> [B, N, T]
  out = jnp.einsum(f"IBKGTD->{g.out_sub.replace('T', 'IT')}", o)
  out = g.ungroup(out.reshape(_merge_blocks(out.shape, g.out_sub)), g.out_sub)
  out = lax.slice_in_dim(out, 0, g.T, axis=layout.axis("T"))
  lse = jnp.einsum("IBKGT->BKGIT", lse).reshape(g.B, g.N, g.nq * g.bq)[..., :g.T]
  return out, lse, count


def backward(query, key, value, bias, mask, spec: MaskSpec, dropout: Dropout | None,
             scale, layout: Layout, q_offset, kv_offset, block_sizes: BlockSizes,
             out, lse, d_out):
  """Gradients of one range pair's share; see the module docstring."""
  g = _Grid(query, key, value, bias, mask, spec, dropout, scale, layout,
            q_offset, kv_offset, block_sizes)
  H, D = query.shape[layout.axis("H")], value.shape[layout.axis("D")]
  out_sub = layout.grouped(layout.out)
  t_out = out_sub.index("T")
  # delta[b, k, g, t] = sum_d d_out * out: the row term of the softmax gradient.
  d_out = split_heads(d_out, layout.axis("N"), g.K)
  delta = jnp.einsum(f"{out_sub},{out_sub}->{_ROWS}", d_out.astype(g.acc),
                     split_heads(out, layout.axis("N"), g.K).astype(g.acc))
  d_out = _pad_axis(d_out, t_out, g.Tp)
  delta = _pad_axis(delta, 3, g.Tp)
  # Padded rows get lse = +inf, so their weights exp(s - lse) are exactly 0.
  lse = _pad_axis(lse.astype(g.acc).reshape(g.B, g.K, g.G, g.T), 3, g.Tp, jnp.inf)

  def kv_block(carry, j):
    dq, d_bias = carry
    kb, vb = g.kv_block(j)
    kv_first = g.kv_offset + j * g.bk
    kv_last = jnp.minimum(kv_first + g.bk, g.kv_offset + g.S) - 1
    lo, hi, vis_lo, vis_hi = _block_plan.q_blocks(
        g.spec, kv_first, kv_last, g.q_offset, g.T, g.bq)
    # A kv block holding padded keys is masked throughout (p must be 0 there).
    padded = (j + 1) * g.bk > g.S
    vis_lo, vis_hi = jnp.where(padded, hi, vis_lo), jnp.where(padded, hi, vis_hi)

    def step(masked):
      def body(i, carry):
        dq, d_bias, dk, dv = carry
        qb = g.q_block(i)
        dob = lax.dynamic_slice_in_dim(d_out, i * g.bq, g.bq, axis=t_out)
        rows = lambda x: lax.dynamic_slice_in_dim(x, i * g.bq, g.bq, axis=3)
        s = g.logits(qb, kb, i, j)
        p = jnp.exp(s - rows(lse)[..., None])  # the final weights of this block
        if masked:
          p = jnp.where(g.mask(i, j), p, 0.0)
        # dp [B, K, G, bq, bk] = d_out . value
        dp = jnp.einsum(f"{out_sub},{g.v_sub}->{_LOGITS}", dob, vb,
                        preferred_element_type=g.acc)
        used = p
        if g.dropout is not None:
          keep = g.dropout_multipliers(i, j)
          used, dp = p * keep, dp * keep
        # dv [B, K, bk, D]
        dv = dv + jnp.einsum(f"{_LOGITS},{out_sub}->BKSD", used.astype(g.dtype), dob,
                             preferred_element_type=g.acc)
        ds = p * (dp - rows(delta)[..., None])  # d logits, before the scale
        if d_bias is not None:
          d_bias = g.add_bias_grad(d_bias, ds, i, j)
        ds = ds.astype(g.dtype)
        # dq [B, K, G, bq, H], dk [B, K, bk, H] (qb carries the scale already)
        dq_i = jnp.einsum(f"{_LOGITS},{g.k_sub}->BKGTH", ds, kb,
                          preferred_element_type=g.acc) * jnp.asarray(scale, g.acc)
        dq = lax.dynamic_update_slice_in_dim(
            dq, lax.dynamic_slice_in_dim(dq, i * g.bq, g.bq, axis=3) + dq_i, i * g.bq, axis=3)
        dk = dk + jnp.einsum(f"{_LOGITS},{_Q_BLOCK}->BKSH", ds, qb,
                             preferred_element_type=g.acc)
        return dq, d_bias, dk, dv
      return g.skip_unless_segments_meet(body, j, kv_outer=True)

    carry = (dq, d_bias, jnp.zeros((g.B, g.K, g.bk, H), g.acc),
             jnp.zeros((g.B, g.K, g.bk, D), g.acc))
    carry = lax.fori_loop(lo, vis_lo, step(True), carry)
    carry = lax.fori_loop(vis_lo, vis_hi, step(g.needs_mask), carry)
    dq, d_bias, dk, dv = lax.fori_loop(vis_hi, hi, step(True), carry)
    return (dq, d_bias), (dk, dv)

  d_bias0 = None if g.bias is None else jnp.zeros(g.bias.shape, g.acc)
  dq0 = jnp.zeros((g.B, g.K, g.G, g.Tp, H), g.acc)
  (dq, d_bias), (dk, dv) = lax.scan(kv_block, (dq0, d_bias0), jnp.arange(g.nk))
  # dq [B, K, G, Tp, H] -> query's layout; dk, dv [nk, B, K, bk, H|D] -> key/value's
  d_query = jnp.einsum(f"BKGTH->{g.q_sub}", dq)
  d_query = lax.slice_in_dim(g.ungroup(d_query, g.q_sub), 0, g.T, axis=layout.axis("T"))
  d_key, d_value = (_unblock(x, f"JBKS{c}", sub, g.S) for x, sub, c in (
      (dk, g.k_sub, "H"), (dv, g.v_sub, "D")))
  if d_bias is not None:
    d_bias = d_bias[tuple(slice(0, n) for n in bias.shape)]
  return d_query, d_key, d_value, d_bias


def _unblock(x, blocked: str, sub: str, size: int):
  """x with subscripts blocked ("J" blocks of "S") -> sub's order, S = J * bk cut to size."""
  y = jnp.einsum(f"{blocked}->{sub.replace('S', 'JS')}", x)
  y = y.reshape(_merge_blocks_at(y.shape, sub, "S"))
  return lax.slice_in_dim(y, 0, size, axis=sub.index("S"))


def _merge_blocks(shape, sub):
  """Shape of [.., I, T, ..] (I blocks of T at sub's T) with I and T merged."""
  return _merge_blocks_at(shape, sub, "T")


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
  """The padded arrays and block accessors shared by forward and backward."""

  def __init__(self, query, key, value, bias, mask, spec, dropout, scale, layout,
               q_offset, kv_offset, block_sizes):
    ax = layout.axis
    self.B, self.T, self.N = (query.shape[ax(c)] for c in "BTN")
    self.S, self.K = (key.shape[ax(c)] for c in "SK")
    self.G = self.N // self.K
    bs = block_sizes.clipped(self.T, self.S)
    self.bq, self.bk = bs.q, bs.kv
    self.nq, self.nk = -(-self.T // self.bq), -(-self.S // self.bk)
    self.Tp, self.Sp = self.nq * self.bq, self.nk * self.bk
    self.q_sub, self.k_sub, self.v_sub = layout.grouped(layout.query), layout.key, layout.value
    self.out_sub = layout.grouped(layout.out)
    self.dtype, self.acc = value.dtype, logits_dtype(query.dtype)
    self.dropout = dropout
    self.q_offset = jnp.asarray(q_offset, jnp.int32)
    self.kv_offset = jnp.asarray(kv_offset, jnp.int32)
    # The scale is folded into the queries once (for float32 exactly what
    # scaling each block of logits gives, to rounding), saving a pass per block.
    query = (query.astype(self.acc) * jnp.asarray(scale, self.acc)).astype(query.dtype)
    self.q = split_heads(_pad_axis(query, ax("T"), self.Tp), ax("N"), self.K)
    self.k = _pad_axis(key, ax("S"), self.Sp)
    self.v = _pad_axis(value, ax("S"), self.Sp)
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

  def q_block(self, i):
    """Query block i as [B, K, G, bq, H]: reordered once per block, so each head's
    [bq, H] rows are contiguous for the block's matmuls (a measured 1.2-1.4x)."""
    qb = lax.dynamic_slice_in_dim(self.q, i * self.bq, self.bq, axis=self.q_sub.index("T"))
    return jnp.einsum(f"{self.q_sub}->{_Q_BLOCK}", qb)

  def kv_block(self, j):
    axis = self.k_sub.index("S")
    return (lax.dynamic_slice_in_dim(self.k, j * self.bk, self.bk, axis=axis),
            lax.dynamic_slice_in_dim(self.v, j * self.bk, self.bk, axis=axis))

  def logits(self, qb, kb, i, j):
    """float32 [B, K, G, bq, bk]: scaled logits plus bias of block (i, j)."""
    s = jnp.einsum(f"{_Q_BLOCK},{self.k_sub}->{_LOGITS}", qb, kb,
                   preferred_element_type=self.acc)  # qb carries the scale
    if self.bias is not None:
      s = s + self._logical_block(self.bias, i, j).astype(self.acc)
    return s

  def mask(self, i, j):
    """bool [B|1, K|1, G|1, bq, bk] of block (i, j): user mask, structure, padding."""
    q_pos = self.q_offset + i * self.bq + jnp.arange(self.bq)
    kv_local = j * self.bk + jnp.arange(self.bk)
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
    keep = Dropout(self.dropout.rate, rng).multipliers((self.B, self.N, self.bq, self.bk))
    return split_heads(keep, 1, self.K)

  def add_bias_grad(self, d_bias, ds, i, j):
    """Adds ds [B, K, G, bq, bk] into d_bias (bias's padded shape) at block (i, j)."""
    ds = ds.reshape(self.B, self.N, self.bq, self.bk)
    start = [0, 0, 0, 0]
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
