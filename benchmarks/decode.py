"""One decode step of one attention layer over a ragged batch: dense cache vs paged split path.

B = 8 rows whose lengths run from 256 to 32k (mean about 4.5k), N = 16 query
heads, K = 4 kv heads, H = D = 128, float32, one new token per row. Each
contender writes the new token's key and value into its cache and attends it,
jitted with the cache donated (written in place), timed over --steps steps,
interleaved so that load on the machine hits all alike (median, milliseconds):

  dense (default)  today's max-length cache [B, 32768, K, H] as jattn.nnx decodes:
                   kv_cache.step, then dot_product_attention with the [B, 1, 1, S]
                   decoding mask (implementation None: "blockwise" on CPU)
  dense (xla)      the same with implementation="xla" (one dense einsum)
  paged (split)    jattn.paged.append + jattn.decode_attention (default "split"):
                   only each row's pages, W at a time, merged by log-sum-exp
  ... attend only  dense (xla) and paged (split) without the write: where the time goes
  torch SDPA       torch.nn.functional.scaled_dot_product_attention over a dense
                   cache with the same mask, if torch is importable (else skipped)

and the cache memory of each (bytes of its key and value arrays).

  python benchmarks/decode.py [--steps 20] [--page-size 64] [--out FILE] [--smoke]

`--tpu` instead estimates the step on TPU v5e and v6e from deviceless compiles
(the "paged_tpu" kernel against the HBM roofline, "split" and "xla"; bfloat16;
`benchmarks/decode_tpu.py` says how), in a venv with libtpu:

  JAX_PLATFORMS=cpu python benchmarks/decode.py --tpu [--int8] [--out FILE]

`--gpu` instead times, on a lent NVIDIA GPU, the "paged_gpu" kernel against "split" and
the HBM roofline (bfloat16; B = 8 rows of 256 to 32k and B = 1 of 128k;
`benchmarks/decode_gpu.py` says how); with --smoke, a CPU rehearsal (the kernel
interpreted, tiny rows):

  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/decode.py --gpu \
      --out $OUT/decode_gpu.json [--rounds 7] [--deadline 300]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn._src.nn import kv_cache  # noqa: E402

LENGTHS = (256, 320, 384, 448, 512, 640, 768, 32512)  # mean 4480
MAX_LENGTH = 32768
N, K, H = 16, 4, 128


def cpu_model() -> str:
  """lscpu's model name and its AVX-512 flags."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
  except OSError:
    return "unknown CPU"
  name = next((l.split(":", 1)[1].strip() for l in out.splitlines() if "Model name" in l), "?")
  flags = sorted({w for w in out.split() if w.startswith("avx512")})
  return f"{name}, {len(flags)} avx512 flags ({' '.join(flags) or 'none'})"


def dense_contender(lengths, max_length, steps, implementation):
  """(step function, its state, cache bytes) of today's dense cache."""
  B = len(lengths)
  key = jax.random.key(0)
  cache_k = jax.random.normal(key, (B, max_length, K, H), jnp.float32)
  cache_v = jax.random.normal(jax.random.key(1), (B, max_length, K, H), jnp.float32)
  index = jnp.asarray(lengths, jnp.int32)

  def step(state, q, k, v):
    cache_k, cache_v, index = state
    cache_k, cache_v, index, mask = kv_cache.step(cache_k, cache_v, index, k, v,
                                                  jnp.ones((B,), jnp.int32), token_axis=1)
    out = jattn.dot_product_attention(q, cache_k, cache_v, mask=mask,
                                      implementation=implementation)
    return (cache_k, cache_v, index), out

  return jax.jit(step, donate_argnums=0), (cache_k, cache_v, index), (
      cache_k.nbytes + cache_v.nbytes)


def attend_only(step_state_bytes, attend):
  """A contender that attends its own cache without writing to it (state kept as is)."""
  _, state, nbytes = step_state_bytes
  attend = jax.jit(attend)  # the state stays outside: a jit returning it would copy it
  return (lambda state, q, k, v: (state, attend(q, state))), state, nbytes


