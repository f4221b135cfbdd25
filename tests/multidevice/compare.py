"""The checks of the 8-device scripts: a ring function against a single-device
reference, values and gradients with respect to every argument; one line per check
(`report`); a call that must raise (`raises`)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def check(name, ring_fn, ref_fn, arrays, *, tol, relative=False, eager=False) -> bool:
  """Prints "ok  name" or "FAIL name" with the errors; True when every error <= tol.

  relative: errors divided by the largest reference entry (at least 1), for
  cases whose logits (biases, slopes) make the entries large.
  eager: the forward and the pullback called outside jit, op by op. By default each side
  is one jitted program (forward and backward together): called eagerly the ring
  compiles its forward and backward afresh at every call, 3 to 4 times slower here.
  Under JATTN_FAIL_FAST (tools/mutation/run.py) the first failure exits: one is enough.
  """
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(
      jax.eval_shape(ref_fn, *arrays).shape), jnp.float32)

  def values_and_grads(fn, *arrays):
    """One forward pass for both (jax.vjp)."""
    out, pullback = jax.vjp(fn, *arrays)
    return out, list(pullback(cotangent.astype(out.dtype)))

  def run(fn):
    if eager:
      return values_and_grads(fn, *arrays)
    return jax.jit(values_and_grads, static_argnums=0)(fn, *arrays)

  (out, grads), (ref, ref_grads) = run(ring_fn), run(ref_fn)
  # in NumPy, since the ring's results live on the mesh and the reference's on one device
  out, ref = np.asarray(out), np.asarray(ref)
  grads, ref_grads = [np.asarray(g) for g in grads], [np.asarray(g) for g in ref_grads]
  scale = (lambda b: max(1.0, np.max(np.abs(b)))) if relative else (lambda b: 1.0)
  errors = [np.max(np.abs(a - b)) / scale(b) for a, b in zip([out] + grads, [ref] + ref_grads)]
  ok = all(e <= tol for e in errors) and all(np.all(np.isfinite(g)) for g in grads)
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {'relative ' if relative else ''}max |err| "
        f"out, grads = " + ", ".join(f"{e:.1e}" for e in errors), flush=True)
  if not ok and os.environ.get("JATTN_FAIL_FAST"):
    sys.exit(1)
  return ok


def report(name, ok, detail) -> bool:
  """Prints "ok  name: detail" or "FAIL name: detail"; returns ok."""
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
  return ok


def raises(name, fn, *needles, kinds=(ValueError,)) -> bool:
  """fn() must raise one of `kinds` whose message holds every needle."""
  try:
    fn()
  except kinds as e:
    return report(name, all(n in str(e) for n in needles), f"{type(e).__name__}: {e}")
  return report(name, False, "raised nothing")
