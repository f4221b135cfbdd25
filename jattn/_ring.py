"""Ring attention: the sequence sharded over a mesh axis, K/V passed around the ring.

Each of the P devices on the ring axis keeps its block of queries. At every
step it attends to the key/value block in hand, folds the result into a running
(out, lse) with the online softmax, and hands the block to the next device with
`jax.lax.ppermute`. After P steps every query has met every key, and no device
ever held more than one block of K/V.

The backward pass (a custom VJP) is a second trip around the ring: each K/V
block travels with its own gradient accumulators dK, dV; every device adds its
queries' contribution, recomputing the block's weights from the saved lse, and
after P hops the accumulators are home.

Causal load balance (zig-zag): with a causal mask, contiguous blocks would
leave device 0 idle (its queries see one block) while device P-1 works on P.
The sequence is therefore cut into 2P chunks and device i holds chunks i and
2P-1-i, one early and one late, so every device does the same amount of work.
Tokens are reordered before the ring and the output is put back in order after.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn._layout import Layout
from jattn._masks import MaskSpec
from jattn._softmax import LARGE_NEGATIVE

_LOGITS = "BKGTS"
_ROWS = "BKGT"  # one value per query row: lse, delta


def zigzag_order(length: int, num_devices: int) -> jax.Array:
  """int [length]: token order that gives device i chunks i and 2P-1-i."""
  chunks = jnp.arange(length).reshape(2 * num_devices, length // (2 * num_devices))
  first, second = chunks[:num_devices], chunks[num_devices:][::-1]
  # [P, 2, length / 2P] -> [length]
  return jnp.stack([first, second], axis=1).reshape(length)


class _Subscripts:
  """Einsum subscripts of one device's blocks, from the layout letters."""

  def __init__(self, layout: Layout):
    self.layout = layout
    self.q = layout.grouped(layout.query)  # e.g. BTKGH
    self.k = layout.key  # BSKH
    self.v = layout.value  # BSKD
    self.out = layout.grouped(layout.out)  # BTKGD
    self.out_rows = self.out.replace("D", "")  # BTKG: out without its depth


def _rows_like_out(rows: jax.Array, sub: _Subscripts) -> jax.Array:
  """[B, K, G, T] -> broadcastable against out (the out layout with D of size 1)."""
  arranged = jnp.einsum(f"{_ROWS}->{sub.out_rows}", rows)
  return jnp.expand_dims(arranged, sub.out.index("D"))


def _block_logits(q, k, mask, scale, sub: _Subscripts):
  # logits [B, K, G, t, s], float32
  logits = jnp.einsum(f"{sub.q},{sub.k}->{_LOGITS}", q, k,
                      preferred_element_type=jnp.float32) * scale
  if mask is not None:
    logits = jnp.where(mask[:, :, None], logits, LARGE_NEGATIVE)
  return logits


