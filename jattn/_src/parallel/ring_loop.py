"""The per-device loop of sequence parallelism: local queries against K/V chunks in turn.

Each of the P devices on the sequence axis keeps its query chunks. At every
step it attends them to the key/value chunks in hand, folds each result into a
running (out, lse) with the online softmax (and, when `Ring.max_logits`, each
row's largest visible logit into a running max), and, on a ring, hands the K/V to
the next device with `jax.lax.ppermute`. After P steps every query has met
every key, and no device ever held more than one device's share of K/V. With
one step (`Ring.steps == 1`) the device already holds every key it needs: the
all-gather strategy (all of S) and Ulysses (all of T and S for its heads).

A device holds `q_chunks` query chunks and `kv_chunks` K/V chunks, each at
its own global offset (the load balance deals chunks out of order), and runs
one (query chunk, K/V chunk) pair at a time in a `fori_loop`, so the program
does not grow with the number of chunks. A pair the call's chunk table marks
EMPTY is skipped with `lax.cond` (the ppermute of the step still runs: the
K/V must reach the next device whatever this one does with it).

Within a pair, each step is the blockwise implementation's raw forward over
(query chunk x K/V chunk), so memory is linear in the chunk lengths, and
blocks that the causal, window, length or segment masks rule out are skipped;
or, where `Ring.kernel` holds a flex_tpu plan (the TPU branch), the flex_tpu
Pallas kernel at the pair's global offsets (`flex_tpu_call.step_forward` /
`step_backward`).

The backward pass (a custom VJP) is a second trip around the ring: each K/V
chunk travels with its own gradient accumulators dK, dV; every device adds its
queries' contribution with the blockwise backward, which recomputes the
weights from the saved lse, and after P hops the accumulators are home.
The forward makes P - 1 hops (the last K/V needs to go nowhere), the
backward P - 1 hops of K/V and P of dK, dV.
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
from jattn._src.kernels import flex_tpu_call, forward_mode
from jattn._src.masks.block_mask import EMPTY

_ROWS = "BNT"  # one value per query row and head: lse, max logits


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static description of one device's loop: mesh axis, chunks, steps, and the math."""

  axis_name: str  # the mesh axis the sequence is sharded over
  num_devices: int  # P, the size of that axis
  steps: int  # K/V chunks visited in turn: P on a ring, 1 when every key is local
  q_chunks: int  # query chunks on each device, each at its own global offset
  kv_chunks: int  # K/V chunks on each device (travelling together on a ring)
  scale: float
  is_causal: bool
  local_window: tuple[int, int] | None
  layout: Layout
  block_sizes: BlockSizes
  # a flex_tpu `Plan` (made with offsets=True for one chunk pair): each step runs the
  # Pallas kernel; None: the blockwise loop with block_sizes
  kernel: object = None
  # also carry each row's largest visible logit (return_max_logits); the kernel's plan,
  # if any, is then made with max_logits=True
  max_logits: bool = False

  def pass_on(self, x):
    """Hands x (a pytree) to the next device on the ring: device i -> i + 1."""
    perm = [(i, (i + 1) % self.num_devices) for i in range(self.num_devices)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), x)

  def fresh(self, shape, fill=0.0) -> jax.Array:
    """A float32 accumulator."""
    return jnp.full(shape, fill, jnp.float32)

  def chunk(self, x, letter: str, index, size: int, axis: int | None = None):
    """Chunk `index` (traced) of `size` along the layout axis of `letter` (or `axis`)."""
    if x is None:
      return None
    axis = self.layout.axis(letter) if axis is None else axis
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)

  def add_to_chunk(self, x, d, letter: str, index, size: int):
    """x with d added to its chunk `index` along the layout axis of `letter`."""
    axis = self.layout.axis(letter)
    part = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)
    return jax.lax.dynamic_update_slice_in_dim(x, part + d, index * size, axis)

  def modifiers(self, q_ids, kv_ids, q_len, kv_len, mods=None) -> Modifiers:
    """The `Modifiers` of one (query chunk, key/value chunk) pair."""
    structure = MaskSpec(is_causal=self.is_causal, local_window=self.local_window,
                         q_lengths=q_len, kv_lengths=kv_len, q_segment_ids=q_ids,
                         kv_segment_ids=kv_ids)
    return Modifiers(structure=structure, mods=mods, scale=self.scale)

  def step_forward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset):
    """(out, lse [B, N, t], max logits [B, N, t] or None unless `max_logits`) of one
    chunk pair at its global offsets; no sinks."""
    if self.kernel is not None:  # its tangent (jax.jvp of jax.grad) from the loop's
      kernel = lambda q, k, v, modifiers, q_offset, kv_offset: flex_tpu_call.step_forward(
          self.kernel, self.layout, q, k, v, modifiers.mods, q_offset, kv_offset)
      return forward_mode.tangent_from(self._loop_forward)(kernel)(q, k, v, modifiers,
                                                                   q_offset, kv_offset)
    return self._loop_forward(q, k, v, modifiers, q_offset, kv_offset)

  def _loop_forward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset):
    if self.max_logits:
      return _blockwise.forward_with_max(q, k, v, modifiers, self.layout, q_offset, kv_offset,
                                         self.block_sizes)
    return (*_blockwise.forward(q, k, v, modifiers, self.layout, q_offset, kv_offset,
                                self.block_sizes), None)

  def step_backward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset, out, lse, d_out):
    """One chunk pair's share of (d_q, d_k, d_v, d score_mod arrays), from the final
    out, lse and d_out."""
    args = (q, k, v, modifiers, q_offset, kv_offset, out, lse, d_out)
    if self.kernel is None:
      return self._loop_backward(*args)
    kernel = functools.partial(flex_tpu_call.step_backward, self.kernel, self.layout)
    return forward_mode.tangent_from(self._loop_backward)(kernel)(*args)

  def _loop_backward(self, q, k, v, modifiers: Modifiers, q_offset, kv_offset, out, lse,
                     d_out):
    dq, dk, dv, _, dc = _blockwise.backward_with_score_grads(
        q, k, v, modifiers, self.layout, q_offset, kv_offset, self.block_sizes, out, lse,
        d_out)
    return dq, dk, dv, dc


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


