"""Batched, multi-head scaled dot-product attention: a drop-in for jax.nn's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn._src.core import checks as _checks
from jattn._src.core.attend import default_scale
from jattn._src.impl.block_sizes import BlockSizes
from jattn._src.impl.blockwise import blockwise_attention
from jattn._src.impl.choose import default_implementation
from jattn._src.impl.cudnn import cudnn_attention, cudnn_unsupported
from jattn._src.impl import interpret as _interpret
from jattn._src.impl import kernel_plans as _lowering
from jattn._src.impl import fused as _splash
from jattn._src.core.layout import Layout, parse_layout
from jattn._src.impl.dense import Dropout
from jattn._src.masks.structural import MaskSpec
from jattn._src.core.modifiers import Modifiers
from jattn._src.masks.programmable import build_mods
from jattn._src.masks.block_mask import check_block_mask
from jattn._src.impl.vmap import vmapped_attention
from jattn._src.impl.xla import xla_attention

# name -> function(query, key, value, modifiers, layout)
#   -> (out, weights | None, lse float32 [B, N, T] | None).
# query, key, value: the arrays in `layout` (a `Layout` with B).
# modifiers: one `Modifiers` (jattn/_src/core/modifiers.py), built after every check,
#   carries the rest: bias and mask ([B|1, N|1, T, S]), the structural masks
#   (`.structure`: causal, window, lengths, segments), the mods (`.mods`:
#   mask_mod / score_mod traced, sinks, block_mask; the user's ready-made
#   jattn.mods objects in `.mods.mask_mod` / `.mods.score_mod`), dropout and
#   scale. Each implementation applies them densely or block by block.
# "blockwise" also takes block_sizes=, "cudnn" return_residual= (keywords).
_IMPLEMENTATIONS = {
    "xla": xla_attention,
    "vmap": vmapped_attention,
    "blockwise": blockwise_attention,
    "cudnn": cudnn_attention,
    "splash": _splash.splash_implementation,  # TPU: jax's splash kernel (issue 11)
    "pallas": _splash.pallas_implementation,  # GPU: jax's Pallas flash kernel (issue 11)
    "ring": None,  # sequence-parallel over the context mesh: _ring_attention.py
}


def _check_implementation(implementation, block_sizes) -> None:
  if implementation is not None and implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {sorted(_IMPLEMENTATIONS)}, "
                     f"got {implementation!r}")
  if block_sizes is not None:
    if not isinstance(block_sizes, BlockSizes):
      raise TypeError(f"block_sizes must be a jattn.BlockSizes(q=..., kv=...), "
                      f"got {block_sizes!r}")
    if implementation not in (None, "blockwise", "ring"):
      raise ValueError(f"block_sizes applies to implementation='blockwise' only, "
                       f"got implementation={implementation!r}")


def _refuse_mods_on_cudnn(mask_mod, score_mod, sinks, block_mask) -> None:
  given = [name for name, x in (("mask_mod", mask_mod), ("score_mod", score_mod),
                                ("sinks", sinks), ("block_mask", block_mask)) if x is not None]
  if given:
    raise ValueError(f"implementation='cudnn' cannot honour {', '.join(given)}: jax.nn's "
                     f"cuDNN kernel takes no mask or score function and no sinks; use "
                     f"'blockwise' or 'xla'")


def _resolve_implementation(implementation, block_sizes, *, platform, dims, dtype,
                            dropout_rate, has_segments, return_weights, scale,
                            has_mods=False, kernel_reasons=None) -> str:
  """The implementation to run; a ValueError when the chosen one cannot honour the call."""
  if implementation is None and block_sizes is not None:
    implementation = "blockwise"  # asking for block sizes is asking for blockwise
  cudnn_reason = cudnn_unsupported(
      platform=platform, dtype=dtype, H=dims["H"], D=dims["D"],
      dropout_rate=dropout_rate, has_segments=has_segments, return_weights=return_weights)
  if cudnn_reason is None and not isinstance(scale, (int, float)):
    cudnn_reason = f"it takes a Python number as scale, got {type(scale).__name__}"
  if cudnn_reason is None and has_mods:
    cudnn_reason = "it takes no mask_mod, score_mod, sinks or block_mask"
  reasons = kernel_reasons or {}
  if implementation is None:
    return default_implementation(platform=platform, T=dims["T"], S=dims["S"],
                                  return_weights=return_weights, cudnn_reason=cudnn_reason,
                                  splash_reason=reasons.get("splash", ""),
                                  pallas_reason=reasons.get("pallas", ""),
                                  B=dims["B"], N=dims["N"])
  if implementation in ("splash", "pallas") and reasons.get(implementation) is not None:
    raise ValueError(f"implementation={implementation!r} cannot run this call: "
                     f"{reasons[implementation]}")
  if implementation == "cudnn" and cudnn_reason is not None:
    raise ValueError(f"implementation='cudnn' cannot run this call: {cudnn_reason}")
  if implementation == "blockwise" and return_weights:
    raise ValueError("return_weights=True needs the [B, N, T, S] weights, which "
                     "implementation='blockwise' never forms; use implementation='xla'")
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
    mask_mod=None, score_mod=None, sinks=None, block_mask=None):
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
      "cudnn", else "pallas", where they apply; on TPU "splash" where it
      applies; see `jattn/_src/impl/choose.py`), "xla" (einsum), "vmap" (single-head
      attention under jax.vmap), "blockwise" (flash-style, memory linear in T
      and S, no weights), "cudnn" (jax.nn's fused GPU kernel), "splash" (jax's
      TPU splash kernel), "pallas" (jax's Pallas GPU flash kernel) -- the last
      three raise a ValueError naming the argument they cannot honour -- or
      "ring" (sequence-parallel over the
      "seq" axis of the mesh set by `jax.set_mesh`: see `jattn.ring_attention`).
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
    mask_mod: mask_mod(b, n, t, s) -> bool for one entry (True = may attend),
      with global positions; ANDed with every other mask. See `jattn.mods`.
    score_mod: score_mod(score, b, n, t, s) -> float, applied to each float32
      logit after scale and bias, before any mask. Arrays it closes over get
      gradients.
    sinks: float [N], one logit per query head: a key with no value in every
      row's softmax denominator.
    block_mask: a `jattn.BlockMask` of mask_mod (from `jattn.create_block_mask`),
      reused across calls and layers; "blockwise" computes it when absent.

  Order of operations: logits * scale + bias -> score_mod -> every mask ->
  softmax (with sinks) -> dropout -> weighted sum of values.

  Returns out; (out, weights) with return_weights; (out, lse) with
  return_residual; (out, weights, lse) with both.
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
  _check_implementation(implementation, block_sizes)
  if implementation == "cudnn":
    _refuse_mods_on_cudnn(mask_mod, score_mod, sinks, block_mask)
  if implementation == "ring":
    from jattn._src.impl.ring import ring_from_context  # it builds on this module

    return ring_from_context(
        query, key, value, bias, mask, local_window_size=local_window_size,
        dropout_rate=dropout_rate, return_weights=return_weights, block_sizes=block_sizes,
        scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, layout=layout, return_residual=return_residual,
        broadcast_dropout=broadcast_dropout, mask_mod=mask_mod, score_mod=score_mod,
        sinks=sinks, block_mask=block_mask)
  query = _checks.float_array("query", query)
  key = _checks.float_array("key", key)
  value = _checks.float_array("value", value)
  lay = parse_layout(layout, query.shape)
  dims = _check_arrays(query, key, value, lay)
  B, T, S, N = dims["B"], dims["T"], dims["S"], dims["N"]
  target = (B, N, T, S)
  legend = "[B, N, T, S]" if lay.has_batch else "[N, T, S]"
  mask = _checks.broadcastable("mask", mask, target if lay.has_batch else target[1:],
                               legend, "bool")
  bias = _checks.broadcastable("bias", bias, target if lay.has_batch else target[1:],
                               legend, "float")
  q_lengths = _lengths("query_seq_lengths", query_seq_lengths, B, lay.has_batch)
  kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, B, lay.has_batch)
  q_ids, kv_ids = _segment_ids(q_segment_ids, kv_segment_ids, B, T, S, lay.has_batch)
  window = _local_window(local_window_size)
  if scale is None:
    scale = default_scale(dims["H"])
  _check_dropout(dropout_rate, dropout_rng)
  for name, flag in (("is_causal", is_causal), ("return_weights", return_weights),
                     ("return_residual", return_residual),
                     ("broadcast_dropout", broadcast_dropout)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  mods = build_mods(mask_mod, score_mod, sinks, block_mask, N=N, defer_ready_made=True)
  platform = jax.devices()[0].platform
  # Can jax's fused kernels take this call? A static plan each, or the reason not.
  lower_args = dict(
      platform=platform, interpret=_interpret.interpreting(), dims=dims,
      dtype=query.dtype, is_causal=is_causal, window=window, q_lengths=q_lengths,
      kv_lengths=kv_lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      bias=bias, mask=mask, dropout_rate=float(dropout_rate), return_weights=return_weights,
      return_residual=return_residual, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks,
      block_mask=block_mask)
  plans = {"splash": _lowering.splash_plan(**lower_args),
           "pallas": _lowering.pallas_plan(**lower_args, scale=scale)}
  impl = _resolve_implementation(
      implementation, block_sizes, platform=platform, dims=dims,
      dtype=query.dtype, dropout_rate=float(dropout_rate),
      has_segments=q_ids is not None, return_weights=return_weights, scale=scale,
      has_mods=mods is not None,
      kernel_reasons={name: reason for name, (_, reason, _) in plans.items()})
  kernel_plan, _, document = plans.get(impl, (None, None, None))
  if document is not None:  # a lowered mods.document mask: its ids become segment ids
    q_ids, kv_ids = _segment_ids(document.q_segment_ids, document.kv_segment_ids, B, T, S,
                                 True)
  if mods is not None and mods.block_mask is not None:
    block_sizes = check_block_mask(mods.block_mask, B=B, N=N, T=T, S=S,
                                   block_sizes=block_sizes, has_batch=lay.has_batch)

  if not lay.has_batch:
    query, key, value = (x[None] for x in (query, key, value))
    lay = Layout("B" + lay.query)
  mask = None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)
  bias = None if bias is None else jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)

  structure = MaskSpec(is_causal=is_causal, local_window=window, q_lengths=q_lengths,
                       kv_lengths=kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  dropout = (Dropout(float(dropout_rate), dropout_rng, broadcast_dropout)
             if dropout_rate > 0.0 else None)
  if impl != "cudnn" and isinstance(scale, (int, float)):
    scale = jnp.asarray(scale)  # traced, as before: a new scale compiles nothing new
  modifiers = Modifiers(bias=bias, mask=mask, structure=structure, mods=mods,
                        dropout=dropout, scale=scale)
  # Mods holding a user's function traced for this call would never hit a jit
  # cache (and fill it), so they run inside the caller's trace instead; ready-made
  # mask mods and sinks are traced inside the jit, which caches on their static fields.
  compute = _compute if mods is None or mods.is_cacheable else _compute.__wrapped__
  out, weights, lse = compute(
      query, key, value, modifiers, layout=lay, impl=impl, block_sizes=block_sizes,
      kernel_plan=kernel_plan,
      return_weights=return_weights, return_residual=return_residual)
  if not dims["has_batch"]:
    out = out[0]
    weights = None if weights is None else weights[0]
    lse = None if lse is None else lse[0]
  extras = (weights,) * return_weights + (lse,) * return_residual
  return (out, *extras) if extras else out


def residual_in_layout(lse, layout: Layout, dtype) -> jax.Array:
  """lse float32 [B, N, T] -> the query's layout without H, in `dtype`, no gradient."""
  rows = layout.query.replace("H", "")
  return jax.lax.stop_gradient(jnp.einsum(f"BNT->{rows}", lse).astype(dtype))


