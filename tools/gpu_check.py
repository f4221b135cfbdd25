"""The GPU check: one command that compiles every CUDA path on a lent GPU, checks it
against float64, and times it against cuDNN, jax's kernels and PyTorch FlexAttention.

    python tools/gpu_check.py [--out DIR] [--stages env tests bench profile sweep] [--budget S ...]
    python tools/gpu_check.py --smoke --out /tmp/rehearsal   # on a CPU: the rehearsal
    python tools/gpu_check.py --stages tests --failed-from gpu_check.json   # a second run:
        # only what failed in the first (its gpu_check.json copied into the working tree)

Stages, in order, each in its own process with its own time budget; a stage that fails
or runs out of time is recorded and the next one runs. On a GPU the default is env,
tests, bench and profile (490 s of budgets, about 8 minutes); the sweep runs when named:
  env    nvidia-smi, jax.print_environment_info(), torch's version and device
  tests  the gpu-marked tests (tests/kernels/test_gpu.py, tests/kernels/test_flex_gpu.py) compiled on
         the GPU: pytest -m gpu, a JUnit XML of every case
  bench  benchmarks/gpu_kernels.py: flex_gpu, flex_mgpu, the default dispatch, cuDNN, Pallas mha,
         torch FlexAttention and SDPA, bfloat16, H = 128, N = 16, T = 4k, 16k, 1k
  profile benchmarks/gpu_profile.py: one step of flex_gpu, cuDNN and flex_mgpu (causal,
         soft-cap, 16 documents; T = 4k) under jax.profiler, the time per kernel
  sweep  benchmarks/gpu_kernels.py --sweep: flex_gpu's tiles, warps and stages (causal
         and 16 documents at T = 4k)
Everything lands in --out (default $OUT, else ./gpu_check_out): gpu_check.json (each
stage's status, seconds, test counts and failures; the env stage's output and the
profile's tables), bench.json, sweep.json, the tests', bench's, profile's and sweep's
logs and the tests' junit.xml: eight files, as many as the device tool returns.

--smoke (a CPU, in the CI tier): the same stages at tiny sizes, the Pallas kernels
interpreted, the tests' rehearsal subset (JATTN_GPU_REHEARSAL=1), torch on the CPU
where installed. It checks that the script runs, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("env", "tests", "bench", "profile", "sweep")
# seconds per stage on the GPU: the whole check fits 8 minutes with the machine's start
# (the H200 run got through 256 of the tests in 170 s on 8 workers; there are 296 now)
BUDGET = {"env": 30, "tests": 230, "bench": 150, "profile": 80, "sweep": 70}
# on a GPU the sweep runs when named (--stages): the H200 run measured the tiles (the
# defaults cite it); the rehearsal runs every stage so none rots
GPU_STAGES = ("env", "tests", "bench", "profile")
# the issue's goals' cases and lengths: what fits the bench stage's budget
GPU_BENCH_ARGS = "--lengths 4096 16384 --cases causal documents soft_cap no_mask --rounds 5"
ENV_SCRIPT = """
import jax
jax.print_environment_info()
print("devices:", jax.devices())
try:
  import torch
  print("torch", torch.__version__, "cuda:", torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except ImportError as e:
  print("torch unavailable:", e)
"""


def commands(stage: str, out: pathlib.Path, smoke: bool, budget: float,
             extra: dict) -> list[list[str]]:
  py = sys.executable
  if stage == "env":
    return ([["nvidia-smi"]] if not smoke else []) + [[py, "-c", ENV_SCRIPT]]
  if stage == "tests":
    # compiling each case is the tests' cost, on the CPU: 12 of the machine's 16 cores
    workers = ["-n", "12"] if not smoke else []
    return [[py, "-m", "pytest", "-v", "-rfEs", "-o", "addopts=", "-p", "no:cacheprovider",
             "-m", "gpu", *workers, f"--junitxml={out / 'junit.xml'}",
             *extra.get("tests", "tests/kernels/test_gpu.py tests/kernels/test_flex_gpu.py").split()]]
  # the benchmark stops starting new timings with a margin for the running one
  deadline = ["--deadline", str(max(1.0, budget - 40))]
  smoke_flag = ["--smoke"] if smoke else []
  if stage == "bench":
    return [[py, "benchmarks/gpu_kernels.py", *deadline, *smoke_flag,
             "--out", str(out / "bench.json"), *extra.get("bench", "").split()]]
  if stage == "profile":
    return [[py, "benchmarks/gpu_profile.py", *deadline, *smoke_flag,
             "--out", str(out / "profile.json"), *extra.get("profile", "").split()]]
  if stage == "sweep":
    return [[py, "benchmarks/gpu_kernels.py", "--sweep", "--lengths", "4096", "--cases",
             "causal", "documents", "--rounds", "5", *deadline, *smoke_flag,
             "--out", str(out / "sweep.json"), *extra.get("sweep", "").split()]]
  raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")


def run_stage(stage: str, out: pathlib.Path, smoke: bool, budget: float, extra: dict) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if smoke:
    env.update(JATTN_GPU_REHEARSAL="1", JAX_PLATFORMS="cpu")
  else:  # on the GPU, the tests compile as users' programs do (not the suite's fast flags)
    env.update(JATTN_TEST_XLA_OPTIMIZE="1")
  record = dict(stage=stage, status="passed", seconds=0.0, commands=[])
  start = time.perf_counter()
  with open(out / f"{stage}.log", "w") as log:
    for cmd in commands(stage, out, smoke, budget, extra):
      left = budget - (time.perf_counter() - start)
      log.write(f"$ {' '.join(cmd)}\n")
      log.flush()
      proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
      try:
        rc = proc.wait(timeout=max(left, 1.0))
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest's workers too
        proc.wait()
        rc = "timeout"
      record["commands"].append(dict(cmd=" ".join(cmd), rc=rc))
      if rc != 0:
        record["status"] = "timed out" if rc == "timeout" else "failed"
  record["seconds"] = round(time.perf_counter() - start, 1)
  if stage == "tests":
    record.update(junit_summary(out / "junit.xml", out / "tests.log"))
  # folded into gpu_check.json: the device tool returns eight files
  if stage == "env":
    record["log"] = _take(out / "env.log")
  if stage == "profile" and (out / "profile.json").exists():
    record["profile"] = json.loads(_take(out / "profile.json"))
  return record


def _take(path: pathlib.Path) -> str:
  text = path.read_text()
  path.unlink()
  return text


def junit_summary(path: pathlib.Path, log: pathlib.Path) -> dict:
  """Counts and the failing cases (name and the first lines of the message); from the
  verbose log's outcome lines when the run was stopped before writing its XML."""
  if not path.exists():
    outcomes = re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+)", log.read_text())
    counts = {o: sum(1 for x, _ in outcomes if x == o) for o in ("PASSED", "FAILED",
                                                                  "SKIPPED", "ERROR")}
    return dict(junit="missing (the run did not finish): counts from the log", counts=counts,
                failures=[dict(test=t, message="") for o, t in outcomes if o in ("FAILED",
                                                                                  "ERROR")])
  counts = dict(passed=0, failed=0, skipped=0, errors=0)
  failures, skips = [], {}
  for case in ET.parse(path).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    skip = case.find("skipped")
    if bad is not None:
      counts["failed" if bad.tag == "failure" else "errors"] += 1
      failures.append(dict(test=name, message=(bad.get("message") or "")[:600]))
    elif skip is not None:
      counts["skipped"] += 1
      reason = (skip.get("message") or "")[:160]
      skips[reason] = skips.get(reason, 0) + 1
    else:
      counts["passed"] += 1
  return dict(counts=counts, failures=failures, skip_reasons=skips)