def _each_pair(ring: Ring, body, carry):
  """body(a, b, carry) for every (query chunk a, K/V chunk b), in a fori_loop."""
  count = ring.q_chunks * ring.kv_chunks
  pair = lambda p, carry: body(p // ring.kv_chunks, p % ring.kv_chunks, carry)
  if count == 1:
    return pair(jnp.int32(0), carry)
  return jax.lax.fori_loop(0, count, pair, carry)


def _if_visible(visible, q_offset, kv_offset, sizes, compute, carry):
  """compute(carry), or carry when the chunk table marks this pair EMPTY."""
  if visible is None:
    return compute(carry)
  seen = visible[q_offset // sizes[0], kv_offset // sizes[1]] != EMPTY
  return jax.lax.cond(seen, compute, lambda carry: carry, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_core(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
              mods=None, visible=None):
  """One device's share of sequence-parallel attention; call inside shard_map.

  q, k, v: the local chunks in `ring.layout` (q_chunks of T, kv_chunks of S, in
  order); q_offsets [q_chunks] / kv_offsets [kv_chunks] int32: the global
  position of the first token of each local chunk; q_ids [B, t] / kv_ids [B, s]:
  segment ids or None; q_len / kv_len [B] (global lengths) or None; mods:
  `_programmable.Mods` or None (mask_mod and score_mod see global positions);
  visible: int8 [T / t_chunk, S / s_chunk] block classes of the call at the
  granularity of the local chunks (EMPTY pairs are skipped), or None. Returns the
  local output in the out layout, the local lse float32 [B, N, t] and, when
  `ring.max_logits`, each local row's largest visible logit float32 [B, N, t]
  (LARGE_NEGATIVE for a row that sees no key; sinks do not count), else None (no
  gradient flows back through either).
  """
  return _ring_forward(ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                       mods, visible)


def _sizes(ring: Ring, q, k) -> tuple[int, int]:
  """Tokens per local query chunk and per K/V chunk."""
  return (q.shape[ring.layout.axis("T")] // ring.q_chunks,
          k.shape[ring.layout.axis("S")] // ring.kv_chunks)


def _ring_forward(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                  mods=None, visible=None):
  lay = ring.layout
  tq, sk = _sizes(ring, q, k)
  size = dict(zip(lay.query, q.shape)) | dict(zip(lay.value, v.shape))
  out = ring.fresh(tuple(size[c] for c in lay.out))
  lse = ring.fresh(tuple(size[c] for c in _ROWS), LARGE_NEGATIVE)
  # each row's running max logit; None unless asked for: an empty pytree, so the default
  # loop carries nothing more
  top = ring.fresh(lse.shape, LARGE_NEGATIVE) if ring.max_logits else None

  def pairs(carry, travelling):
    k_blk, v_blk, kv_off, kv_ids_blk = travelling

    def body(a, b, carry):
      def compute(carry):
        out, lse, top = carry
        out_ab, lse_ab, top_ab = ring.step_forward(
            ring.chunk(q, "T", a, tq), ring.chunk(k_blk, "S", b, sk),
            ring.chunk(v_blk, "S", b, sk),
            ring.modifiers(ring.chunk(q_ids, "T", a, tq, 1),
                           ring.chunk(kv_ids_blk, "S", b, sk, 1), q_len, kv_len, mods),
            q_offsets[a], kv_off[b])
        out_a, lse_a = _combine(ring.chunk(out, "T", a, tq), ring.chunk(lse, "T", a, tq, 2),
                                out_ab, lse_ab, lay)
        axis = lay.axis("T")
        if top is not None:  # a max over disjoint key sets is the max of the maxes
          top_a = jnp.maximum(ring.chunk(top, "T", a, tq, 2), top_ab)
          top = jax.lax.dynamic_update_slice_in_dim(top, top_a, a * tq, 2)
        return (jax.lax.dynamic_update_slice_in_dim(out, out_a, a * tq, axis),
                jax.lax.dynamic_update_slice_in_dim(lse, lse_a, a * tq, 2), top)
      return _if_visible(visible, q_offsets[a], kv_off[b], (tq, sk), compute, carry)
    return _each_pair(ring, body, carry)

  carry, travelling = (out, lse, top), (k, v, kv_offsets, kv_ids)
  if ring.steps > 1:  # P - 1 hops: the K/V of the last step goes nowhere
    carry, travelling = jax.lax.fori_loop(
        0, ring.steps - 1, lambda _, c: (pairs(*c), ring.pass_on(c[1])), (carry, travelling))
  out, lse, top = pairs(carry, travelling)
  if mods is not None and mods.sinks is not None:  # once, after every key range
    out, lse = add_sinks(out, lse, mods.sinks, lay.out)  # a sink is no key: top unchanged
  return out.astype(v.dtype), lse, top


def _ring_fwd(ring: Ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
              mods=None, visible=None):
  out, lse, top = _ring_forward(ring, q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len,
                                kv_len, mods, visible)
  return (out, lse, top), (q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len,
                           mods, visible, out, lse)


def _ring_bwd(ring: Ring, residuals, cotangents):
  d_out = cotangents[0]  # the lse and max logits carry no gradient, as jax.nn's residual
  (q, k, v, q_offsets, kv_offsets, q_ids, kv_ids, q_len, kv_len, mods, visible, out,
   lse) = residuals
  lay = ring.layout
  tq, sk = _sizes(ring, q, k)

  def pairs(carry, travelling):
    k_blk, v_blk, kv_off, kv_ids_blk = travelling

    def body(a, b, carry):
      def compute(carry):
        d_q, d_consts, d_k, d_v = carry
        dq, dk, dv, dc = ring.step_backward(
            ring.chunk(q, "T", a, tq), ring.chunk(k_blk, "S", b, sk),
            ring.chunk(v_blk, "S", b, sk),
            ring.modifiers(ring.chunk(q_ids, "T", a, tq, 1),
                           ring.chunk(kv_ids_blk, "S", b, sk, 1), q_len, kv_len, mods),
            q_offsets[a], kv_off[b], ring.chunk(out, "T", a, tq),
            ring.chunk(lse, "T", a, tq, 2), ring.chunk(d_out, "T", a, tq))
        return (ring.add_to_chunk(d_q, dq, "T", a, tq), jax.tree.map(jnp.add, d_consts, dc),
                ring.add_to_chunk(d_k, dk, "S", b, sk), ring.add_to_chunk(d_v, dv, "S", b, sk))
      return _if_visible(visible, q_offsets[a], kv_off[b], (tq, sk), compute, carry)
    return _each_pair(ring, body, carry)

  consts = () if mods is None else mods.score_consts
  d_consts = tuple(jnp.zeros(c.shape, jnp.float32)
                   if jnp.issubdtype(c.dtype, jnp.inexact) else None for c in consts)
  # each K/V chunk travels with its own dK, dV accumulators (the last two of the carry)
  carry = (ring.fresh(q.shape), d_consts, ring.fresh(k.shape), ring.fresh(v.shape))
  travelling = (k, v, kv_offsets, kv_ids)
  if ring.steps > 1:
    def step(_, c):
      carry, travelling = pairs(*c), c[1]
      d_kv = ring.pass_on(carry[2:])
      return (*carry[:2], *d_kv), ring.pass_on(travelling)
    carry, travelling = jax.lax.fori_loop(0, ring.steps - 1, step, (carry, travelling))
  d_q, d_consts, d_k, d_v = pairs(carry, travelling)
  if ring.steps > 1:  # the P-th hop brings every dK, dV home
    d_k, d_v = ring.pass_on((d_k, d_v))
  d_mods = None
  if mods is not None:
    # This device's share of the gradients of the replicated sinks and score_mod
    # arrays; the shard_map transpose sums the shares over the devices.
    d_sinks = None if mods.sinks is None else sinks_grad(
        out, lse, d_out, mods.sinks, lay.out).astype(mods.sinks.dtype)
    d_mods = mods.gradients(sinks=d_sinks, score_consts=d_consts)
  # Offsets, segment ids, lengths and the chunk table are integers: no cotangent.
  return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
          None, None, None, None, None, None, d_mods, None)


ring_core.defvjp(_ring_fwd, _ring_bwd)
