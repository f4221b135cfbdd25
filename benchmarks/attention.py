"""Side-by-side attention benchmark: jattn's implementations against jax.nn, flax.nnx,
PyTorch and tokamax.

torch and tokamax are optional contenders (`pip install torch==2.13.0`,
`pip install tokamax==0.0.12`), skipped with a message when not importable.

One process, the same inputs for every contender (B=1, N=8, H=64 by default),
warm-ups, then rounds that run every contender once each (so load from other
processes spreads over all of them), reporting the median. Peak memory is
measured per case in a child process (its ru_maxrss).

    python benchmarks/attention.py --out bench_out
    python benchmarks/attention.py --out bench_out --sizes 4096 --dtypes float32 \\
        --modes fwd --causal both
    python benchmarks/attention.py --out bench_out --memory-only   # the long cases

Writes bench_out/results.json and bench_out/chart.png, and prints the table.
GFLOP/s counts 4 B N T S H flops for the forward (halved when causal) and
2.5 times that for the backward, as the flash-attention papers do.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jattn  # noqa: E402

B, N, H = 1, 8, 64
ANCHORS = ("torch", "jax.nn")


def _torch():
  try:
    import torch
  except ImportError:
    return None
  return torch


def _tokamax():
  try:  # optional, like torch: pip install tokamax==0.0.12 (runs beside jax 0.10)
    import tokamax
    from absl import flags
  except ImportError:
    return None
  if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; ours are not theirs
    flags.FLAGS(sys.argv[:1])
  return tokamax


# ---------------------------------------------------------------- contenders
# Each builder returns a zero-argument callable that runs one call to completion.

def _jax_runner(fn, q, k, v, mode, dtype):
  if mode == "fwd":
    f = jax.jit(fn)
    return lambda: f(q, k, v).block_until_ready()
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), dtype)

  @jax.jit
  def fwd_bwd(q, k, v):
    out, pullback = jax.vjp(fn, q, k, v)
    return out, pullback(ct)
  return lambda: jax.block_until_ready(fwd_bwd(q, k, v))


def jattn_builder(impl):
  def build(q, k, v, causal, mode, dtype):
    fn = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl)
    return _jax_runner(fn, q, k, v, mode, dtype)
  return build


def jax_nn(q, k, v, causal, mode, dtype):
  fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  return _jax_runner(fn, q, k, v, mode, dtype)


def flax_nnx(q, k, v, causal, mode, dtype):
  from flax import nnx
  T = q.shape[1]
  mask = nnx.make_causal_mask(jnp.ones((B, T))) if causal else None  # [B, 1, T, T]
  fn = lambda q, k, v: nnx.dot_product_attention(q, k, v, mask=mask)
  return _jax_runner(fn, q, k, v, mode, dtype)


def tokamax_builder(impl):
  def build(q, k, v, causal, mode, dtype):
    tokamax = _tokamax()
    fn = lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl)
    return _jax_runner(fn, q, k, v, mode, dtype)
  return build


def torch_sdpa(q, k, v, causal, mode, dtype):
  torch = _torch()
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  # [B, T, N, H] -> PyTorch's [B, N, T, H], contiguous, as its kernels want
  tq, tk, tv = (torch.from_numpy(np.array(x, np.float32)).to(tdtype).transpose(1, 2)
                .contiguous() for x in (q, k, v))
  sdpa = torch.nn.functional.scaled_dot_product_attention
  if mode == "fwd":
    def run():
      with torch.no_grad():
        sdpa(tq, tk, tv, is_causal=causal)
    return run
  for t in (tq, tk, tv):
    t.requires_grad_(True)
  ct = torch.from_numpy(np.random.default_rng(1).standard_normal(tq.shape).astype(
      np.float32)).to(tdtype)

  def run():
    out = sdpa(tq, tk, tv, is_causal=causal)
    torch.autograd.grad(out, (tq, tk, tv), ct)
  return run


def contenders(names):
  table = {
      "jattn:xla": jattn_builder("xla"),
      "jattn:vmap": jattn_builder("vmap"),
      "jattn:blockwise": jattn_builder("blockwise"),
      "jattn:default": jattn_builder(None),
      "jax.nn": jax_nn,
      "flax.nnx": flax_nnx,
      "torch": torch_sdpa,
      "tokamax:xla_chunked": tokamax_builder("xla_chunked"),
      "tokamax:default": tokamax_builder(None),
  }
  chosen = {n: table[n] for n in names}
  for name in [n for n in chosen if n.startswith("tokamax")]:
    if _tokamax() is None:
      print(f"tokamax not importable: skipping {name}")
      del chosen[name]
  if "torch" in chosen and _torch() is None:
    print("torch not importable: skipping torch SDPA")
    del chosen["torch"]
  return chosen


# ---------------------------------------------------------------- timing

def flops(T, causal, mode):
  f = 4.0 * B * N * T * T * H * (0.5 if causal else 1.0)
  return f * (3.5 if mode == "fwdbwd" else 1.0)


def matmul_gflops(m, k, n, rounds):
  """GFLOP/s of a float32 [m, k] x [k, n] matmul, measured now (median of rounds)."""
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2.0 * m * k * n / np.median(times) / 1e9


def matmul_roofline(T, rounds):
  """GFLOP/s of a float32 [T, H] x [H, S] matmul (S = T), measured now."""
  return matmul_gflops(T, H, T, rounds)


def inputs(T, dtype):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.dtype(dtype))
               for _ in range(3))


def time_case(q, k, v, causal, mode, builders, rounds, warmup, settle):
  """Median seconds per call of every contender on the inputs q, k, v [B, T, N, H]."""
  dtype = str(q.dtype)
  runs = {}
  for name, build in builders.items():
    try:
      runs[name] = build(q, k, v, causal, mode, dtype)
      for _ in range(warmup):
        runs[name]()
    except Exception as e:  # a contender that cannot run this case says why
      print(f"  {name}: failed: {type(e).__name__}: {str(e)[:120]}")
      runs.pop(name, None)
  times = {name: [] for name in runs}
  order = list(runs)
  shuffle = np.random.default_rng(q.shape[1])  # seeded by T
  for _ in range(rounds):  # interleaved rounds: load drifts hit everyone alike
    # A new order each round: no contender always runs right after the same
    # neighbour (after "xla" frees its [T, S] logits, the next run pays for it).
    shuffle.shuffle(order)
    for name in order:
      # Before each timed call, untimed calls of the same contender for `settle`
      # seconds (at least one). After a dense contender frees its GBs of logits
      # the machine stays busy for a while and the next contender paid for it
      # (causal forward at 4096 with jax.nn in the run: jattn 229 -> 154 ms,
      # torch 166 -> 134 ms once absorbed); an idle pause instead makes XLA's
      # parked threads slow for the next few calls (jattn at 1024: 16 -> 34 ms).
      until = time.perf_counter() + settle
      runs[name]()
      while time.perf_counter() < until:
        runs[name]()
      t0 = time.perf_counter()
      runs[name]()
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


# ---------------------------------------------------------------- memory

def child_case(args):
  """Runs one case once (compile + run) in this process; the parent reads its peak RSS."""
  q, k, v = inputs(args.T, args.dtype_one)
  run = contenders([args.contender])[args.contender](
      q, k, v, args.causal_one, args.mode_one, args.dtype_one)
  t0 = time.perf_counter()
  run()
  seconds = time.perf_counter() - t0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
  print(json.dumps({"seconds_with_compile": seconds, "peak_rss_gib": peak}))


def measure_memory(contender, T, dtype, causal, mode, limit_gib=None, timeout=3600):
  """Peak resident memory (GiB) of a child that runs one case, or the reason it failed.

  limit_gib: address-space limit of the child (RLIMIT_AS), so a contender that
  needs more fails fast instead of exhausting the shared machine.
  """
  cmd = [sys.executable, __file__, "--child", "--contender", contender, "--T", str(T),
         "--dtype-one", dtype, "--mode-one", mode] + (["--causal-one"] if causal else [])

  def limit():
    if limit_gib is not None:
      size = int(limit_gib * 2**30)
      resource.setrlimit(resource.RLIMIT_AS, (size, size))

  proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit,
                        timeout=timeout)
  result = {"contender": contender, "T": T, "dtype": dtype, "causal": causal,
            "mode": mode, "limit_gib": limit_gib,
            "logits_gib": B * N * T * T * 4 / 2**30}
  if proc.returncode != 0:
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    result.update(ok=False, error=tail[:200])
  else:
    # the child's own ru_maxrss, measured as it finishes
    result.update(ok=True, **json.loads(proc.stdout.strip().splitlines()[-1]))
  return result


# ---------------------------------------------------------------- output

def table_rows(results):
  rows = []
  for case in results["cases"]:
    times = case["ms"]
    for name, ms in times.items():
      gflops = case["flops"] / (ms / 1e3) / 1e9
      ratios = {a: (times[a] / ms if a in times else None) for a in ANCHORS}
      rows.append(dict(T=case["T"], dtype=case["dtype"], causal=case["causal"],
                       mode=case["mode"], contender=name, ms=ms, gflops=gflops,
                       roofline=case["matmul_gflops"], **{f"x{a}": r for a, r in ratios.items()}))
  return rows


def print_table(rows):
  head = (f"{'T':>6} {'dtype':>8} {'causal':>6} {'mode':>6} {'contender':>16} "
          f"{'ms':>9} {'GFLOP/s':>8} {'x torch':>8} {'x jax.nn':>8} {'matmul GF/s':>11}")
  print(head)
  print("-" * len(head))
  fmt = lambda r: "-" if r is None else f"{r:.2f}"
  for r in rows:
    print(f"{r['T']:>6} {r['dtype']:>8} {str(r['causal']):>6} {r['mode']:>6} "
          f"{r['contender']:>16} {r['ms']:>9.1f} {r['gflops']:>8.1f} "
          f"{fmt(r['xtorch']):>8} {fmt(r['xjax.nn']):>8} {r['roofline']:>11.1f}")


def chart(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = sorted({(r["dtype"], r["causal"], r["mode"]) for r in rows})
  cols = min(4, len(panels))
  nrows = -(-len(panels) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
  for ax, (dtype, causal, mode) in zip(axes.flat, panels):
    sel = [r for r in rows if (r["dtype"], r["causal"], r["mode"]) == (dtype, causal, mode)]
    for name in sorted({r["contender"] for r in sel}):
      pts = sorted((r["T"], r["gflops"]) for r in sel if r["contender"] == name)
      ax.plot(*zip(*pts), marker="o", label=name)
    roof = sorted({(r["T"], r["roofline"]) for r in sel})
    ax.plot(*zip(*roof), "k--", label="matmul [T,H]x[H,S]")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{dtype} {'causal' if causal else 'full'} {mode}")
    ax.set_xlabel("T = S")
    ax.set_ylabel("GFLOP/s")
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(f"B={B} N={N} H={H}, {os.cpu_count()} CPU cores, median of rounds")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="bench_out", help="output directory")
  p.add_argument("--sizes", default="512,1024,2048,4096,8192", help="T = S values")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd")
  p.add_argument("--causal", default="both", choices=("no", "yes", "both"))
  p.add_argument("--contenders", default="jattn:xla,jattn:blockwise,jattn:default,"
                 "jax.nn,flax.nnx,torch,tokamax:xla_chunked")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--settle", type=float, default=0.5,
                 help="seconds of untimed calls of a contender before each timed one")
  p.add_argument("--memory", action="store_true",
                 help="also measure peak memory per case (a child process each)")
  p.add_argument("--memory-only", action="store_true",
                 help="only the long-sequence memory cases (64k forward, 32k fwd+bwd)")
  p.add_argument("--long-sizes", default="65536:fwd,32768:fwdbwd")
  # one case in a child process (memory measurement)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--contender", help=argparse.SUPPRESS)
  p.add_argument("--T", type=int, help=argparse.SUPPRESS)
  p.add_argument("--dtype-one", help=argparse.SUPPRESS)
  p.add_argument("--mode-one", help=argparse.SUPPRESS)
  p.add_argument("--causal-one", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return child_case(args)

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {"config": dict(B=B, N=N, H=H, cpu_count=os.cpu_count(),
                            platform=jax.devices()[0].platform, jax=jax.__version__,
                            torch=getattr(_torch(), "__version__", None),
                            rounds=args.rounds, settle_s=args.settle, argv=sys.argv[1:]),
             "cases": [], "memory": []}
  if not args.memory_only:
    builders = contenders(args.contenders.split(","))
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for dtype in args.dtypes.split(","):
      for mode in args.modes.split(","):
        for causal in causals:
          for T in map(int, args.sizes.split(",")):
            print(f"T={T} {dtype} causal={causal} {mode}", flush=True)
            ms = time_case(*inputs(T, dtype), causal, mode, builders, args.rounds,
                           args.warmup, args.settle)
            results["cases"].append(dict(
                T=T, dtype=dtype, causal=causal, mode=mode, flops=flops(T, causal, mode),
                ms={k: v * 1e3 for k, v in ms.items()},
                matmul_gflops=matmul_roofline(T, args.rounds)))
            json.dump(results, open(out / "results.json", "w"), indent=1)
    rows = table_rows(results)
    print_table(rows)
    chart(rows, out / "chart.png")
  if args.memory or args.memory_only:
    for spec in args.long_sizes.split(","):
      T, mode = spec.split(":")
      T = int(T)
      for contender, limit in (("jattn:blockwise", None), ("jattn:xla", 8)):
        print(f"memory: {contender} T={T} {mode} (address limit {limit} GiB)", flush=True)
        r = measure_memory(contender, T, "float32", False, mode, limit_gib=limit)
        print("  ", r, flush=True)
        results["memory"].append(r)
        json.dump(results, open(out / "results.json", "w"), indent=1)
  print(f"wrote {out / 'results.json'}" + ("" if args.memory_only else
                                           f" and {out / 'chart.png'}"))


if __name__ == "__main__":
  main()
