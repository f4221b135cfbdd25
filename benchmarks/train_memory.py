"""Memory of one MQAR training step: the blockwise path against the dense one.

For a config (default: configs/mqar_long_context.py, T = 4096), compiles the
jitted training step twice, once with `implementation="blockwise"` and once
with "xla" (the dense [T, S] scores and weights), and prints XLA's memory
analysis of each (temporaries: what the step allocates beyond its arguments
and outputs), then each one's peak resident memory over a few steps, measured
in a child process of its own (`ru_maxrss`), and the ratios.

  python benchmarks/train_memory.py [--steps 2] [--config.seq_len=8192 ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from compile_time import cpu_model  # noqa: E402

IMPLEMENTATIONS = ("blockwise", "xla")


def load_config(overrides: list[str]):
  from configs import mqar_long_context
  config = mqar_long_context.get_config()
  for item in overrides:  # --config.field=value
    field, value = item.removeprefix("--config.").split("=", 1)
    config[field] = type(config[field])(value)
  return config


def measure(implementation: str, steps: int, overrides: list[str]) -> dict:
  """In this process: compile the step, read its memory analysis, run `steps` steps."""
  import jax
  import mqar_data
  import training
  config = load_config(overrides)
  config.implementation = implementation
  graphdef, tx, state = training.create_state(config)
  step = jax.jit(training.make_train_step(graphdef, tx), donate_argnums=0)
  batch = jax.device_put(mqar_data.train_batch(config, 0))
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  times = []
  for i in range(steps):
    start = time.perf_counter()
    state, metrics = compiled(state, jax.device_put(mqar_data.train_batch(config, i)))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return {"implementation": implementation, "T": config.seq_len, "B": config.batch_size,
          "temp_bytes": analysis.temp_size_in_bytes,
          "argument_bytes": analysis.argument_size_in_bytes,
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "compile_s": compile_s, "step_s": sorted(times)[len(times) // 2]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2, help="steps run after compiling")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args, overrides = parser.parse_known_args()
  if args.child:  # one implementation, in a process of its own (its own peak RSS)
    print(json.dumps(measure(args.child, args.steps, overrides)))
    return
  results = {}
  for implementation in IMPLEMENTATIONS:
    out = subprocess.run([sys.executable, __file__, "--child", implementation,
                          "--steps", str(args.steps), *overrides],
                         capture_output=True, text=True)
    if out.returncode:
      print(f"{implementation}: failed\n{out.stderr[-2000:]}")
      continue
    results[implementation] = json.loads(out.stdout.strip().splitlines()[-1])
  config = load_config(overrides)
  print(f"{cpu_model()}; T={config.seq_len} B={config.batch_size} "
        f"F={config.features} N={config.num_heads} layers={config.num_layers}")
  print(f"{'implementation':<15} {'XLA temporaries':>16} {'peak RSS':>10} "
        f"{'compile':>8} {'step (median)':>14}")
  mib = 2 ** 20
  for name, r in results.items():
    print(f"{name:<15} {r['temp_bytes'] / mib:13.0f} MiB {r['peak_rss_bytes'] / mib:6.0f} MiB "
          f"{r['compile_s']:7.1f}s {r['step_s']:13.2f}s")
  if len(results) == 2:
    b, x = results["blockwise"], results["xla"]
    print(f"dense / blockwise: temporaries {x['temp_bytes'] / b['temp_bytes']:.1f}x, "
          f"peak RSS {x['peak_rss_bytes'] / b['peak_rss_bytes']:.1f}x, "
          f"step time {x['step_s'] / b['step_s']:.2f}x")


if __name__ == "__main__":
  main()
