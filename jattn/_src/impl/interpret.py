"""Test-only: run jax's Pallas kernels ("splash", "pallas") in interpret mode.

    with jattn._src.impl.interpret.pallas_interpret():
      out = jattn.dot_product_attention(q, k, v, implementation="splash")

Inside the block the kernels are interpreted (slowly) on whatever platform
jax runs on, so CPU tests can check their values and gradients. The flag is
a context variable, read when a call is dispatched and made part of the
call's static kernel plan (so a jit cache never mixes the two modes).
"""

from __future__ import annotations

import contextlib
import contextvars

_INTERPRET = contextvars.ContextVar("jattn_pallas_interpret", default=False)


@contextlib.contextmanager
def pallas_interpret(enabled: bool = True):
  token = _INTERPRET.set(bool(enabled))
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def interpreting() -> bool:
  return _INTERPRET.get()
