"""Precision of the gradients into a score_mod's captured arrays in 16-bit, per implementation.

For ALiBi slopes, a relative-bias table and a learned soft-cap, in bfloat16 and
float16: the relative error (max |got - want| / max |want|) of the gradient with
respect to the captured array, against central finite differences of a float64
NumPy forward on the same (16-bit rounded) inputs and cotangent. The kernels
("flex_tpu", "flex_gpu", "flex_mgpu") run in Pallas interpret mode on this CPU.
Prints each error and its ratio to "xla"'s (goal: at most 2).

    python benchmarks/captured_grads.py [--impls xla,blockwise,flex_tpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jattn  # noqa: E402
from jattn._src.impl.interpret import pallas_interpret  # noqa: E402

B, T, S, N, K, H, D = 1, 128, 128, 4, 2, 32, 32
t_, s_ = np.arange(T)[:, None], np.arange(S)[None, :]
n_ = np.arange(N)[:, None, None]
CASES = {  # name -> (array, array -> score_mod, float64 NumPy score of (logits [N, T, S], array))
    "alibi_slopes": (np.array([0.5, 0.25, -0.125, 0.0625]), jattn.mods.alibi,
                     lambda l, a: l + a[n_] * (s_ - t_)),
    "relative_bias_table": (np.random.default_rng(1).standard_normal((N, 9)),
                            jattn.mods.relative_bias,
                            lambda l, a: l + a[n_, np.clip(s_ - t_, -4, 4) + 4]),
    "soft_cap": (np.array(2.0), jattn.mods.soft_cap, lambda l, a: a * np.tanh(l / a)),
}


def _data(dtype):
  rng = np.random.default_rng(0)
  q, k, v, do = (rng.standard_normal(shape) for shape in (
      (B, T, N, H), (B, S, K, H), (B, S, K, D), (B, T, N, D)))
  q = 2.0 * q  # logits past +-1, as trained models have
  # the reference sees the same 16-bit values
  return [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
          for x in (q, k, v, do)]


def _reference_loss(q, k, v, do, score, a):
  kk, vv = np.repeat(k[0], N // K, axis=1), np.repeat(v[0], N // K, axis=1)  # [S, N, *]
  logits = score(np.einsum("tnh,snh->nts", q[0], kk) / np.sqrt(H), a)
  logits = np.where(s_ <= t_, logits, -np.inf)  # causal
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return float(np.sum(np.einsum("nts,snd->tnd", p, vv) * do[0]))


def _reference_grad(data, score, a, eps=1e-5):
  a = np.array(a, np.float64)
  g = np.zeros_like(a)
  for i in np.ndindex(a.shape):
    up, down = a.copy(), a.copy()
    up[i] += eps
    down[i] -= eps
    g[i] = (_reference_loss(*data, score, up) - _reference_loss(*data, score, down)) / (2 * eps)
  return g


def _grad(impl, dtype, data, make, a):
  q, k, v, do = (jnp.asarray(x, dtype) for x in data)

  def loss(a, q, k, v, do):  # the arrays as arguments: no constant folding of the data
    out = jattn.dot_product_attention(q, k, v, is_causal=True, score_mod=make(a),
                                      implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
  interpret = pallas_interpret() if impl.startswith("flex") else contextlib.nullcontext()
  with interpret:
    return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(a, jnp.float32), q, k, v, do),
                      np.float64)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--impls", default="xla,blockwise,flex_tpu,flex_gpu,flex_mgpu")
  parser.add_argument("--dtypes", default="bfloat16,float16")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  results = []
  for dtype in args.dtypes.split(","):
    data = _data(dtype)
    for name, (a, make, score) in CASES.items():
      want = _reference_grad(data, score, a)
      errors = {}
      for impl in args.impls.split(","):
        try:
          got = _grad(impl, dtype, data, make, a)
        except Exception as e:  # a kernel this jax cannot run: say why, go on
          print(f"{dtype:9s} {name:20s} {impl:10s} refused: {str(e).splitlines()[0][:90]}")
          continue
        errors[impl] = float(np.abs(got - want).max() / np.abs(want).max())
        ratio = errors[impl] / errors["xla"] if "xla" in errors else float("nan")
        print(f"{dtype:9s} {name:20s} {impl:10s} error {errors[impl]:.2e}  x{ratio:.2f} xla's")
        results.append(dict(dtype=dtype, case=name, implementation=impl,
                            relative_error=errors[impl], ratio_to_xla=ratio))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(dict(
        shape=dict(B=B, T=T, S=S, N=N, K=K, H=H, D=D), jax=jax.__version__,
        results=results), indent=1))


if __name__ == "__main__":
  main()
