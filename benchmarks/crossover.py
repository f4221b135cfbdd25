"""Where "blockwise" starts to beat "xla": the rule behind implementation=None.

For each shape, the forward and the forward+backward (gradient of the sum) of
both implementations are jitted once, then timed in rounds with the four
contenders in a new random order each round; the medians are printed side by
side. CPU rule: jattn/_choose.py, CPU_BLOCKWISE_FROM.

  python benchmarks/crossover.py [--dtype bfloat16] [--rounds 15]
      [--shapes 1x64x8x64,1x128x8x64 ...]  # B x T x N x H, T = S
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn

DEFAULT_SHAPES = "1x64x8x64,1x128x8x64,1x256x8x64,16x256x2x64,16x256x2x32,1x1024x8x64"


def contenders(causal: bool):
  """name -> f(q, k, v): each implementation's forward and forward+backward, jitted."""
  fns = {}
  for impl in ("xla", "blockwise"):
    attend = functools.partial(jattn.dot_product_attention, implementation=impl,
                               is_causal=causal)
    fns[f"{impl} fwd"] = jax.jit(attend)
    fns[f"{impl} fwd+bwd"] = jax.jit(jax.grad(
        lambda q, k, v, attend=attend: attend(q, k, v).sum(), argnums=(0, 1, 2)))
  return fns


def medians_ms(fns, args, rounds: int, rng):
  for f in fns.values():  # compile and warm up
    jax.block_until_ready(f(*args))
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name in rng.permutation(list(fns)):
      start = time.perf_counter()
      jax.block_until_ready(fns[name](*args))
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x T x N x H, T = S")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
  print(f"{'B x T x N x H':>16} {'dtype':>9} {'causal':>6} | {'fwd ms: xla':>11} "
        f"{'blockwise':>9} | {'fwd+bwd ms: xla':>15} {'blockwise':>9}")
  for shape in args.shapes.split(","):
    B, T, N, H = (int(x) for x in shape.split("x"))
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), args.dtype) for _ in range(3))
    for causal in causals:
      ms = medians_ms(contenders(causal), (q, k, v), args.rounds, rng)
      print(f"{shape:>16} {args.dtype:>9} {'yes' if causal else 'no':>6} | "
            f"{ms['xla fwd']:11.2f} {ms['blockwise fwd']:9.2f} | "
            f"{ms['xla fwd+bwd']:15.2f} {ms['blockwise fwd+bwd']:9.2f}", flush=True)


if __name__ == "__main__":
  main()