def _block_forward(q, k, v, mask, scale, sub: _Subscripts):
  """One query block against one K/V block -> (out normalised in the block, lse).

  out in the out layout, float32; lse [B, K, G, t]. A row with no visible key
  in this block gets out 0 and lse about LARGE_NEGATIVE, so it weighs nothing
  when blocks are combined.
  """
  logits = _block_logits(q, k, mask, scale, sub)
  lse = jax.nn.logsumexp(logits, axis=-1)
  weights = jnp.exp(logits - lse[..., None])
  if mask is not None:
    weights = jnp.where(mask[:, :, None], weights, 0.0)
  out = jnp.einsum(f"{_LOGITS},{sub.v}->{sub.out}", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out, lse


def _block_backward(q, k, v, mask, scale, sub: _Subscripts, lse, delta, d_out):
  """Gradients of one block pair, given the final lse and delta = rowsum(dO * O)."""
  logits = _block_logits(q, k, mask, scale, sub)
  weights = jnp.exp(logits - lse[..., None])  # the final softmax weights of this block
  if mask is not None:
    weights = jnp.where(mask[:, :, None], weights, 0.0)
  d_out = d_out.astype(jnp.float32)
  d_v = jnp.einsum(f"{_LOGITS},{sub.out}->{sub.v}", weights, d_out)
  d_weights = jnp.einsum(f"{sub.out},{sub.v}->{_LOGITS}", d_out, v.astype(jnp.float32))
  d_logits = weights * (d_weights - delta[..., None]) * scale
  d_q = jnp.einsum(f"{_LOGITS},{sub.k}->{sub.q}", d_logits, k.astype(jnp.float32))
  d_k = jnp.einsum(f"{_LOGITS},{sub.q}->{sub.k}", d_logits, q.astype(jnp.float32))
  return d_q, d_k, d_v


def _combine(out_a, lse_a, out_b, lse_b, sub: _Subscripts):
  """Merges two partial softmax results over disjoint key sets by their lse."""
  lse = jnp.logaddexp(lse_a, lse_b)
  out = (out_a * _rows_like_out(jnp.exp(lse_a - lse), sub)
         + out_b * _rows_like_out(jnp.exp(lse_b - lse), sub))
  return out, lse


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static description of one ring: mesh axis, its size, and the math."""

  axis_name: str  # the mesh axis the sequence is sharded over
  num_devices: int  # P, the size of that axis
  varying_axes: tuple[str, ...]  # every mesh axis the local blocks differ over
  scale: float
  is_causal: bool
  layout: Layout

  def pass_on(self, x):
    """Hands x (a pytree) to the next device on the ring: device i -> i + 1."""
    perm = [(i, (i + 1) % self.num_devices) for i in range(self.num_devices)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), x)

  def fresh(self, shape, fill=0.0) -> jax.Array:
    """A float32 accumulator marked as varying over the mesh axes, so that
    shard_map's type check accepts it as a loop carry."""
    return jax.lax.pcast(jnp.full(shape, fill, jnp.float32), self.varying_axes,
                         to="varying")

  def mask(self, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len):
    """bool [B|1, 1, t, s] of one block pair from global token positions, or None."""
    spec = MaskSpec(is_causal=self.is_causal, q_lengths=q_len, kv_lengths=kv_len,
                    q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return spec.block(q_pos, kv_pos, q_ids, kv_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_core(ring: Ring, q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len):
  """One device's share of ring attention; call inside shard_map.

  q: the local queries in `ring.layout` with N split into K, G; k, v: the local
  key/value blocks; q_pos [t] / kv_pos [s]: global positions of the local
  tokens; q_ids [B, t] / kv_ids [B, s]: segment ids or None; q_len / kv_len
  [B] or None. Returns the local output in the out layout (N still split).
  """
  out, _ = _ring_forward(ring, q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len)
  return out


def _ring_forward(ring: Ring, q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len):
  sub = _Subscripts(ring.layout)
  size = dict(zip(sub.q, q.shape)) | dict(zip(sub.v, v.shape))
  out = ring.fresh(tuple(size[c] for c in sub.out))
  lse = ring.fresh(tuple(size[c] for c in _ROWS), LARGE_NEGATIVE)

  def step(_, carry):
    out, lse, travelling = carry
    k_blk, v_blk, kv_pos_blk, kv_ids_blk = travelling
    mask = ring.mask(q_pos, kv_pos_blk, q_ids, kv_ids_blk, q_len, kv_len)
    out_blk, lse_blk = _block_forward(q, k_blk, v_blk, mask, ring.scale, sub)
    out, lse = _combine(out, lse, out_blk, lse_blk, sub)
    return out, lse, ring.pass_on(travelling)

  out, lse, _ = jax.lax.fori_loop(0, ring.num_devices, step,
                                  (out, lse, (k, v, kv_pos, kv_ids)))
  return out.astype(v.dtype), lse


def _ring_fwd(ring: Ring, q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len):
  out, lse = _ring_forward(ring, q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len)
  return out, (q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len, out, lse)


def _ring_bwd(ring: Ring, residuals, d_out):
  q, k, v, q_pos, kv_pos, q_ids, kv_ids, q_len, kv_len, out, lse = residuals
  sub = _Subscripts(ring.layout)
  # delta [B, K, G, t] = rowsum(dO * O): the softmax normaliser's share
  delta = jnp.einsum(f"{sub.out},{sub.out}->{_ROWS}", d_out.astype(jnp.float32),
                     out.astype(jnp.float32))

  def step(_, carry):
    d_q, travelling = carry
    k_blk, v_blk, kv_pos_blk, kv_ids_blk, d_k_blk, d_v_blk = travelling
    mask = ring.mask(q_pos, kv_pos_blk, q_ids, kv_ids_blk, q_len, kv_len)
    dq_i, dk_i, dv_i = _block_backward(q, k_blk, v_blk, mask, ring.scale, sub,
                                       lse, delta, d_out)
    travelling = (k_blk, v_blk, kv_pos_blk, kv_ids_blk, d_k_blk + dk_i, d_v_blk + dv_i)
    return d_q + dq_i, ring.pass_on(travelling)

  start = (k, v, kv_pos, kv_ids, ring.fresh(k.shape), ring.fresh(v.shape))
  # P hops bring every block, with its accumulated gradients, back home.
  d_q, (*_, d_k, d_v) = jax.lax.fori_loop(0, ring.num_devices, step,
                                          (ring.fresh(q.shape), start))
  # Positions, segment ids and lengths are integers: no cotangent.
  return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
          None, None, None, None, None, None)


ring_core.defvjp(_ring_fwd, _ring_bwd)
