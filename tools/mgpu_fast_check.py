"""The check of "flex_mgpu_ws" (the warp-specialised Mosaic GPU forward) on a lent Hopper
GPU, under 5 minutes: its values against float64, then its speed.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 tools/mgpu_fast_check.py
        [--out DIR] [--deadline 240] [--hang-after 120] [--lengths 4096 16384] [--rounds 5]
    python tools/mgpu_fast_check.py --smoke --out /tmp/rehearsal   # on a CPU: the script
        # runs end to end with the interpretable "flex_mgpu" standing in (tiny shapes)
    JAX_PLATFORMS=cpu python tools/mgpu_fast_check.py --compile-only h100 --out DIR
        # on a CPU with the CUDA plugin: every jax program of the card's run compiled for
        # the card (deviceless_cuda), nothing run; under the card's jax 0.11.2 too, with
        # JATTN_CUDA_TARGET_CONFIGS (deviceless_cuda.target_config); about 3 minutes

1. values (bfloat16, H = 128): flex_mgpu_ws's out and lse against the float64 NumPy
   reference (tests/reference.py) for causal, 16 documents, a sliding window, soft-cap,
   ALiBi, chunked, prefix-LM, grouped heads (N = 8, K = 2), T != S, unaligned T, a fully
   masked row and max logits; the interpretable flex_mgpu, compiled, beside it on causal;
   on soft-cap and the masked rows also "flex_mgpu_ws:fma16", part of the softmax's exp2
   on the FP32 pipe (flex_mgpu.ws_exp2_fma(16));
   the gradients of causal GQA and of 4 documents with soft-cap (GQA), by flex_mgpu_ws's
   default backward (flex_mgpu's kernels) and by its warp-specialised dq and dk/dv kernels
   (flex_mgpu.ws_dq, ws_dkv: "flex_mgpu_ws:bwd"), against float64, relative to the
   largest entry within 2e-2; with them, Mosaic GPU's own ptxas report of the fast
   kernels (registers, spills, setmaxnreg honoured or not: JSON "ptxas"); and the
   documents-with-soft-cap gradient by implementation=None ("default:<what explain
   names>": flex_mgpu_ws on a Hopper card, registry.hopper_fast_path). Out error
   bound: 4 x the
   error of rounding the float64 answer to bfloat16 (as tests/kernels/test_flex_mgpu.py).
2. speed (bfloat16, B = 2, N = 16, H = 128, T = 4096; then 16384 at B = 1 if time is
   left): causal, 16 documents, soft-cap 30 (causal), a 256-key causal window, ALiBi
   (causal) and no mask, forward (benchmarks/gpu_kernels.py's cases); flex_mgpu_ws against
   flex_mgpu (causal), flex_gpu, cuDNN (jax.nn: causal, window, no mask), jax's
   attention_mgpu (causal, float16), torch FlexAttention (compiled; its FLASH backend too,
   where torch has it) and torch SDPA (causal, no mask); medians of interleaved
   rounds (benchmarks/gpu_kernels.py's timers), ms, TFLOP/s and ratios; causal, soft-cap
   and 16 documents forward + backward at the first length (flex_mgpu_ws's backward is flex_mgpu's;
   ":bwd" with the warp-specialised dq and dk/dv kernels, ":bwd:rows32" / ":bwd:rows64"
   with the dk/dv kernel's other query tile); on causal, ":tiles": each Mosaic GPU path
   made to read and write through the to_tiles transposes (kernel_inputs.through_tiles),
   the cost the in-place TMA reads and writes removed; forward, ":fma16" and ":fma32"
   (soft-cap; causal ":fma16"): 16 or 32 columns of each kv tile's exp2 on the FP32
   pipe, beside soft-cap's tanh on the special-function unit.
Order: causal's values, the gradients, causal and soft-cap forward + backward at T =
4096, the other values, the other timings (documents' forward + backward first). Each
case's failure is caught, printed and recorded; the next case runs. New work stops
starting after --deadline seconds.
Hangs: a case still running after --hang-after seconds (120 on the card) has hung (a
kernel whose warpgroups wait on each other forever): tools/watchdog.py writes the JSON
so far, naming it under "hung", and ends the run with exit status 3, rather than let it
hold the card until the device tool's limit. The warp-specialised dq and dk/dv kernels,
which no card has run, are checked in a child process (this script,
--fast-backward-only; its JSON in DIR/fast_backward): a hang or a crash of the card's
context there ends only the child, its rows join the run's, and the timings go on
without the ":bwd" contenders. --rehearse-hang STAGE makes a case hang on purpose (the
CPU rehearsal of both).
JSON: DIR/mgpu_fast_check.json (DIR: --out, else $OUT), rewritten before each case, so a
run killed from outside leaves what it had. At the end, issue 45's goals and the
fastest jattn path of each timed call, from the run's timings (benchmarks/gpu_goals.py):
printed, and in the JSON under "goals".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the card
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402
from jattn._src import deviceless_cuda  # noqa: E402
from jattn._src.impl.interpret import pallas_interpret  # noqa: E402
from jattn._src.kernels import flex_mgpu, kernel_inputs  # noqa: E402
from benchmarks import gpu_goals  # noqa: E402
from benchmarks import gpu_kernels as bench  # noqa: E402
from tests.reference import reference_mods  # noqa: E402
from tests.reference_grads import reference_mods_vjp  # noqa: E402
from tools.watchdog import EXIT_HUNG, Watchdog  # noqa: E402

FAST = "flex_mgpu_ws"
SOFT_CAP = bench.SOFT_CAP  # 30, as the benchmark's soft_cap case


def say(*args):
  print(*args, flush=True)


# ---------------------------------------------------------------- 1. values


def value_cases(N: int):
  """name -> (T, S, K, dot_product_attention kwargs, allowed(t, s, b, n) or array, score)."""
  def docs(T, count):
    return np.repeat(np.arange(count), -(-T // count))[:T]
  slopes = np.asarray(mods.alibi_slopes(N), np.float64)
  ids = docs(512, 4)
  prefix = np.asarray([100, 300])
  t_, s_ = (lambda T, S: (np.arange(T)[:, None], np.arange(S)[None, :]))(512, 512)
  causal = s_ <= t_
  return {
      "causal": (512, 512, N, dict(is_causal=True), causal, None),
      "causal_mask_mod_gqa_8_2": (512, 512, 2, dict(mask_mod=mods.causal()), causal, None),
      "documents_4": (512, 512, N, dict(mask_mod=mods.document(jnp.asarray(
          np.stack([ids, ids])))), ids[:, None] == ids[None, :], None),
      "sliding_window_100": (512, 512, N, dict(mask_mod=mods.sliding_window(100)),
                             (s_ <= t_) & (s_ >= t_ - 100), None),
      "soft_cap_causal": (512, 512, N, dict(is_causal=True, score_mod=mods.soft_cap(SOFT_CAP)),
                          causal, lambda x: SOFT_CAP * np.tanh(x / SOFT_CAP)),
      "alibi_causal": (512, 512, N, dict(is_causal=True, score_mod=mods.alibi(
          mods.alibi_slopes(N))), causal,
          lambda x: x + slopes[None, :, None, None] * (s_ - t_)[None, None]),
      "chunked_128": (512, 512, N, dict(mask_mod=mods.chunked(128)),
                      t_ // 128 == s_ // 128, None),
      "prefix_lm": (512, 512, N, dict(mask_mod=mods.prefix_lm(jnp.asarray(prefix))),
                    (s_ <= t_)[None] | (s_[None] < prefix[:, None, None]), None),
      "T_ne_S_causal_256x768": (256, 768, N, dict(is_causal=True),
                                np.arange(768)[None, :] <= np.arange(256)[:, None], None),
      "unaligned_T_300_documents": (300, 300, N, dict(mask_mod=mods.document(jnp.asarray(
          np.stack([docs(300, 3)] * 2)))),
          docs(300, 3)[:, None] == docs(300, 3)[None, :], None),
      "fully_masked_rows": (512, 512, N, dict(mask_mod=lambda b, n, t, s: (t >= 70) & (s <= t)),
                            (t_ >= 70) & causal, None),
  }


# the cases that also check the fast forward with part of its exp2 on the FP32 pipe
# (flex_mgpu.ws_exp2_fma(16), "flex_mgpu_ws:fma16"): soft-cap's, and rows that see no key
FMA_VALUE_CASES = ("soft_cap_causal", "fully_masked_rows")


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check_values(args, out, deadline, impls, names):
  B, N, H = 2, 8, (64 if args.smoke else 128)
  cases = value_cases(N)
  rng = np.random.default_rng(0)
  for name in names:
    T, S, K, kw, allowed, score = cases[name]
    if args.smoke:  # tiny: the interpreter simulates every program
      T, S = min(T, 128), min(S, 128)
      allowed = np.asarray(allowed)[..., :T, :S]
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    allowed = np.asarray(allowed)
    if allowed.ndim == 3:  # [B, T, S]
      allowed = allowed[:, None]
    want, w = reference_mods(_f64(q), _f64(k), _f64(v), allowed=allowed, score=score)
    logits = np.einsum("BTNH,BSNH->BNTS", _f64(q), np.repeat(_f64(k), N // K, 2)) / np.sqrt(H)
    logits = score(logits) if score is not None else logits
    masked = np.where(np.broadcast_to(allowed, logits.shape), logits, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
      want_lse = np.log(np.sum(np.exp(masked), -1))  # [B, N, T]
    seen = np.isfinite(want_lse)
    tol = 4 * float(np.max(np.abs(_f64(jnp.asarray(want, jnp.bfloat16)) - want)))
    runs = [(impl, impl, contextlib.nullcontext)
            for impl in (impls if name == "causal" else impls[:1])]
    if FAST in impls and name in FMA_VALUE_CASES:
      runs.append((FAST, f"{FAST}:fma16", lambda: flex_mgpu.ws_exp2_fma(16)))
    for impl, label, variant in runs:
      if time.perf_counter() > deadline:
        out["skipped"].append(dict(stage="values", case=name, impl=label))
        continue
      start = time.perf_counter()
      try:
        with _stage(args, out, f"values {name} {label}"), _context(args), variant():
          fn = jax.jit(lambda q, k, v: jattn.dot_product_attention(
              q, k, v, implementation=impl, return_residual=True, **kw))
          if args.compile_only:
            _compile_only(args, out, f"values {name} {label}", fn, q, k, v)
            continue
          o, lse = jax.block_until_ready(fn(q, k, v))
        err = float(np.max(np.abs(_f64(o) - want)))
        lse = np.einsum("btn->bnt", _f64(lse))
        lse_err = float(np.max(np.abs(lse[seen] - want_lse[seen]))) if seen.any() else 0.0
        empty_ok = bool(np.all(_f64(o).transpose(0, 2, 1, 3)[~seen] == 0))
        ok = err <= tol and lse_err <= max(4 * tol, 2e-2) and empty_ok
        row = dict(case=name, impl=label, T=T, S=S, N=N, K=K, err=err, tol=tol,
                   lse_err=lse_err, empty_rows_zero=empty_ok, passed=ok,
                   seconds=round(time.perf_counter() - start, 1))
        say(f"[values] {name:28s} {label:13s} {'ok  ' if ok else 'FAIL'} err {err:.3g} "
            f"(bound {tol:.3g}) lse err {lse_err:.3g} empty rows zero {empty_ok} "
            f"({row['seconds']} s)")
      except Exception as e:  # noqa: BLE001 (recorded; the next case runs)
        row = dict(case=name, impl=label, passed=False, error=_error(e))
        say(f"[values] {name:28s} {label:13s} ERROR {row['error'][:600]}")
      out["values"].append(row)


GRAD_CASES = ("causal_gqa_8_2", "documents_4_soft_cap_gqa_8_2")


def check_grad(args, out, deadline, impl, label=None, context=contextlib.nullcontext,
               case="causal_gqa_8_2"):
  """d sum(out * g) / d q, k, v of a GQA case (N = 8, K = 2; "BTNH" with T a multiple of
  128 and H = 128: read in place) against the float64 gradient (causal: analytic; 4
  documents with soft-cap: tests/reference_grads.py); context(): planned inside it
  (`_fast_backward` for the warp-specialised dq and dk/dv kernels)."""
  label = label or impl
  if time.perf_counter() > deadline:
    out["skipped"].append(dict(stage="grad", impl=label, case=case))
    return
  B, T, N, K, H = 1, (128 if args.smoke else 512), 8, 2, (64 if args.smoke else 128)
  rng = np.random.default_rng(1)
  q, k, v, g = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
  ids = np.repeat(np.arange(4), T // 4)
  kw = dict(is_causal=True) if case == "causal_gqa_8_2" else dict(
      mask_mod=mods.document(jnp.asarray(ids[None])), score_mod=mods.soft_cap(SOFT_CAP))
  start = time.perf_counter()
  try:
    with _stage(args, out, f"grad {case} {label}"), _context(args), context():
      loss = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
          q, k, v, implementation=impl, **kw).astype(jnp.float32) * g.astype(jnp.float32))
      report = f"{label} {case}" if label.endswith(":bwd") and not args.smoke else None
      grads = jax.grad(loss, (0, 1, 2))
      # compiled inside the report (ptxas runs then), run outside it: a run that hangs
      # still leaves the report in the JSON
      with _ptxas_report(out, report):
        if args.compile_only:
          _compile_only(args, out, f"grad {case} {label}", grads, q, k, v)
          return
        compiled = jax.jit(grads).lower(q, k, v).compile()
      got = jax.block_until_ready(compiled(q, k, v))
    if case == "causal_gqa_8_2":
      want = _grads(*(_f64(x) for x in (q, k, v, g)))
    else:
      tanh = lambda x: np.tanh(x / SOFT_CAP)
      _, *want = reference_mods_vjp(*(_f64(x) for x in (q, k, v, g)),
                                    allowed=ids[:, None] == ids[None, :],
                                    score=lambda x: SOFT_CAP * tanh(x),
                                    d_score=lambda x: 1.0 - tanh(x) ** 2)
    errs = [float(np.max(np.abs(_f64(a) - b)) / np.max(np.abs(b))) for a, b in zip(got, want)]
    ok = max(errs) < 2e-2  # bfloat16 inputs and dq, dk, dv: relative to the largest entry
    row = dict(case=f"{case}_grad", impl=label, rel_err=errs, passed=ok,
               seconds=round(time.perf_counter() - start, 1))
    say(f"[grad]   {case} {label}: {'ok' if ok else 'FAIL'} relative errors dq, dk, dv "
        f"{', '.join(f'{e:.3g}' for e in errs)} (bound 2e-2)")
  except Exception as e:  # noqa: BLE001
    row = dict(case=f"{case}_grad", impl=label, passed=False, error=_error(e))
    say(f"[grad]   {case} {label} ERROR {row['error'][:600]}")
  out["values"].append(row)


def default_choice(args) -> str:
  """What implementation=None runs on "cuda" for the documents-with-soft-cap gradient case
  (jattn.explain on its shapes: flex_mgpu_ws on a Hopper card, flex_gpu where no GPU is
  seen)."""
  T, H = (128, 64) if args.smoke else (512, 128)
  q = jax.ShapeDtypeStruct((1, T, 8, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, T, 2, H), jnp.bfloat16)
  ids = jnp.zeros((1, T), jnp.int32)
  return str(jattn.explain(q, kv, kv, mask_mod=mods.document(ids),
                           score_mod=mods.soft_cap(SOFT_CAP)).implementation("cuda"))


@contextlib.contextmanager
def _ptxas_report(out, label):
  """For label (else nothing): Mosaic GPU's own ptxas log of the kernels compiled inside,
  read as benchmarks/gpu_static.py reads it: per kernel, registers, spills and whether
  ptxas ignored setmaxnreg (C7504, seen once with jax 0.12), into out["ptxas"]."""
  if label is None:
    yield
    return
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import gpu_static  # noqa: PLC0415
  log = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"mgpu_fast_check_{os.getpid()}.log"
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  try:
    with gpu_static.captured_stdout(log):
      yield
  finally:
    os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {}
    for name in gpu_static.KERNELS["flex_mgpu_ws"] + gpu_static.KERNELS["flex_mgpu"]:
      figures = gpu_static.ptxas_figures(text, f"{name}_mosaic_gpu_kernel")
      if figures:
        found[name] = {k: figures[k] for k in ("registers", "spill_stores_bytes",
                                               "spill_loads_bytes", "setmaxnreg_ignored")}
    out.setdefault("ptxas", {})[label] = found or "no ptxas log (jax printed none)"
    say(f"[ptxas]  {label}: {found or 'no ptxas log'}")


def _grads(q, k, v, g):
  """float64 dq, dk, dv of sum(attention(q, k, v, causal) * g), [B, T, N|K, H]."""
  N, K = q.shape[2], k.shape[2]
  kk, vv = np.repeat(k, N // K, 2), np.repeat(v, N // K, 2)
  scale = 1 / np.sqrt(q.shape[-1])
  T, S = q.shape[1], k.shape[1]
  s = np.einsum("btnh,bsnh->bnts", q, kk) * scale
  s = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("bnts,bsnd->btnd", p, vv)
  dp = np.einsum("btnd,bsnd->bnts", g, vv)
  ds = p * (dp - np.einsum("btnd,btnd->bnt", g, o)[..., None])
  dq = np.einsum("bnts,bsnh->btnh", ds, kk) * scale
  dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
  dv = np.einsum("bnts,btnd->bsnd", p, g)
  fold = lambda x: x.reshape(*x.shape[:2], K, N // K, x.shape[-1]).sum(3)
  return dq, fold(dk), fold(dv)


# ---------------------------------------------------------------- 2. speed


# forward at every length, after causal: the masks of issue 45's goals (no_mask: the work
# 16 documents are measured against)
FORWARD_CASES = ("documents", "soft_cap", "window", "alibi", "no_mask")
BACKWARD_CASES = ("causal", "soft_cap", "documents")  # forward + backward, first length


def speed_jobs(lengths):
  """(T, case, backward): at every length causal and FORWARD_CASES forward; at the first,
  BACKWARD_CASES forward + backward (main runs the first two of those first)."""
  jobs = []
  for x, T in enumerate(lengths):
    jobs += [(T, "causal", False)] + [(T, c, True) for c in BACKWARD_CASES] * (x == 0)
    jobs += [(T, case, False) for case in FORWARD_CASES]
  return jobs


def measure_speed(args, out, deadline, impls, jobs, fast_backward=True):
  """Times each job's contenders; fast_backward=False leaves out the warp-specialised
  backward's (":bwd"), whose isolated check did not come back (check_fast_backward)."""
  if args.compile_only:  # torch compiles on its own card, at run time
    torch_device, note = None, "not run (--compile-only)"
  else:
    torch_device, note = bench._torch_device(argparse.Namespace(torch=True,
                                                                smoke=args.smoke))
  out["torch"] = note
  say(f"[speed] torch: {note}")
  N, H = (2, 64) if args.smoke else (16, 128)
  inputs = {}
  for T, case, backward in jobs:
    pass_ = "fwd+bwd" if backward else "fwd"
    if time.perf_counter() > deadline:
      out["skipped"].append(dict(stage="speed", T=T, case=case, pass_=pass_))
      say(f"[speed] T={T} {case} {pass_}: skipped (deadline)")
      continue
    B = 1 if args.smoke else max(1, 8192 // T)
    if T not in inputs:
      inputs = {T: bench._inputs(B, T, N, H, "bfloat16", torch_device)}  # one length held
    jx, th = inputs[T]
    contenders = _jax_contenders(case, B, T, N, impls, args.smoke, backward, fast_backward)
    timers = {}
    for name, fn in contenders.items():
      if time.perf_counter() > deadline:
        break
      given = tuple(x.astype(jnp.float16) for x in jx) if name.endswith(":f16") else jx
      with _stage(args, out, f"speed T={T} {case} {pass_} {name}: compile"):
        timers[name] = _timer(out, T, case, name, lambda: _make(
            args, fn, given, backward, out, f"speed T={T} {case} {pass_} {name}"))
    if th is not None and time.perf_counter() < deadline:
      for name, fn in _torch_contenders(case, B, T, N, torch_device, out, backward).items():
        if time.perf_counter() > deadline:
          break
        with _stage(args, out, f"speed T={T} {case} {pass_} {name}: compile"):
          timers[name] = _timer(out, T, case, name,
                                lambda: bench.torch_timer(fn, th, backward))
    timers = {n: t for n, t in timers.items() if t is not None}
    if args.smoke:
      timers = {n: (lambda t: lambda: _in_context(args, t))(t) for n, t in timers.items()}
    with _stage(args, out, f"speed T={T} {case} {pass_}: timing"):
      times = bench.interleaved(timers, args.rounds)
    flops = 4 * B * N * H * T * T * bench.visible_fraction(case, T) * (2.5 if backward else 1)
    rows = {}
    for name, ts in times.items():
      med = statistics.median(ts)
      rows[name] = dict(T=T, B=B, case=case, pass_=pass_, contender=name, ms=1e3 * med,
                        tflops=flops / med / 1e12, spread=(max(ts) - min(ts)) / med)
      out["speed"].append(rows[name])
    fast = rows.get(FAST)
    for name, row in sorted(rows.items(), key=lambda x: x[1]["ms"]):
      ratio = f"  {FAST} / this {fast['ms'] / row['ms']:.2f}" if fast else ""
      say(f"[speed] T={T:<6d} B={B} {case:9s} {pass_:7s} {name:22s} {row['ms']:8.3f} ms "
          f"{row['tflops']:6.1f} TFLOP/s{ratio}")


def _jax_contenders(case, B, T, N, impls, smoke, backward=False, fast_backward=True):
  """name -> fn(q, k, v) [B, T, N, H]: the fast path's variants ("flex_mgpu_ws:kv64" its
  64-key tiles; ":bwd" its warp-specialised dq and dk/dv kernels, ":bwd:mask_mod" those
  with causal as a mask_mod; ":fma16" / ":fma32" part
  of its exp2 on the FP32 pipe; ":tiles", causal, each
  Mosaic GPU path through the to_tiles transposes it no longer needs), the reference
  (causal only: the interpreted design's cost), flex_gpu and cuDNN (causal)."""
  kw = bench.case_kwargs(case, B, T, N)
  attend = lambda impl, extra=None: (lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation=impl, **(extra or kw)))
  out = {impls[0]: attend(impls[0])}
  if case == "causal":  # the in-place reads and writes against the to_tiles copies
    for impl in impls:
      def tiles(q, k, v, impl=impl):
        with kernel_inputs.through_tiles():
          return attend(impl)(q, k, v)
      out[f"{impl}:tiles"] = tiles
  if FAST in impls and backward and fast_backward:
    def fast_backward(q, k, v, rows=None, extra=None):
      with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv(), (
          flex_mgpu.ws_dkv_rows(rows) if rows else contextlib.nullcontext()):
        return attend(FAST, extra)(q, k, v)
    out[f"{FAST}:bwd"] = fast_backward
    # the dk/dv kernel's other query tile (causal and documents take 64 rows, soft-cap 32:
    # the card says which is faster, spills and all: flex_mgpu._ws_dkv_rows)
    other = 64 if case == "soft_cap" else 32
    out[f"{FAST}:bwd:rows{other}"] = lambda q, k, v: fast_backward(q, k, v, other)
    if case == "causal":  # issue 45's goal names causal as a mask_mod, forward + backward
      out[f"{FAST}:bwd:mask_mod"] = lambda q, k, v: fast_backward(
          q, k, v, extra=dict(mask_mod=mods.causal()))
  if FAST in impls and not backward and case in ("causal", "soft_cap"):
    # part of the softmax's exp2 on the FP32 pipe (flex_mgpu.ws_exp2_fma), since soft-cap's
    # tanh shares the special-function unit with it: 16 columns, the SASS model's choice,
    # and 32 (docs/gpu_kernel.md); causal, whose exponentials are not its limit, the control
    for columns in (16, 32) if case == "soft_cap" else (16,):
      def fma(q, k, v, columns=columns):
        with flex_mgpu.ws_exp2_fma(columns):
          return attend(FAST)(q, k, v)
      out[f"{FAST}:fma{columns}"] = fma
  if case == "causal" and not backward:
    out[f"{impls[0]}:mask_mod"] = attend(impls[0], dict(mask_mod=mods.causal()))
    if FAST in impls:
      def kv64(q, k, v):
        with flex_mgpu.ws_kv_tile(64):
          return attend(FAST)(q, k, v)
      out[f"{FAST}:kv64"] = kv64
  if case == "causal" or smoke:
    out.update({impl: attend(impl) for impl in impls[1:]})
  if not smoke:
    out["flex_gpu"] = attend("flex_gpu")
    if case in ("causal", "no_mask", "window"):  # what cuDNN's flags say
      out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn", **kw)
    if case == "causal":
      if not backward:  # the same design, jax's (its causal backward is not written)
        out["jax_attention_mgpu:f16"] = _jax_attention_mgpu
  return out


