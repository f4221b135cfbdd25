"""The accelerator benchmark scripts run (--smoke: tiny shapes, Pallas interpret mode on
this CPU): nobody here can run them for real, so this is what keeps them from rotting
until a TPU or GPU owner does. Slow tier: each script compiles a dozen programs."""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
from unittest import mock

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.thorough
@pytest.mark.parametrize("script", ["tpu_kernels.py", "gpu_kernels.py"])
def test_kernel_benchmark_runs_in_smoke_mode(script):
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                        capture_output=True, text=True, timeout=600, cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "fwd+bwd" in done.stdout


# Once per CI run, on the leg whose jax is the GPU machines' (0.11 and later): the
# rehearsal runs the whole script, and its kernels' tests run on both legs by themselves.
@pytest.mark.slow
@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="the GPU check's rehearsal runs on the jax >= 0.11 leg (the GPU "
                           "machines' jax)")
def test_the_gpu_check_rehearses_every_stage_on_this_cpu(tmp_path):
  """tools/gpu_check.py --smoke: the GPU check's stages at tiny sizes (the rehearsal
  subset of tests/kernels/test_gpu.py interpreted and exported, the benchmark and the tile sweep
  interpreted, one profiled step per contender), so the prepared command cannot rot between sessions that have a GPU."""
  done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
  summary = json.loads((tmp_path / "gpu_check.json").read_text())
  stages = {s["stage"]: s for s in summary["stages"]}
  assert list(stages) == ["env", "tests", "bench", "profile", "sweep"], done.stdout[-2000:]
  assert all(s["status"] == "passed" for s in stages.values()), done.stdout[-3000:]
  counts = stages["tests"]["counts"]
  assert counts["passed"] >= 10 and counts["failed"] == counts["errors"] == 0, counts
  for name in ("bench", "sweep"):
    results = json.loads((tmp_path / f"{name}.json").read_text())
    assert results["results"] and not results["errors"], results["errors"]
  profile = stages["profile"]["profile"]  # folded into gpu_check.json, as the env log
  assert profile["profiles"] and not profile["errors"], profile["errors"]
  assert all(p["lines"] for p in profile["profiles"]), profile["profiles"]
  assert "jax" in stages["env"]["log"]
  assert len(list(tmp_path.iterdir())) <= 8  # what the device tool returns
  assert done.returncode == 0


@pytest.mark.slow
def test_decode_benchmark_runs_in_smoke_mode():
  """benchmarks/decode.py --smoke (tiny lengths): every contender runs, torch or not."""
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke",
                         "--page-size", "8"], capture_output=True, text=True, timeout=600,
                        cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "paged (split)" in done.stdout and "torch SDPA" in done.stdout


@pytest.mark.slow
@pytest.mark.training  # it trains a model: CI's first leg only
def test_int8_pages_benchmark_runs_in_smoke_mode(tmp_path):
  """benchmarks/int8_pages.py --smoke: trains configs/tiny.py, decodes over each kind
  of page and writes its JSON."""
  out = tmp_path / "int8.json"
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "int8_pages.py"), "--smoke",
                         "--workdir", str(tmp_path / "run"), "--examples", "4", "--out",
                         str(out)], capture_output=True, text=True, timeout=600, cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(out.read_text())
  assert set(got["pages"]) == {"float32", "bfloat16", "int8"}
  assert got["pages"]["float32"]["max_abs_logit_diff_all"] < 1e-3  # the cache is exact
  assert got["pages"]["int8"]["max_abs_logit_diff_all"] > 0  # int8 pages are not


@pytest.mark.slow
def test_the_gpu_decode_timing_rehearses_on_this_cpu(tmp_path):
  """benchmarks/decode.py --gpu --smoke: the GPU decode stage (paged_gpu interpreted
  against split, tiny rows) runs end to end, so the next session with a GPU has it."""
  out = tmp_path / "decode_gpu.json"
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--gpu",
                         "--smoke", "--out", str(out)], capture_output=True, text=True,
                        timeout=600, cwd="/")
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  report = json.loads(out.read_text())
  [row] = report["results"]
  assert not report["errors"] and set(row["step_us"]) == {"paged_gpu", "split",
                                                             "paged_gpu kernel only"}
  assert row["max_abs_difference"] < 0.05  # bfloat16 outputs of two paths


@pytest.mark.thorough
def test_context_parallel_benchmark_runs_at_small_sizes(tmp_path):
  """benchmarks/context_parallel.py at T = 4096 (plan only), memory at one size, timing at
  T = 256: every table is printed and written."""
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"),
                         "--lengths", "4096", "--memory-lengths", "1024", "--memory-devices",
                         "8", "--time-length", "256", "--repeats", "1", "--plan-devices", "8",
                         "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=600, cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / "context_parallel.json").read_text())
  assert {r["mask"] for r in results["balance"]} == {"causal", "16 documents", "4k window",
                                                      "prefix-LM"}
  assert {r["strategy"] for r in results["memory"]} == {"ring", "all_gather", "ulysses"}
  assert [r["path_over_before"] for r in results["planning"] if "critical_path" in r] == [1.0] * 4
  assert len(results["timing"]) == 8, results["timing"]