def paged_contender(lengths, max_length, steps, page_size, pages_per_step):
  """(step function, its state, cache bytes) of the paged cache, pool sized to the rows."""
  B = len(lengths)
  num_pages = int(sum(-(-(n + steps + 1) // page_size) for n in lengths))
  cache = jattn.paged.init_cache(B, max_length, num_kv_heads=K, head_dim=H,
                                 page_size=page_size, num_pages=num_pages)
  longest = max(lengths)
  for start in range(0, longest, 4096):  # the prompts, in chunks (ragged)
    new = np.clip(np.asarray(lengths) - start, 0, 4096)
    kv = jax.random.normal(jax.random.key(start), (B, 4096, K, H), jnp.float32)
    cache = jax.jit(jattn.paged.append)(cache, kv, kv, jnp.asarray(new, jnp.int32))
  jattn.paged.check(cache)

  def step(cache, q, k, v):
    cache = jattn.paged.append(cache, k, v)
    return cache, jattn.decode_attention(q, cache, pages_per_step=pages_per_step)

  return jax.jit(step, donate_argnums=0), cache, cache.memory_bytes()


def torch_contender(lengths, max_length):
  """(step function, cache bytes) of torch SDPA over a dense cache, or None without torch."""
  try:
    import torch
  except ImportError:
    return None
  B = len(lengths)
  torch.manual_seed(0)
  cache_k = torch.randn(B, K, max_length, H)
  cache_v = torch.randn(B, K, max_length, H)
  index = torch.tensor(lengths)
  positions = torch.arange(max_length)

  def step(q, k, v):
    rows = torch.arange(B)
    cache_k[rows, :, index] = k
    cache_v[rows, :, index] = v
    mask = (positions[None, :] <= index[:, None])[:, None, None, :]  # [B, 1, 1, S]
    with torch.no_grad():
      return torch.nn.functional.scaled_dot_product_attention(
          q, cache_k, cache_v, attn_mask=mask, enable_gqa=True)

  q = torch.randn(B, N, 1, H)
  kv = torch.randn(B, K, H)
  return (lambda: step(q, kv, kv)), cache_k.nbytes + cache_v.nbytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--pages-per-step", type=int, default=None)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--smoke", action="store_true", help="tiny lengths, 2 steps")
  parser.add_argument("--tpu", action="store_true",
                      help="estimates for TPU v5e / v6e from deviceless compiles")
  parser.add_argument("--int8", action="store_true",
                      help="--tpu: int8 pages against bfloat16 ones (roofline, paged_tpu)")
  parser.add_argument("--gpu", action="store_true",
                      help="paged_gpu vs split vs the HBM roofline on a lent GPU")
  parser.add_argument("--rounds", type=int, default=7, help="--gpu: interleaved rounds")
  parser.add_argument("--deadline", type=float, default=300.0,
                      help="--gpu: no new batch starts after this many seconds")
  args = parser.parse_args()
  if args.gpu:
    from benchmarks import decode_gpu
    sys.exit(decode_gpu.main(args.out, smoke=args.smoke, rounds=args.rounds,
                             deadline=args.deadline))
  if args.tpu:
    from benchmarks import decode_tpu
    (decode_tpu.main_int8 if args.int8 else decode_tpu.main)(args.out)
    return
  lengths, max_length = (LENGTHS, MAX_LENGTH) if not args.smoke else ((5, 40, 17), 64)
  steps = 2 if args.smoke else args.steps
  B = len(lengths)
  print(f"jax {jax.__version__}; CPU: {cpu_model()}")
  print(f"B = {B}, lengths {list(lengths)} (mean {np.mean(lengths):.0f}), dense max_length "
        f"{max_length}, N = {N}, K = {K}, H = D = {H}, float32, one token per row")
  q = jax.random.normal(jax.random.key(2), (B, 1, N, H), jnp.float32)
  kv = jax.random.normal(jax.random.key(3), (B, 1, K, H), jnp.float32)
  paged = lambda: paged_contender(lengths, max_length, steps, args.page_size,
                                 args.pages_per_step)
  contenders = {
      "dense (default)": dense_contender(lengths, max_length, steps, None),
      "dense (xla)": dense_contender(lengths, max_length, steps, "xla"),
      "paged (split)": paged(),
      "dense attend only": attend_only(dense_contender(lengths, max_length, steps, "xla"),
                                       lambda q, s: jattn.dot_product_attention(
                                           q, s[0], s[1], mask=kv_cache.decode_mask(
                                               s[2], 1, max_length), implementation="xla")),
      "paged attend only": attend_only(paged(), lambda q, c: jattn.decode_attention(
          q, c, pages_per_step=args.pages_per_step)),
  }
  states = {name: c[1] for name, c in contenders.items()}
  times = {name: [] for name in contenders}
  memory = {name: c[2] for name, c in contenders.items()}
  for name, (step, _, _) in contenders.items():  # compile and warm up
    states[name], out = step(states[name], q, kv, kv)
    jax.block_until_ready(out)
  torch_step = torch_contender(lengths, max_length)
  if torch_step is None:
    print("torch SDPA: skipped (torch is not importable; it is no dependency of jattn)")
  else:
    times["torch SDPA"], memory["torch SDPA"] = [], torch_step[1]
    torch_step[0]()
  for _ in range(steps):
    for name, (step, _, _) in contenders.items():
      start = time.perf_counter()
      states[name], out = step(states[name], q, kv, kv)
      jax.block_until_ready(out)
      times[name].append(time.perf_counter() - start)
    if torch_step is not None:
      start = time.perf_counter()
      torch_step[0]()
      times["torch SDPA"].append(time.perf_counter() - start)
  paged = statistics.median(times["paged (split)"])
  print(f"{'contender':<18} {'step ms':>9} {'vs paged':>9} {'cache MiB':>10} {'vs paged':>9}")
  rows = []
  for name in times:
    t = statistics.median(times[name])
    rows.append({"contender": name, "step_ms": 1e3 * t, "cache_bytes": memory[name]})
    print(f"{name:<18} {1e3 * t:9.2f} {t / paged:8.2f}x {memory[name] / 2**20:10.1f} "
          f"{memory[name] / memory['paged (split)']:8.2f}x")
  plan = jattn.explain_decode(q, states["paged (split)"]).choices["cpu"].plan
  print(f"paged plan: {plan}; page_size {args.page_size}")
  if args.out is not None:
    args.out.write_text(json.dumps({
        "jax": jax.__version__, "cpu": cpu_model(), "lengths": list(lengths),
        "max_length": max_length, "N": N, "K": K, "H": H, "steps": steps,
        "page_size": args.page_size, "plan": str(plan), "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
