"""2**x on the FMA pipe: a polynomial and the float's exponent bits, no special-function
unit (`MUFU.EX2` on NVIDIA GPUs).

Why: in "flex_mgpu_ws"'s softmax stage every probability is one `exp2`, and with a
score_mod like soft-cap also one `tanh`, both on the SM's special-function unit, which
issues 16 results a clock against 128 for the FP32 pipe. With soft-cap, by our count,
the unit's work per tile is about as long as the tile's `wgmma`s and cannot hide under the
other consumer's (docs/gpu_kernel.md, "Soft-cap, from SASS"); the card measured soft-cap
at 1.23 to 1.29x causal. Computing part of a tile's exponentials here moves them to the
FP32 pipe (FlashAttention-4's idea, for Blackwell); `flex_mgpu.ws_exp2_fma(columns)` sets
how many columns of each kv tile take this path.

How (only FP32 adds and FMAs, an integer shift and add, bitcasts):
  x = max(x, -125)                         keeps j >= -125: the result stays a normal float
  t = x + 1.5 * 2**23                      rounds x to the integer j (ties to even); j sits
                                           in t's low bits
  f = x - (t - 1.5 * 2**23)                f = x - j in [-0.5, 0.5]
  p = c0 + f (c1 + f (c2 + f c3))          2**f within 7.5e-5 relative (minimax, below)
  2**x = bits(p) + (bits(t) << 23)         adds j to p's exponent: the shift drops t's own
                                           exponent and leaves j << 23 in two's complement
and 0 where x < -125: a masked logit (LARGE_NEGATIVE) must weigh exactly 0, or a row that
sees no key would divide tiny weights by their tiny sum instead of giving out = 0.

The coefficients are a degree-3 minimax fit of 2**f on [-0.5, 0.5] for the relative error
(Remez exchange in float64, run for this file; `test_fma_exp2.py` checks the bound): 7.5e-5
at most, under bfloat16's and float16's rounding of P (2**-9 and 2**-12) and a relative
error in the row sum l, so in out, of the same 7.5e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# 2**f ~ C0 + C1 f + C2 f**2 + C3 f**3 on [-0.5, 0.5], relative error <= 7.5e-5
C0, C1, C2, C3 = 0.99992806, 0.69326097, 0.24261113, 0.05517167
MAX_RELATIVE_ERROR = 7.5e-5
_ROUND = 1.5 * 2.0**23  # x + _ROUND, for |x| < 2**22, is round(x) in the low mantissa bits
_SMALLEST = -125.0  # 2**-125: j + p's exponent stays a normal float's


def exp2(x: jax.Array) -> jax.Array:
  """2**x, float32, elementwise, for x < 127 (the softmax gives x <= 0):
  within MAX_RELATIVE_ERROR for x >= -125, and 0 below."""
  clamped = jnp.maximum(x, _SMALLEST)
  # the barrier: XLA's simplifier rewrites (x + c) - c to x, which would make f = 0 (the
  # GPU interpreter runs this through XLA:CPU; LLVM and ptxas keep IEEE order anyway)
  t = lax.optimization_barrier(clamped + _ROUND)
  f = clamped - (t - _ROUND)
  p = C0 + f * (C1 + f * (C2 + f * C3))
  exponent = lax.shift_left(lax.bitcast_convert_type(t, jnp.int32), 23)
  power = lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + exponent,
                                   jnp.float32)
  return jnp.where(x < _SMALLEST, 0.0, power)
