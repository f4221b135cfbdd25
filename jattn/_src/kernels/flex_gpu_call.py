"""The "flex_gpu" call: its Triton GPU kernels (`flex_gpu_kernels`, imported on first use)
under jattn's kernel VJP, for a `flex_gpu.Plan`.

Apart from `flex_gpu`, which plans, so that the kernels can import the `Plan`
they are built from without an import cycle.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn._src.core.layout import Layout
from jattn._src.kernels import kernel_vjp
from jattn._src.kernels.flex_gpu import Plan
from jattn._src.kernels.kernel_vjp import batched, without_batch


def _kernels():
  """The Pallas Triton kernels' module, imported on first use (the plan checked its API)."""
  from jattn._src.kernels import flex_gpu_kernels
  return flex_gpu_kernels


def _forward(p: Plan, layout: Layout, query, key, value, modifiers):
  """The forward kernel -> (out in the query's layout with D, lse float32 [B, N, T],
  max logits float32 [B, N, T] or None)."""
  out, lse, max_logits = _kernels().forward(p, layout, query, key, value, modifiers)
  out = jnp.einsum(f"BNTD->{batched(layout).out}", out[:, :, :p.T, :p.D])
  max_logits = None if max_logits is None else max_logits[:, :, :p.T]
  return without_batch(out, layout), lse[:, :, :p.T], max_logits


# -> (out, None, lse float32 [B, N, T], max logits or None), as `blockwise_attention`: the
# kernels under jattn's kernel VJP (sinks after the forward)
run = kernel_vjp.kernel_run(_forward, lambda *args: _kernels().backward(*args))
