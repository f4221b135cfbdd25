"""The TPU compiler's own schedule of jattn's flex_tpu kernels and jax's splash kernels,
read from this CPU (no TPU), turned into an estimated kernel time per call.

A TPU TensorCore issues one VLIW bundle per cycle from a static schedule. libtpu, asked
with LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true", writes each
kernel's final bundles (`<kernel>-NN-final_bundles.txt`). A Pallas kernel compiles to one
loop over its grid steps; inside it each `pl.when` is a forward branch over a
predicated region (init, the FULL tile, the PARTIAL tile, the finish). This script:

1. compiles, deviceless (jax's compile-only TPU topologies), `jax.grad` of one
   attention call per case with `implementation="flex_tpu"` or `"splash"`, at a small
   T (the per-step bundles do not depend on T: only the loop's trip count does), for
   each generation;
2. parses each kernel's bundles: the loop body, its predicated regions, and the
   bundles a grid step executes on each path: EMPTY (loop overhead only), FULL,
   PARTIAL, plus the per-row init and finish (splash has one compute path: it applies
   its mask on every tile it runs);
3. counts the grid steps of each class for the real call (B = 1, N = 16, T = S = 4096
   and 16384) from the block tables on the host: jattn's own classes for flex_tpu,
   splash's `MaskInfo` for splash;
4. estimates each kernel's time as the sum over its steps of
   max(bundles / clock, HBM bytes the step moves / bandwidth), and gives the MXU-only
   bound (the matmuls' MXU cycles alone) beside it.

What it leaves out (see docs/tpu_kernel.md): DMA waits (assumed hidden behind the
compute: the estimate takes the larger of the two per step, not their sum), the
pipeline's per-step DMA issue cost when operands live in HBM (at the small compile
size XLA places operands in VMEM), branch delay slots, the XLA ops around the kernels
(transposes, padding, the block tables), and anything a real chip adds (clock
throttling, HBM refresh). It is the compiler's schedule, not a measurement.

    python benchmarks/tpu_schedule.py [--gens v5e v6e] [--out PATH] [--smoke]
        [--label NAME]  (record this run's figures under NAME in the JSON, e.g. "before")

Needs libtpu (`pip install "jax[tpu]"`); run with JAX_PLATFORMS=cpu. Each compile is
cached by its inputs' fingerprint under --cache (default /tmp/jattn_tpu_schedule).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Per generation, per TensorCore: public peak bf16 FLOP/s and HBM bandwidth (Google Cloud
# TPU system-architecture pages: v5e 197 TFLOP/s, 819 GB/s; v6e 918 TFLOP/s, 1640 GB/s;
# v5p 459 TFLOP/s and 2765 GB/s per chip of two TensorCores). `mxus` x `width`: the MXU
# rows retired per cycle, in units of one LHS row on a width x width array. v5e and v5p:
# four 128 x 128 MXUs (the schedule names mxu0..mxu3). v6e: the schedule names two
# 256 x 256 units, yet schedules splash's dk/dv tile (4096 row passes of 256-wide
# matmuls) in 1349 bundles, so a unit retires at least 1.5 rows a cycle: taken as two,
# i.e. four 256-wide row passes a cycle (an assumption: no published figure says).
# The clock is derived: peak / (mxus x width^2 x 2 FLOP): v5e 1.50 GHz, v6e 1.75 GHz,
# v5p 1.75 GHz.
GENERATIONS = {
    "v5e": dict(topology="v5e=1x1", peak_flops=197e12, hbm_bytes_s=819e9, mxus=4, width=128),
    "v6e": dict(topology="v6e=1x1", peak_flops=918e12, hbm_bytes_s=1640e9, mxus=4, width=256),
    "v5p": dict(topology="v5p=1x1x1", peak_flops=459e12 / 2, hbm_bytes_s=2765e9 / 2, mxus=4,
                width=128),
}


def clock_hz(gen: str) -> float:
  g = GENERATIONS[gen]
  return g["peak_flops"] / (g["mxus"] * g["width"] ** 2 * 2)


# ---------------------------------------------------------------- the bundles' parser

_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LB|LH|LE|PB|PF|CT)?:?\s*>?\s*\{")
from benchmarks.tpu_loops import _BRANCH, _REGION  # noqa: E402 (any loop nest's reader)


@dataclasses.dataclass
class Schedule:
  """One kernel's final bundles, as control flow: the grid loop's body [body_start,
  body_end] (bundle addresses), the bundles before and after it, and the predicated
  regions a step may skip: (branch address, first skipped, first after) in order."""

  total: int
  body_start: int
  body_end: int
  regions: list
  mxu_units: int

  @property
  def body(self) -> int:
    return self.body_end - self.body_start + 1

  def as_dict(self):
    return dict(total=self.total, body=self.body, body_start=self.body_start,
                regions=[dict(branch=b, skips=end - start) for b, start, end in self.regions])


def parse_bundles(text: str) -> Schedule:
  """The control flow of a `*-final_bundles.txt`: its loop and its forward branches."""
  addresses, region_at, branches = [], {}, []
  mxus = set()
  for line in text.splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    a = int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1))
    addresses.append(a)
    for r in _REGION.findall(line):
      region_at.setdefault(int(r), a)
    for pred, r in _BRANCH.findall(line):
      branches.append((a, int(r)))
    mxus.update(re.findall(r"\.mxu(\d)\b", line))
  if not addresses:
    raise ValueError("no bundles found: not a final_bundles dump")
  jumps = [(a, region_at[r]) for a, r in branches if r in region_at]
  back = [(a, t) for a, t in jumps if t <= a]
  if len(back) != 1:
    raise ValueError(f"expected one loop (one backward branch), found {len(back)}")
  end, start = back[0]
  forward = sorted((a, t) for a, t in jumps if start <= a < t <= end + 1)
  # the top-level ranges; the widest is the software pipeline's guard (prologue and
  # epilogue iterations), whose children are the step's predicated regions
  top = [r for r in forward if not any(o != r and o[0] <= r[0] and r[1] <= o[1]
                                       for o in forward)]
  guard = max(top, key=lambda r: r[1] - r[0])
  inner = [r for r in forward if r != guard and guard[0] < r[0] and r[1] <= guard[1]]
  children = [r for r in inner if not any(o != r and o[0] <= r[0] and r[1] <= o[1]
                                          for o in inner)]
  regions = [(a, a + 1, t) for a, t in children]
  return Schedule(len(addresses), start, end, regions, len(mxus))


def paths(kind: str, sched: Schedule) -> dict:
  """Bundles per grid step on each path, and per row, for a kernel of `kind`
  ("flex": regions init, FULL, PARTIAL, finish; "splash": init, run, finish)."""
  names = {"flex": ("init", "full", "partial", "finish"),
           "splash": ("init", "run", "finish")}[kind]
  if kind == "flex" and len(sched.regions) == 2:
    # a call with no mask: every tile FULL, so the compiler keeps no PARTIAL path and
    # runs the tile unpredicated: the step is the loop's whole body less init and finish
    size = {n: end - start for n, (_, start, end) in zip(("init", "finish"), sched.regions)}
    step = sched.body - sum(size.values())
    return dict(loop_overhead=step, init=size["init"], finish=size["finish"],
                launch=sched.total - sched.body, full=step, partial=step, empty=step)
  if len(sched.regions) != len(names):
    raise ValueError(f"{kind} kernel: expected {len(names)} predicated regions "
                     f"{names}, the schedule has {len(sched.regions)}: {sched.as_dict()}")
  size = {n: end - start for n, (_, start, end) in zip(names, sched.regions)}
  overhead = sched.body - sum(size.values())
  out = dict(loop_overhead=overhead, init=size["init"], finish=size["finish"],
             launch=sched.total - sched.body)
  if kind == "flex":
    out.update(full=overhead + size["full"], partial=overhead + size["partial"])
  else:  # splash: the same code on every tile it runs (its mask is applied throughout)
    out.update(full=overhead + size["run"], partial=overhead + size["run"])
  out["empty"] = overhead
  return out


# ---------------------------------------------------------------- the calls compiled

H_COMPILE = {128: 128, 256: 256}
T_COMPILE = 1024
N_COMPILE = 4


def doc_ids(T: int, docs: int = 16):
  """int32 [1, T]: 16 documents of uneven lengths (proportional to 1, 2, ..., 16)."""
  import numpy as np
  w = np.arange(1, docs + 1, dtype=np.float64)
  ends = np.round(np.cumsum(w) / w.sum() * T).astype(np.int64)
  return np.searchsorted(ends, np.arange(T), side="right").astype(np.int32)[None]


def call_kwargs(case: str, T: int, N: int):
  """The attention call's keyword arguments for a case (T: the tokens, N: query heads)."""
  import jax.numpy as jnp
  import numpy as np
  import jattn
  causal = dict(is_causal=True)
  if case == "none":  # no mask: every tile FULL
    return {}
  if case == "causal":
    return causal
  if case == "window":
    return dict(is_causal=True, local_window_size=(1023, 0))
  if case == "window_mod":  # the same window written as a mask_mod, as FlexAttention's users do
    return dict(mask_mod=jattn.mods.and_masks(jattn.mods.causal(),
                                              jattn.mods.sliding_window(1023)))
  if case == "documents":
    return dict(mask_mod=jattn.mods.document(jnp.asarray(doc_ids(T))))
  if case == "segments":  # the same documents as segment ids (flex_tpu: as mods.document)
    ids = jnp.asarray(doc_ids(T))
    return dict(q_segment_ids=ids, kv_segment_ids=ids)
  if case == "softcap":
    return dict(causal, score_mod=jattn.mods.soft_cap(30.0))
  if case == "alibi":
    return dict(causal, score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N)))
  if case == "relbias":
    table = np.random.default_rng(0).normal(size=(N, 2 * 64 + 1)).astype(np.float32)
    return dict(causal, score_mod=jattn.mods.relative_bias(jnp.asarray(table)))
  raise ValueError(case)


