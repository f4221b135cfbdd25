"""What choosing the kernel at lowering time costs a CPU user: trace + lower + compile.

`implementation=None` traces the choice of every platform (the TPU branch
builds splash's block tables, the CUDA branch jax's Pallas kernel) and lowers
only the CPU's; `implementation="blockwise"` is the CPU's program alone, what
None compiled to on CPU before the choice moved to lowering. For
`jit(grad(loss))` of a causal bfloat16 call, each is timed from cold caches
(jax's and splash's), in one process, and the ratio printed:

    python benchmarks/compile_time.py [--lengths 4096 32768] [--repeats 3]
    python benchmarks/compile_time.py --train-step   # the MQAR model's whole step instead

Nothing is executed: the arrays are `jax.ShapeDtypeStruct`s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

import jattn


def _clear_caches():
  jax.clear_caches()
  try:  # splash's own cache of block tables, and jattn's of splash kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info
    splash_attention_mask_info._process_mask.cache_clear()
    from jattn._src.impl import fused
    fused._splash_kernel.cache_clear()
  except (ImportError, AttributeError):
    pass


def time_stages(step, *args) -> dict:
  """Seconds to trace the jitted `step` on args, lower it for the CPU and compile it."""
  t0 = time.perf_counter()
  traced = step.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower(lowering_platforms=("cpu",))
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2, "total": t3 - t0}


def time_once(T: int, implementation, B=1, N=8, H=128) -> dict:
  """Seconds to trace, lower (for the CPU) and compile jit(grad(loss)) from cold caches."""
  _clear_caches()
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return time_stages(step, x, x, x)


def time_train_step(implementation) -> dict:
  """The same for the default MQAR config's jitted training step (two layers of
  attention, MLPs, AdamW), with `implementation` in every layer."""
  import pathlib
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  sys.path[:0] = [str(root), str(root / "examples")]
  import mqar_data
  import training
  from configs import mqar
  config = mqar.get_config()
  config.implementation = implementation
  _clear_caches()
  graphdef, tx, state = training.create_state(config)
  step = jax.jit(training.make_train_step(graphdef, tx))
  batch = mqar_data.train_batch(config, 0)
  return time_stages(step, state, batch)


def cpu_model() -> str:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next(l.split(":", 1)[1].strip() for l in out.splitlines() if "Model name" in l)
    return name + (" (AVX-512)" if "avx512f" in out else " (no AVX-512)")
  except (OSError, StopIteration):
    return platform.processor() or "unknown CPU"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--train-step", action="store_true",
                      help="time the MQAR training step (configs/mqar.py, T = 256) instead")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {cpu_model()}; median of {args.repeats} cold runs, seconds")
  print(f"{'T':>6} {'program':<22} {'trace':>7} {'lower':>7} {'compile':>8} {'total':>7} "
        f"{'vs CPU-only':>11}")
  programs = (("CPU only (blockwise)", "blockwise"), ("None (every platform)", None))
  for T in (["step"] if args.train_step else args.lengths):
    runs = {name: [] for name, _ in programs}
    for _ in range(args.repeats):  # interleaved, so load drifts hit both alike
      for name, implementation in programs:
        runs[name].append(time_train_step(implementation) if args.train_step
                          else time_once(T, implementation))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in runs.items()}
    base = medians["CPU only (blockwise)"]["total"]
    for name, m in medians.items():
      print(f"{T:>6} {name:<22} {m['trace']:7.2f} {m['lower']:7.2f} {m['compile']:8.2f} "
            f"{m['total']:7.2f} {m['total'] / base:10.2f}x")


if __name__ == "__main__":
  main()
