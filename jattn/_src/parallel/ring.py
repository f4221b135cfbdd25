"""`ring_attention`: sequence-parallel attention over a mesh axis, K/V passed round a ring."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, Mesh

from jattn._src.core.block_sizes import BlockSizes
from jattn._src.parallel.balance import ChunkOrder
from jattn._src.parallel.context_parallel import (RingStep, context_parallel_attention,
                                                  refuse_unsupported, run)

__all__ = ["RingStep", "from_context", "ring_attention"]


def ring_attention(query, key, value, *, mesh: Mesh | AbstractMesh, axis_name: str = "seq",
                   scale: float | None = None, is_causal: bool = False,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                   layout: str = "BTNH", batch_axis_name: str | None = None,
                   head_axis_name: str | None = None, load_balance: bool | ChunkOrder = True,
                   block_sizes: BlockSizes | None = None, return_residual: bool = False,
                   return_max_logits: bool = False, mask_mod=None, score_mod=None,
                   sinks=None, block_mask=None, bias=None, mask=None, implementation=None,
                   dropout_rate=0.0, dropout_rng=None, broadcast_dropout=False,
                   return_weights=False):
  """Attention with the sequence sharded over `mesh` axis `axis_name` (ring attention).

  `jattn.context_parallel_attention(..., strategy="ring")`: the same arrays and
  result as `dot_product_attention` (query [B, T, N, H], key [B, S, K, H], value
  [B, S, K, D] in `layout`), computed with `shard_map`: T and S are split over
  the P devices of `axis_name`, each device keeps its queries and the key/value
  chunks go round the ring (`jax.lax.ppermute`), forward and backward, so a device
  holds one device's share of K/V at a time.

  batch_axis_name / head_axis_name optionally shard B and the heads (N and K
  together) over other mesh axes. load_balance (default True): the chunks are
  dealt to devices by the mask's block classes (zig-zag for is_causal: chunks i
  and 2P-1-i on device i; a greedy balance for documents, windows, prefix-LM, a
  block mask), inside the shard_map, and the output comes back in the original
  order; False: one contiguous chunk per device; a `jattn.ChunkOrder`: that order.

  Within a device each step runs the blockwise implementation (block_sizes,
  default per platform), so per-device memory is linear in T / P. On TPU each
  step runs jattn's flex_tpu Pallas kernel instead (forward and backward, the
  mods, causal mask and block skipping at the step's global positions; block_sizes,
  if given, are its tiles), wherever the kernel takes the step; sequence lengths and
  segment ids become mask mods of the global arrays there, unless the batch or heads
  are sharded; where it cannot (those, tiles it refuses, ...), blockwise; each
  platform's step
  and the kernel's reason are reported by `jattn.explain(...,
  implementation="ring")` inside `jax.set_mesh`, or `jattn.explain_calls()`
  around the call.

  return_residual=True returns (out, lse) as `dot_product_attention`.
  return_max_logits=True also returns each query row's largest visible logit (after
  scale and score_mod; float32, no gradient, shaped like the lse; a row that sees no
  key gets the lse's empty-row constant; sinks do not count), after the lse if both
  are asked for: each device keeps a running max over the key chunks it meets, and the
  rows come home as the lse does.

  mask_mod, score_mod, sinks: as `dot_product_attention`; the mods see global
  positions on every device, and each step skips the key blocks mask_mod
  leaves empty (classified per step; a block_mask is read for the balance and
  to skip whole chunk pairs). With them, B and the heads must not be sharded
  (batch_axis_name and head_axis_name None): the mods index the whole batch and
  every head.

  The mesh's axes may be Explicit (`jax.make_mesh`'s default) or Auto, and the
  inputs unsharded or sharded along any axis of it: on Explicit axes they are
  resharded to the ring's layout (`jax.sharding.reshard`) and the output comes
  back with the query's sharding (D unsharded), the lse with the query's
  without H; Auto axes are placed by shard_map.

  Requires T and S divisible by P (by P times the chunks per device of the
  balance, 2P for zig-zag); T and S may differ. bias, a dense mask, dropout,
  return_weights and implementation are refused, naming the argument.

  Raises:
    ValueError: an axis name the mesh lacks, one mesh axis named twice, an
      input sharded over an axis the mesh lacks, T or S not divisible by P (2P),
      an unsupported argument, or any check of `dot_product_attention`, naming
      the argument and shapes.

  Examples:
    >>> import jax, jattn
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))   # P = 1 here; 8 on 8 devices
    >>> q = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))    # [B, T, N, H]
    >>> jattn.ring_attention(q, q, q, mesh=mesh, axis_name="seq", is_causal=True).shape
    (1, 32, 2, 8)
  """
  return run("ring_attention", query, key, value, bias, mask, mesh=mesh, axis_name=axis_name,
             strategy="ring", batch_axis_name=batch_axis_name, head_axis_name=head_axis_name,
             load_balance=load_balance, scale=scale, is_causal=is_causal,
             query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
             local_window_size=local_window_size, q_segment_ids=q_segment_ids,
             kv_segment_ids=kv_segment_ids, layout=layout, implementation=implementation,
             dropout_rate=dropout_rate, dropout_rng=dropout_rng,
             broadcast_dropout=broadcast_dropout, return_weights=return_weights,
             block_sizes=block_sizes, return_residual=return_residual,
             return_max_logits=return_max_logits, mask_mod=mask_mod, score_mod=score_mod,
             sinks=sinks, block_mask=block_mask)


# The mesh axis names that dot_product_attention(implementation="ring" or
# "context_parallel") uses.
SEQUENCE_AXIS, BATCH_AXIS, HEADS_AXIS = "seq", "data", "model"


def from_context(implementation, query, key, value, bias, mask, *, dropout_rate,
                 return_weights, broadcast_dropout, dropout_rng=None, **kwargs):
  """`dot_product_attention(implementation="ring" | "context_parallel")`: the sequence
  sharded over the "seq" axis of the mesh set with `jax.set_mesh` ("ring": the ring;
  "context_parallel": the strategy chosen per call, as strategy=None); "data" and
  "model" axes, if present, shard the batch and the heads."""
  refuse_unsupported(f"implementation={implementation!r}", bias=bias is not None,
                     mask=mask is not None, dropout_rate=bool(dropout_rate),
                     return_weights=bool(return_weights),
                     broadcast_dropout=bool(broadcast_dropout))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or SEQUENCE_AXIS not in mesh.axis_names:
    raise ValueError(f"implementation={implementation!r} needs a mesh with a "
                     f"{SEQUENCE_AXIS!r} axis set by `with jax.set_mesh(mesh):`, got {mesh}")
  present = lambda name: name if name in mesh.axis_names else None
  call = ring_attention if implementation == "ring" else context_parallel_attention
  return call(query, key, value, mesh=mesh, axis_name=SEQUENCE_AXIS,
              batch_axis_name=present(BATCH_AXIS), head_axis_name=present(HEADS_AXIS),
              **kwargs)
