"""GPU benchmark of jattn's own Pallas kernel ("flex_gpu") against cuDNN and jax's Pallas mha.

NOT RUN ON A GPU: none was available when this was written. It was checked only
with --smoke (tiny shapes, the Pallas kernels in interpret mode on a CPU: the
script runs; the times say nothing about a GPU). A GPU owner runs it as

    python benchmarks/gpu_kernels.py [--lengths 1024 4096 16384] [--B 1] [--N 16] [--K 16]
                                     [--H 128] [--dtype bfloat16] [--rounds 5] [--out r.json]

Cases, forward and forward+backward, the same inputs for every contender, in one process:
  causal      flex_gpu with mask_mod=mods.causal() and with is_causal=True
              vs cuDNN (jax.nn.dot_product_attention(implementation="cudnn"))
              vs jax's Pallas mha (jax.experimental.pallas.ops.gpu.attention)
  no_mask     flex_gpu, cuDNN                       (the reference work for documents)
  documents   flex_gpu with mods.document: 16 equal documents packed in T
  window      flex_gpu local_window_size=(256, 0)   vs cuDNN's local_window_size
  alibi       flex_gpu mods.alibi, causal
  soft_cap    flex_gpu mods.soft_cap(30), causal

and the issue's goals, printed as ratios of medians: causal as a mask_mod within 1.2x of
cuDNN's causal; 16 documents at least 4x faster than no mask at T = 16k; soft-cap at most
1.2x of plain causal (flex_gpu). TFLOP/s counts the visible entries only (4 B N H per
visible (t, s) forward, 2.5x that forward+backward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from benchmarks.kernel_timing import interleaved, timed  # noqa: E402
from jattn import mods  # noqa: E402
from jattn._src.impl.interpret import pallas_interpret  # noqa: E402


def cases(args, T):
  """name -> (kwargs of dot_product_attention for flex_gpu, visible fraction, other contenders)."""
  N = args.N
  slopes = jnp.asarray(2.0 ** (-8.0 * (np.arange(N) + 1) / N), jnp.float32)
  ids = jnp.asarray(np.repeat(np.arange(16), -(-T // 16))[:T][None].repeat(args.B, 0))
  half = 0.5 + 0.5 / T
  return {
      "causal": (dict(is_causal=True), half, ("cudnn", "pallas_mha", "mask_mod")),
      "no_mask": (dict(), 1.0, ("cudnn",)),
      "documents": (dict(mask_mod=mods.document(ids)), 1 / 16, ()),
      "window": (dict(local_window_size=(256, 0)), min(1.0, 257 / T), ("cudnn",)),
      "alibi": (dict(is_causal=True, score_mod=mods.alibi(slopes)), half, ()),
      "soft_cap": (dict(is_causal=True, score_mod=mods.soft_cap(30.0)), half, ()),
  }


def contenders(kw, others):
  flex = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="flex_gpu", **kw)
  out = {"flex_gpu": flex}
  if "mask_mod" in others:
    out["flex_gpu:mask_mod"] = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="flex_gpu", mask_mod=mods.causal())
  if "cudnn" in others:
    out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", **kw)
  if "pallas_mha" in others:
    from jax.experimental.pallas.ops.gpu import attention
    out["pallas_mha"] = lambda q, k, v: attention.mha(
        q, k, v, segment_ids=None, causal=True, sm_scale=1 / np.sqrt(q.shape[-1]))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--B", type=int, default=1)
  parser.add_argument("--N", type=int, default=16)
  parser.add_argument("--K", type=int, default=16)
  parser.add_argument("--H", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes in interpret mode on any backend: checks the script, "
                           "measures nothing")
  args = parser.parse_args()
  platform = jax.devices()[0].platform
  if args.smoke:
    args.lengths, args.B, args.N, args.K, args.H, args.rounds = [64], 1, 2, 1, 32, 1
  elif platform != "gpu":
    raise SystemExit(f"needs an NVIDIA GPU (found {platform}); --smoke checks the script")
  device = jax.devices()[0].device_kind
  print(f"jax {jax.__version__}, {device}, {args.dtype}, B={args.B} N={args.N} K={args.K} "
        f"H={args.H}; medians of {args.rounds} interleaved rounds")
  results, median = [], {}
  for T in args.lengths:
    r = np.random.default_rng(0)
    inputs = tuple(jnp.asarray(r.normal(size=(args.B, T, n, args.H)), args.dtype)
                   for n in (args.N, args.K, args.K))
    for name, (kw, visible, others) in cases(args, T).items():
      if args.smoke:
        others = tuple(o for o in others if o == "mask_mod")  # no cuDNN or Triton here
      for backward in (False, True):
        with pallas_interpret() if args.smoke else contextlib.nullcontext():
          fns = {c: timed(f, inputs, backward) for c, f in contenders(kw, others).items()}
          times = interleaved(fns, args.rounds)
        flops = 4 * args.B * args.N * args.H * T * T * visible * (2.5 if backward else 1)
        pass_ = "fwd+bwd" if backward else "fwd"
        for c, ts in times.items():
          med = median[T, name, pass_, c] = statistics.median(ts)
          row = dict(T=T, case=name, pass_=pass_, contender=c, ms=1e3 * med,
                     tflops=flops / med / 1e12, device=device, smoke=args.smoke)
          results.append(row)
          print(f"T={T:<6d} {name:10s} {pass_:8s} {c:18s} {row['ms']:10.3f} ms "
                f"{row['tflops']:7.2f} TFLOP/s")
    for pass_ in ("fwd", "fwd+bwd"):
      goals = [("causal mask_mod / cuDNN causal (goal <= 1.2)",
                (T, "causal", pass_, "flex_gpu:mask_mod"), (T, "causal", pass_, "cudnn")),
               ("no mask / 16 documents (goal >= 4 at 16k)",
                (T, "no_mask", pass_, "flex_gpu"), (T, "documents", pass_, "flex_gpu")),
               ("soft-cap / causal (goal <= 1.2)",
                (T, "soft_cap", pass_, "flex_gpu"), (T, "causal", pass_, "flex_gpu"))]
      for text, a, b in goals:
        if a in median and b in median:
          print(f"T={T:<6d} {pass_:8s} {text}: {median[a] / median[b]:.2f}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results),
                                                 indent=1))


if __name__ == "__main__":
  main()
