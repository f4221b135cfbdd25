"""Forward-mode derivatives of a kernel's passes, taken from the blockwise loop.

A Pallas call has no JVP rule, so `jax.jvp` of `jax.grad` (a Hessian-vector product)
or `jax.hessian` cannot pass through a kernel's forward or backward as they are.
`tangent_from(reference)` gives a pass a `jax.custom_jvp`: the kernel computes the
value; the tangent is the forward-mode derivative of `reference`, the same pass in
`blockwise_loop` (pure JAX, the same function of the same inputs, memory linear in T
and S): `kernel_vjp.blockwise_forward` / `blockwise_backward` for a call's kernels, the
ring's loop steps for its kernel steps. The kernels' own first-order path is untouched:
`jax.grad` never evaluates these rules.

It matters on a CPU too: with implementation=None a program holds every platform's
branch under `jax.lax.platform_dependent`, and JAX differentiates all of them, lowered
or not.
"""

from __future__ import annotations

import jax


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