FLEX_CASES = ("none", "causal", "window", "window_mod", "documents", "segments", "softcap",
              "alibi", "relbias")
SPLASH_CASES = ("none", "causal", "window", "window_mod", "documents", "segments", "softcap")
# the kernels' names in the dump (regular expressions): splash names its kernels by
# heads (mha, or mqa for grouped heads), segment ids and residuals
KERNELS = {"flex_tpu": {"fwd": "jattn_flex_tpu_fwd", "dq": "jattn_flex_tpu_dq",
                        "dkv": "jattn_flex_tpu_dkv"},
           "splash": {"fwd": "splash_m[hq]a_fwd(_segmented)?_residuals",
                      "dq": "splash_m[hq]a_dq", "dkv": "splash_m[hq]a_dkv"}}


_COMPILE_VERSION = 1  # bump when what compile_case compiles or parses changes


def _fingerprint(impl, *parts) -> str:
  """The cache key of a compile: its arguments and the sources of its kernel (flex_tpu's
  edits leave splash's compiles cached, and the other way round)."""
  kernels = ROOT / "jattn/_src/kernels"
  src = ([kernels / f"{f}.py" for f in ("flex_tpu_kernels", "flex_tpu", "tile_mods",
                                        "tile_classes", "kernel_plan", "kernel_vjp",
                                        "flex_tpu_call")]
         if impl == "flex_tpu" else
         [ROOT / "jattn/_src/impl/fused.py", ROOT / "jattn/_src/impl/splash_mask.py"])
  h = hashlib.sha256(repr((_COMPILE_VERSION, impl) + parts).encode())
  for f in src:
    h.update(f.read_bytes())
  return h.hexdigest()[:16]


