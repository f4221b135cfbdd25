"""The "blockwise" implementation: `_blockwise.forward` with a custom VJP.

The forward saves only the output and the log-sum-exp [B, N, T]; the
backward recomputes each block's weights from them (`_blockwise.backward`),
so memory stays linear in T and S in both passes. The log-sum-exp is also
returned (jax.nn's `return_residual`), without a gradient, as jax.nn's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jattn import _blockwise
from jattn._block_sizes import BlockSizes, default_block_sizes
from jattn._dense import Dropout
from jattn._layout import Layout
from jattn._masks import MaskSpec
from jattn._programmable import add_sinks, sinks_grad


def blockwise_attention(query, key, value, bias, mask, spec: MaskSpec,
                        dropout: Dropout | None, scale, layout: Layout, *,
                        block_sizes: BlockSizes | None = None):
  """Arguments as `_xla.xla_attention`; returns (out, None, lse): no weights are formed."""
  if block_sizes is None:
    block_sizes = default_block_sizes(jax.devices()[0].platform)
  static = _Static(is_causal=spec.is_causal, local_window=spec.local_window,
                   dropout_rate=None if dropout is None else dropout.rate,
                   dropout_broadcast=dropout is not None and dropout.broadcast,
                   layout=layout, block_sizes=block_sizes)
  arrays = dict(q_lengths=spec.q_lengths, kv_lengths=spec.kv_lengths,
                q_segment_ids=spec.q_segment_ids, kv_segment_ids=spec.kv_segment_ids,
                rng=None if dropout is None else dropout.rng, scale=scale, mods=spec.mods)
  out, lse = _attention(static, query, key, value, bias, mask, arrays)
  return out, None, lse


@dataclasses.dataclass(frozen=True)
class _Static:
  """The hashable (non-array) configuration of one call."""

  is_causal: bool
  local_window: tuple[int, int] | None
  dropout_rate: float | None
  dropout_broadcast: bool
  layout: Layout
  block_sizes: BlockSizes


def _unpack(static: _Static, arrays):
  spec = MaskSpec(is_causal=static.is_causal, local_window=static.local_window,
                  q_lengths=arrays["q_lengths"], kv_lengths=arrays["kv_lengths"],
                  q_segment_ids=arrays["q_segment_ids"],
                  kv_segment_ids=arrays["kv_segment_ids"], mods=arrays["mods"])
  dropout = (None if static.dropout_rate is None
             else Dropout(static.dropout_rate, arrays["rng"], static.dropout_broadcast))
  return spec, dropout, arrays["scale"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, query, key, value, bias, mask, arrays):
  """-> (out, lse float32 [B, N, T])."""
  return _forward(static, query, key, value, bias, mask, arrays)[0]


def _forward(static, query, key, value, bias, mask, arrays):
  spec, dropout, scale = _unpack(static, arrays)
  out, lse = _blockwise.forward(query, key, value, bias, mask, spec, dropout, scale,
                                static.layout, 0, 0, static.block_sizes)
  if spec.mods is not None and spec.mods.sinks is not None:
    out, lse = add_sinks(out, lse, spec.mods.sinks, static.layout.out)
  return (out, lse), (query, key, value, bias, mask, arrays, out, lse)


def _backward(static, residuals, cotangents):
  d_out, _ = cotangents  # the lse carries no gradient (jax.nn stops it too)
  query, key, value, bias, mask, arrays, out, lse = residuals
  spec, dropout, scale = _unpack(static, arrays)
  d_query, d_key, d_value, d_bias, d_consts = _blockwise.backward_with_score_grads(
      query, key, value, bias, mask, spec, dropout, scale, static.layout, 0, 0,
      static.block_sizes, out, lse, d_out)
  d_bias = None if bias is None else d_bias.astype(bias.dtype)
  d_arrays = {name: None for name in arrays}
  mods = arrays["mods"]
  if mods is not None:  # the gradients of the sinks and of score_mod's arrays
    d_sinks = None if mods.sinks is None else sinks_grad(
        out, lse, d_out, mods.sinks, static.layout.out).astype(mods.sinks.dtype)
    d_consts = tuple(None if d is None else d.astype(c.dtype)
                     for d, c in zip(d_consts, mods.score_consts))
    d_arrays["mods"] = dataclasses.replace(
        mods, mask_consts=(None,) * len(mods.mask_consts), score_consts=d_consts,
        sinks=d_sinks, block_mask=None)
  return (d_query.astype(query.dtype), d_key.astype(key.dtype),
          d_value.astype(value.dtype), d_bias, None, d_arrays)


_attention.defvjp(_forward, _backward)