@functools.partial(jax.jit, static_argnames=(
    "layout", "impl", "block_sizes", "return_weights", "return_residual",
    "kernel_plan"))
def _compute(query, key, value, modifiers: Modifiers, *, layout, impl, block_sizes,
             return_weights, return_residual, kernel_plan=None):
  """Runs implementation `impl`; its flags (causal, window, dropout rate, a
  Python scale) are static parts of the modifiers' pytree, so jit keys on them."""
  if modifiers.mods is not None:
    modifiers = modifiers.replace(mods=modifiers.mods.traced())
  fn = _IMPLEMENTATIONS[impl]
  if impl == "blockwise":
    fn = functools.partial(fn, block_sizes=block_sizes)
  if impl == "cudnn":
    fn = functools.partial(fn, return_residual=return_residual)
  if kernel_plan is not None:  # splash / pallas: the lowering chosen at dispatch
    fn = functools.partial(fn, plan=kernel_plan)
  out, weights, lse = fn(query, key, value, modifiers, layout)
  # Only what was asked for leaves the jit, so the rest is never computed.
  return (out, weights if return_weights else None,
          residual_in_layout(lse, layout, value.dtype) if return_residual else None)


def _check_arrays(query, key, value, lay: Layout) -> dict:
  """Ranks, shared batch/length/depth, N % K and dtypes; returns the sizes."""
  for name, x, sub in (("key", key, lay.key), ("value", value, lay.value)):
    if x.ndim != len(sub):
      raise ValueError(f"{name}: expected rank {len(sub)} [{', '.join(sub)}] for layout "
                       f"{lay.query!r}, got shape {x.shape} (query has shape {query.shape})")
  ax = lay.axis
  _checks.equal_dim("length S", "key", key.shape, ax("S"), "value", value.shape, ax("S"))
  _checks.equal_dim("kv heads K", "key", key.shape, ax("K"), "value", value.shape, ax("K"))
  _checks.equal_dim("depth H", "query", query.shape, ax("H"), "key", key.shape, ax("H"))
  if lay.has_batch:
    _checks.equal_dim("batch B", "query", query.shape, ax("B"), "key", key.shape, ax("B"))
    _checks.equal_dim("batch B", "key", key.shape, ax("B"), "value", value.shape, ax("B"))
  N, K = query.shape[ax("N")], key.shape[ax("K")]
  if K == 0 or N % K != 0:
    raise ValueError(f"num heads N of query must be a multiple of kv heads K of key "
                     f"(N % K == 0): query has shape {query.shape} (N={N}), key has "
                     f"shape {key.shape} (K={K})")
  _checks.same_dtype(query, key, value)
  return dict(B=query.shape[ax("B")] if lay.has_batch else 1, T=query.shape[ax("T")],
              S=key.shape[ax("S")], N=N, K=K, H=query.shape[ax("H")],
              D=value.shape[ax("D")],
              has_batch=lay.has_batch)