class MissingKernel(RuntimeError):
  """A kernel of the compiled program has no bundles file in the dump."""


def _compile_in_child(gen, impl, case, H, K_ratio, cache_dir, D=None, dtype="bfloat16"):
  """compile_case in a fresh process with its own dump directory. In one process libtpu
  sometimes dumps no file for a kernel of a later compile (seen for flex_tpu's forward
  after another case's): a fresh process dumps every kernel it compiles."""
  import subprocess
  code = ("import sys, json; sys.path.insert(0, sys.argv[1]); "
          "from benchmarks import tpu_schedule as t; "
          "print(json.dumps(t._child(*json.loads(sys.argv[2]))))")
  done = subprocess.run([sys.executable, "-c", code, str(ROOT),
                         json.dumps([gen, impl, case, H, K_ratio, cache_dir, D, dtype])],
                        capture_output=True, text=True, timeout=900,
                        env={k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"})
  if done.returncode:
    raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _child(gen, impl, case, H, K_ratio, cache_dir, D=None, dtype="bfloat16"):
  dump = tempfile.mkdtemp(prefix="jattn_tpu_dump_")
  os.environ["LIBTPU_INIT_ARGS"] = (f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
                                    "--xla_jf_dump_llo_pass_label_regex=final_bundles")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return compile_case(gen, impl, case, H, K_ratio, dump, cache_dir, D, dtype)
  finally:
    shutil.rmtree(dump, ignore_errors=True)


def compile_case(gen, impl, case, H, K_ratio, dump_dir, cache_dir, D=None, dtype="bfloat16"):
  """{kernel role: the parsed paths} of jax.grad of one call, compiled for `gen`.
  K_ratio: G = N / K of the compiled call (1: K = N); D: value's head size (default H);
  dtype: the inputs' ("bfloat16" or "float32")."""
  D = H if D is None else D
  extra = () if (D, dtype) == (H, "bfloat16") else (D, dtype)  # the old keys stay valid
  key = _fingerprint(impl, gen, case, H, K_ratio, T_COMPILE, N_COMPILE, *extra)
  cached = pathlib.Path(cache_dir) / f"{key}.json"
  if cached.exists():
    return json.loads(cached.read_text())
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  import jattn
  devs = topologies.get_topology_desc(GENERATIONS[gen]["topology"], "tpu").devices
  mesh = jax.sharding.Mesh(devs[:1], ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  N, T = N_COMPILE, T_COMPILE
  K = N // K_ratio
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.dtype(dtype), sharding=sharding)
  k = jax.ShapeDtypeStruct((1, T, K, H), jnp.dtype(dtype), sharding=sharding)
  v = jax.ShapeDtypeStruct((1, T, K, D), jnp.dtype(dtype), sharding=sharding)
  kwargs = call_kwargs(case, T, N)

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation=impl, **kwargs)
    return out.astype(jnp.float32).sum()

  for f in pathlib.Path(dump_dir).iterdir():
    f.unlink()
  t0 = time.time()
  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
      lowering_platforms=("tpu",)).compile()
  seconds = time.time() - t0
  got = {"compile_s": round(seconds, 1)}
  files = [f for f in pathlib.Path(dump_dir).iterdir() if f.name.endswith("-final_bundles.txt")
           and "schedule-analysis" not in f.name]
  kind = "flex" if impl == "flex_tpu" else "splash"
  for role, name in KERNELS[impl].items():
    mine = [f for f in files if re.search(rf"-{name}(_\w+)?\.\d+-", f.name)]
    if len(mine) != 1:
      raise MissingKernel(f"{gen} {impl} {case}: expected one {name} kernel, got "
                         f"{[f.name for f in mine]} among {[f.name for f in files]}")
    sched = parse_bundles(mine[0].read_text())
    got[role] = dict(paths(kind, sched), mxu_units=sched.mxu_units, schedule=sched.as_dict())
  cached.parent.mkdir(parents=True, exist_ok=True)
  cached.write_text(json.dumps(got))
  return got


