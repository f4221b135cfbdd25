"""benchmarks/gpu_static.py --smoke: the static report of the ten GPU kernels (flex_gpu,
flex_mgpu, flex_mgpu_ws with its warp-specialised backward, paged_gpu's decode) runs on
this CPU (deviceless compile for an H100) and reads every figure from the compilers'
output; the budgets themselves are asserted by test_compile_cuda_mgpu_ws.py."""

import json
import pathlib
import subprocess
import sys

import pytest

from jattn._src import deviceless_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(deviceless_cuda.missing() is not None,
                       reason=f"no deviceless CUDA compile: {deviceless_cuda.missing()}"),
]


def test_gpu_static_reports_every_kernel_in_smoke_mode(tmp_path):
  out = tmp_path / "static.json"
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_static.py"), "--smoke",
                         "--out", str(out)], capture_output=True, text=True, timeout=900,
                        cwd="/")
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  report = json.loads(out.read_text())
  assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and not report["errors"]
  kernels = {name: k for r in report["results"] for name, k in r["kernels"].items()}
  assert sorted(kernels) == sorted(
      [f"jattn_{impl}_{part}" for impl in ("flex_gpu", "flex_mgpu", "flex_mgpu_ws")
       for part in ("fwd", "dq", "dkv")] + ["jattn_paged_decode_gpu"])
  for name, k in kernels.items():
    assert 0 < k["registers"] <= 255 and k["barriers"] >= 1, (name, k)
    assert k["threads_per_block"] % 128 == 0 and k["dynamic_smem_bytes"] > 0, (name, k)
    assert k["spill_stores_bytes"] >= 0
    assert set(k["budgets"]) >= {"no_spills", "registers_within_launch", "smem_within_card",
                                 "tensor_core_in_inner_loop"}, (name, k)
    if name.startswith("jattn_flex_mgpu_ws"):  # setmaxnreg: consumers up, the producer down
      assert k["setmaxnreg"]["inc"] and k["setmaxnreg"]["dec"], (name, k)
      assert k["threads_per_block"] == 384 and "budgets_whole_program" in k, (name, k)
    elif name.startswith("jattn_flex_mgpu"):  # Mosaic's own ptxas and ours read one PTX alike
      assert k["registers_ptxas_here"] == k["registers"], (name, k)
    if report["nvdisasm"]:  # a Hopper kernel's loop runs its products on the tensor cores
      loop = k["inner_loop"]
      # the decode kernel's 16-row query tile is under wgmma's 64 rows: mma.sync (HMMA)
      form = "HMMA" if name == "jattn_paged_decode_gpu" else "HGMMA"
      assert loop["tensor_core"] >= 1 and all(f.startswith(form) for f in
                                               loop["tensor_core_forms"]), (name, loop)
      assert loop["instructions"] < loop["kernel_instructions"]
  assert "jattn_flex_mgpu_dkv" in done.stdout  # the table


def test_flex_gpu_and_flex_mgpu_kernels_neither_spill_nor_serialize_wgmma_at_h_128(tmp_path):
  """flex_gpu (the programmable CUDA kernel where flex_mgpu_ws is not taken) and flex_mgpu
  (whose dq and dk/dv kernels are flex_mgpu_ws's default backward) at the card's benchmark
  shape, as the compile tier's jax (0.12.0.1) compiles them: no kernel spills registers.
  flex_gpu's soft-cap dk/dv kernel spilled 112 bytes a thread (15 spill stores and 19 loads
  in its loop) until dK's update came before dV's (since then dP comes after dV's update);
  flex_mgpu's dk/dv kernel spilled 68 (causal) to 280 bytes (soft-cap) until its products
  accumulated into the carried dK and dV and dP^T came after P^T's product
  (docs/gpu_kernel.md; jax 0.11.2, the card's, still spills 16 bytes in flex_mgpu's
  soft-cap dk/dv, none in flex_gpu's). Nor does ptxas note a serialized `wgmma` (C7511 in
  flex_gpu's dk/dv, C7514 in its dq, until those kernels formed g P before dP)."""
  out = tmp_path / "static.json"
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_static.py"),
                         "--implementations", "flex_gpu", "flex_mgpu", "--cases", "causal",
                         "soft_cap", "documents", "--out", str(out)], capture_output=True,
                        text=True, timeout=900, cwd="/")
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  report = json.loads(out.read_text())
  assert not report["errors"] and len(report["results"]) == 6, report["errors"]
  for result in report["results"]:
    assert len(result["kernels"]) == 3, result
    for name, k in result["kernels"].items():
      assert k["spill_stores_bytes"] == 0 and k["budgets"]["no_spills"], (result["case"], name,
                                                                          k["spill_stores_bytes"])
      # C7511 / C7514: ptxas serialized the kernel's wgmmas (flex_gpu's dq and dk/dv until
      # dP's product came after P's)
      assert not k["ptxas_notes"], (result["case"], name, k["ptxas_notes"])
