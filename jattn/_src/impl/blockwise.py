"""The "blockwise" implementation: `_blockwise.forward` with a custom VJP.

The forward saves only the output (in float32, the accumulator's: the backward's
row term rowsum(out * d_out) must not see a 16-bit output's rounding) and the
log-sum-exp [B, N, T]; the
backward recomputes each block's weights from them (`_blockwise.backward`),
so memory stays linear in T and S in both passes. The log-sum-exp is also
returned (jax.nn's `return_residual`), without a gradient, as jax.nn's, and so is
the online softmax's running row max (`return_max_logits`), without a gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jattn._src.kernels import blockwise_loop as _blockwise
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import add_sinks, sinks_grad


def blockwise_attention(query, key, value, modifiers: Modifiers, layout: Layout, *,
                        block_sizes: BlockSizes):
  """Arguments as `_xla.xla_attention`; returns (out, None, lse, max_logits): no weights
  are formed.

  block_sizes: the plan's (`registry.BlockwisePlan`: the user's, else the platform's)."""
  out, lse, max_logits = _attention(_Static(layout, block_sizes), query, key, value,
                                    modifiers)
  return out, None, lse, max_logits


@dataclasses.dataclass(frozen=True)
class _Static:
  """The hashable (non-array) configuration of one call besides the modifiers'."""

  layout: Layout
  block_sizes: BlockSizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, query, key, value, modifiers):
  """-> (out, lse float32 [B, N, T], max logits float32 [B, N, T])."""
  return _forward(static, query, key, value, modifiers)[0]


def _forward(static, query, key, value, modifiers):
  # out in float32 (the accumulator's): the residual that the backward's row term
  # rowsum(out * d_out) reads, so a 16-bit out's rounding stays out of the gradients
  out, lse, max_logits = _blockwise.forward_with_max(
      query, key, value, modifiers, static.layout, 0, 0, static.block_sizes,
      accumulator_out=True)
  if modifiers.sinks is not None:  # into out and lse; a sink is no key's logit
    out, lse = add_sinks(out, lse, modifiers.sinks, static.layout.out)
  return (out.astype(value.dtype), lse, max_logits), (query, key, value, modifiers, out, lse)


def _backward(static, residuals, cotangents):
  # the lse and max logits carry no gradient (jax.nn stops the lse too)
  d_out = cotangents[0]
  query, key, value, modifiers, out, lse = residuals
  d_query, d_key, d_value, d_bias, d_consts = _blockwise.backward_with_score_grads(
      query, key, value, modifiers, static.layout, 0, 0, static.block_sizes, out, lse, d_out)
  bias, mods = modifiers.bias, modifiers.mods
  d_bias = None if bias is None else d_bias.astype(bias.dtype)
  d_mods = None
  if mods is not None:  # the gradients of the sinks and of score_mod's arrays
    d_sinks = None if mods.sinks is None else sinks_grad(
        out, lse, d_out, mods.sinks, static.layout.out).astype(mods.sinks.dtype)
    d_mods = mods.gradients(sinks=d_sinks, score_consts=d_consts)
  return (d_query.astype(query.dtype), d_key.astype(key.dtype),
          d_value.astype(value.dtype), modifiers.gradients(bias=d_bias, mods=d_mods))


_attention.defvjp(_forward, _backward)
