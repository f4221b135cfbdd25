"""One training step of the default MQAR model: jattn.nnx vs flax.nnx attention.

Both models are the same Transformer (jattn.transformer) with the same
parameters; only the attention module differs. Both use learned positions
(flax's module cannot apply the default config's rotary embeddings). Both steps run in this process,
interleaved, and the medians are compared.

  python benchmarks/train_step.py [--repeats 20] [--config.batch_size=32 ...]
"""

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import mqar_data  # noqa: E402
import training  # noqa: E402
from configs import mqar  # noqa: E402


def flax_attention(config, rngs):
  return nnx.MultiHeadAttention(config.num_heads, config.features,
                                num_kv_heads=config.num_kv_heads, decode=False, rngs=rngs)


def compiled_step(config, attention):
  graphdef, tx, state = training.create_state(config, attention)
  step = jax.jit(training.make_train_step(graphdef, tx), donate_argnums=0)
  return step, state


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()
  config = mqar.get_config()
  # flax's module has no hook to rotate q and k, so both models use learned positions
  config.position_encoding = "learned"
  batch = jax.device_put(mqar_data.train_batch(config, 0))
  runs = {"jattn.nnx": compiled_step(config, None),
          "flax.nnx": compiled_step(config, flax_attention)}
  times = {name: [] for name in runs}
  states = {name: state for name, (_, state) in runs.items()}
  for i in range(args.warmup + args.repeats):
    for name, (step, _) in runs.items():  # interleaved, so load changes hit both
      start = time.perf_counter()
      states[name], metrics = step(states[name], batch)
      jax.block_until_ready((states[name], metrics))
      if i >= args.warmup:
        times[name].append(time.perf_counter() - start)
  medians = {name: statistics.median(t) for name, t in times.items()}
  print(f"devices: {jax.devices()}; B={config.batch_size} T={config.seq_len} "
        f"F={config.features} N={config.num_heads} layers={config.num_layers}")
  for name, m in medians.items():
    print(f"{name:>10}: median {m * 1e3:8.2f} ms/step over {args.repeats} steps "
          f"(min {min(times[name]) * 1e3:.2f})")
  print(f"ratio jattn / flax: {medians['jattn.nnx'] / medians['flax.nnx']:.3f} "
        "(< 1: jattn faster)")


if __name__ == "__main__":
  main()
