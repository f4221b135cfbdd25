"""Ring attention on simulated CPU devices: per-device memory and time against T and P.

    python benchmarks/ring.py --out runs/ring            # memory grid + timings
    python benchmarks/ring.py --time-up-to 131072        # also time the longest

Per-device memory is XLA's own account of the compiled SPMD program (argument,
output and temporary buffers of one device, `compiled.memory_analysis()`), for
the forward and the forward+backward (gradient wrt query, key and value). P=1
is the same ring on one device: the single-device blockwise implementation.
The devices are simulated (`--xla_force_host_platform_device_count`) and share
this machine's cores, so times show the work, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

MAX_DEVICES = 8
# simulated devices, kept beside any flags already set (the test suite sets some)
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={MAX_DEVICES}").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jattn  # noqa: E402

MiB = 2**20


def make_inputs(mesh, T, N, H):
  """query, key, value [1, T, N, H] float32, sharded over T on the mesh's 'seq' axis."""
  sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))
  keys = jax.random.split(jax.random.key(0), 3)
  make = jax.jit(lambda key: jax.random.normal(key, (1, T, N, H), jnp.float32),
                 out_shardings=sharding)
  return [make(k) for k in keys]


def ring_functions(mesh):
  forward = jax.jit(lambda q, k, v: jattn.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True))
  loss = lambda q, k, v: jnp.sum(jattn.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True))
  forward_backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return {"forward": forward, "forward+backward": forward_backward}


def per_device_mib(fn, args) -> float:
  stats = fn.lower(*args).compile().memory_analysis()
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return total / MiB


def median_ms(fn, args, repeats) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="8192,16384,32768,65536,131072")
  parser.add_argument("--devices", default="1,2,4,8")
  parser.add_argument("--heads", type=int, default=2, help="N (= K)")
  parser.add_argument("--depth", type=int, default=64, help="H")
  parser.add_argument("--time-up-to", type=int, default=32768,
                      help="time forward (P=8) for T up to this; longer T: memory only")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="runs/ring")
  args = parser.parse_args()
  lengths = [int(t) for t in args.lengths.split(",")]
  device_counts = [int(p) for p in args.devices.split(",")]
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)

  rows = []
  print(f"causal ring attention, B=1 N=K={args.heads} H={args.depth} float32, "
        f"{jax.device_count()} simulated CPU devices")
  print(f"{'T':>7} {'P':>2} {'fwd MiB/dev':>12} {'fwd+bwd MiB/dev':>16} {'fwd ms (P=8)':>13}")
  for T in lengths:
    for P in device_counts:
      mesh = Mesh(np.array(jax.devices()[:P]), ("seq",))
      q, k, v = make_inputs(mesh, T, args.heads, args.depth)
      fns = ring_functions(mesh)
      row = {"T": T, "P": P}
      for name, fn in fns.items():
        row[f"{name} MiB/device"] = per_device_mib(fn, (q, k, v))
      if P == max(device_counts) and T <= args.time_up_to:
        row["forward ms"] = median_ms(fns["forward"], (q, k, v), args.repeats)
      rows.append(row)
      timing = f"{row['forward ms']:13.0f}" if "forward ms" in row else f"{'-':>13}"
      print(f"{T:7d} {P:2d} {row['forward MiB/device']:12.1f} "
            f"{row['forward+backward MiB/device']:16.1f} {timing}", flush=True)

  (out_dir / "ring.json").write_text(json.dumps(rows, indent=1))
  plot(rows, device_counts, out_dir / "ring_memory.png")
  print(f"wrote {out_dir / 'ring.json'} and {out_dir / 'ring_memory.png'}")


def plot(rows, device_counts, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for P in device_counts:
    points = [(r["T"], r["forward+backward MiB/device"]) for r in rows if r["P"] == P]
    ax.plot(*zip(*points), marker="o", label=f"P={P}")
  ax.set(xscale="log", yscale="log", xlabel="sequence length T",
         ylabel="MiB per device (fwd+bwd)", title="Ring attention: memory per device")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
