"""flex_mgpu_ws's three warp-specialised kernels (its forward, and the dq and dk/dv kernels
of `flex_mgpu.ws_dq()` / `ws_dkv()`) compiled for an H100 and an H200 from this CPU, with
issue 45 item 2's budgets read from the compilers' own output by
`benchmarks/gpu_static.py` (`measure`, `budgets`):

  * no register spills, and registers within the launch's share (64K / 384 threads);
  * `setmaxnreg` in the PTX, its counts within the register file (consumers raised, the
    producer lowered);
  * a tensor-core instruction (HGMMA) in the inner loop's SASS (nvdisasm);
  * shared memory within the card's 227 KiB.

What is asserted is ptxas run here on Mosaic GPU's PTX as a whole program
(`budgets_whole_program`: setmaxnreg honoured, as jax 0.11.2's Mosaic GPU compiled on the
H100). Mosaic GPU's own ptxas run is recorded by gpu_static.py (`budgets`) and not
asserted: on one host jax 0.12's ignored setmaxnreg (C7504) and fitted the consumers into
the launch's 168 registers, on another the same versions honoured it (docs/gpu_kernel.md).
A case over a budget that is known and reported is an xfail naming it; any other is a
failure.

Nothing runs: values are the interpreter's (tests/kernels/test_flex_mgpu.py) and the
card's (tools/mgpu_fast_check.py). Marked `compile`; the default tier compiles two
cases on the H100 (causal, documents), `thorough` every case of tests/kernels/test_gpu.py
the fast path takes, on both cards.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jattn._src import compat, deviceless_cuda
from tests.kernels.test_gpu import CASES

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(deviceless_cuda.missing() is not None,
                       reason=f"no deviceless CUDA compile: {deviceless_cuda.missing()}"),
    pytest.mark.skipif(compat.missing("pallas_mosaic_gpu_ws") is not None,
                       reason=f"no warp-specialised Mosaic GPU API: "
                              f"{compat.missing('pallas_mosaic_gpu_ws')}"),
]

B, T, N, K, H = 1, 256, 4, 2, 128  # grouped heads (G = 2), the fast backward's E = 128
KERNELS = ("jattn_flex_mgpu_ws_fwd", "jattn_flex_mgpu_ws_dq", "jattn_flex_mgpu_ws_dkv")
# (case, kernel) -> the budgets it is over, measured and reported (docs/gpu_kernel.md):
# none. (With 64-row query tiles the ws dk/dv kernel spilled, bytes stored / loaded per
# thread at T = 256: soft-cap 112 / 116, ALiBi 96 / 100, mods_and_or 68 / 72,
# hand_written 8 / 48, mods_chunked 8 / 8; such calls now take 32-row tiles,
# flex_mgpu._ws_dkv_rows.)
KNOWN_OVER: dict = {}


# One case's figures, in a fresh process: a kernel compiled earlier in this one (sinks'
# kernels are causal's) comes from a cache, without the PTX and ptxas log they are read from
_MEASURE = """
import json, pathlib, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import gpu_static as gs
from jattn._src.kernels import flex_mgpu
from tests.kernels.test_gpu import _case
target, case, work = sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
B, T, N, K, H, fma_columns = (int(x) for x in sys.argv[5:11])
tools = {name: gs.find_tool(name, None) for name in ("ptxas", "nvdisasm")}
if tools["ptxas"] is None:
  sys.exit("ptxas not found (pip install nvidia-cuda-nvcc): the compile venv lacks it")
with flex_mgpu.ws_exp2_fma(fma_columns):
  report = gs.measure("flex_mgpu_ws", case, target=target, B=B, T=T, N=N, K=K, H=H,
                      dtype="bfloat16", tools=tools, work=work,
                      kwargs=_case(case, B, T, T, N)[0])
