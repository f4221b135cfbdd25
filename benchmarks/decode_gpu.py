"""The decode step on a lent NVIDIA GPU: "paged_gpu" (the Pallas Triton kernel) against
"split" and the HBM roofline (`python benchmarks/decode.py --gpu`).

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/decode.py --gpu \
        --out $OUT/decode_gpu.json [--rounds 7] [--deadline 150]
    python benchmarks/decode.py --gpu --smoke      # a CPU: tiny rows, the kernel interpreted

Batches (bfloat16 pages of 64 tokens, N = 16, K = 4, H = D = 128, one query a row,
causal, attend only: no write): B = 8 rows of 256 to 32512 tokens (benchmarks/decode.py's)
and B = 1 row of 128k. For each: the step time of decode_attention(implementation=
"paged_gpu") and of "split" (medians of interleaved rounds, jitted), of the Pallas
kernel alone (its inputs made beforehand: the step less the XLA ops around it, the
work list before and the chunks' merge after), the largest difference between the
two paths' outputs, and the roofline: the bytes of the keys and values
the rows hold (sum of lengths x K x (H + D) x 2) over the card's HBM bandwidth
(H100 SXM 3.35 TB/s, H200 4.8 TB/s: NVIDIA's data sheets), the floor of any kernel that
reads each page once. Nothing is timed on a CPU except in --smoke, which checks that the
script runs, not the speed.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from benchmarks import gpu_kernels as bench  # noqa: E402
from jattn._src.impl.interpret import pallas_interpret  # noqa: E402

# HBM bandwidth, bytes/s, by device kind (NVIDIA's data sheets: H100 SXM5 3.35 TB/s,
# H200 4.8 TB/s); a card not listed gets no roofline
BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12,
             "NVIDIA H200 141GB HBM3e": 4.8e12}
PAGE, N, K, H = 64, 16, 4, 128
BATCHES = {"B8_256_to_32k": ((256, 320, 384, 448, 512, 640, 768, 32512), 32768),
           "B1_128k": ((131072,), 131072 + PAGE)}
SMOKE = {"smoke": ((5, 40, 17), 64)}


def filled_cache(lengths, max_length, page, heads, dim, dtype):
  """A cache whose rows hold `lengths` random tokens, the pool sized to them."""
  B = len(lengths)
  num_pages = int(sum(-(-n // page) for n in lengths))
  cache = jattn.paged.init_cache(B, max_length, num_kv_heads=heads, head_dim=dim,
                                 page_size=page, num_pages=num_pages, dtype=dtype)
  chunk = min(8192, max(lengths))
  append = jax.jit(jattn.paged.append)
  for start in range(0, max(lengths), chunk):
    new = np.clip(np.asarray(lengths) - start, 0, chunk)
    kv = jax.random.normal(jax.random.key(start), (B, chunk, heads, dim), dtype)
    cache = append(cache, kv, kv, jnp.asarray(new, jnp.int32))
  jattn.paged.check(cache)
  return cache


def kernel_only(plan, q, cache):
  """A timer of the Pallas kernel alone, its inputs (work list, chunks) made beforehand:
  the step's time less the XLA ops around it (the work list before, the merge after).
  Causal, no mods (the batch's call)."""
  from jattn._src.decode import paged_gpu
  options = dict(q_lengths=jnp.ones((q.shape[0],), jnp.int32),
                 scale=jnp.float32(1 / np.sqrt(q.shape[3])), dtype=q.dtype)
  inputs = jax.jit(lambda q, c: paged_gpu.prepare(plan, q, c, None, options)[0])(q, cache)
  tm = (None, (), None, ())  # no mask_mod, no score_mod
  kernel = jax.jit(lambda inputs: paged_gpu.call_kernel(plan, tm, inputs))
  return bench._calibrated(lambda: kernel(inputs), jax.block_until_ready)


def measure_batch(name, lengths, max_length, *, smoke, rounds, device_kind):
  page, heads, dim, n = (16, 2, 32, 4) if smoke else (PAGE, K, H, N)
  dtype = jnp.bfloat16
  cache = filled_cache(lengths, max_length, page, heads, dim, dtype)
  q = jax.random.normal(jax.random.key(7), (len(lengths), 1, n, dim), dtype)
  calls = {impl: jax.jit(lambda q, c, impl=impl: jattn.decode_attention(
      q, c, is_causal=True, implementation=impl)) for impl in ("paged_gpu", "split")}
  with pallas_interpret() if smoke else contextlib.nullcontext():
    outs = {impl: np.asarray(f(q, cache), np.float32) for impl, f in calls.items()}
    timers = {impl: bench._calibrated(lambda f=f: f(q, cache), jax.block_until_ready)
              for impl, f in calls.items()}
    plan = jattn.explain_decode(q, cache, is_causal=True, implementation="paged_gpu")
    timers["paged_gpu kernel only"] = kernel_only(plan.choices["cpu" if smoke else "cuda"].plan,
                                                  q, cache)
    times = bench.interleaved(timers, rounds)
  median = {impl: statistics.median(t) for impl, t in times.items()}
  kv_bytes = int(sum(lengths)) * heads * 2 * dim * 2  # keys and values, bfloat16
  bandwidth = BANDWIDTH.get(device_kind)
  roofline = kv_bytes / bandwidth if bandwidth else None
  row = {"batch": name, "lengths": list(lengths), "kv_bytes": kv_bytes,
         "roofline_us": None if roofline is None else 1e6 * roofline,
         "step_us": {impl: 1e6 * t for impl, t in median.items()},
         "paged_gpu_vs_split": median["paged_gpu"] / median["split"],
         "kernel_share": median["paged_gpu kernel only"] / median["paged_gpu"],
         "paged_gpu_vs_roofline": None if roofline is None else median["paged_gpu"] / roofline,
         "split_vs_roofline": None if roofline is None else median["split"] / roofline,
         "max_abs_difference": float(np.max(np.abs(outs["paged_gpu"] - outs["split"]))),
         "plan": str(plan.choices["cpu" if smoke else "cuda"].plan)}
  print(f"{name}: paged_gpu {row['step_us']['paged_gpu']:.1f} us, split "
        f"{row['step_us']['split']:.1f} us ({row['paged_gpu_vs_split']:.2f}x split), roofline "
        + (f"{row['roofline_us']:.1f} us ({row['paged_gpu_vs_roofline']:.2f}x)"
           if roofline else f"unknown for {device_kind!r}")
        + f"; the kernel alone {row['step_us']['paged_gpu kernel only']:.1f} us"
        + f"; max |paged_gpu - split| {row['max_abs_difference']:.3g}", flush=True)
  return row


def main(out=None, *, smoke=False, rounds=7, deadline=300.0):
  started = time.perf_counter()
  device_kind = jax.devices()[0].device_kind
  if not smoke and jax.devices()[0].platform != "gpu":
    raise SystemExit(f"decode_gpu: no GPU here ({device_kind}); --smoke rehearses on a CPU")
  print(f"jax {jax.__version__}; {device_kind}; bfloat16, pages of "
        f"{16 if smoke else PAGE}, N = {4 if smoke else N}, K = {2 if smoke else K}, causal")
  results, errors = [], []
  for name, (lengths, max_length) in (SMOKE if smoke else BATCHES).items():
    if time.perf_counter() - started > deadline:
      errors.append({"batch": name, "error": "skipped: past the deadline"})
      continue
    try:
      results.append(measure_batch(name, lengths, max_length, smoke=smoke,
                                   rounds=2 if smoke else rounds, device_kind=device_kind))
    except Exception as e:  # reported, and the next batch runs
      errors.append({"batch": name, "error": f"{type(e).__name__}: {e}"[:2000]})
      print(f"{name}: {errors[-1]['error'][:300]}", flush=True)
  if out is not None:
    pathlib.Path(out).write_text(json.dumps(
        {"jax": jax.__version__, "device_kind": device_kind, "smoke": smoke,
         "bandwidth": BANDWIDTH.get(device_kind), "results": results, "errors": errors},
        indent=1) + "\n")
  return 1 if errors else 0
