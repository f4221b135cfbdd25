"""Forward-mode derivatives of a kernel's passes, taken from the blockwise loop.

A Pallas call has no JVP rule, so `jax.jvp` of `jax.grad` (a Hessian-vector product)
or `jax.hessian` cannot pass through a kernel's forward or backward as they are.
`tangent_from(reference)` gives a pass a `jax.custom_jvp`: the kernel computes the
value; the tangent is the forward-mode derivative of `reference`, the same pass in
`blockwise_loop` (pure JAX, the same function of the same inputs, memory linear in T
and S). The kernels' own first-order path is untouched: `jax.grad` never evaluates
these rules.

It matters on a CPU too: with implementation=None a program holds every platform's
branch under `jax.lax.platform_dependent`, and JAX differentiates all of them, lowered
or not.
"""

from __future__ import annotations

import functools

import jax

from jattn._src.core.block_sizes import BlockSizes
from jattn._src.kernels import blockwise_loop


def tangent_from(reference):
  """fn(*arrays) -> fn with a custom JVP: its value, and the tangent of
  `reference(*arrays)` (the same outputs, where fn gives None perhaps more), each in the
  dtype of fn's output."""

  def wrap(fn):
    @jax.custom_jvp
    def run(*args):
      return fn(*args)

    @run.defjvp
    def run_jvp(primals, tangents):
      outs = fn(*primals)
      _, d_outs = jax.jvp(reference, primals, tangents)
      return outs, jax.tree.map(_like, outs, d_outs, is_leaf=lambda x: x is None)

    return run

  return wrap


def _like(primal, tangent):
  """The tangent in the primal's dtype; none where the pass gives no value."""
  return None if primal is None else tangent.astype(primal.dtype)


def forward_pass(forward):
  """forward(plan, layout, query, key, value, modifiers) -> (out in `layout`, lse
  [B, N, T], max logits [B, N, T] or None), the kernel's (no sinks), with a JVP."""

  def run(plan, layout, *arrays):
    reference = functools.partial(_blockwise_forward, plan, layout)
    return tangent_from(reference)(functools.partial(forward, plan, layout))(*arrays)

  return run


def backward_pass(backward):
  """backward(plan, layout, query, key, value, modifiers, out, lse, d_out) -> (dq, dk,
  dv, score_mod's arrays' gradients: a tuple with None where none is given, or None),
  the kernel's, with a JVP."""

  def run(plan, layout, *arrays):
    reference = functools.partial(_blockwise_backward, plan, layout)
    return tangent_from(reference)(functools.partial(backward, plan, layout))(*arrays)

  return run


def _with_batch(x, layout):
  return x if layout.has_batch else x[None]


def _without_batch(x, layout):
  return x if layout.has_batch else x[0]


def _block_sizes(plan) -> BlockSizes:
  return BlockSizes(plan.block_q, plan.block_kv)


def _blockwise_forward(plan, layout, query, key, value, modifiers):
  q, k, v = (_with_batch(x, layout) for x in (query, key, value))
  out, lse, max_logits = blockwise_loop.forward_with_max(
      q, k, v, modifiers, layout.with_batch(), 0, 0, _block_sizes(plan), accumulator_out=True)
  return _without_batch(out, layout), lse, max_logits


def _blockwise_backward(plan, layout, query, key, value, modifiers, out, lse, d_out):
  q, k, v, o, d_o = (_with_batch(x, layout) for x in (query, key, value, out, d_out))
  d_q, d_k, d_v, _, d_consts = blockwise_loop.backward_with_score_grads(
      q, k, v, modifiers, layout.with_batch(), 0, 0, _block_sizes(plan), o, lse, d_o)
  return (*(_without_batch(x, layout) for x in (d_q, d_k, d_v)), d_consts)
