"""One check for the 8-device scripts: a ring function against a single-device
reference, values and gradients with respect to every argument."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def check(name, ring_fn, ref_fn, arrays, *, tol, relative=False) -> bool:
  """Prints "ok  name" or "FAIL name" with the errors; True when every error <= tol.

  relative: errors divided by the largest reference entry (at least 1), for
  cases whose logits (biases, slopes) make the entries large.
  Under JATTN_FAIL_FAST (tools/mutation/run.py) the first failure exits: one is enough.
  """
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(
      jax.eval_shape(ref_fn, *arrays).shape), jnp.float32)

  def values_and_grads(fn):
    """One forward pass for both (jax.vjp); in NumPy, since the ring's results live
    on the mesh and the reference's on one device."""
    out, pullback = jax.vjp(fn, *arrays)
    return np.asarray(out), [np.asarray(g) for g in pullback(cotangent.astype(out.dtype))]

  (out, grads), (ref, ref_grads) = values_and_grads(ring_fn), values_and_grads(ref_fn)
  scale = (lambda b: max(1.0, np.max(np.abs(b)))) if relative else (lambda b: 1.0)
  errors = [np.max(np.abs(a - b)) / scale(b) for a, b in zip([out] + grads, [ref] + ref_grads)]
  ok = all(e <= tol for e in errors) and all(np.all(np.isfinite(g)) for g in grads)
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {'relative ' if relative else ''}max |err| "
        f"out, grads = " + ", ".join(f"{e:.1e}" for e in errors), flush=True)
  if not ok and os.environ.get("JATTN_FAIL_FAST"):
    sys.exit(1)
  return ok
