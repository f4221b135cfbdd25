"""Where "blockwise" starts to beat "xla": the rule behind implementation=None.

For each shape, the forward and the forward+backward of both implementations
are timed with `benchmarks/attention.py`'s builders and protocol (interleaved
rounds in a new random order, untimed calls before each timed one, medians)
and printed side by side. CPU rule: jattn/_src/impl/registry.py, CPU_BLOCKWISE_FROM.

  python benchmarks/crossover.py [--dtype bfloat16] [--rounds 15]
      [--shapes 1x64x8x64,1x128x8x64 ...]  # B x T x N x H, T = S
"""

import argparse

import jax.numpy as jnp
import numpy as np

import attention  # benchmarks/attention.py, beside this script: builders and timing

DEFAULT_SHAPES = "1x64x8x64,1x128x8x64,1x256x8x64,16x256x2x64,16x256x2x32,1x1024x8x64"
CONTENDERS = {impl: attention.jattn_builder(impl) for impl in ("xla", "blockwise")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x T x N x H, T = S")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--settle", type=float, default=0.5,
                      help="seconds of untimed calls of a contender before each timed one")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
  print(f"{'B x T x N x H':>16} {'dtype':>9} {'causal':>6} | {'fwd ms: xla':>11} "
        f"{'blockwise':>9} | {'fwd+bwd ms: xla':>15} {'blockwise':>9}")
  for shape in args.shapes.split(","):
    B, T, N, H = (int(x) for x in shape.split("x"))
    qkv = tuple(jnp.asarray(rng.standard_normal((B, T, N, H)), args.dtype) for _ in range(3))
    for causal in causals:
      ms = {mode: {name: 1e3 * sec for name, sec in attention.time_case(
          *qkv, causal, mode, CONTENDERS, args.rounds, 1, args.settle).items()}
          for mode in ("fwd", "fwdbwd")}
      print(f"{shape:>16} {args.dtype:>9} {'yes' if causal else 'no':>6} | "
            f"{ms['fwd']['xla']:11.2f} {ms['fwd']['blockwise']:9.2f} | "
            f"{ms['fwdbwd']['xla']:15.2f} {ms['fwdbwd']['blockwise']:9.2f}", flush=True)


if __name__ == "__main__":
  main()
