"""Ring attention: the sequence sharded over a mesh axis, K/V passed around the ring.

Each of the P devices on the ring axis keeps its block of queries. At every
step it attends to the key/value block in hand, folds the result into a running
(out, lse) with the online softmax, and hands the block to the next device with
`jax.lax.ppermute`. After P steps every query has met every key, and no device
ever held more than one block of K/V.

Within a device, each step is the blockwise implementation's raw forward over
(local queries x visiting K/V), so memory is linear in the block lengths, and
blocks that the causal, length or segment masks rule out are skipped; or, where
`Ring.kernel` holds a flex_tpu plan (the TPU branch), the flex_tpu Pallas kernel
at the step's global offsets (`flex_tpu.step_forward` / `step_backward`).

The backward pass (a custom VJP) is a second trip around the ring: each K/V
block travels with its own gradient accumulators dK, dV; every device adds its
queries' contribution with the blockwise backward, which recomputes the
weights from the saved lse, and after P hops the accumulators are home.

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

from jattn._src.kernels import blockwise_loop as _blockwise
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.core.layout import Layout
from jattn._src.masks.structural import MaskSpec
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import add_sinks, sinks_grad
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.kernels import flex_tpu

_ROWS = "BNT"  # one value per query row and head: lse


def _zigzag_home(chunk: int, num_devices: int) -> int:
  """The device that holds `chunk` (of 2P) in zig-zag order: i and 2P-1-i on device i."""
  return chunk if chunk < num_devices else 2 * num_devices - 1 - chunk


def to_zigzag(x, axis: int, axis_name: str, num_devices: int):
  """Inside shard_map: from contiguous order (device i holds chunks 2i, 2i+1)
  to zig-zag order (device i holds chunks i, 2P-1-i), with two ppermutes.

  Chunk i is even on an even device, so there the even chunk comes first.
  """
  P = num_devices
  even, odd = jnp.split(x, 2, axis=axis)
  even = jax.lax.ppermute(even, axis_name, [(i, _zigzag_home(2 * i, P)) for i in range(P)])
  odd = jax.lax.ppermute(odd, axis_name, [(i, _zigzag_home(2 * i + 1, P)) for i in range(P)])
  on_even_device = jax.lax.axis_index(axis_name) % 2 == 0
  first = jnp.where(on_even_device, even, odd)
  second = jnp.where(on_even_device, odd, even)
  return jnp.concatenate([first, second], axis=axis)


def from_zigzag(x, axis: int, axis_name: str, num_devices: int):
  """The inverse of `to_zigzag`: every chunk goes back to its contiguous place."""
  P = num_devices
  first, second = jnp.split(x, 2, axis=axis)
  on_even_device = jax.lax.axis_index(axis_name) % 2 == 0
  even = jnp.where(on_even_device, first, second)
  odd = jnp.where(on_even_device, second, first)
  even = jax.lax.ppermute(even, axis_name, [(_zigzag_home(2 * i, P), i) for i in range(P)])
  odd = jax.lax.ppermute(odd, axis_name, [(_zigzag_home(2 * i + 1, P), i) for i in range(P)])
  return jnp.concatenate([even, odd], axis=axis)


def chunk_offsets(length: int, chunks: int, axis_name: str, num_devices: int) -> jax.Array:
  """int32 [chunks]: global position of the first token of each local chunk."""
  i = jax.lax.axis_index(axis_name)
  size = length // (chunks * num_devices)  # tokens per chunk
  if chunks == 1:
    return (i * size)[None].astype(jnp.int32)
  return jnp.stack([i * size, (2 * num_devices - 1 - i) * size]).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static description of one ring: mesh axis, its size, and the math."""

  axis_name: str  # the mesh axis the sequence is sharded over
  num_devices: int  # P, the size of that axis
  chunks: int  # contiguous chunks per device: 2 in zig-zag order, else 1
  scale: float
  is_causal: bool
  layout: Layout
  block_sizes: BlockSizes
  # a flex_tpu `Plan` (made with offsets=True for one chunk pair): each step runs the
  # Pallas kernel; None: the blockwise loop with block_sizes
  kernel: object = None

  def pass_on(self, x):
    """Hands x (a pytree) to the next device on the ring: device i -> i + 1."""
    perm = [(i, (i + 1) % self.num_devices) for i in range(self.num_devices)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), x)

  def fresh(self, shape, fill=0.0) -> jax.Array:
    """A float32 accumulator."""
    return jnp.full(shape, fill, jnp.float32)

  def split(self, x, letter: str, axis: int | None = None):
    """The local chunks of x along the layout axis of `letter` (or `axis`)."""
    axis = self.layout.axis(letter) if axis is None else axis
    return jnp.split(x, self.chunks, axis=axis) if x is not None else [None] * self.chunks

  def merge(self, xs, letter: str):
    return jnp.concatenate(xs, axis=self.layout.axis(letter))

  def modifiers(self, q_ids, kv_ids, q_len, kv_len, mods=None) -> Modifiers:
    """The `Modifiers` of one (query chunk, key/value chunk) pair."""
    structure = MaskSpec(is_causal=self.is_causal, q_lengths=q_len, kv_lengths=kv_len,
                         q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return Modifiers(structure=structure, mods=mods, scale=self.scale)

  def step_forward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset):
    """(out, lse [B, N, t]) of one chunk pair at its global offsets; no sinks."""
    if self.kernel is None:
      return _blockwise.forward(q, k, v, modifiers, self.layout, q_offset, kv_offset,
                                self.block_sizes)
    return flex_tpu.step_forward(self.kernel, self.layout, q, k, v, modifiers.mods, q_offset,
                                 kv_offset)

  def step_backward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset, out, lse, d_out):
    """One chunk pair's share of (d_q, d_k, d_v, d score_mod arrays), from the final
    out, lse and d_out."""
    if self.kernel is None:
      dq, dk, dv, _, dc = _blockwise.backward_with_score_grads(
          q, k, v, modifiers, self.layout, q_offset, kv_offset, self.block_sizes, out, lse,
          d_out)
      return dq, dk, dv, dc
    return flex_tpu.step_backward(self.kernel, self.layout, q, k, v, modifiers, q_offset,
                                  kv_offset, out, lse, d_out)


