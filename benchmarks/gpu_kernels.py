"""GPU benchmark: jattn's flex_gpu (Triton), flex_mgpu (Mosaic GPU) and default dispatch
against cuDNN, jax's Pallas mha, PyTorch FlexAttention and PyTorch SDPA, on the same card
in one process.

    python benchmarks/gpu_kernels.py [--lengths 1024 4096 16384] [--tokens 8192] [--N 16]
        [--H 128] [--dtype bfloat16] [--rounds 7] [--deadline 240] [--out r.json]
    python benchmarks/gpu_kernels.py --sweep ...     # flex_gpu's tiles, warps and stages
    python benchmarks/gpu_kernels.py --smoke ...     # tiny, interpreted, any backend

B = tokens // T (clipped to 1..8): 8 x 1k, 2 x 4k, 1 x 16k. Cases, forward and
forward + backward (d loss / d q, k, v of sum(out)), the same inputs for every contender:
  causal     is_causal=True; jattn also as mask_mod=mods.causal(); cuDNN; Pallas mha;
             torch FlexAttention (a causal block mask); torch SDPA (is_causal)
  no_mask    the reference work: 16 documents' goal is against it
  documents  mods.document: 16 equal documents packed in T (FlexAttention: the same ids)
  window     causal 256-key window (local_window_size=(256, 0)); cuDNN's window
  alibi      mods.alibi(alibi_slopes(N)), causal
  soft_cap   mods.soft_cap(30), causal
Timing: each contender compiled and warmed up, then timed in interleaved, shuffled rounds;
a round runs it back to back enough times to last ~50 ms, synchronises, and counts the mean;
the figure is the median over rounds. TFLOP/s counts visible entries only (4 B N H per
visible (t, s) forward, 2.5x that forward + backward). `--deadline` stops starting new
timings after that many seconds (what was skipped is listed in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the card
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402
from jattn._src import compat  # noqa: E402
from jattn._src.impl.interpret import pallas_interpret  # noqa: E402
from jattn._src.kernels import flex_gpu  # noqa: E402

WINDOW = 256
SOFT_CAP = 30.0
DOCUMENTS = 16


# ---------------------------------------------------------------- the cases


def visible_fraction(case: str, T: int) -> float:
  causal = (T + 1) / (2 * T)
  return {"no_mask": 1.0, "documents": 1 / DOCUMENTS,
          "window": min(T, (WINDOW + 1) * T - WINDOW * (WINDOW + 1) / 2) / (T * T)
          if T > WINDOW else causal}.get(case, causal)


CASES = ("causal", "no_mask", "documents", "soft_cap", "window", "alibi")


def case_kwargs(case: str, B: int, T: int, N: int) -> dict:
  """The dot_product_attention arguments of `case`, one of CASES (the module docstring's
  list); benchmarks/gpu_static.py compiles the same calls."""
  ids = jnp.asarray(np.repeat(np.arange(DOCUMENTS), -(-T // DOCUMENTS))[:T][None].repeat(B, 0))
  return {"causal": dict(is_causal=True), "no_mask": dict(),
          "documents": dict(mask_mod=mods.document(ids)),
          "window": dict(local_window_size=(WINDOW, 0)),
          "alibi": dict(is_causal=True, score_mod=mods.alibi(mods.alibi_slopes(N))),
          "soft_cap": dict(is_causal=True, score_mod=mods.soft_cap(SOFT_CAP))}[case]


def jax_contenders(case: str, B: int, T: int, N: int, smoke: bool = False):
  """name -> fn(q, k, v) [B, T, N, H] -> out, for the jax contenders of `case`."""
  kw = case_kwargs(case, B, T, N)
  attend = lambda impl, **extra: (lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation=impl, **{**kw, **extra}))
  out = {"flex_gpu": attend("flex_gpu"), "jattn_default": attend(None)}
  # the Mosaic GPU kernel, where this jax has it (and, in the smoke run, its interpreter)
  if compat.missing("pallas_mosaic_gpu") is None and not (
      smoke and compat.missing("mosaic_gpu_interpret")):
    out["flex_mgpu"] = attend("flex_mgpu")
  if case == "causal":
    out["flex_gpu:mask_mod"] = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="flex_gpu", mask_mod=mods.causal())
  if case in ("causal", "no_mask", "window") and not smoke:  # no cuDNN off a GPU
    out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", **kw)
  # jax's Pallas Triton mha, where this jax has it (jax 0.12.1 removed it)
  if case in ("causal", "no_mask") and compat.missing("pallas_mha") is None:
    def mha(q, k, v):
      from jax.experimental.pallas.ops.gpu import attention
      return attention.mha(q, k, v, segment_ids=None, causal=case == "causal",
                           sm_scale=1 / np.sqrt(q.shape[-1]), interpret=smoke)
    out["pallas_mha"] = mha
  return out


def torch_contenders(case: str, B: int, T: int, N: int, device: str):
  """name -> fn(q, k, v) [B, N, T, H] -> out: FlexAttention (compiled) and SDPA."""
  import torch
  from torch.nn.attention import flex_attention as fa

  # Every case and pass recompiles flex_attention (new mods, grad mode, shapes); past
  # dynamo's limit (8) it silently runs unfused, ~50x slower (seen on the H200 at 16k).
  torch._dynamo.reset()
  for name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, name):
      setattr(torch._dynamo.config, name, 1024)

  doc = torch.as_tensor(np.repeat(np.arange(DOCUMENTS), -(-T // DOCUMENTS))[:T],
                        device=device)
  slopes = torch.as_tensor(np.asarray(mods.alibi_slopes(N)), device=device)
  causal = lambda b, h, q, kv: q >= kv
  mask, score = {
      "causal": (causal, None), "no_mask": (None, None),
      "documents": (lambda b, h, q, kv: doc[q] == doc[kv], None),
      "window": (lambda b, h, q, kv: (q >= kv) & (q - kv <= WINDOW), None),
      "alibi": (causal, lambda x, b, h, q, kv: x + slopes[h] * (kv - q)),
      "soft_cap": (causal, lambda x, b, h, q, kv: SOFT_CAP * torch.tanh(x / SOFT_CAP)),
  }[case]
  block_mask = None if mask is None else fa.create_block_mask(mask, None, None, T, T,
                                                              device=device)
  flex = torch.compile(fa.flex_attention, dynamic=False)
  out = {"torch_flex": lambda q, k, v: flex(q, k, v, score_mod=score, block_mask=block_mask)}
  if case in ("causal", "no_mask"):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out["torch_sdpa"] = lambda q, k, v: sdpa(q, k, v, is_causal=case == "causal")
  return out


# ---------------------------------------------------------------- timing


def timed_program(fn, backward: bool):
  """What a timing runs: fn(q, k, v), or for forward + backward d sum(out) / d q, k, v."""
  if not backward:
    return fn
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def jax_timer(fn, inputs, backward: bool):
  """-> once(): runs fn (or forward + backward) `reps` times, returns seconds per run."""
  run = jax.jit(timed_program(fn, backward))
  return _calibrated(lambda: run(*inputs), jax.block_until_ready)


def torch_timer(fn, inputs, backward: bool):
  import torch
  sync = lambda _: torch.cuda.synchronize() if inputs[0].is_cuda else None
  if backward:
    inputs = [x.detach().requires_grad_() for x in inputs]

    def step():
      fn(*inputs).float().sum().backward()
  else:
    def step():
      with torch.no_grad():
        return fn(*inputs)
  return _calibrated(step, sync)


def _calibrated(step, wait, target_s: float = 0.05):
  wait(step())  # compile and warm up
  wait(step())
  start = time.perf_counter()
  wait(step())
  reps = max(1, min(100, int(target_s / max(time.perf_counter() - start, 1e-6))))

  def once():
    start = time.perf_counter()
    for _ in range(reps):
      result = step()
    wait(result)
    return (time.perf_counter() - start) / reps
  return once


def interleaved(timers: dict, rounds: int) -> dict:
  """name -> [seconds per run, one per round]; every round runs each, shuffled."""
  times = {name: [] for name in timers}
  for _ in range(rounds):
    order = list(timers)
    random.shuffle(order)
    for name in order:
      times[name].append(timers[name]())
  return times


# ---------------------------------------------------------------- main


def _inputs(B, T, N, H, dtype, torch_device):
  r = np.random.default_rng(0)
  arrays = [r.standard_normal((B, T, N, H), np.float32) for _ in "qkv"]
  jx = tuple(jnp.asarray(x, dtype) for x in arrays)
  th = None
  if torch_device is not None:
    import torch
    th = tuple(torch.as_tensor(np.einsum("BTNH->BNTH", x), device=torch_device)
               .to(getattr(torch, dtype)) for x in arrays)
  return jx, th


def _torch_device(args):
  if not args.torch:
    return None, "not asked for (--no-torch)"
  try:
    import torch
    from torch.nn.attention import flex_attention  # noqa: F401
  except ImportError as e:
    return None, f"torch unavailable: {e}"
  if torch.cuda.is_available():
    return "cuda", f"torch {torch.__version__}"
  if args.smoke:
    return "cpu", f"torch {torch.__version__} (CPU: smoke only)"
  return None, f"torch {torch.__version__} sees no GPU"


def measure(args, out: dict, deadline: float):
  torch_device, torch_note = _torch_device(args)
  out["torch"] = torch_note
  sweep = _sweep_configs(args) if args.sweep else [None]
  for T in args.lengths:
    B = max(1, min(8, args.tokens // T))
    jx, th = _inputs(B, T, args.N, args.H, args.dtype, torch_device)
    for case in args.cases:
      for backward in (False, True):
        pass_ = "fwd+bwd" if backward else "fwd"
        if time.perf_counter() > deadline:
          out["skipped"].append(dict(T=T, case=case, pass_=pass_, why="deadline"))
          continue
        timers = {}
        for launch in sweep:
          contenders = jax_contenders(case, B, T, args.N, args.smoke)
          if args.sweep:
            contenders = {f"flex_gpu{_name(launch)}": contenders["flex_gpu"]}
          for name, fn in contenders.items():
            timers[name] = _guarded(out, (T, case, pass_, name), lambda: _with(
                launch, args, lambda: jax_timer(fn, jx, backward)))
        if th is not None and not args.sweep:
          try:
            contenders = torch_contenders(case, B, T, args.N, torch_device)
          except Exception as e:  # noqa: BLE001 (recorded, not fatal)
            out["errors"].append(dict(T=T, case=case, contender="torch", error=repr(e)[:500]))
            contenders = {}
          if torch_device == "cpu" and backward:  # FlexAttention has no CPU backward
            contenders.pop("torch_flex", None)
          for name, fn in contenders.items():
            timers[name] = _guarded(out, (T, case, pass_, name),
                                    lambda: torch_timer(fn, th, backward))
        timers = {n: t for n, t in timers.items() if t is not None}
        times = interleaved({n: _launched(sweep, n, t, args) for n, t in timers.items()},
                            args.rounds)
        flops = 4 * B * args.N * args.H * T * T * visible_fraction(case, T)
        flops *= 2.5 if backward else 1.0
        for name, ts in times.items():
          med = statistics.median(ts)
          row = dict(T=T, B=B, case=case, pass_=pass_, contender=name, ms=1e3 * med,
                     tflops=flops / med / 1e12, spread=(max(ts) - min(ts)) / med)
          out["results"].append(row)
          print(f"T={T:<6d} B={B} {case:9s} {pass_:8s} {name:26s} {row['ms']:9.3f} ms "
                f"{row['tflops']:7.1f} TFLOP/s", flush=True)


def _sweep_configs(args):
  if args.smoke:
    return [(16, 16, 4, 2), (32, 16, 4, 2)]
  return [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
          (128, 128, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2)]


def _name(launch):
  return "" if launch is None else ":q{}_kv{}_w{}_s{}".format(*launch)


def _with(launch, args, make):
  """make() inside the launch parameters (sweep) and interpret mode (smoke)."""
  with contextlib.ExitStack() as stack:
    if args.smoke:
      stack.enter_context(pallas_interpret())
    if launch is not None:
      stack.enter_context(flex_gpu.launch_parameters(
          block_q=launch[0], block_kv=launch[1], num_warps=launch[2], num_stages=launch[3]))
    return make()


def _launched(sweep, name, timer, args):
  """Timed runs of a jitted function need no context: the plan is in its cache key; in
  interpret mode the context is still needed at each call."""
  if not args.smoke:
    return timer
  return lambda: _with(None, args, timer)


def _guarded(out, key, make):
  try:
    return make()
  except Exception as e:  # noqa: BLE001 (a contender that fails is recorded, not fatal)
    T, case, pass_, name = key
    out["errors"].append(dict(T=T, case=case, pass_=pass_, contender=name,
                              error=f"{type(e).__name__}: {str(e)[:800]}"))
    print(f"T={T:<6d} {case:9s} {pass_:8s} {name:26s} FAILED {type(e).__name__}", flush=True)
    return None


def ratios(results) -> list[dict]:
  """The issue's goals as ratios of medians, where both sides were measured."""
  ms = {(r["T"], r["case"], r["pass_"], r["contender"]): r["ms"] for r in results}
  goals = [("causal mask_mod / cuDNN causal", "<= 1.2", ("causal", "flex_gpu:mask_mod"),
            ("causal", "cudnn")),
           # flex_mgpu replaces flex_gpu as the default where it is at least as fast
           ("flex_mgpu causal / flex_gpu causal", "<= 1.0", ("causal", "flex_mgpu"),
            ("causal", "flex_gpu")),
           ("flex_mgpu documents / flex_gpu documents", "<= 1.0", ("documents", "flex_mgpu"),
            ("documents", "flex_gpu")),
           ("flex_gpu causal / torch FlexAttention causal", "<= 1.0", ("causal", "flex_gpu"),
            ("causal", "torch_flex")),
           ("flex_gpu documents / torch FlexAttention documents", "<= 1.0",
            ("documents", "flex_gpu"), ("documents", "torch_flex")),
           ("flex_gpu soft-cap / torch FlexAttention soft-cap", "<= 1.0",
            ("soft_cap", "flex_gpu"), ("soft_cap", "torch_flex")),
           ("flex_gpu no mask / 16 documents", ">= 4 at 16k", ("no_mask", "flex_gpu"),
            ("documents", "flex_gpu")),
           ("flex_gpu soft-cap / causal", "<= 1.2", ("soft_cap", "flex_gpu"),
            ("causal", "flex_gpu")),
           ("jattn default causal / cuDNN causal", "", ("causal", "jattn_default"),
            ("causal", "cudnn"))]
  rows = []
  for T in sorted({k[0] for k in ms}):
    for pass_ in ("fwd", "fwd+bwd"):
      for text, goal, a, b in goals:
        ka, kb = (T, a[0], pass_, a[1]), (T, b[0], pass_, b[1])
        if ka in ms and kb in ms:
          rows.append(dict(T=T, pass_=pass_, ratio=text, goal=goal, value=ms[ka] / ms[kb]))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 1024])
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--N", type=int, default=16)
  parser.add_argument("--H", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  parser.add_argument("--deadline", type=float, default=1e9, help="seconds")
  parser.add_argument("--no-torch", dest="torch", action="store_false")
  parser.add_argument("--sweep", action="store_true",
                      help="time flex_gpu under several tiles, warps and stages instead")
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes in interpret mode on any backend: checks the script, "
                           "measures nothing")
  args = parser.parse_args(argv)
  deadline = time.perf_counter() + args.deadline
  platform = jax.devices()[0].platform
  if args.smoke:
    args.lengths, args.tokens, args.N, args.H, args.rounds = [64], 64, 2, 32, 1
    args.cases = args.cases[:2] if not args.sweep else ["causal"]
  elif platform != "gpu":
    raise SystemExit(f"needs an NVIDIA GPU (found {platform}); --smoke checks the script")
  device = jax.devices()[0].device_kind
  out = dict(device_kind=device, jax=jax.__version__, args=vars(args), smoke=args.smoke,
             results=[], errors=[], skipped=[])
  print(f"jax {jax.__version__}, {device}, {args.dtype}, N={args.N} H={args.H}, "
        f"tokens={args.tokens}; medians of {args.rounds} interleaved rounds", flush=True)
  try:
    measure(args, out, deadline)
  finally:
    out["ratios"] = ratios(out["results"])
    for r in out["ratios"]:
      print(f"T={r['T']:<6d} {r['pass_']:8s} {r['ratio']}: {r['value']:.2f}  (goal {r['goal']})")
    if args.out:
      pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