def test_the_gpu_check_reruns_the_failed_tests_by_node_id(tmp_path):
  """--failed-from: a GPU run's failures (JUnit names, or node ids read from the log when
  the run was cut short) become pytest node ids, so that a second run in the same session
  reruns those alone."""
  sys.path.insert(0, str(ROOT / "tools"))
  import gpu_check
  summary = dict(stages=[
      dict(stage="env"),
      dict(stage="tests", failures=[
          dict(test="tests.kernels.test_gpu::test_values_and_gradients_against_float64"
                    "[flex_gpu-mods_chunked-bfloat16-base]", message="..."),
          dict(test="tests/kernels/test_flex_gpu.py::test_compiled_on_a_gpu_values_and_lse_"
                    "against_float64[causal_T_ne_S]", message="")]),
      dict(stage="bench", failures=[dict(test="not a test")])])
  ids = gpu_check.failed_tests(summary)
  assert ids == ["tests/kernels/test_gpu.py::test_values_and_gradients_against_float64"
                 "[flex_gpu-mods_chunked-bfloat16-base]",
                 "tests/kernels/test_flex_gpu.py::test_compiled_on_a_gpu_values_and_lse_"
                 "against_float64[causal_T_ne_S]"]
  # each is a test pytest can collect here
  done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                         "-p", "no:cacheprovider", *ids], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
  assert "2 tests collected" in done.stdout, done.stdout[-2000:]
  # a run with no failure to rerun is refused, naming the file (not a run of every test)
  clean = tmp_path / "gpu_check.json"
  clean.write_text(json.dumps(dict(stages=[dict(stage="tests", failures=[])])))
  refused = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--stages",
                            "tests", "--failed-from", str(clean), "--out", str(tmp_path / "o")],
                           capture_output=True, text=True, timeout=60)
  assert refused.returncode == 2, refused.stdout[-2000:]
  assert f"--failed-from {clean}: its tests stage lists no failed test" in refused.stderr


@pytest.mark.thorough
@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="the rehearsal interprets flex_mgpu (jax >= 0.11's GPU interpreter)")
def test_the_fast_path_check_rehearses_on_this_cpu(tmp_path):
  """tools/mgpu_fast_check.py --smoke: the flex_mgpu_ws check end to end, the interpreted
  flex_mgpu standing in for the compiled-only fast path (about 250 s here): both
  gradient cases against float64, and the in-place and through-tiles timings."""
  done = subprocess.run([sys.executable, str(ROOT / "tools" / "mgpu_fast_check.py"), "--smoke",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "mgpu_fast_check.json").read_text())
  assert result["values"] and all(r["passed"] for r in result["values"]), result["values"]
  assert {r["pass_"] for r in result["speed"]} == {"fwd", "fwd+bwd"}, result["speed"]
  assert not result["errors"] and not result["skipped"], result["errors"]
  assert {r["case"] for r in result["values"]} >= {"causal_gqa_8_2_grad",
                                                   "documents_4_soft_cap_gqa_8_2_grad"}
  # the warp-specialised backward's check (the stand-in's here) ran in a child process,
  # its rows joined this run's
  isolated = [r for r in result["values"] if r["impl"] == "flex_mgpu:bwd"]
  assert len(isolated) == 2 and not result["hung"], result["values"]
  assert (tmp_path / "fast_backward" / "mgpu_fast_check.json").exists()
  assert [r["impl"] for r in result["values"] if r["impl"].startswith("default:")] == [
      "default:flex_gpu"]  # no GPU seen here: the portable CUDA choice
  assert {"flex_mgpu", "flex_mgpu:tiles"} <= {r["contender"] for r in result["speed"]}
  # the goals, from the run's own rows (benchmarks/gpu_goals.py): printed and saved
  assert result["goals"] and "fastest jattn path" in done.stdout
  assert {g["goal"] for g in result["goals"]} == {"causal_vs_cudnn", "flex_attention",
                                                  "documents_16", "soft_cap"}
  # every mask of issue 45's goals is timed forward; documents forward + backward too
  assert {(r["case"], r["pass_"]) for r in result["speed"]} >= {
      (c, "fwd") for c in ("causal", "documents", "soft_cap", "window", "alibi", "no_mask")
  } | {(c, "fwd+bwd") for c in ("causal", "soft_cap", "documents")}