def _jax_attention_mgpu(q, k, v):
  """jax's own FlashAttention-3 kernel on Mosaic GPU (causal; it takes float16 here:
  the timer hands it float16 copies of the inputs), the design's reference point."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                       causal=True)
  return attention_mgpu.attention(q, k, v, config)


def _torch_contenders(case, B, T, N, device, out, backward=False):
  """FlexAttention (Triton; FLASH where this torch has it) and SDPA, from the benchmark."""
  try:
    got = bench.torch_contenders(case, B, T, N, device)
  except Exception as e:  # noqa: BLE001
    out["errors"].append(dict(T=T, case=case, contender="torch", error=_error(e)))
    say(f"[speed] T={T} {case}: torch contenders failed: {_error(e)[:300]}")
    return {}
  if device == "cpu" and backward:  # FlexAttention has no CPU backward
    got.pop("torch_flex", None)
  if device == "cuda" and "torch_flex" in got and not backward:
    flex = got["torch_flex"]
    got["torch_flex:FLASH"] = lambda q, k, v: _flash(flex, q, k, v)
  return got


def _flash(flex, q, k, v):
  """torch FlexAttention with kernel_options={"BACKEND": "FLASH"} (torch >= 2.10 with
  flash-attn 4's CuTe kernels): the benchmark's closure, its options swapped."""
  cells = {c: x.cell_contents for c, x in zip(flex.__code__.co_freevars, flex.__closure__)}
  return cells["flex"](q, k, v, score_mod=cells["score"], block_mask=cells["block_mask"],
                       kernel_options={"BACKEND": "FLASH"})


@contextlib.contextmanager
def _fast_backward():
  with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    yield


def _make(args, fn, inputs, backward=False, out=None, label=""):
  with _context(args):
    if args.compile_only:  # the program jax_timer would run, compiled; no timer
      _compile_only(args, out, label, bench.timed_program(fn, backward), *inputs)
      return None
    return bench.jax_timer(fn, inputs, backward)


def _compile_only(args, out, label, fn, *inputs):
  """--compile-only: jax.jit(fn) compiled for the card from this host (deviceless_cuda:
  Mosaic GPU, Triton and cuDNN to SASS with the card's limits), recorded in
  out["compiled"]; raises nothing (a failure is the row's error)."""
  start = time.perf_counter()
  try:
    deviceless_cuda.compile_for(args.compile_only, fn, *inputs)
    row = dict(program=label, compiled=True)
  except Exception as e:  # noqa: BLE001 (recorded; the next program compiles)
    row = dict(program=label, compiled=False, error=_error(e))
  row["seconds"] = round(time.perf_counter() - start, 1)
  out["compiled"].append(row)
  say(f"[compile] {label:52s} {'ok' if row['compiled'] else 'FAILED ' + row['error'][-600:]}"
      f" ({row['seconds']} s)")


def _in_context(args, timer):
  with _context(args):
    return timer()


def _timer(out, T, case, name, make):
  start = time.perf_counter()
  try:
    timer = make()
    if timer is not None:  # (--compile-only: _compile_only said what it did)
      say(f"[speed] T={T} {case} {name}: compiled and warmed in "
          f"{time.perf_counter() - start:.1f} s")
    return timer
  except Exception as e:  # noqa: BLE001
    out["errors"].append(dict(T=T, case=case, contender=name, error=_error(e)))
    say(f"[speed] T={T} {case} {name}: FAILED {_error(e)[:400]}")
    return None


# ---------------------------------------------------------------- main


def _context(args):
  return pallas_interpret() if args.smoke else contextlib.nullcontext()


def _error(e: BaseException) -> str:
  tail = "".join(traceback.format_exception_only(type(e), e)).strip()
  return tail[-3000:]


def _stage(args, out, label):
  """One case's jax calls under the watchdog (tools/watchdog.py: a call that never returns
  ends the run, "hung" in the JSON); the results before it are written first, so that a
  run killed from outside (the device tool's time limit) still leaves them."""
  _save(args, out)
  return args.watch.stage(label)


def _save(args, out):
  """out, with its summary, as DIR/mgpu_fast_check.json (written whole, then renamed)."""
  bad = [r for r in out["values"] if not r.get("passed")]
  failed = [r for r in out["compiled"] if not r["compiled"]]
  out["summary"] = dict(values_passed=len(out["values"]) - len(bad), values_failed=len(bad),
                        speed_rows=len(out["speed"]), errors=len(out["errors"]),
                        skipped=len(out["skipped"]), hung=len(out["hung"]),
                        compiled=len(out["compiled"]) - len(failed),
                        compile_failed=len(failed))
  path = pathlib.Path(args.out) / "mgpu_fast_check.json"
  part = path.with_name(path.name + ".part")
  part.write_text(json.dumps(out, indent=1, default=str))
  os.replace(part, path)


def _fast_backward_run(impls):
  """(impl, label) of the warp-specialised dq and dk/dv kernels' gradient check; under
  --smoke the stand-in's own backward, which rehearses the isolation, not the kernels
  (the interpreter runs those in tests/kernels/test_flex_mgpu.py)."""
  return (impls[0], f"{impls[0]}:bwd")


def check_fast_backward(args, out, deadline, impls) -> bool:
  """The gradients of GRAD_CASES by the warp-specialised dq and dk/dv kernels, which no
  card has run: in a child process (this script, --fast-backward-only) with its own
  watchdog, so that a deadlock or a crash of the card's context ends that process, not
  the run. Its rows join out; True where it came back (then the timings take the
  ":bwd" contenders), False where it hung, crashed or was skipped."""
  impl, label = _fast_backward_run(impls)
  if args.compile_only:  # nothing runs, nothing hangs
    for case in GRAD_CASES:
      check_grad(args, out, deadline, impl, label, _fast_backward, case=case)
    return True
  left = deadline - time.perf_counter()
  if left <= 0:
    out["skipped"].extend(dict(stage="grad", impl=label, case=case) for case in GRAD_CASES)
    return False
  _save(args, out)
  child = pathlib.Path(args.out) / "fast_backward"
  argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--fast-backward-only",
          "--out", str(child), "--deadline", f"{left:.0f}", "--hang-after", f"{args.hang_after:g}"]
  argv += ["--smoke"] * args.smoke + ["--rehearse-hang", args.rehearse_hang] * bool(
      args.rehearse_hang)
  say(f"[isolated] {label}: the gradients in a child process (a hang or a crash there "
      "ends it, not this run)")
  start = time.perf_counter()
  try:  # its watchdog ends a hung stage; the timeout is for a child that cannot
    status = subprocess.run(argv, timeout=len(GRAD_CASES) * args.hang_after + 120).returncode
  except subprocess.TimeoutExpired:
    status = None
  seconds = round(time.perf_counter() - start, 1)
  path = child / "mgpu_fast_check.json"
  got = json.loads(path.read_text()) if path.exists() else {}
  for key in ("values", "skipped", "errors"):
    out[key] += got.get(key, [])
  out.setdefault("ptxas", {}).update(got.get("ptxas", {}))
  out["hung"] += [dict(row, isolated=True) for row in got.get("hung", [])]
  if status == 0:
    return True
  if status is None:
    out["hung"].append(dict(stage=f"isolated {label}", seconds=seconds, isolated=True))
  elif status != EXIT_HUNG:
    out["errors"].append(dict(stage=f"isolated {label}", error=f"the child process ended "
                              f"with status {status} (a crash?) after {seconds} s"))
  say(f"[isolated] {label}: {'hung' if status in (None, EXIT_HUNG) else f'status {status}'}"
      f" after {seconds} s; its contenders are left out of the timings")
  return False


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "mgpu_fast_check_out"))
  parser.add_argument("--deadline", type=float, default=None,
                      help="seconds after which no new case starts (240 on a card; 700 in a "
                           "--smoke rehearsal, where the interpreter runs every case; 3600 "
                           "with --compile-only)")
  parser.add_argument("--hang-after", type=float, default=None, metavar="SECONDS",
                      help="a case still running after this long has hung: the run writes "
                           "what it has and ends, exit status 3 (120 on a card, 900 under "
                           "--smoke; no watchdog with --compile-only)")
  parser.add_argument("--rehearse-hang", default=None, metavar="STAGE",
                      help="the first case whose label starts with STAGE (values, grad or "
                           "speed, e.g. 'grad causal_gqa_8_2 flex_mgpu:bwd') hangs on "
                           "purpose: what the run does when a kernel never returns")
  parser.add_argument("--fast-backward-only", action="store_true",
                      help="only the warp-specialised backward's gradient check (the child "
                           "process the run starts for it)")
  parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--smoke", action="store_true",
                      help="a CPU rehearsal: tiny shapes, the interpretable flex_mgpu standing "
                           "in for flex_mgpu_ws (which runs compiled only)")
  parser.add_argument("--compile-only", choices=sorted(deviceless_cuda.TARGETS), default=None,
                      help="on a host without the card: compile every jax program of the run "
                           "for it (the card's shapes; nothing runs, torch is left out), with "
                           "implementation=None planned as on a Hopper card")
  args = parser.parse_args(argv)
  if args.smoke and args.compile_only:
    parser.error("--smoke and --compile-only exclude each other (tiny interpreted shapes, "
                 "or the card's shapes compiled)")
  if args.hang_after is not None and not args.hang_after > 0:
    parser.error(f"--hang-after: seconds must be positive, got {args.hang_after:g}")
  if args.rehearse_hang is not None:
    if not args.rehearse_hang.startswith(("values", "grad", "speed")):
      parser.error("--rehearse-hang: a stage label starts with values, grad or speed, got "
                   f"{args.rehearse_hang!r}")
    if args.compile_only:
      parser.error("--rehearse-hang and --compile-only exclude each other (nothing runs, "
                   "so nothing hangs: the watchdog is off)")
  start = time.perf_counter()
  if args.deadline is None:
    args.deadline = 700.0 if args.smoke else 3600.0 if args.compile_only else 240.0
  if args.hang_after is None:
    args.hang_after = 900.0 if args.smoke else 120.0
  deadline = start + args.deadline
  if args.compile_only:  # before jax starts a backend: the plugin finds no driver
    jax.config.update("jax_platforms", "cpu")
    deviceless_cuda.cuda_devices(args.compile_only)
  platform = jax.devices()[0].platform
  if args.smoke:
    args.lengths, args.rounds = [128], 1
    impls = ["flex_mgpu"]
  elif platform != "gpu" and not args.compile_only:
    raise SystemExit(f"needs an NVIDIA Hopper GPU (found {platform}); --smoke rehearses, "
                     "--compile-only h100 compiles the run for the card")
  else:
    impls = [FAST, "flex_mgpu"]
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  device = (f"compile-only {deviceless_cuda.TARGETS[args.compile_only]}" if args.compile_only
            else jax.devices()[0].device_kind)
  out = dict(device=device, jax=jax.__version__, smoke=args.smoke,
             started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), argv=sys.argv, values=[],
             speed=[], errors=[], skipped=[], compiled=[], hung=[])

  def on_hang(label, seconds):  # the watchdog's thread; the main thread is in the hung call
    out["hung"].append(dict(stage=label, seconds=seconds))
    out["seconds"] = round(time.perf_counter() - start, 1)
    _save(args, out)

  args.watch = Watchdog(None if args.compile_only else args.hang_after, on_hang,
                        args.rehearse_hang)
  if args.fast_backward_only:  # the child of check_fast_backward
    try:
      for case in GRAD_CASES:
        check_grad(args, out, deadline, *_fast_backward_run(impls), _fast_backward,
                   case=case)
    finally:
      out["seconds"] = round(time.perf_counter() - start, 1)
      _save(args, out)
    return out
  try:
    import torch
    out["torch_version"] = torch.__version__
  except ImportError:
    out["torch_version"] = None
  say(f"[mgpu_fast_check] jax {jax.__version__} on {out['device']}, torch "
      f"{out['torch_version']}; deadline {args.deadline:.0f} s"
      + ("" if args.compile_only else f", a case hangs after {args.hang_after:g} s"))
  # --compile-only: implementation=None plans as the card's process would (a Hopper GPU
  # seen: registry.hopper_fast_path), not as this GPU-less host's
  hopper = (mock.patch.object(flex_mgpu, "gpu_capability", lambda: (9, 0)) if args.compile_only
            else contextlib.nullcontext())
  try:
    hopper.__enter__()
    # the most telling first, should the deadline cut the rest: causal's values, its
    # forward time at the first length, the other values, the gradients, the other times
    names = list(value_cases(8))
    if args.smoke:  # cases without per-token arrays (their shapes are the card's)
      names = ["causal", "sliding_window_100", "fully_masked_rows"]
    jobs = speed_jobs(args.lengths)
    # first what no card has seen: the warp-specialised dq and dk/dv kernels' gradients
    # (in a child process: check_fast_backward), then their forward + backward time
    # beside the old backward, cuDNN and FlexAttention
    check_values(args, out, deadline, impls, names[:1])
    for case in GRAD_CASES:
      check_grad(args, out, deadline, impls[0], case=case)
    fast_backward = check_fast_backward(args, out, deadline, impls)
    # implementation=None, which on a Hopper card takes flex_mgpu_ws (bfloat16, H = 128:
    # registry.hopper_fast_path), labelled with what jattn.explain names for "cuda"
    check_grad(args, out, deadline, None, f"default:{default_choice(args)}", case=GRAD_CASES[1])
    backward_first = [job for job in jobs if job[2]] + [job for job in jobs if not job[2]]
    measure_speed(args, out, deadline, impls, backward_first[:2], fast_backward)
    check_values(args, out, deadline, impls, names[1:])
    measure_speed(args, out, deadline, impls, backward_first[2:], fast_backward)
  finally:
    hopper.__exit__(None, None, None)
    out["seconds"] = round(time.perf_counter() - start, 1)
    if out["speed"]:  # issue 45's goals and the fastest paths, from this run's timings
      try:
        out["goals"] = gpu_goals.goals(out["speed"])
        say(gpu_goals.report(out["speed"]))
      except Exception as e:  # noqa: BLE001  (the JSON below is written whatever happens)
        out["errors"].append(dict(stage="goals", error=_error(e)))
    _save(args, out)
    say(f"[mgpu_fast_check] done in {out['seconds']} s: {out['summary']}")
  return out


if __name__ == "__main__":
  main()
