"""Programmable attention benchmark: mask_mod / score_mod against the built-in arguments.

The protocol of benchmarks/attention.py (one process, the same inputs for every
contender, warm-ups, interleaved rounds in a shuffled order, medians, ratios),
on the default implementation, B=1 N=8 H=64 float32:

  causal:    mask_mod=mods.causal()  vs  is_causal=True       (fwd and fwd+bwd; target <= 1.15x)
  documents: 16 packed documents (mask_mod=mods.document, which classifies the
             blocks in the call, and block_mask= made once)  vs  no mask   (fwd; target >= 4x faster)
  soft_cap:  score_mod=mods.soft_cap(30)  vs  no score_mod    (fwd; target <= 1.3x)
  memory:    T = 32768 fwd+bwd, documents + soft_cap, peak RSS of a child (target <= 4 GB)

PyTorch's flex_attention (under torch.compile, CPU) joins each case as a contender
when torch is importable. Every result is printed with the CPU model.

    python benchmarks/flex.py --out bench_out [--T 4096] [--rounds 5] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import attention as protocol  # noqa: E402  (benchmarks/attention.py: time_case, inputs)
import jattn  # noqa: E402
from jattn import mods  # noqa: E402

B, N, H = protocol.B, protocol.N, protocol.H
DOCUMENTS = 16
CAP = 30.0


def cpu_model() -> str:
  out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
  name = next((line.split(":", 1)[1].strip() for line in out.splitlines()
               if line.startswith("Model name")), "unknown")
  flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
  return f"{name} ({'avx512f' if 'avx512f' in flags else 'no avx512f'}, {jax.device_count()} device, " \
         f"{len(__import__('os').sched_getaffinity(0))} cores)"


def document_ids(T: int) -> np.ndarray:
  """int32 [B, T]: DOCUMENTS packed documents of equal length."""
  return np.repeat(np.arange(DOCUMENTS, dtype=np.int32), -(-T // DOCUMENTS))[None, :T]


def jattn_case(**kwargs):
  """A contender builder for protocol.time_case: dot_product_attention with kwargs."""
  def build(q, k, v, causal, mode, dtype):
    del causal  # the case's kwargs say it
    fn = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kwargs)
    return protocol._jax_runner(fn, q, k, v, mode, dtype)
  return build


def torch_flex_case(kind: str):
  """PyTorch flex_attention under torch.compile (CPU), or None without torch."""
  torch = protocol._torch()
  if torch is None:
    return None
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention

  def build(q, k, v, causal, mode, dtype):
    del causal
    T = q.shape[1]
    to = lambda x: torch.from_numpy(np.asarray(x)).permute(0, 2, 1, 3).contiguous()
    tq, tk, tv = (to(x).requires_grad_(mode != "fwd") for x in (q, k, v))
    ids = torch.from_numpy(document_ids(T)[0])
    masks = {"causal": lambda b, h, t, s: s <= t,
             "documents": lambda b, h, t, s: ids[t] == ids[s]}
    block_mask = (create_block_mask(masks[kind], None, None, T, T, device="cpu")
                  if kind in masks else None)
    score = (lambda x, b, h, t, s: CAP * torch.tanh(x / CAP)) if kind == "soft_cap" else None
    compiled = torch.compile(flex_attention)
    ct = torch.randn_like(tq)

    def run():
      out = compiled(tq, tk, tv, score_mod=score, block_mask=block_mask)
      if mode != "fwd":
        out.backward(ct)
    return run
  return build


def cases(T: int):
  """name -> (mode, {contender: builder}, (numerator, denominator) for the ratio, target)."""
  ids = jnp.asarray(document_ids(T))
  doc = mods.document(ids, ids)
  out = {}
  for mode in ("fwd", "fwd+bwd"):
    out[f"causal {mode}"] = (mode, {
        "is_causal=True": jattn_case(is_causal=True),
        "mask_mod=causal": jattn_case(mask_mod=mods.causal()),
        "torch flex": torch_flex_case("causal")}, ("mask_mod=causal", "is_causal=True"), 1.15)
  out["documents fwd"] = ("fwd", {
      "no mask": jattn_case(),
      "mask_mod=document": jattn_case(mask_mod=doc),
      # the block mask made once (per batch) and reused, as by every layer of a model
      "block_mask=document": jattn_case(block_mask=jax.block_until_ready(
          jattn.create_block_mask(doc, B, None, T, T))),
      "torch flex": torch_flex_case("documents")}, ("no mask", "mask_mod=document"), 4.0)
  out["soft_cap fwd"] = ("fwd", {
      "no score_mod": jattn_case(),
      "score_mod=soft_cap": jattn_case(score_mod=mods.soft_cap(CAP)),
      "torch flex": torch_flex_case("soft_cap")}, ("score_mod=soft_cap", "no score_mod"), 1.3)
  return out


def child_memory(T: int) -> None:
  """One fwd+bwd at T with documents + soft_cap in this process; prints its peak RSS."""
  q, k, v = protocol.inputs(T, "float32")
  ids = jnp.asarray(document_ids(T))
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, mask_mod=mods.document(ids, ids), score_mod=mods.soft_cap(CAP))
  run = protocol._jax_runner(fn, q, k, v, "fwd+bwd", "float32")
  t0 = time.perf_counter()
  run()
  # VmHWM, not ru_maxrss: the latter carries the parent's peak through fork and exec.
  status = pathlib.Path("/proc/self/status").read_text()
  peak_kib = next(int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("VmHWM:"))
  peak = peak_kib / 2**20  # KiB -> GiB
  print(json.dumps({"T": T, "seconds_with_compile": time.perf_counter() - t0,
                    "peak_rss_gib": peak}))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--memory-T", type=int, default=32768)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--settle", type=float, default=0.5)
  parser.add_argument("--skip-memory", action="store_true")
  parser.add_argument("--only", default=None, help="run the cases whose name contains this")
  parser.add_argument("--child-memory", type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child_memory:
    return child_memory(args.child_memory)

  cpu = cpu_model()
  print(f"CPU: {cpu}; jax {jax.__version__}; B={B} N={N} H={H} T=S={args.T} float32", flush=True)
  q, k, v = protocol.inputs(args.T, "float32")
  results = []
  for name, (mode, builders, (num, den), target) in cases(args.T).items():
    if args.only and args.only not in name:
      continue
    builders = {n: b for n, b in builders.items() if b is not None}
    times = protocol.time_case(q, k, v, False, mode, builders, args.rounds, args.warmup,
                               args.settle)
    ratio = times[num] / times[den] if num in times and den in times else float("nan")
    row = dict(case=name, T=args.T, mode=mode, seconds=times, ratio=f"{num} / {den}",
               value=ratio, target=target, cpu=cpu)
    if "torch flex" in times:
      row["torch_flex_over_jattn"] = times["torch flex"] / times[num]
    results.append(row)
    print(f"{name:16s} " + "  ".join(f"{n} {t * 1e3:.1f} ms" for n, t in times.items())
          + f"  | {num} / {den} = {ratio:.2f} (target {'<=' if target < 2 else '>='} "
          f"{target}) | CPU {cpu}", flush=True)
  if not args.skip_memory:
    proc = subprocess.run([sys.executable, __file__, "--child-memory", str(args.memory_T)],
                          capture_output=True, text=True)
    if proc.returncode == 0:
      row = json.loads(proc.stdout.strip().splitlines()[-1]) | dict(
          case="memory fwd+bwd documents + soft_cap", target_gib=4.0, cpu=cpu)
    else:
      row = dict(case="memory", T=args.memory_T, error=proc.stderr.strip()[-300:], cpu=cpu)
    results.append(row)
    print(json.dumps(row), flush=True)
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flex.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