# ---------------------------------------------------------------- grid steps per class


def flex_counts(case, T, N, K, H):
  """flex_tpu's grid-step counts per class, from jattn's block tables on the host."""
  import jax.numpy as jnp
  import numpy as np
  import jattn
  from jattn._src.kernels import flex_tpu
  from jattn._src.kernels.tile_classes import tile_classes
  from jattn._src.masks.modifiers import Modifiers
  from jattn._src.masks.programmable import build_mods
  from jattn._src.masks.structural import MaskSpec
  from jattn._src.masks.structure_mods import as_mask_mods
  kw = call_kwargs(case, T, N)
  window = kw.get("local_window_size")
  spec = MaskSpec(is_causal=kw.get("is_causal", False),
                  local_window=None if window is None else tuple(window),
                  q_segment_ids=kw.get("q_segment_ids"), kv_segment_ids=kw.get("kv_segment_ids"))
  mods = build_mods(kw.get("mask_mod"), kw.get("score_mod"), None, None, N=N)
  m = Modifiers(mods=mods, structure=spec, scale=1 / np.sqrt(H))
  # the kernel reads segment ids as a mods.document mask (`structure_mods`)
  mods = as_mask_mods(m).mods
  p = flex_tpu.plan(B=1, T=T, S=T, N=N, K=K, H=H, D=H, dtype=jnp.bfloat16, modifiers=m)
  if isinstance(p, str):
    raise RuntimeError(f"flex_tpu refuses {case}: {p}")
  from jattn._src.masks.closed_form_blocks import EMPTY, FULL, PARTIAL
  if p.is_causal or p.window is not None or p.has_mask_mod:
    classes = np.asarray(tile_classes(p, None if mods is None else mods.traced()))
  else:  # no mask: every tile FULL
    classes = np.full((1, 1, p.T_padded // p.block_q, p.S_padded // p.block_kv), FULL)
  classes = np.broadcast_to(classes, (1, N) + classes.shape[2:])
  nq, nk = classes.shape[2:]
  full, partial = int((classes == FULL).sum()), int((classes == PARTIAL).sum())
  # the grid's inner extent: each row's non-empty tiles only, padded to the widest row
  # (`tile_classes.grid_widths`), or every tile (a kernel without it)
  import jattn._src.kernels.tile_classes as tc
  kv_w, q_w = tc.grid_widths(p) if hasattr(tc, "grid_widths") and p.skip else (nk, nq)
  G = N // K
  return dict(block_q=p.block_q, block_kv=p.block_kv, rows=N * nq, kv_rows=K * nk,
              grid_width=kv_w, q_grid_width=q_w, full=full, partial=partial,
              steps=N * nq * kv_w, empty=N * nq * kv_w - full - partial,
              dkv_steps=K * nk * G * q_w, dkv_empty=K * nk * G * q_w - full - partial)


def splash_counts(case, T, N, K, H):
  """splash's grid-step counts, from its own MaskInfo (jattn's splash plan)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jattn
  from jattn._src.impl import fused
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16)
  report = jattn.explain(q, kv, kv, implementation="splash", **call_kwargs(case, T, N))
  plan = report.choices["tpu"].plan
  G = N // K
  kernel = fused._splash_kernel(plan, T, T, G if K != N else N, K != N, True)
  bq = fused._block(T)
  out = dict(block_q=bq, block_kv=fused._block(T), guard_empty_rows=bool(plan.guard_empty_rows),
             segments=bool(plan.segments or getattr(plan, "document", False)))
  heads = G if K != N else N
  reps = K if K != N else 1  # the MQA kernel runs once per kv head
  for role, info in (("fwd", kernel.fwd_mask_info), ("dq", kernel.dq_mask_info),
                     ("dkv", kernel.dkv_mask_info)):
    if info is None:
      continue
    bm = np.asarray(info.block_mask) if info.block_mask is not None else None
    if info.data_next is not None:
      shape = np.asarray(info.data_next).shape
    else:
      shape = (1, T // bq, T // fused._block(T))
    per_head = int(np.prod(shape[1:]))
    steps = heads * per_head * reps
    if bm is None:
      run = steps
    else:
      bm = np.broadcast_to(bm, (heads,) + bm.shape[1:])
      run = int((bm > 0).sum()) * reps
    out[role] = dict(steps=steps, run=run, grid_width=int(shape[-1]), rows=N * shape[1])
  return out


@functools.lru_cache(maxsize=None)
def _counts(impl, case, T, N, K):
  """The grid-step counts (the tiles and block tables do not depend on H)."""
  return (flex_counts if impl == "flex_tpu" else splash_counts)(case, T, N, K, 128)


# ---------------------------------------------------------------- the estimate


def mxu_cycles(gen, M, Kd, Nd):
  """MXU cycles of an [M, Kd] x [Kd, Nd] matmul on all the generation's MXUs at once."""
  g = GENERATIONS[gen]
  w = g["width"]
  return M * -(-Kd // w) * -(-Nd // w) / g["mxus"]


def tile_mxu(gen, role, bq, bk, H, D):
  """MXU cycles of one tile's matmuls: forward q k^T, p v; dq adds dO v^T and dS k;
  dk/dv q k^T, dO v^T, p^T dO and dS^T q."""
  qk = mxu_cycles(gen, bq, H, bk)
  if role == "fwd":
    return qk + mxu_cycles(gen, bq, bk, D)
  if role == "dq":
    return qk + mxu_cycles(gen, bq, D, bk) + mxu_cycles(gen, bq, bk, H)
  return qk + mxu_cycles(gen, bq, D, bk) + mxu_cycles(gen, bk, bq, D) + mxu_cycles(
      gen, bk, bq, H)


def estimate(gen, impl, role, p, counts, H, D, T, N, K, itemsize=2):
  """Estimated seconds of one kernel for the call: sum over its steps of max(bundles /
  clock, bytes / bandwidth), and the parts of that sum. itemsize: the inputs' bytes."""
  clk, bw = clock_hz(gen), GENERATIONS[gen]["hbm_bytes_s"]
  bf, f32, lanes = itemsize, 4, 128
  if impl == "flex_tpu":
    bq, bk = counts["block_q"], counts["block_kv"]
    run = counts["full"] + counts["partial"]
    empty = counts["empty"] if role != "dkv" else counts.get("dkv_empty", counts["empty"])
    full, partial = counts["full"], counts["partial"]
    rows = counts["rows"] if role != "dkv" else counts["kv_rows"]
  else:
    bq = bk = counts["block_q"]
    c = counts[role]
    run, empty = c["run"], c["steps"] - c["run"]
    full, partial = run, 0  # one path: FULL and PARTIAL tiles cost the same
    rows = c["rows"] if role != "dkv" else K * (T // bk)
  # bytes per computed step and per row (the init / finish of a row of steps)
  if role == "fwd":
    step_bytes = bk * (H + D) * bf
    row_bytes = bq * H * bf + bq * D * bf + bq * lanes * f32
  elif role == "dq":
    step_bytes = bk * (H + D) * bf
    row_bytes = bq * (H + D) * bf + 2 * bq * lanes * f32 + bq * H * f32
  else:
    step_bytes = bq * (H + D) * bf + 2 * bq * lanes * f32
    row_bytes = bk * (H + D) * bf + bk * (H + D) * (f32 if impl == "flex_tpu" else bf)
  step = lambda bundles, nbytes: max(bundles / clk, nbytes / bw)
  t_full = full * step(p["full"], step_bytes)
  t_partial = partial * step(p["partial"], step_bytes)
  t_empty = empty * p["empty"] / clk
  t_rows = rows * step(p["init"] + p["finish"], row_bytes)
  total = t_full + t_partial + t_empty + t_rows + p["launch"] / clk
  mxu = run * tile_mxu(gen, role, bq, bk, H, D) / clk
  hbm = (run * step_bytes + rows * row_bytes) / bw
  return dict(seconds=total, full_s=t_full, partial_s=t_partial, empty_s=t_empty,
              rows_s=t_rows, mxu_bound_s=mxu, hbm_s=hbm,
              compute_bound_steps=bool(p["full"] / clk >= step_bytes / bw))


# ---------------------------------------------------------------- the run


def configs(smoke: bool, gens, heads=("128", "256"), dtypes=("bfloat16",)):
  """(gen, H, D, dtype, T, K) of the estimate; the compiles are keyed by (gen, H, D, dtype,
  G). heads: "H" (D = H) or "HxD" (value's head size D, e.g. "192x128", MLA-style)."""
  if smoke:
    return [("v5e", 128, 128, "bfloat16", 4096, 16)]
  hd = [tuple(int(x) for x in h.split("x")) * (1 if "x" in h else 2) for h in heads]
  return [(g, H, D, dt, T, K) for g in gens for H, D in hd for dt in dtypes
          for T in (4096, 16384) for K in (16, 4)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gens", nargs="+", default=["v5e", "v6e"])
  ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tpu_schedule.json"))
  ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "jattn_tpu_schedule"))
  ap.add_argument("--label", default="current")
  ap.add_argument("--smoke", action="store_true",
                  help="v5e, H = 128, causal only (flex_tpu and splash): the compile tier's check")
  ap.add_argument("--heads", nargs="+", default=["128", "256"],
                  help='head sizes: "H" (D = H) or "HxD", e.g. 192x128 (MLA-style)')
  ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="bfloat16, float32")
  ap.add_argument("--cases", nargs="+", default=None,
                  help=f"flex_tpu's cases (default all: {' '.join(FLEX_CASES)}); splash runs "
                  "those of them it has")
  ap.add_argument("--impls", nargs="+", default=["flex_tpu", "splash"])
  ap.add_argument("--tables", action="store_true",
                  help="print the JSON's run --label as markdown tables, compile nothing")
  args = ap.parse_args(argv)
  if args.tables:
    print(markdown(args.out, args.label))
    return None
  dump = tempfile.mkdtemp(prefix="jattn_tpu_dump_")
  os.environ["LIBTPU_INIT_ARGS"] = (
      f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
      "--xla_jf_dump_llo_pass_label_regex=final_bundles " + os.environ.get("LIBTPU_INIT_ARGS", ""))
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compiles on this host
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import numpy as np
  N = 16
  flex_cases = ("causal",) if args.smoke else FLEX_CASES
  splash_cases = ("causal",) if args.smoke else SPLASH_CASES
  if args.cases:
    flex_cases = tuple(c for c in flex_cases if c in args.cases)
    splash_cases = tuple(c for c in splash_cases if c in args.cases)
  rows, compiled = [], {}
  t_start = time.time()
  try:
    for gen, H, D, dt, T, K in configs(args.smoke, args.gens, args.heads, args.dtypes):
      G = N // K
      for impl, cases in (("flex_tpu", flex_cases), ("splash", splash_cases)):
        if impl not in args.impls:
          continue
        for case in cases:
          # compile G > 1 for causal only: the kernels differ from G = 1 by index maps
          g_compile = G if case == "causal" else 1
          ck = (gen, impl, case, H, g_compile, D, dt)
          if ck not in compiled:
            try:
              try:
                compiled[ck] = compile_case(gen, impl, case, H, g_compile, dump, args.cache,
                                            D, dt)
              except MissingKernel:  # libtpu dumped no file for a kernel it had compiled
                compiled[ck] = _compile_in_child(gen, impl, case, H, g_compile, args.cache,
                                                 D, dt)
            except Exception as e:  # noqa: BLE001 - a refusal is a result: recorded, shown
              compiled[ck] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(f"compiled {ck}: {compiled[ck].get('compile_s', compiled[ck].get('error', 'cached'))}",
                  flush=True)
          got = compiled[ck]
          if "error" in got:
            rows.append(dict(gen=gen, H=H, D=D, dtype=dt, T=T, S=T, B=1, N=N, K=K, impl=impl,
                             case=case, error=got["error"]))
            continue
          counts = _counts(impl, case, T, N, K)
          est = {role: estimate(gen, impl, role, got[role], counts, H, D, T, N, K,
                                np.dtype(dt).itemsize)
                 for role in ("fwd", "dq", "dkv")}
          fwd = est["fwd"]["seconds"]
          extra = 0.0
          if impl == "splash" and counts["guard_empty_rows"]:
            extra = fwd  # jattn's splash path runs one more forward for the empty-row guard
          rows.append(dict(
              gen=gen, H=H, D=D, dtype=dt, T=T, S=T, B=1, N=N, K=K, impl=impl, case=case,
              compiled_G=g_compile, counts=counts,
              bundles={r: {k: got[r][k] for k in ("full", "partial", "empty", "init",
                                                   "finish", "loop_overhead", "launch")}
                       for r in ("fwd", "dq", "dkv")},
              mxu_per_tile={r: tile_mxu(gen, r, counts["block_q"], counts["block_kv"], H, D)
                            for r in ("fwd", "dq", "dkv")},
              estimate=est, fwd_s=fwd + extra,
              fwd_bwd_s=fwd + extra + est["dq"]["seconds"] + est["dkv"]["seconds"]))
  finally:
    shutil.rmtree(dump, ignore_errors=True)
  summary = _ratios(rows)
  _print(rows, summary)
  result = dict(
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      jax=jax.__version__, libtpu=_libtpu_version(),
      command="JAX_PLATFORMS=cpu python benchmarks/tpu_schedule.py " + " ".join(
          sys.argv[1:] if argv is None else argv),
      clocks_hz={g: clock_hz(g) for g in args.gens},
      generations={g: GENERATIONS[g] for g in args.gens},
      compile_T=T_COMPILE, compile_N=N_COMPILE, runtime_s=round(time.time() - t_start, 1),
      rows=rows, ratios=summary)
  out = pathlib.Path(args.out)
  previous = json.loads(out.read_text()) if out.exists() and not args.smoke else {}
  runs = previous.get("runs", {})
  runs[args.label] = result
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(runs=runs, latest=args.label), indent=1) + "\n")
  print(f"wrote {out} (run {args.label!r}, {result['runtime_s']} s)")
  return result