def _rows_like_out(rows: jax.Array, layout: Layout) -> jax.Array:
  """lse-like [B, N, T] -> broadcastable against out (the out layout, D of size 1)."""
  out_rows = layout.out.replace("D", "")
  return jnp.expand_dims(jnp.einsum(f"{_ROWS}->{out_rows}", rows), layout.out.index("D"))


def _combine(out_a, lse_a, out_b, lse_b, layout: Layout):
  """Merges two partial softmax results over disjoint key sets by their lse."""
  lse = jnp.logaddexp(lse_a, lse_b)
  out = (out_a * _rows_like_out(jnp.exp(lse_a - lse), layout)
         + out_b.astype(jnp.float32) * _rows_like_out(jnp.exp(lse_b - lse), layout))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_core(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
              mods=None):
  """One device's share of ring attention; call inside shard_map.

  q, k, v: the local blocks in `ring.layout`; q_offsets / kv_offsets int32
  [chunks]: the global position of the first token of each local chunk;
  q_ids [B, t] / kv_ids [B, s]: segment ids or None; q_len / kv_len [B]
  (global lengths) or None; mods: `_programmable.Mods` or None (replicated;
  mask_mod and score_mod see global positions). Returns the local output in
  the out layout and the local lse float32 [B, N, t] (no gradient flows back
  through it).
  """
  return _ring_forward(ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                       mods)


