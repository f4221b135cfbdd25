"""The "cudnn" implementation: jax.nn.dot_product_attention's fused GPU kernel.

cuDNN takes [B, T, N, H] only, so other layouts are reordered by einsums
built from the layout letters on the way in and out. `plan` says why it
cannot take a call (never a silent fallback); it is asked only for the
"cuda" platform, and refuses when the host has no cuDNN to build for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn._src import compat
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers

_DTYPES = (jnp.float16, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class CudnnPlan:
  """scale: the user's Python number (cuDNN takes it as a constant), or None: a traced
  scale, folded into the query."""

  scale: float | None
  return_residual: bool


@compat.derived  # forgotten with compat's answers (compat.refresh)
def cudnn_missing() -> str | None:
  """Why jax cannot build a cuDNN call on this host (jax.nn raises then), or None."""
  reason = compat.missing("cudnn_check")  # a private jax name
  if reason is not None:
    return reason
  try:
    compat.load("cudnn_check")()
  except RuntimeError as e:
    return f"cuDNN is not detected on this host ({type(e).__name__}: {e})"
  return None


def cudnn_unsupported(*, dtype, H: int, D: int, dropout_rate: float, has_segments: bool,
                      return_weights: bool) -> str | None:
  """Why cuDNN cannot run a call of this kind, or None when it can."""
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


def _unsupported_shapes(call) -> str | None:
  """What jax's cuDNN path refuses while the call or its gradient is traced
  (jax/_src/cudnn/fused_attention_stablehlo.py, jax/_src/nn/functions.py), or None."""
  T, S = call.dims.T, call.dims.S
  # check_is_flash_attention refuses odd lengths "with a bias" in training, and
  # _dot_product_attention_fwd_rule passes its empty placeholder bias, never None
  if T % 2 or S % 2:
    return f"its backward (jax's cuDNN fused attention) needs even T and S, got T={T}, S={S}"
  for name, x in (("bias", call.modifiers.bias), ("mask", call.modifiers.mask)):
    if x is not None and x.shape[-2:] != (T, S):  # check_layout, on bias and mask added
      return (f"its {name} must span T and S (jax's cuDNN takes no broadcast there), got "
              f"{name} of shape {x.shape} for T={T}, S={S}")
  if call.window is not None and call.window[1] and not call.is_causal:
    return (f"its sliding window looks left only (jax.nn raises for a right window "
            f"without is_causal), got local_window_size={call.window}")
  if call.window is not None and T > S:  # cuDNN's own error on an H200
    return (f"its sliding window needs T <= S (\"only supported with max_s_q <= "
            f"max_s_kv\"), got T={T}, S={S}")
  return None


def plan(call, platform: str):
  """A `CudnnPlan`, or the reason cuDNN cannot take `call`."""
  given = [name for name, present in (("mask_mod", call.mask_mod is not None),
                                      ("score_mod", call.score_mod is not None),
                                      ("sinks", call.has_sinks),
                                      ("block_mask", call.has_block_mask)) if present]
  if given:
    return (f"it cannot honour {', '.join(given)}: jax.nn's cuDNN kernel takes no mask or "
            f"score function and no sinks; use 'blockwise' or 'xla'")
  if call.return_max_logits:
    return ("return_max_logits: jax.nn's cuDNN call returns no max logits (its running "
            "max stays inside the kernel); flex_gpu returns them")
  reason = cudnn_unsupported(
      dtype=call.dtype, H=call.dims.H, D=call.dims.D, dropout_rate=call.dropout_rate,
      has_segments=call.structure.q_segment_ids is not None,
      return_weights=call.return_weights) or cudnn_missing() or _unsupported_shapes(call)
  if reason is not None:
    return reason
  scale = float(call.scale) if isinstance(call.scale, (int, float)) else None
  return CudnnPlan(scale=scale, return_residual=call.return_residual)


def run(plan: CudnnPlan, query, key, value, modifiers: Modifiers, layout: Layout):
  """Arguments as `_xla.xla_attention`; returns (out, None, lse [B, N, T] or None, None).

  The lse is asked of cuDNN only when wanted (return_residual); dropout and
  mods were refused by `plan`."""
  spec = modifiers.structure
  q, k, v = (jnp.einsum(f"{sub}->{canon}", x) for x, sub, canon in (
      (query, layout.query, "BTNH"), (key, layout.key, "BSKH"), (value, layout.value, "BSKD")))
  scale = plan.scale
  if scale is None:  # a traced scale: cuDNN takes a constant, so the query carries it
    q = (q.astype(jnp.float32) * modifiers.scale).astype(q.dtype)
    scale = 1.0
  is_causal, window = spec.is_causal, spec.local_window
  if window is not None:
    # cuDNN's window is t - left <= s <= t on top of its causal mask: without is_causal
    # it gave other values on an H200. `plan` leaves windows (left, 0), or any with
    # is_causal, which both are exactly that mask.
    is_causal, window = True, (window[0], 0)
  lengths = [None if x is None else x.astype(jnp.int32)  # jax.nn takes int32 only
             for x in (spec.q_lengths, spec.kv_lengths)]
  out = jax.nn.dot_product_attention(
      q, k, v, modifiers.bias, modifiers.mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1],
      local_window_size=window, implementation="cudnn",
      return_residual=plan.return_residual)
  out, lse = out if plan.return_residual else (out, None)  # lse [B, T, N]
  lse = None if lse is None else jnp.einsum("BTN->BNT", lse)
  return jnp.einsum(f"BTND->{layout.out}", out), None, lse, None