def markdown(path, label):
  """The JSON's run `label` as the markdown tables of docs/tpu_kernel.md."""
  run = json.loads(pathlib.Path(path).read_text())["runs"][label]
  lines = [f"Run `{label}`: {run['date']}, jax {run['jax']}, libtpu {run['libtpu']}, "
           f"`{run['command']}`.", ""]
  ok = [r for r in run["rows"] if "error" not in r]
  by = {_key(r): r for r in ok}
  lines += ["| gen | H | T | K | mask | flex_tpu fwd ms | splash fwd ms | ratio | "
            "flex_tpu f+b ms | splash f+b ms | ratio |", "|" + " --- |" * 11]
  for (gen, H, T, K, impl, case), r in by.items():
    s = by.get((gen, H, T, K, "splash", case))
    if impl != "flex_tpu" or s is None:
      continue
    lines.append(f"| {gen} | {H} | {T} | {K} | {case} | {r['fwd_s'] * 1e3:.3f} | "
                 f"{s['fwd_s'] * 1e3:.3f} | {r['fwd_s'] / s['fwd_s']:.2f} | "
                 f"{r['fwd_bwd_s'] * 1e3:.3f} | {s['fwd_bwd_s'] * 1e3:.3f} | "
                 f"{r['fwd_bwd_s'] / s['fwd_bwd_s']:.2f} |")
  lines += ["", "| gen | H | T | K | score_mod | fwd ms | / causal | f+b ms | / causal |",
            "|" + " --- |" * 9]
  for (gen, H, T, K, impl, case), r in by.items():
    c = by.get((gen, H, T, K, "flex_tpu", "causal"))
    if impl != "flex_tpu" or case not in ("softcap", "alibi", "relbias") or c is None:
      continue
    lines.append(f"| {gen} | {H} | {T} | {K} | {case} | {r['fwd_s'] * 1e3:.3f} | "
                 f"{r['fwd_s'] / c['fwd_s']:.2f} | {r['fwd_bwd_s'] * 1e3:.3f} | "
                 f"{r['fwd_bwd_s'] / c['fwd_bwd_s']:.2f} |")
  lines += ["", "Bundles per grid step (T = 4096, K = 16 rows; per-step counts do not depend "
            "on T), and the MXU-only cycles of the tile:", "",
            "| gen | H | impl | mask | tile | fwd FULL / PARTIAL / EMPTY | MXU | "
            "dq FULL / PARTIAL | MXU | dk/dv FULL / PARTIAL | MXU |", "|" + " --- |" * 11]
  for (gen, H, T, K, impl, case), r in by.items():
    if T != 4096 or K != 16:
      continue
    b, m, c = r["bundles"], r["mxu_per_tile"], r["counts"]
    lines.append(
        f"| {gen} | {H} | {impl} | {case} | {c['block_q']} x {c['block_kv']} | "
        f"{b['fwd']['full']} / {b['fwd']['partial']} / {b['fwd']['empty']} | {m['fwd']:.0f} | "
        f"{b['dq']['full']} / {b['dq']['partial']} | {m['dq']:.0f} | "
        f"{b['dkv']['full']} / {b['dkv']['partial']} | {m['dkv']:.0f} |")
  bad = [r for r in run["rows"] if "error" in r]
  for r in {(r["gen"], _heads(r), r["impl"], r["case"]): r for r in bad}.values():
    lines.append(f"\nNot compiled: {r['gen']} H = {_heads(r)} {r['impl']} {r['case']}: "
                 f"{r['error'][:200]}")
  return "\n".join(lines)