def _ring_forward(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                  mods=None):
  lay = ring.layout
  q_chunks, q_ids_chunks = ring.split(q, "T"), ring.split(q_ids, "T", axis=1)
  size = dict(zip(lay.query, q_chunks[0].shape)) | dict(zip(lay.value, v.shape))
  outs = [ring.fresh(tuple(size[c] for c in lay.out)) for _ in q_chunks]
  lses = [ring.fresh(tuple(size[c] for c in _ROWS), LARGE_NEGATIVE) for _ in q_chunks]

  def step(_, carry):
    outs, lses, travelling = carry
    k_blk, v_blk, kv_off, kv_ids_blk = travelling
    outs, lses = list(outs), list(lses)
    for a, (qa, qa_ids) in enumerate(zip(q_chunks, q_ids_chunks)):
      for b, (kb, vb, kb_ids) in enumerate(zip(ring.split(k_blk, "S"), ring.split(v_blk, "S"),
                                               ring.split(kv_ids_blk, "S", axis=1))):
        out_ab, lse_ab = ring.step_forward(
            qa, kb, vb, ring.modifiers(qa_ids, kb_ids, q_len, kv_len, mods), q_offsets[a],
            kv_off[b])
        outs[a], lses[a] = _combine(outs[a], lses[a], out_ab, lse_ab, lay)
    return tuple(outs), tuple(lses), ring.pass_on(travelling)

  outs, lses, _ = jax.lax.fori_loop(
      0, ring.num_devices, step, (tuple(outs), tuple(lses), (k, v, kv_offsets, kv_ids)))
  out, lse = ring.merge(outs, "T"), jnp.concatenate(lses, axis=-1)
  if mods is not None and mods.sinks is not None:  # once, after every key range
    out, lse = add_sinks(out, lse, mods.sinks, lay.out)
  return out.astype(v.dtype), lse


def _ring_fwd(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
              mods=None):
  out, lse = _ring_forward(ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                           mods)
  return (out, lse), (q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len, mods,
                      out, lse)


def _ring_bwd(ring: Ring, residuals, cotangents):
  d_out, _ = cotangents  # the lse carries no gradient, as jax.nn's residual
  q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len, mods, out, lse = residuals
  lay = ring.layout
  q_parts = list(zip(ring.split(q, "T"), ring.split(q_ids, "T", axis=1),
                     ring.split(out, "T"), jnp.split(lse, ring.chunks, axis=-1),
                     ring.split(d_out, "T")))

  def step(_, carry):
    (d_qs, d_consts), travelling = carry
    k_blk, v_blk, kv_off, kv_ids_blk, d_k_blk, d_v_blk = travelling
    d_qs = list(d_qs)
    d_ks, d_vs = ring.split(d_k_blk, "S"), ring.split(d_v_blk, "S")
    kv_parts = list(zip(ring.split(k_blk, "S"), ring.split(v_blk, "S"),
                        ring.split(kv_ids_blk, "S", axis=1)))
    for a, (qa, qa_ids, out_a, lse_a, d_out_a) in enumerate(q_parts):
      for b, (kb, vb, kb_ids) in enumerate(kv_parts):
        dq, dk, dv, dc = ring.step_backward(
            qa, kb, vb, ring.modifiers(qa_ids, kb_ids, q_len, kv_len, mods), q_offsets[a],
            kv_off[b], out_a, lse_a, d_out_a)
        d_qs[a], d_ks[b], d_vs[b] = d_qs[a] + dq, d_ks[b] + dk, d_vs[b] + dv
        d_consts = jax.tree.map(jnp.add, d_consts, dc)
    travelling = (k_blk, v_blk, kv_off, kv_ids_blk, ring.merge(d_ks, "S"), ring.merge(d_vs, "S"))
    return (tuple(d_qs), d_consts), ring.pass_on(travelling)

  start = (k, v, kv_offsets, kv_ids, ring.fresh(k.shape), ring.fresh(v.shape))
  d_qs = tuple(ring.fresh(part[0].shape) for part in q_parts)
  consts = () if mods is None else mods.score_consts
  d_consts0 = tuple(jnp.zeros(c.shape, jnp.float32)
                    if jnp.issubdtype(c.dtype, jnp.inexact) else None for c in consts)
  # P hops bring every block, with its accumulated gradients, back home.
  (d_qs, d_consts), (*_, d_k, d_v) = jax.lax.fori_loop(
      0, ring.num_devices, step, ((d_qs, d_consts0), start))
  d_mods = None
  if mods is not None:
    # This device's share of the gradients of the replicated sinks and score_mod
    # arrays; the shard_map transpose sums the shares over the devices.
    d_sinks = None if mods.sinks is None else sinks_grad(
        out, lse, d_out, mods.sinks, lay.out).astype(mods.sinks.dtype)
    d_mods = mods.gradients(sinks=d_sinks, score_consts=d_consts)
  # Offsets, segment ids and lengths are integers: no cotangent.
  return (ring.merge(d_qs, "T").astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
          None, None, None, None, None, None, d_mods)


ring_core.defvjp(_ring_fwd, _ring_bwd)
