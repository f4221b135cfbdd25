"""The "flex_tpu" call: its TPU kernels (`flex_tpu_kernels`, imported on first use)
under jattn's kernel VJP, for a `flex_tpu.Plan`.

Apart from `flex_tpu`, which plans, so that the kernels can import the `Plan`
they are built from without an import cycle.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn._src.core.layout import Layout
from jattn._src.kernels import kernel_plan, kernel_vjp
from jattn._src.kernels.flex_tpu import Plan
from jattn._src.masks import structure_mods
from jattn._src.masks.modifiers import Modifiers


def _kernels():
  """The Pallas TPU kernels' module, imported on first use (the plan checked its API)."""
  from jattn._src.kernels import flex_tpu_kernels
  return flex_tpu_kernels


def _forward(*args):
  return _kernels().forward(*args)


def _backward(*args):
  return _kernels().backward(*args)


# -> (out, None, lse float32 [B, N, T], max logits or None), as `blockwise_attention`:
# the kernels under jattn's kernel VJP (sinks after the forward); a call nothing
# differentiates runs the forward without the gradients' float32 residual
_run = kernel_vjp.kernel_run(
    lambda plan_, layout, q, k, v, modifiers: _forward(plan_, layout, q, k, v, modifiers.mods,
                                                       None, True),  # out in float32
    lambda plan_, layout, q, k, v, modifiers, out, lse, d_out: _backward(
        plan_, layout, q, k, v, modifiers.mods, out, lse, d_out),
    lambda plan_, layout, q, k, v, modifiers: _forward(plan_, layout, q, k, v, modifiers.mods,
                                                       None, False))


def run(plan_: Plan, query, key, value, modifiers: Modifiers, layout: Layout):
  """The kernels on this call, its sequence lengths and segment ids read as mask mods (as
  `flex_tpu.plan` planned them)."""
  return _run(plan_, query, key, value, structure_mods.as_mask_mods(modifiers), layout)


# ---------------------------------------------------------------- one ring step


def step_forward(plan_: Plan, layout: Layout, query, key, value, mods, q_offset, kv_offset):
  """One range pair of ring attention, as `blockwise_loop.forward_with_max`: -> (out, lse
  float32 [B, N, T], max logits float32 [B, N, T] when `plan_.max_logits`, else None) of
  T queries from global position q_offset against S keys from kv_offset (int32 scalars,
  traced: scalar prefetch). No sinks: the ring adds them once, at the end.

  layout has B; mods: the ring's `Mods` (traced here) or None; plan_ made with
  `offsets=True` for these T, S."""
  mods = None if mods is None else mods.traced()
  plan_ = kernel_plan.for_trace(plan_, mods)
  return _forward(plan_, layout, query, key, value, mods, _offsets(q_offset, kv_offset))


def step_backward(plan_: Plan, layout: Layout, query, key, value, modifiers: Modifiers,
                  q_offset, kv_offset, out, lse, d_out):
  """This range pair's share of the gradients, as `blockwise_loop.backward_with_score_grads`
  from the final out, lse (sinks included) and d_out: -> (d_query, d_key, d_value float32,
  score_mod's float arrays' gradients (None for the others))."""
  mods = None if modifiers.mods is None else modifiers.mods.traced()
  plan_ = kernel_plan.for_trace(plan_, mods)
  return _backward(plan_, layout, query, key, value, mods, out, lse, d_out,
                   _offsets(q_offset, kv_offset))


def _offsets(q_offset, kv_offset):
  return jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)])