def failed_tests(summary: dict) -> list[str]:
  """pytest node ids of the tests stage's failures in a gpu_check.json: JUnit's
  "tests.kernels.test_gpu::test_x[p]" -> "tests/kernels/test_gpu.py::test_x[p]"."""
  ids = []
  for stage in summary["stages"]:
    for failure in stage.get("failures", []) if stage["stage"] == "tests" else []:
      module, _, name = failure["test"].partition("::")
      ids.append(failure["test"] if module.endswith(".py") else  # from the log: a node id
                 f"{module.replace('.', '/')}.py::{name}")
  return ids


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
  parser.add_argument("--stages", nargs="+", default=None, choices=STAGES,
                      help=f"default on a GPU {' '.join(GPU_STAGES)}; with --smoke all")
  parser.add_argument("--budget", nargs="+", default=[], metavar="STAGE=SECONDS",
                      help="override a stage's time budget, e.g. tests=120")
  parser.add_argument("--failed-from", default=None, metavar="GPU_CHECK_JSON",
                      help="rerun only the tests that failed in an earlier run's gpu_check.json "
                           "(copy it into the working tree: it travels with the repository)")
  parser.add_argument("--tests", default=None,
                      help="the tests stage's pytest arguments (default: the two gpu files)")
  parser.add_argument("--bench-args", default=None,
                      help="more arguments of the bench stage (on a GPU, default: "
                           f"{GPU_BENCH_ARGS!r}, the H200 run's, 104 s there)")
  parser.add_argument("--profile-args", default="", help="more arguments of the profile stage")
  parser.add_argument("--sweep-args", default="", help="more arguments of the sweep stage")
  parser.add_argument("--smoke", action="store_true",
                      help="the CPU rehearsal: tiny, interpreted, torch on the CPU")
  args = parser.parse_args(argv)
  budget = dict(BUDGET, **{k: float(v) for k, v in (b.split("=") for b in args.budget)})
  out = pathlib.Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  summary = dict(smoke=args.smoke, started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 stages=[])
  bench = args.bench_args if args.bench_args is not None else (
      "" if args.smoke else GPU_BENCH_ARGS)
  extra = dict(bench=bench, profile=args.profile_args, sweep=args.sweep_args)
  if args.failed_from:
    failed = failed_tests(json.loads(pathlib.Path(args.failed_from).read_text()))
    if not failed:  # an empty list would run every gpu-marked test pytest finds
      parser.error(f"--failed-from {args.failed_from}: its tests stage lists no failed test")
    extra["tests"] = " ".join(failed)
  if args.tests:
    extra["tests"] = args.tests
  for stage in args.stages or (STAGES if args.smoke else GPU_STAGES):
    record = run_stage(stage, out, args.smoke, budget[stage], extra)
    summary["stages"].append(record)
    line = f"[gpu_check] {stage}: {record['status']} in {record['seconds']} s"
    if "counts" in record:
      line += f" {record['counts']}"
    print(line, flush=True)
    for failure in record.get("failures", []):
      print(f"    FAILED {failure['test']}: {failure['message'][:300]}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
  return 0 if all(s["status"] == "passed" for s in summary["stages"]) else 1


if __name__ == "__main__":
  sys.exit(main())
