"""The "flex_gpu" call: its Triton GPU kernels (`flex_gpu_kernels`, imported on first use)
under jattn's kernel VJP, for a `flex_gpu.Plan`.

Apart from `flex_gpu`, which plans, so that the kernels can import the `Plan`
they are built from without an import cycle.
"""

from __future__ import annotations

from jattn._src.kernels import kernel_vjp


def _kernels():
  """The Pallas Triton kernels' module, imported on first use (the plan checked its API)."""
  from jattn._src.kernels import flex_gpu_kernels
  return flex_gpu_kernels


# -> (out, None, lse float32 [B, N, T], max logits or None), as `blockwise_attention`: the
# kernels under jattn's kernel VJP (sinks after the forward); the forward gives out in the
# caller's layout
run = kernel_vjp.padded_kernel_run(_kernels, out_in_layout=True, accumulator_out=True)
