"""The "cudnn" implementation: jax.nn.dot_product_attention's fused GPU kernel.

cuDNN takes [B, T, N, H] only, so other layouts are reordered by einsums
built from the layout letters on the way in and out. Arguments it cannot
honour raise a ValueError up front (`cudnn_unsupported`): never a silent fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._src.core.layout import Layout
from jattn._src.core.modifiers import Modifiers

_DTYPES = (jnp.float16, jnp.bfloat16)


def cudnn_unsupported(*, platform: str, dtype, H: int, D: int, dropout_rate: float,
                      has_segments: bool, return_weights: bool) -> str | None:
  """Why cuDNN cannot run this call, or None when it can."""
  if platform != "gpu":
    return f"it needs an NVIDIA GPU, the platform is {platform!r}"
  if dtype not in _DTYPES:
    return f"it takes float16 or bfloat16, got query dtype {dtype}"
  if H != D or H > 128 or H % 8:
    return f"it needs H == D, a multiple of 8 and <= 128, got H={H}, D={D}"
  if dropout_rate > 0.0:
    return f"jax.nn's cuDNN path has no dropout, got dropout_rate={dropout_rate}"
  if has_segments:
    return "jax.nn's cuDNN path takes no q_segment_ids / kv_segment_ids"
  if return_weights:
    return "it does not form the weights (return_weights=True)"
  return None


def cudnn_attention(query, key, value, modifiers: Modifiers, layout: Layout, *,
                    return_residual: bool = False):
  """Arguments as `_xla.xla_attention`; returns (out, None, lse [B, N, T] or None).

  The lse is asked of cuDNN only when wanted (return_residual). Dropout and
  mods are excluded by `cudnn_unsupported`; the scale is a Python number."""
  spec, scale = modifiers.structure, modifiers.scale
  q, k, v = (jnp.einsum(f"{sub}->{canon}", x) for x, sub, canon in (
      (query, layout.query, "BTNH"), (key, layout.key, "BSKH"), (value, layout.value, "BSKD")))
  out = jax.nn.dot_product_attention(
      q, k, v, modifiers.bias, modifiers.mask,
      scale=float(scale) if isinstance(scale, float) else scale,
      is_causal=spec.is_causal, query_seq_lengths=spec.q_lengths,
      key_value_seq_lengths=spec.kv_lengths, local_window_size=spec.local_window,
      implementation="cudnn", return_residual=return_residual)
  out, lse = out if return_residual else (out, None)  # lse [B, T, N]
  lse = None if lse is None else jnp.einsum("BTN->BNT", lse)
  return jnp.einsum(f"BTND->{layout.out}", out), None, lse