def _int_array(name: str, x, expected: tuple[int, ...], legend: str) -> jax.Array:
  x = _checks.as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} "
                    f"with shape {x.shape}")
  if x.shape != expected:
    raise ValueError(f"{name}: expected shape {legend} = {expected}, got shape {x.shape}")
  return x


def _lengths(name, lengths, B, has_batch):
  if lengths is None:
    return None
  if not has_batch:
    return _int_array(name, lengths, (), "[] (no batch axis)")[None]
  return _int_array(name, lengths, (B,), "[B]")


def _segment_ids(q_ids, kv_ids, B, T, S, has_batch):
  if (q_ids is None) != (kv_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together, got "
                     f"q_segment_ids={None if q_ids is None else 'array'}, "
                     f"kv_segment_ids={None if kv_ids is None else 'array'}")
  if q_ids is None:
    return None, None
  if not has_batch:
    return (_int_array("q_segment_ids", q_ids, (T,), "[T]")[None],
            _int_array("kv_segment_ids", kv_ids, (S,), "[S]")[None])
  return (_int_array("q_segment_ids", q_ids, (B, T), "[B, T]"),
          _int_array("kv_segment_ids", kv_ids, (B, S), "[B, S]"))


def _local_window(window) -> tuple[int, int] | None:
  if window is None:
    return None
  pair = (window, window) if isinstance(window, int) else window
  if (not isinstance(pair, (tuple, list)) or len(pair) != 2
      or not all(isinstance(w, int) and not isinstance(w, bool) for w in pair)):
    raise TypeError(f"local_window_size must be an int or a pair of ints "
                    f"(left, right), got {window!r}")
  if min(pair) < 0:
    raise ValueError(f"local_window_size must be non-negative, got {window!r}")
  return (int(pair[0]), int(pair[1]))


def _check_dropout(rate, rng) -> None:
  if not isinstance(rate, (int, float)) or isinstance(rate, bool):
    raise TypeError(f"dropout_rate must be a float in [0, 1), got {rate!r}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
  if rate > 0.0 and rng is None:
    raise ValueError(f"dropout_rng is required when dropout_rate > 0 "
                     f"(dropout_rate={rate!r}, dropout_rng=None)")