def _heads(r) -> str:
  """A row's head sizes and dtype as the tables print them: "128", "192x128", "128 f32"."""
  h = str(r["H"]) if r.get("D", r["H"]) == r["H"] else f"{r['H']}x{r['D']}"
  return h + ("" if r.get("dtype", "bfloat16") == "bfloat16" else " f32")


def _key(r):
  return (r["gen"], _heads(r), r["T"], r["K"], r["impl"], r["case"])


def _libtpu_version():
  try:
    from importlib.metadata import version
    return version("libtpu")
  except Exception:  # noqa: BLE001 - reported, not needed
    return "unknown"


def _ratios(rows):
  """flex_tpu / splash on the same mask, and each mod / flex_tpu's plain causal; the FULL
  tile's bundles over its MXU-only cycles."""
  by = {_key(r): r for r in rows if "error" not in r}
  out = []
  for (gen, H, T, K, impl, case), r in by.items():
    if impl != "flex_tpu":
      continue
    entry = dict(gen=gen, H=H, T=T, K=K, case=case,
                 full_tile_over_mxu=r["bundles"]["fwd"]["full"] / r["mxu_per_tile"]["fwd"])
    s = by.get((gen, H, T, K, "splash", case))
    if s:
      entry["vs_splash_fwd"] = r["fwd_s"] / s["fwd_s"]
      entry["vs_splash_fwd_bwd"] = r["fwd_bwd_s"] / s["fwd_bwd_s"]
    c = by.get((gen, H, T, K, "flex_tpu", "causal"))
    if case in ("softcap", "alibi", "relbias") and c:
      entry["vs_causal_fwd"] = r["fwd_s"] / c["fwd_s"]
      entry["vs_causal_fwd_bwd"] = r["fwd_bwd_s"] / c["fwd_bwd_s"]
    out.append(entry)
  return out


