"""Test-only: run jax's Pallas kernels ("splash", "pallas") in interpret mode.

    with jattn._src.impl.interpret.pallas_interpret():
      out = jattn.dot_product_attention(q, k, v, implementation="splash")

Inside the block the kernels are interpreted (slowly) on whatever platform
jax runs on, so CPU tests can check their values and gradients. The flag is
a context variable, read when a call is dispatched and made part of the
call's static kernel plan (so a jit cache never mixes the two modes).

tpu: a `jax.experimental.pallas.tpu.InterpretParams` runs "flex_tpu"'s kernels
under jax's TPU interpreter with those options (race detection, uninitialised
memory as NaN, out-of-bounds checks) instead of the generic interpreter.
"""

from __future__ import annotations

import contextlib
import contextvars

from jattn._src.kernels import flex_tpu

_INTERPRET = contextvars.ContextVar("jattn_pallas_interpret", default=False)


@contextlib.contextmanager
def pallas_interpret(enabled: bool = True, *, tpu=None):
  token = _INTERPRET.set(bool(enabled))
  tpu_token = flex_tpu.TPU_INTERPRETER.set(tpu)
  try:
    yield
  finally:
    flex_tpu.TPU_INTERPRETER.reset(tpu_token)
    _INTERPRET.reset(token)


def interpreting() -> bool:
  return _INTERPRET.get()