def _script_module(script: str):
  """The repository's script at `script` loaded as a module, its main not run."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(script).stem, ROOT / script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_fast_path_check_ends_a_hung_case_and_keeps_what_it_has(tmp_path):
  """tools/mgpu_fast_check.py's watchdog (tools/watchdog.py): a case that never returns
  (here the first, made to hang by --rehearse-hang) ends the run after --hang-after
  seconds with exit status 3 and the JSON written, naming the case, instead of holding a
  lent card until the device tool's limit."""
  done = subprocess.run([sys.executable, str(ROOT / "tools" / "mgpu_fast_check.py"), "--smoke",
                         "--hang-after", "2", "--rehearse-hang", "values causal",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 3, (done.stdout + done.stderr)[-2000:]
  assert "HUNG: 'values causal flex_mgpu' has run" in done.stdout
  result = json.loads((tmp_path / "mgpu_fast_check.json").read_text())
  assert [h["stage"] for h in result["hung"]] == ["values causal flex_mgpu"]
  assert result["summary"]["hung"] == 1 and 2 <= result["hung"][0]["seconds"] < 30


def test_the_fast_backward_check_runs_apart_so_a_hang_there_ends_only_it(tmp_path):
  """The warp-specialised backward kernels, never run on a card, are checked in a child
  process: when it hangs (on purpose here), its watchdog ends it, its JSON's rows join
  the run's, and the run goes on without the ":bwd" timings."""
  module = _script_module("tools/mgpu_fast_check.py")
  args = argparse.Namespace(smoke=True, compile_only=None, out=str(tmp_path), hang_after=2.0,
                            rehearse_hang="grad causal_gqa_8_2 flex_mgpu:bwd")
  args.watch = module.Watchdog(None, None)
  out = dict(values=[], speed=[], errors=[], skipped=[], compiled=[], hung=[])
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  with mock.patch.dict(os.environ, env):
    came_back = module.check_fast_backward(args, out, time.perf_counter() + 300, ["flex_mgpu"])
  assert came_back is False
  assert out["hung"] == [dict(stage="grad causal_gqa_8_2 flex_mgpu:bwd",
                              seconds=out["hung"][0]["seconds"], isolated=True)], out
  assert not out["errors"] and not out["values"], out
  # the run's own JSON was written before the child started (what a kill would leave)
  assert json.loads((tmp_path / "mgpu_fast_check.json").read_text())["hung"] == []
  # the timings leave out the warp-specialised backward then, and only then
  contenders = lambda ok: module._jax_contenders("causal", 1, 128, 2, [module.FAST, "flex_mgpu"],
                                                 True, backward=True, fast_backward=ok)
  assert {n for n in contenders(True) if ":bwd" in n} == {
      "flex_mgpu_ws:bwd", "flex_mgpu_ws:bwd:rows32", "flex_mgpu_ws:bwd:mask_mod"}
  assert not {n for n in contenders(False) if ":bwd" in n}


@pytest.mark.parametrize("script,argv,message", [
    ("benchmarks/gpu_static.py", ["--ws-exp2-fma", "24"],
     "--ws-exp2-fma: columns must be a multiple of 16 from 0 to 128, got 24"),
    ("benchmarks/gpu_static.py", ["--cases", "causal", "softcap"],
     "argument --cases: invalid choice: 'softcap'"),
    ("benchmarks/gpu_kernels.py", ["--cases", "documents", "int8"],
     "argument --cases: invalid choice: 'int8'"),
    ("tools/mgpu_fast_check.py", ["--compile-only", "h300"],
     "argument --compile-only: invalid choice: 'h300'"),
    ("tools/mgpu_fast_check.py", ["--smoke", "--compile-only", "h100"],
     "--smoke and --compile-only exclude each other"),
    ("tools/mgpu_fast_check.py", ["--hang-after", "0"],
     "--hang-after: seconds must be positive, got 0"),
    ("tools/mgpu_fast_check.py", ["--hang-after", "soon"],
     "argument --hang-after: invalid float value: 'soon'"),
    ("tools/mgpu_fast_check.py", ["--rehearse-hang", "forward"],
     "--rehearse-hang: a stage label starts with values, grad or speed, got 'forward'"),
    ("tools/mgpu_fast_check.py", ["--rehearse-hang", "grad", "--compile-only", "h100"],
     "--rehearse-hang and --compile-only exclude each other"),
])
def test_a_bad_option_is_refused_before_any_work(script, argv, message, capsys):
  """The options this round added: a bad value is the parser's error (exit 2), naming the
  option and the value, before the script compiles anything. (The script's main runs in
  this process: a subprocess would spend 3 to 4 s of each case importing jax.)"""
  with pytest.raises(SystemExit) as exited:
    _script_module(script).main(argv)
  err = capsys.readouterr().err
  assert exited.value.code == 2, err[-2000:]
  assert message in err, err[-2000:]