report["nvdisasm"] = tools["nvdisasm"] is not None
# the forward's exponentials on the special-function unit, in its PTX
forward = work / f"flex_mgpu_ws_{case}" / "jattn_flex_mgpu_ws_fwd.ptx"
report["forward_ex2"] = forward.read_text().count("ex2.approx")
(work / "report.json").write_text(json.dumps(report))
"""


def check_budgets(target, case, tmp_path, fma_columns=0):
  """fma_columns: the forward's exp2 columns on the FP32 pipe (flex_mgpu.ws_exp2_fma)."""
  done = subprocess.run([sys.executable, "-c", _MEASURE, str(ROOT), target, case,
                         str(tmp_path), *map(str, (B, T, N, K, H, fma_columns))],
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  # a consumer thread's exp2 of its 64 x 128 tile: 64 entries, 2 of alpha, less those moved
  assert report["forward_ex2"] == 64 + 2 - fma_columns // 2, report["forward_ex2"]
  # the forward's loop, read from SASS: both matmuls (K = 128: 8 wgmma k-steps each) and
  # the softmax's exponentials (not a barrier retry's out-of-line range: gpu_static)
  loop = report["kernels"]["jattn_flex_mgpu_ws_fwd"].get("inner_loop", {})
  if "error" not in loop:
    assert loop["tensor_core"] == 16, loop
    assert loop["classes"]["exp_and_special"] >= 64 + 2 - fma_columns // 2, loop
  tools = {"nvdisasm": report["nvdisasm"] or None}
  over = {}
  for name in KERNELS:
    k = report["kernels"][name]
    assert k.get("setmaxnreg", {}).get("inc") and k["setmaxnreg"]["dec"], (name, k)
    checks = k["budgets_whole_program"]
    if tools["nvdisasm"] is None:  # the SASS check needs nvdisasm: said, not passed
      checks = {b: ok for b, ok in checks.items() if b != "tensor_core_in_inner_loop"}
    missing = [b for b, ok in checks.items() if ok is None]
    assert not missing, (name, missing, k)
    failed = sorted(b for b, ok in checks.items() if ok is False)
    if failed:
      over[name] = failed
  known = {name: sorted(KNOWN_OVER[(case, name)]) for name in KERNELS
           if (case, name) in KNOWN_OVER}
  if over and over == {n: b for n, b in known.items() if n in over}:
    pytest.xfail(f"known and reported: {over}")
  assert not over, f"over budget: {over}"
  if tools["nvdisasm"] is None:
    pytest.skip("budgets met except the SASS check: nvdisasm not found "
                "(pip install nvidia-cuda-nvdisasm)")


# CI's share (the warp-specialised backward is opt-in): causal, documents (per-token rows
# by TMA) and soft-cap (the dk/dv kernel's 32-row query tiles); the other cases and the
# H200, the same sm_90a, in the thorough tier
DEFAULT = [("h100", "causal"), ("h100", "mods_document"), ("h100", "soft_cap")]
# the cases flex_mgpu_ws plans (relative_bias reads a table: Mosaic GPU has no gather)
_WS_CASES = [c for c in CASES if c != "relative_bias"]


@pytest.mark.parametrize("target,case", DEFAULT, ids=lambda x: x)
def test_ws_kernels_compile_within_their_budgets(target, case, tmp_path):
  check_budgets(target, case, tmp_path)


def test_ws_forward_with_exp2_on_the_fma_pipe_compiles_within_its_budgets(tmp_path):
  """flex_mgpu.ws_exp2_fma(16) on soft-cap, the case it is for: the forward issues 8
  fewer MUFU.EX2 a thread (its PTX), and the three kernels stay within the budgets."""
  check_budgets("h100", "soft_cap", tmp_path, fma_columns=16)


@pytest.mark.thorough
@pytest.mark.parametrize("target,case", [(t, c) for t in deviceless_cuda.TARGETS
                                         for c in _WS_CASES if (t, c) not in DEFAULT],
                         ids=lambda x: x)
def test_ws_kernels_compile_within_their_budgets_every_case(target, case, tmp_path):
  check_budgets(target, case, tmp_path)


@pytest.mark.thorough
def test_the_card_runs_programs_compile_for_an_h100(tmp_path):
  """tools/mgpu_fast_check.py --compile-only h100: every jax program the card's run would
  execute (values, gradients, each timed contender forward and forward + backward)
  compiled for the card before device time is spent on it (issue 45, item 3). One length
  here (the card's run has two, the same programs at other shapes): 146 s on 2 cores."""
  done = subprocess.run([sys.executable, str(ROOT / "tools" / "mgpu_fast_check.py"),
                         "--compile-only", "h100", "--lengths", "1024", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "mgpu_fast_check.json").read_text())
  failed = [(r["program"], r["error"][-300:]) for r in result["compiled"] if not r["compiled"]]
  assert not failed, failed
  programs = {r["program"] for r in result["compiled"]}
  assert "grad documents_4_soft_cap_gqa_8_2 default:flex_mgpu_ws" in programs  # as on Hopper
  assert {f"speed T=1024 {case} fwd+bwd flex_mgpu_ws:bwd" for case in ("causal", "soft_cap")
          } <= programs
  assert {f"speed T=1024 {case} fwd flex_mgpu_ws" for case in (
      "causal", "documents", "soft_cap", "window", "alibi", "no_mask")} <= programs
  assert not result["values"] and not result["speed"]  # nothing ran, nothing is claimed
