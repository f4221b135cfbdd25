"""The custom VJP that jattn's own kernels ("flex_tpu", "flex_gpu", "flex_mgpu") run
under: the kernel's forward gives (out, lse, and its running row max when the plan asks
for max logits: no gradient), sinks join after it (as in "blockwise"), the kernel's
backward gives dq, dk, dv and the gradients of score_mod's arrays (its scalar reads' and
its tables' read at positions), and for a kernel that gives none ("flex_mgpu") they come
from the blockwise backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jattn._src.core.layout import Layout
from jattn._src.kernels import blockwise_loop, forward_mode
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.kernels import kernel_plan
from jattn._src.masks.programmable import add_sinks, sinks_grad


def batched(layout: Layout) -> Layout:
  return layout if layout.has_batch else Layout("B" + layout.query)


def with_batch(x, layout):
  return x if layout.has_batch else x[None]


def without_batch(x, layout):
  return x if layout.has_batch else x[0]


def padded_kernel_run(kernels, *, out_in_layout: bool = False, accumulator_out: bool = False):
  """`kernel_run` for GPU kernels whose forward returns out [B, N, T', D'] and lse, max
  logits [B, N, T'] padded to their tiles (T' >= T, D' >= D): the padding is cut off and
  out moved to the caller's layout (out_in_layout: the forward gives out in the batched
  layout already, unpadded). kernels() -> the kernels' module (`forward`, `backward`),
  imported on first use; accumulator_out: its forward takes that keyword (out in float32
  where score_mod's arrays get gradients)."""

  def forward(p, layout: Layout, query, key, value, modifiers, residual=accumulator_out):
    extra = dict(accumulator_out=True) if residual else {}
    out, lse, max_logits = kernels().forward(p, layout, query, key, value, modifiers,
                                             **extra)
    if not out_in_layout:
      out = jnp.einsum(f"BNTD->{batched(layout).out}", out[:, :, :p.T, :p.D])
    max_logits = None if max_logits is None else max_logits[:, :, :p.T]
    return without_batch(out, layout), lse[:, :, :p.T], max_logits

  primal = functools.partial(forward, residual=False) if accumulator_out else None
  return kernel_run(forward, lambda *args: kernels().backward(*args), primal)


def kernel_run(forward, backward, primal=None):
  """run(plan, query, key, value, modifiers, layout) -> (out, None, lse float32 [B, N, T],
  max logits float32 [B, N, T] or None) of a tile kernel, with the contract of
  `blockwise_attention` (gradients into query, key, value, sinks and score_mod's float
  arrays; none out of the lse and max logits).

  forward(plan, layout, query, key, value, modifiers) -> (out in `layout`, lse [B, N, T],
  max logits [B, N, T] when `plan.max_logits`, else None); out in float32 where the
  kernel can write it (the residual of the backward's row term rowsum(out * d_out),
  which a 16-bit out's rounding would put into the gradients of score_mod's arrays),
  else in value's dtype: then the blockwise recomputation of those gradients
  recomputes a float32 out first;
  backward(plan, layout, query, key, value, modifiers, out, lse, d_out) -> (dq, dk, dv,
  score_mod's consts' gradients: a tuple, None where the kernel gives none; or None for
  all: then they come from the blockwise backward);
  primal: the forward of a call nothing differentiates (as forward; default forward):
  out in value's dtype, so that an inference call pays nothing for the gradients'
  float32 residual (the float32 P V that score_mod's float arrays ask for);
  modifiers' mods traced, the plan numbered for that trace (`kernel_plan.for_trace`).
  Each pass takes its forward-mode derivative from the blockwise loop (`forward_mode`),
  so `jax.jvp` of `jax.grad` and `jax.hessian` pass through the kernels.
  """
  forward = _tangents_from(forward, blockwise_forward)
  backward = _tangents_from(backward, blockwise_backward)
  primal = None if primal is None else _tangents_from(primal, blockwise_forward)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def attention(plan, layout, query, key, value, modifiers):
    return attention_fwd(plan, layout, query, key, value, modifiers, primal or forward)[0]

  def attention_fwd(plan, layout, query, key, value, modifiers, forward=forward):
    out, lse, max_logits = forward(plan, layout, query, key, value, modifiers)
    if modifiers.sinks is not None:  # into out and lse; a sink is no key's logit
      out, lse = add_sinks(out, lse, modifiers.sinks, batched(layout).out)
    return (out.astype(value.dtype), lse, max_logits), (query, key, value, modifiers, out,
                                                         lse)

  def attention_bwd(plan, layout, residuals, cotangents):
    # the lse and max logits carry no gradient (as jax.nn's lse, as blockwise)
    d_out = cotangents[0]
    query, key, value, modifiers, out, lse = residuals
    mods = modifiers.mods
    d_q, d_k, d_v, d_consts = backward(plan, layout, query, key, value, modifiers, out, lse,
                                       d_out)
    d_mods = None
    if mods is not None:
      o, d_o = with_batch(out, layout), with_batch(d_out, layout)
      d_sinks = None if mods.sinks is None else sinks_grad(
          o, lse, d_o, mods.sinks, batched(layout).out).astype(mods.sinks.dtype)
      if d_consts is None and (plan.score_reads or plan.score_tables):
        d_consts = blockwise_backward(plan, layout, query, key, value, modifiers,
                                      _accumulator_out(plan, layout, query, key, value,
                                                       modifiers, out), lse, d_out)[3]
      elif d_consts is None:  # no float array read: nothing to differentiate
        d_consts = (None,) * len(mods.score_consts)
      d_mods = mods.gradients(sinks=d_sinks, score_consts=d_consts)
    return (d_q.astype(query.dtype), d_k.astype(key.dtype), d_v.astype(value.dtype),
            modifiers.gradients(bias=None, mods=d_mods))

  def attention_fwd_symbolic(plan, layout, query, key, value, modifiers):
    # jax says which inputs the gradient flows into (`perturbed`): the float32 residual
    # is for score_mod's captured float arrays only, so a differentiated call whose
    # arrays are constants (ALiBi's fixed slopes) runs the primal forward too
    perturbed = any(x.perturbed for x in jax.tree.leaves(
        modifiers.mods.score_consts if modifiers.mods is not None else (),
        is_leaf=_is_primal))
    query, key, value, modifiers = jax.tree.map(
        lambda x: x.value, (query, key, value, modifiers), is_leaf=_is_primal)
    outs, residuals = attention_fwd(plan, layout, query, key, value, modifiers,
                                    forward if perturbed else primal or forward)
    # the pytree's structure is static: () marks arrays that want gradients, None not
    return outs, (residuals, () if perturbed else None)

  def attention_bwd_symbolic(plan, layout, residuals, cotangents):
    residuals, perturbed = residuals
    if perturbed is None:  # no read gradient wanted: the backward computes none
      plan = dataclasses.replace(plan, score_reads=())
    d_out = cotangents[0]
    if isinstance(d_out, SymbolicZero):  # out unused: nothing flows back
      d_out = jnp.zeros(d_out.shape, d_out.dtype)
    return attention_bwd(plan, layout, residuals, (d_out,) + tuple(cotangents[1:]))

  attention.defvjp(attention_fwd_symbolic, attention_bwd_symbolic, symbolic_zeros=True)

  def run(plan, query, key, value, modifiers, layout: Layout):
    if modifiers.mods is not None:
      modifiers = modifiers.replace(mods=modifiers.mods.traced())
      plan = kernel_plan.for_trace(plan, modifiers.mods)
    out, lse, max_logits = attention(plan, layout, query, key, value, modifiers)
    max_logits = None if max_logits is None else without_batch(max_logits, layout)
    return out, None, without_batch(lse, layout), max_logits

  return run


def _is_primal(x) -> bool:
  return isinstance(x, CustomVJPPrimal)


def _accumulator_out(plan, layout: Layout, query, key, value, modifiers, out):
  """out in float32: as given, or, from a kernel that writes a 16-bit out
  ("flex_mgpu"), recomputed by the blockwise forward (sinks added), so that the
  row term rowsum(out * d_out) of score_mod's gradients carries no 16-bit rounding."""
  if jnp.finfo(out.dtype).bits >= 32:
    return out
  out, lse, _ = blockwise_forward(plan, layout, query, key, value, modifiers)
  if modifiers.sinks is not None:
    out, _ = add_sinks(with_batch(out, layout), lse, modifiers.sinks, batched(layout).out)
    out = without_batch(out, layout)
  return out


def blockwise_forward(plan, layout: Layout, query, key, value, modifiers):
  """A kernel's forward by jattn's blockwise loop (pure JAX, memory linear in T and S):
  (out float32 in `layout`, lse float32 [B, N, T], max logits [B, N, T]); no sinks."""
  q, k, v = (with_batch(x, layout) for x in (query, key, value))
  out, lse, max_logits = blockwise_loop.forward_with_max(
      q, k, v, modifiers, batched(layout), 0, 0, BlockSizes(plan.block_q, plan.block_kv),
      accumulator_out=True)
  return without_batch(out, layout), lse, max_logits


def blockwise_backward(plan, layout: Layout, query, key, value, modifiers, out, lse, d_out):
  """A kernel's backward by jattn's blockwise loop: (dq, dk, dv in `layout`, score_mod's
  float arrays' gradients: a tuple, None for the others). Arrays in `layout` (with or
  without B); lse float32 [B, N, T]."""
  q, k, v, o, d_o = (with_batch(x, layout) for x in (query, key, value, out, d_out))
  d_q, d_k, d_v, _, d_consts = blockwise_loop.backward_with_score_grads(
      q, k, v, modifiers, batched(layout), 0, 0, BlockSizes(plan.block_q, plan.block_kv), o,
      lse, d_o)
  return (*(without_batch(x, layout) for x in (d_q, d_k, d_v)), d_consts)


def _tangents_from(kernel_pass, reference):
  """kernel_pass(plan, layout, *arrays) with its forward-mode derivative taken from the
  same pass of the blockwise loop, `reference` (`forward_mode.tangent_from`)."""
  def run(plan, layout, *arrays):
    return forward_mode.tangent_from(functools.partial(reference, plan, layout))(
        functools.partial(kernel_pass, plan, layout))(*arrays)
  return run
