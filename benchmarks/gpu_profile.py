"""Where one attention step's GPU time goes: each contender under `jax.profiler`, by kernel.

    python benchmarks/gpu_profile.py [--T 4096] [--B 2] [--out profile.json] [--deadline 50]
    python benchmarks/gpu_profile.py --smoke --out /tmp/p.json    # tiny, interpreted, any backend

The GPU issue's goals that the H200 run left unmet (flex_gpu's causal at 2.2x cuDNN's,
soft-cap at 1.24x causal) need to know whether the time is in the kernel itself or in
what surrounds it (the layout transposes, padding, the sinks' and lse's epilogues). For
each (case, contender, pass), most telling first: compile, warm up, time `--calls`
untraced calls (median), then trace as many under `jax.profiler.trace` and read the
Perfetto trace it writes. Events are grouped by the trace's lines (on a GPU: a device's
streams and its "XLA Ops" line; on a CPU: the host threads), and within a line by name:
milliseconds and count per call, and the first event's args, which on a GPU carry the
kernel's launch details (grid, block, registers, shared memory, occupancy) where the
profiler records them. The contenders and cases are benchmarks/gpu_kernels.py's.
`--deadline` stops starting new profiles after that many seconds; what is left is
listed. Writes the JSON progressively, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gpu_kernels  # noqa: E402  (beside this script: the cases, inputs, interpret context)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from perfetto_trace import trace_events  # noqa: E402  (beside this script too)

# (case, contender, forward + backward), the gaps the H200 run left first
PROFILES = (("causal", "flex_gpu", False), ("causal", "cudnn", False),
            ("causal", "flex_gpu", True), ("causal", "cudnn", True),
            ("causal", "flex_gpu:mask_mod", False), ("soft_cap", "flex_gpu", False),
            ("causal", "flex_mgpu", False), ("documents", "flex_gpu", True))
TOP = 12  # names kept per trace line


def compiled_step(fn, backward: bool):
  if not backward:
    return jax.jit(fn)
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                          argnums=(0, 1, 2)))


def by_line(events: list[dict], calls: int) -> dict:
  """line -> {total ms per call, top names: ms and count per call, first args}.

  On a GPU only the device's lines are kept (the host's spans overlap them); on a CPU
  every host line, less Python frames ("$...") and the executor's own spans."""
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]:
                       e.get("args", {}).get("name", "") for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  processes, threads = meta("process_name"), meta("thread_name")
  devices = {pid for pid, name in processes.items() if "GPU" in name or "/device:" in name}
  spans = collections.defaultdict(lambda: collections.defaultdict(list))
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name.startswith("$") or "Executor" in name:
      continue
    if devices and e["pid"] not in devices:
      continue
    line = f"{processes.get(e['pid'], e['pid'])} / {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
    spans[line][name].append(e)
  lines = {}
  for line, names in spans.items():
    totals = {name: sum(e.get("dur", 0) for e in es) for name, es in names.items()}
    top = sorted(totals, key=totals.get, reverse=True)[:TOP]
    lines[line] = dict(
        ms_per_call=sum(totals.values()) / 1e3 / calls,
        top=[dict(name=name, ms_per_call=totals[name] / 1e3 / calls,
                  count_per_call=len(names[name]) / calls,
                  args=json.dumps(names[name][0].get("args", {}))[:400]) for name in top])
  return lines


def profile(args, case: str, contender: str, backward: bool, inputs) -> dict:
  B, T = inputs[0].shape[:2]
  fns = gpu_kernels.jax_contenders(case, B, T, args.N, args.smoke)
  if contender not in fns:
    return dict(skipped=f"{contender} is no contender for {case} here")
  step = compiled_step(fns[contender], backward)
  run = lambda: gpu_kernels._with(None, args, lambda: jax.block_until_ready(step(*inputs)))
  run(), run()  # compile and warm up
  wall = []
  for _ in range(args.calls):
    start = time.perf_counter()
    run()
    wall.append(time.perf_counter() - start)
  events = gpu_kernels._with(None, args, lambda: trace_events(step, inputs, args.calls))
  return dict(untraced_ms=1e3 * statistics.median(wall), lines=by_line(events, args.calls))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--B", type=int, default=2)
  parser.add_argument("--N", type=int, default=16)
  parser.add_argument("--H", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--deadline", type=float, default=1e9, help="seconds")
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes in interpret mode on any backend: checks the script")
  args = parser.parse_args(argv)
  deadline = time.perf_counter() + args.deadline
  platform = jax.devices()[0].platform
  if args.smoke:
    args.T, args.B, args.N, args.H, args.calls = 64, 1, 2, 32, 1
  elif platform != "gpu":
    raise SystemExit(f"needs an NVIDIA GPU (found {platform}); --smoke checks the script")
  out = dict(device_kind=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
             profiles=[], errors=[], skipped=[])
  inputs, _ = gpu_kernels._inputs(args.B, args.T, args.N, args.H, args.dtype, None)
  write = lambda: args.out and pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
  for case, contender, backward in PROFILES:
    key = dict(case=case, contender=contender, pass_="fwd+bwd" if backward else "fwd")
    if time.perf_counter() > deadline:
      out["skipped"].append(dict(key, why="deadline"))
      continue
    try:
      found = profile(args, case, contender, backward, inputs)
    except Exception as e:  # noqa: BLE001 (a contender that fails is recorded, not fatal)
      out["errors"].append(dict(key, error=f"{type(e).__name__}: {str(e)[:800]}"))
      print(f"{case:9s} {key['pass_']:8s} {contender:18s} FAILED {type(e).__name__}", flush=True)
      continue
    if "skipped" in found:
      out["skipped"].append(dict(key, why=found["skipped"]))
      continue
    out["profiles"].append(dict(key, **found))
    print(f"{case:9s} {key['pass_']:8s} {contender:18s} {found['untraced_ms']:9.3f} ms untraced",
          flush=True)
    for line, summary in found["lines"].items():
      print(f"  {line}: {summary['ms_per_call']:.3f} ms per call", flush=True)
      for top in summary["top"][:6]:
        print(f"    {top['ms_per_call']:9.3f} ms  x{top['count_per_call']:<5g} {top['name'][:90]}",
              flush=True)
    write()
  write()
  return out


if __name__ == "__main__":
  main()
