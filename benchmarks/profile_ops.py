"""Where the time of one attention call goes: XLA:CPU's per-operation trace.

Runs the jitted call a few times under `jax.profiler.trace` with XLA:CPU's
per-thunk trace events on, reads the Perfetto trace it writes, and prints the
operations (fusions, matmuls, loops) by total time per call, with the
optimised HLO's line for each so that a name can be matched to what it
computes. Durations of operations that ran concurrently add up to more than
the wall time. Also prints the GFLOP/s of a large float32 matmul, the roofline
the attention's two (forward) or seven (forward+backward) matmuls run against.

  python benchmarks/profile_ops.py [--T 4096] [--mode fwd|fwdbwd] [--causal]
      [--implementation blockwise] [--top 20] [--hlo]
"""

import argparse
import collections
import functools
import os
import re
import statistics
import time

# Must be set before JAX starts its CPU backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attention  # noqa: E402  (benchmarks/attention.py, beside this script)
from perfetto_trace import trace_events  # noqa: E402  (beside this script too)
import jattn  # noqa: E402


def build(args):
  attend = functools.partial(jattn.dot_product_attention, is_causal=args.causal,
                             implementation=args.implementation)
  if args.mode == "fwd":
    return jax.jit(attend)
  return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--B", type=int, default=1)
  parser.add_argument("--T", type=int, default=4096, help="T = S")
  parser.add_argument("--N", type=int, default=8)
  parser.add_argument("--H", type=int, default=64)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--implementation", default="blockwise")
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--top", type=int, default=20)
  parser.add_argument("--hlo", action="store_true", help="print each op's HLO line")
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  inputs = tuple(jnp.asarray(rng.standard_normal((args.B, args.T, args.N, args.H)), args.dtype)
                 for _ in range(3))
  f = build(args)
  hlo = f.lower(*inputs).compile().as_text()
  for _ in range(2):  # compile and warm up
    jax.block_until_ready(f(*inputs))

  total = collections.Counter()
  count = collections.Counter()
  for event in trace_events(f, inputs, args.calls):
    name = event.get("name", "")
    # Keep XLA's operations; drop Python frames and the executor's own spans.
    if event.get("ph") != "X" or name.startswith("$") or "Executor" in name:
      continue
    total[name] += event["dur"]
    count[name] += 1

  wall = []
  for _ in range(args.calls):
    start = time.perf_counter()
    jax.block_until_ready(f(*inputs))
    wall.append(time.perf_counter() - start)
  print(f"{args.implementation} {args.mode} B={args.B} T=S={args.T} N={args.N} H={args.H} "
        f"{args.dtype} causal={args.causal}: {1e3 * statistics.median(wall):.1f} ms per call "
        f"untraced (median of {args.calls}); a 2048^3 float32 matmul runs at "
        f"{attention.matmul_gflops(2048, 2048, 2048, rounds=5):.0f} GFLOP/s. "
        f"Per operation, ms per call:")
  for name, us in total.most_common(args.top):
    print(f"{us / 1e3 / args.calls:9.1f} ms  x{count[name] // args.calls:<5d} {name}")
    if args.hlo:
      line = re.search(rf"^\s*%?{re.escape(name)} = .*$", hlo, re.MULTILINE)
      if line:
        print("             " + re.sub(r", metadata=\{.*", "", line.group(0).strip())[:200])


if __name__ == "__main__":
  main()