def _print(rows, summary):
  print(f"{'gen':4} {'H':>3} {'T':>5} {'K':>2} {'impl':8} {'case':9} {'fwd ms':>8} "
        f"{'f+b ms':>8} {'mxu fwd':>8} {'FULL':>5} {'PART':>5} {'EMPTY':>5}")
  for r in rows:
    if "error" in r:
      print(f"{r['gen']:4} {r['H']:3d} {r['T']:5d} {r['K']:2d} {r['impl']:8} {r['case']:9} "
            f"did not compile: {r['error'][:150]}")
      continue
    b = r["bundles"]["fwd"]
    print(f"{r['gen']:4} {r['H']:3d} {r['T']:5d} {r['K']:2d} {r['impl']:8} {r['case']:9} "
          f"{r['fwd_s'] * 1e3:8.3f} {r['fwd_bwd_s'] * 1e3:8.3f} "
          f"{r['estimate']['fwd']['mxu_bound_s'] * 1e3:8.3f} {b['full']:5d} {b['partial']:5d} "
          f"{b['empty']:5d}")
  print("\nratios (estimated):")
  for e in summary:
    parts = [f"{k}={v:.2f}" for k, v in e.items() if isinstance(v, float)]
    print(f"  {e['gen']} H={e['H']} T={e['T']} K={e['K']} {e['case']}: " + " ".join(parts))


if __name__ == "__main__":
  main()
