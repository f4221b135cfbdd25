"""Context parallelism on 8 devices: the load balance, bytes, memory, and measured time.

    python benchmarks/context_parallel.py --out runs/cp          # ~4 min on 2 cores
    python benchmarks/context_parallel.py --out runs/cp --plot docs/images/context_parallel_balance.png
    python benchmarks/context_parallel.py --parts balance --out runs/cp   # part 1 alone: seconds

1. Balance (counts from the plan, nothing computed): at T = 32k and 128k on 8
   devices, the non-empty 256 x 256 block pairs per device, max / mean, for the
   zig-zag order and for the mask-aware balance, and the modelled critical path of
   a ring pass (the sum over ring steps of the busiest device's work in that step,
   since each step ends in a ppermute; at least the mean work per device): causal,
   16 documents of random lengths (causal), a causal 4k window, prefix-LM with a
   T / 4 prefix. Then the planning at pod scale: at P = 8 to 256 devices and
   T = 4096 P (16 P chunks of 256 tokens, as the balance deals them), the seconds
   the balance's search takes (`balance.plan` on the block table, NumPy) and the
   critical path it finds, against zig-zag's, the mean work, and the exhaustive
   search's before the pod-scale budget (recorded at commit eef80ee on the 2-core
   Intel Xeon that ran the results: `BEFORE`); and for 16 documents the whole `context_parallel_plan` call,
   which also classifies the mask's blocks (jax, on the host).
2. Bytes each device sends (forward + backward) and the memory it holds, per
   strategy, from the plan (B=1, N=32, K=8, H=D=128, bfloat16, causal).
3. Per-device memory of the compiled forward + backward (XLA's own account of one
   device's SPMD program, `compiled.memory_analysis()`: arguments, outputs and
   temporaries) per strategy against T and P, and the same divided by T / P: flat
   where memory is linear in T / P (compiled, not run; causal, float32).
4. Measured forward + backward time of each strategy on 8 simulated CPU devices
   at a small size, as ratios to the zig-zag ring, in one process. The 8
   simulated devices share this machine's cores, so wall time measures the total
   work of all devices, not the balance (the slowest device on real hardware).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

# simulated devices, kept beside any flags already set (the test suite sets some)
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402

P = 8
ZIGZAG = jattn.ChunkOrder(tuple((i, 2 * P - 1 - i) for i in range(P)), "zig-zag")


def documents(T: int, count: int, seed: int = 0) -> np.ndarray:
  """int [1, T]: `count` packed documents, lengths from `count - 1` random cuts."""
  cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), count - 1, replace=False))
  return np.searchsorted(cuts, np.arange(T), side="right")[None].astype(np.int32)


def masks(T: int) -> dict:
  return {
      "causal": dict(is_causal=True),
      "16 documents": dict(is_causal=True, mask_mod=mods.document(documents(T, 16))),
      "4k window": dict(is_causal=True, local_window_size=(4096, 0)),
      "prefix-LM": dict(mask_mod=mods.prefix_lm(np.array([T // 4], np.int32))),
  }


def balance_rows(lengths):
  rows = []
  for T in lengths:
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    for name, kw in masks(T).items():
      plan = lambda **lb: jattn.context_parallel_plan(q, q, q, mesh=AbstractMesh((P,), ("seq",)),
                                                      strategy="ring", **lb, **kw)
      balanced, zigzag = plan(), plan(load_balance=ZIGZAG)
      b, z = balanced.costs["ring"], zigzag.costs["ring"]
      rows.append(dict(T=T, mask=name, order=str(balanced.order), block=balanced.block,
                       zigzag_imbalance=z.imbalance, balanced_imbalance=b.imbalance,
                       zigzag_work=z.work, balanced_work=b.work,
                       zigzag_critical_path=z.critical_path,
                       balanced_critical_path=b.critical_path,
                       mean_work=b.mean_work))  # the critical path's lower bound
  return rows


# The exhaustive search (commit eef80ee) on the tables of `plan_blocks`, 2-core Intel Xeon:
# (seconds of balance.plan, critical path). 64 devices and more did not finish in minutes.
BEFORE = {(8, "causal"): (0.02, 1032), (8, "16 documents"): (0.27, 148),
          (8, "4k window"): (0.05, 258), (8, "prefix-LM"): (0.02, 1094),
          (16, "causal"): (0.11, 2056), (16, "16 documents"): (4.7, 288),
          (16, "4k window"): (0.16, 272), (16, "prefix-LM"): (0.09, 2182),
          (32, "causal"): (1.4, 4104), (32, "16 documents"): (36.8, 531),
          (32, "4k window"): (1.4, 272), (32, "prefix-LM"): (0.86, 4358)}


def plan_blocks(P: int, b: int = 256) -> dict:
  """bool block tables of the four masks at T = 4096 P in b x b blocks, from each block's
  first and last rows and columns (16 documents: shared where their documents overlap)."""
  T = 4096 * P
  q0 = np.arange(T // b)[:, None] * b
  k0, q1, k1 = q0.T, q0 + b - 1, q0.T + b - 1
  ids = documents(T, 16)[0]
  return {"causal": k0 <= q1,
          "16 documents": (k0 <= q1) & (ids[k1] >= ids[q0]) & (ids[k0] <= ids[q1]),
          "4k window": (k0 <= q1) & (q0 - k1 <= 4096),
          "prefix-LM": (k0 < T // 4) | (k0 <= q1)}


def planning_rows(device_counts):
  from jattn._src.parallel import balance
  rows = []
  for P_ in device_counts:
    for name, blocks in plan_blocks(P_).items():
      start = time.perf_counter()
      order, work = balance.plan(blocks, P_, (1,) + balance.CHUNKS)
      seconds = time.perf_counter() - start
      zigzag = balance.work_of(balance.zigzag(P_), blocks).critical_path
      before_s, before_path = BEFORE.get((P_, name), (None, None))
      rows.append(dict(P=P_, mask=name, order=str(order), plan_s=seconds,
                       critical_path=work.critical_path, mean_work=work.mean,
                       zigzag_critical_path=zigzag, path_over_mean=work.critical_path / work.mean,
                       before_s=before_s, before_critical_path=before_path,
                       path_over_before=work.critical_path / before_path if before_path else None))
    T = 4096 * P_
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    start = time.perf_counter()
    jattn.context_parallel_plan(q, q, q, mesh=AbstractMesh((P_,), ("seq",)), strategy="ring",
                                is_causal=True, mask_mod=mods.document(documents(T, 16)))
    rows.append(dict(P=P_, mask="16 documents", order="context_parallel_plan, whole call",
                     plan_s=time.perf_counter() - start))
  return rows


def bytes_rows(lengths):
  rows = []
  for T in lengths:
    q = jax.ShapeDtypeStruct((1, T, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    plan = jattn.explain(q, kv, kv, mesh=AbstractMesh((P,), ("seq",)), is_causal=True)
    for name, c in plan.costs.items():
      rows.append(dict(T=T, strategy=name, refused=c.refused,
                       bytes_sent_mib=max(c.bytes_sent) / 2**20 if c.bytes_sent else None,
                       memory_mib=c.memory / 2**20 if not c.refused else None,
                       chosen=name == plan.strategy))
  return rows


def memory_rows(lengths, device_counts):
  rows = []
  for P_ in device_counts:
    mesh = Mesh(np.array(jax.devices()[:P_]), ("seq",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))
    for T in lengths:
      x = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32, sharding=sharding)
      for strategy in ("ring", "all_gather", "ulysses"):
        loss = lambda q, k, v, strategy=strategy: jnp.sum(jattn.context_parallel_attention(
            q, k, v, mesh=mesh, strategy=strategy, is_causal=True))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        stats = step.lower(x, x, x).compile().memory_analysis()
        mib = (stats.argument_size_in_bytes + stats.output_size_in_bytes
               + stats.temp_size_in_bytes - stats.alias_size_in_bytes) / 2**20
        rows.append(dict(T=T, P=P_, strategy=strategy, fwd_bwd_mib=mib,
                         mib_per_1k_tokens_per_device=mib / (T / P_ / 1024)))
  return rows


def timing_rows(T: int, repeats: int):
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, T, 8, 64), jnp.float32) for key in keys)
  ids = documents(T, 16)
  rows = []
  for name, kw in (("causal", dict(is_causal=True)),
                   ("16 documents", dict(is_causal=True, mask_mod=mods.document(ids)))):
    variants = {"ring, zig-zag": dict(strategy="ring", load_balance=ZIGZAG),
                "ring, balanced": dict(strategy="ring"),
                "all_gather, balanced": dict(strategy="all_gather"),
                "ulysses": dict(strategy="ulysses")}
    steps = {}
    for label, extra in variants.items():
      loss = lambda q, k, v, extra=extra: jnp.sum(jattn.context_parallel_attention(
          q, k, v, mesh=mesh, **extra, **kw))
      steps[label] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
      jax.block_until_ready(steps[label](q, k, v))  # compile and warm up
    samples = {label: [] for label in variants}
    for _ in range(repeats):  # round robin: a change of load on shared cores hits all alike
      for label, step in steps.items():
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        samples[label].append(time.perf_counter() - start)
    times = {label: statistics.median(s) for label, s in samples.items()}
    base = times["ring, zig-zag"]
    for label, t in times.items():
      rows.append(dict(T=T, mask=name, variant=label, ms=1e3 * t, ratio=t / base))
  return rows


def cpu():
  info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
  model = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                if l.startswith("Model name")), "?")
  flags = open("/proc/cpuinfo").read()
  avx512 = sorted({w for w in flags.split() if w.startswith("avx512")})
  return dict(model=model, avx512=avx512, cores=os.cpu_count())


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  row = next(r for r in rows if r["mask"] == "16 documents" and r["T"] == 32768)
  fig, ax = plt.subplots(figsize=(7, 3.2))
  x = np.arange(P)
  ax.bar(x - 0.2, row["zigzag_work"], 0.4, label=f"zig-zag (max/mean {row['zigzag_imbalance']:.2f}"
         f", ring critical path {row['zigzag_critical_path']:.0f})")
  ax.bar(x + 0.2, row["balanced_work"], 0.4,
         label=f"{row['order']} (max/mean {row['balanced_imbalance']:.2f}, ring critical path "
               f"{row['balanced_critical_path']:.0f})")
  ax.axhline(row["mean_work"], color="gray", lw=0.8, ls="--",
             label=f"mean {row['mean_work']:.1f}: the critical path's lower bound")
  ax.set_xlabel("device")
  ax.set_ylabel("non-empty 256x256 block pairs")
  ax.set_title("16 causal documents of random lengths, T = 32k, 8 devices")
  ax.set_ylim(0, 1.6 * max(row["zigzag_work"]))
  ax.legend(fontsize=8, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def table(rows, keys):
  lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
  for r in rows:
    cells = [(f"{r[k]:.3f}" if r[k] < 10 else f"{r[k]:.0f}") if isinstance(r.get(k), float)
             else "" if r.get(k) is None else str(r[k]) for k in keys]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="32768,131072")
  parser.add_argument("--plan-devices", default="8,16,32,64,256",
                      help="device counts of the planning rows (part balance); empty: none")
  parser.add_argument("--memory-lengths", default="8192,32768")
  parser.add_argument("--memory-devices", default="4,8")
  parser.add_argument("--time-length", type=int, default=4096, help="T of the timed runs")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="runs/cp")
  parser.add_argument("--plot", default=None, help="PNG of per-device work, documents")
  parser.add_argument("--parts", default="balance,bytes,memory,timing",
                      help="the parts to run, comma-separated (balance, bytes, memory, timing)")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  if parts - {"balance", "bytes", "memory", "timing"}:
    parser.error(f"--parts names balance, bytes, memory or timing, got {args.parts}")
  lengths = [int(x) for x in args.lengths.split(",")]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = dict(cpu=cpu(), jax=jax.__version__, devices=P,
                 command=" ".join(["python"] + sys.argv))
  if "balance" in parts:
    results["balance"] = balance_rows(lengths)
    print(table(results["balance"], ["T", "mask", "order", "zigzag_imbalance",
                                     "balanced_imbalance", "zigzag_critical_path",
                                     "balanced_critical_path", "mean_work"]), flush=True)
    if args.plan_devices:
      jattn.context_parallel_plan(*(jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16),) * 3,
                                  mesh=AbstractMesh((P,), ("seq",)), strategy="ring",
                                  is_causal=True)  # compiles what the timed calls reuse
      results["planning"] = planning_rows([int(x) for x in args.plan_devices.split(",")])
      print(table(results["planning"], ["P", "mask", "order", "plan_s", "before_s",
                                        "critical_path", "before_critical_path",
                                        "path_over_before", "zigzag_critical_path",
                                        "mean_work"]), flush=True)
  if "bytes" in parts:
    results["bytes"] = bytes_rows(lengths)
    print(table(results["bytes"], ["T", "strategy", "bytes_sent_mib", "memory_mib", "chosen"]),
          flush=True)
  if "memory" in parts:
    results["memory"] = memory_rows([int(x) for x in args.memory_lengths.split(",")],
                                    [int(x) for x in args.memory_devices.split(",")])
    print(table(results["memory"], ["T", "P", "strategy", "fwd_bwd_mib",
                                    "mib_per_1k_tokens_per_device"]), flush=True)
  if "timing" in parts and args.time_length:
    results["timing"] = timing_rows(args.time_length, args.repeats)
    print(table(results["timing"], ["T", "mask", "variant", "ms", "ratio"]), flush=True)
  (out / "context_parallel.json").write_text(json.dumps(results, indent=1, default=str))
  if args.plot and "balance" in parts:
    plot(results["balance"], args.plot)
  print(results["cpu"])


if __name__ == "__main__":
  main()
