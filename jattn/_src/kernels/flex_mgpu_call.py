"""The "flex_mgpu" call: its Mosaic GPU kernels (`flex_mgpu_kernels`, imported on first use)
under jattn's kernel VJP, for a `flex_mgpu.Plan`; and "flex_mgpu_ws" (`run_ws`): the
warp-specialised forward (`flex_mgpu_ws`) with the same backward.

Apart from `flex_mgpu`, which plans, so that the kernels can import the `Plan`
they are built from without an import cycle.
"""

from __future__ import annotations

from jattn._src.kernels import kernel_vjp


def _kernels():
  """The Mosaic GPU kernels' module, imported on first use (the plan checked its API)."""
  from jattn._src.kernels import flex_mgpu_kernels
  return flex_mgpu_kernels


# -> (out, None, lse float32 [B, N, T], max logits or None), as `blockwise_attention`: the
# kernels under jattn's kernel VJP (sinks after the forward, score_mod's arrays by blockwise);
# the forward gives out in the caller's layout
run = kernel_vjp.padded_kernel_run(_kernels, out_in_layout=True)


def _fast():
  from jattn._src.kernels import flex_mgpu_ws
  return flex_mgpu_ws


# "flex_mgpu_ws": the warp-specialised forward (compiled only), the same backward
run_ws = kernel_vjp.kernel_run(lambda *args: _fast().forward(*args),
                               lambda *args: _fast().backward(*args))
