"""Batched, multi-head scaled dot-product attention: a drop-in for jax.nn's."""

from __future__ import annotations

from jattn._src import dispatch
from jattn._src.call import make_call
from jattn._src.impl import interpret
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.impl.registry import NAMES
from jattn._src.parallel import sharded_call
from jattn._src.parallel.ring import from_context


def check_implementation(implementation, block_sizes) -> str | None:
  """The implementation's name, checked; block sizes alone ask for "blockwise"."""
  if implementation is not None and implementation not in NAMES:
    raise ValueError(f"implementation must be None or one of {sorted(NAMES)}, "
                     f"got {implementation!r}")
  if block_sizes is not None:
    if not isinstance(block_sizes, BlockSizes):
      raise TypeError(f"block_sizes must be a jattn.BlockSizes(q=..., kv=...), "
                      f"got {block_sizes!r}")
    if implementation not in (None, "blockwise", "ring", "context_parallel"):
      raise ValueError(f"block_sizes applies to implementation='blockwise' only, "
                       f"got implementation={implementation!r}")
    return implementation or "blockwise"  # asking for block sizes is asking for blockwise
  return implementation


def dot_product_attention(
    query, key, value, bias=None, mask=None, *,
    scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None,
    q_segment_ids=None, kv_segment_ids=None,
    layout="BTNH",
    implementation=None,
    dropout_rate=0.0, dropout_rng=None, broadcast_dropout=False,
    return_weights=False, block_sizes=None, return_residual=False,
    return_max_logits=False, mask_mod=None, score_mod=None, sinks=None, block_mask=None):
  """Scaled dot-product attention over a batch of multi-head sequences.

  Takes the arrays of `jax.nn.dot_product_attention` and gives the same result:
  query [B, T, N, H], key [B, S, K, H], value [B, S, K, D] -> out [B, T, N, D]
  (the batch axis may be absent). N % K == 0: each of the K kv heads serves
  G = N // K query heads (grouped-query attention; K == 1 is multi-query).

  Args:
    query, key, value: arrays in `layout` (key/value with S for T).
    bias: float, added to the logits; broadcastable to [B, N, T, S].
    mask: bool, True = may attend; broadcastable to [B, N, T, S]. Like
      jax.nn's, only bool masks are accepted (a TypeError otherwise): pass
      additive masks as `bias`, or `mask != 0` for flax's float masks (the
      Flax modules and `jattn.flax_attention_fn` convert those themselves).
    scale: multiplies the logits; 1 / sqrt(H) by default.
    is_causal: query i attends keys j <= i (aligned at the start, as jax.nn).
    query_seq_lengths, key_value_seq_lengths: int [B]; positions past the
      length are padding.
    local_window_size: int w or (left, right): query i attends keys
      i - left <= j <= i + right.
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S]: packed sequences,
      a query attends only keys of its own segment.
    layout: the axis order of query, key, value and output, any order of the
      letters B, T, N, H: "BTNH" (jax.nn's), "BNTH" (PyTorch's), "BNHT"
      (tokens as columns), or without B.
    implementation: None (the fastest correct one for the platform and shape:
      on CPU "blockwise" from T * S >= 128 * 128 and "xla" below; on GPU
      "cudnn", else "flex_gpu", else "flex_mgpu", else "pallas", where they
      apply; on TPU "flex_tpu", else "splash"; then "xla" or "blockwise" by the
      logits' size; on a Hopper GPU the process sees, "flex_mgpu_ws" after cuDNN
      for bfloat16 with H = D = 128; see `jattn/_src/impl/registry.py`), "xla"
      (einsum), "vmap" (single-head attention under jax.vmap), "blockwise"
      (flash-style, memory linear in T and S, no weights), "cudnn" (jax.nn's
      fused GPU kernel), "splash" (jax's TPU splash kernel), "pallas" (jax's
      Pallas GPU flash kernel), "flex_tpu" / "flex_gpu" / "flex_mgpu" (jattn's
      own Pallas kernels with the mods inside: TPU, Triton GPU, Mosaic GPU),
      "flex_mgpu_ws" (flex_mgpu's warp-specialised Hopper forward) -- the
      kernels raise a ValueError naming the argument they cannot honour -- or
      "ring" (sequence-parallel over the "seq" axis of the mesh set by
      `jax.set_mesh`: see `jattn.ring_attention`), or "context_parallel" (the
      same mesh; ring, all-gather or Ulysses chosen per call:
      `jattn.context_parallel_attention` with strategy=None).
      tests/impl/test_docs_match_registry.py holds this list and these orders
      to the registry.
    dropout_rate, dropout_rng: dropout on the attention weights, with inverted
      scaling; the same rng gives the same result.
    broadcast_dropout: one dropout draw [T, S] shared by every batch element
      and head (flax's broadcast_dropout=True) instead of one per (b, n).
    return_weights: also return the softmax weights [B, N, T, S] (before dropout).
    block_sizes: `jattn.BlockSizes(q=..., kv=...)` for "blockwise" (implies it
      when implementation is None); the platform's default when None. Its
      dropout draw depends on the block sizes.
    return_residual: also return the log-sum-exp of each query row's logits
      (after scale, bias and masks), as jax.nn: shaped like the query without
      H ([B, T, N] for "BTNH", [B, N, T] for "BNTH" and "BNHT"), in value's
      dtype, no gradient (stopped, as jax.nn's). A row that may attend to no
      key gets the finite -0.7 * float32 max, as jax.nn (float16: -inf). From
      every implementation; "vmap" computes it with the einsum logits. With
      sinks, the sink is a term of the sum.
    return_max_logits: also return each query row's largest visible logit
      (after scale, bias and score_mod; what Muon's QK-clip watches), shaped
      like the residual ([B, T, N] for "BTNH"), float32 (float64 for float64
      inputs), no gradient (stopped). A row that may attend to no key gets the
      empty-row constant of its lse (the finite -0.7 * float32 max), so it
      never wins a max over rows: `max_logits.max(axis=(0, 1))` is each head's
      largest visible logit ([N], for "BTNH"). Sinks are no logit of a key and
      do not count (with sinks an empty row keeps the constant, though its lse
      is the sink's logit). From every implementation that runs on CPU and from
      jattn's kernels ("flex_tpu", "flex_gpu", "flex_mgpu"), which return
      their running row max; jax's kernels ("splash", "pallas", "cudnn") keep
      theirs inside and refuse (None falls back to jattn's kernel); "ring" and
      "context_parallel" keep a running max per device over the key chunks.
    mask_mod: mask_mod(b, n, t, s) -> bool for one entry (True = may attend),
      with global positions; ANDed with every other mask. See `jattn.mods`.
    score_mod: score_mod(score, b, n, t, s) -> float, applied to each float32
      logit after scale and bias, before any mask. Arrays it closes over get
      gradients.
    sinks: float [N], one logit per query head: a key with no value in every
      row's softmax denominator.
    block_mask: a `jattn.BlockMask` of mask_mod (from `jattn.create_block_mask`),
      reused across calls and layers; "blockwise" computes it when absent.

  On a mesh: on arrays sharded over Explicit mesh axes (`jax.make_mesh`'s
  default), each device computes its batch rows and heads under `jax.shard_map`,
  whatever the implementation, and the output keeps the query's sharding (D
  unsharded), as jax.nn's does. Under a mesh of Auto axes set by `jax.set_mesh`,
  where a platform's choice is a Pallas kernel (which the compiler cannot
  partition), the same, with the batch over the mesh's "data" axis and the heads
  over "model" where present. The mods still see global (b, n), dropout draws
  apart per device, a sharded sequence is gathered (`jattn.ring_attention`
  shards it). See docs/scaling.md.

  Order of operations: logits * scale + bias -> score_mod -> every mask ->
  softmax (with sinks) -> dropout -> weighted sum of values.

  Returns out, followed by what was asked, in this order: weights
  (return_weights), lse (return_residual), max logits (return_max_logits);
  e.g. (out, lse) with return_residual, (out, weights, lse) with both.
  A query that may attend to no key returns zeros, with finite gradients.
  Logits and softmax are computed in float32; the output has value's dtype.

  Raises:
    ValueError: shapes that do not fit each other or the layout, N not a
      multiple of K, an unknown layout or implementation, or an implementation
      that cannot honour the call (e.g. return_weights with "blockwise", a mod
      with "cudnn"); the message names the argument and the shapes.
    TypeError: non-floating inputs, a non-bool mask, non-integer lengths or
      segment ids, a mask_mod or score_mod that is not callable.

  Examples:
    >>> import jax, jattn
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))    # [B, T, N, H]
    >>> kv = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))   # [B, S, K, H], K = 2
    >>> jattn.dot_product_attention(q, kv, kv, is_causal=True).shape   # [B, T, N, D]
    (2, 16, 4, 8)
  """
  implementation = check_implementation(implementation, block_sizes)
  kwargs = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, layout=layout,
                return_residual=return_residual, return_max_logits=return_max_logits,
                mask_mod=mask_mod, score_mod=score_mod, sinks=sinks, block_mask=block_mask)
  if implementation in ("ring", "context_parallel"):
    return from_context(
        implementation, query, key, value, bias, mask, local_window_size=local_window_size,
        dropout_rate=dropout_rate, return_weights=return_weights, block_sizes=block_sizes,
        broadcast_dropout=broadcast_dropout, **kwargs)
  call = make_call(query, key, value, bias, mask, local_window_size=local_window_size,
                   dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                   broadcast_dropout=broadcast_dropout, return_weights=return_weights,
                   block_sizes=block_sizes, interpret=interpret.interpreting(), **kwargs)
  mesh = sharded_call.explicit_mesh(dict(query=call.query, key=call.key,
                                         value=call.value, modifiers=call.modifiers))
  if mesh is None:
    choices = dispatch.choose_all(call, implementation)
    mesh = sharded_call.mesh_of_kernels(choices)
  if mesh is not None:  # each device its batch rows and heads, under shard_map
    out, weights, lse, max_logits = sharded_call.run(
        call, mesh, implementation=implementation, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
        block_sizes=block_sizes, dot_product_attention=dot_product_attention)
  else:
    dispatch.record(choices)
    out, weights, lse, max_logits = dispatch.compute(call, choices)
  if not call.dims.has_batch:
    out, weights, lse, max_logits = (None if x is None else x[0]
                                     for x in (out, weights, lse, max_logits))
  extras = ((weights,) * return_weights + (lse,) * return_residual
            + (max_logits,) * return_max_logits)
  return (out, *extras) if extras else out
