"""benchmarks/tpu_schedule.py: the parser of the TPU compiler's final bundles (on a
hand-written dump, any host) and the script's --smoke run (deviceless, needs libtpu)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import tpu_schedule  # noqa: E402

# A grid loop of the shape Mosaic's kernels compile to: a prologue, the loop body from
# 0x2 (LB) to its back-edge at 0xc, the pipeline guard 0x3 -> 0xb, inside it four
# predicated regions (init 0x5, FULL 0x6-0x7, PARTIAL 0x9, finish 0xa).
_DUMP = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 }
   0x1   :  { %s2 = smov 0 } /* Start region 9 */
   0x2 LB: > { %s3 = sadd.s32 1, %s2 } /* Start region 1 */
   0x3   : > { %4 = sbr.rel (%p1) target = $region2 }
   0x4   : > { %5 = sbr.rel (%p2) target = $region3 }
   0x5   : > { %6 = vst [vmem:[#a]] %v0 }
   0x6 PF: > { %7 = sbr.rel (%p3) target = $region4 } /* Start/End empty region 3 */
   0x7   : > { %v8 = vmatmul.bf16.gmra.mxu0 %v1 }
   0x8   : > { %v9 = vpop.f32.mrf.mxu1 }
   0x9 PF: > { %10 = sbr.rel (%p4) target = $region5 } /* Start/End empty region 4 */
   0xa   : > { %v11 = vsel %vm1, %v2, %v3 }
   0xb PF: > { %12 = sbr.rel (%p5) target = $region2 } /* Start/End empty region 5 */
   0xc   : > { %13 = vst [vmem:[#b]] %v4 }
   0xd PF: > { %14 = sbr.rel (%p6) target = $region1 } /* Start region 2 */
   0xe   :  { %15 = vnop }
"""


def test_parser_finds_the_loop_its_regions_and_each_path():
  sched = tpu_schedule.parse_bundles(_DUMP)
  assert (sched.total, sched.body_start, sched.body_end, sched.mxu_units) == (15, 2, 13, 2)
  # (branch, first skipped, first after): init, FULL, PARTIAL, finish
  assert sched.regions == [(4, 5, 6), (6, 7, 9), (9, 10, 11), (11, 12, 13)]
  p = tpu_schedule.paths("flex", sched)
  # body 12 bundles, 5 of them in the four regions: 7 run on every step
  assert p == dict(loop_overhead=7, init=1, finish=1, launch=3, full=9, partial=8, empty=7)
  with pytest.raises(ValueError, match="expected 3 predicated regions"):
    tpu_schedule.paths("splash", sched)


def test_mxu_bound_of_a_tile():
  # v5e: four 128 x 128 MXUs; a 128 x 512 forward tile at H = D = 128: q k^T and p v
  # each 128 rows x 4 column blocks (or 4 contraction blocks), 1024 row passes / 4
  assert tpu_schedule.tile_mxu("v5e", "fwd", 128, 512, 128, 128) == 256
  # v6e: four 256-wide row passes a cycle; H = 128 fills half the contraction of q k^T
  assert tpu_schedule.tile_mxu("v6e", "fwd", 512, 512, 128, 128) == (512 * 2 + 512 * 2) / 4


@pytest.mark.compile
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (pip install 'jax[tpu]') for the deviceless TPU compile")
def test_smoke_run_compiles_flex_tpu_and_splash_and_estimates(tmp_path):
  out = tmp_path / "schedule.json"
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks/tpu_schedule.py"), "--smoke",
                         "--out", str(out), "--cache", str(tmp_path / "cache")],
                        capture_output=True, text=True, timeout=900,
                        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-3000:]
  run = json.loads(out.read_text())["runs"]["current"]
  rows = {r["impl"]: r for r in run["rows"]}
  assert set(rows) == {"flex_tpu", "splash"}
  for r in rows.values():
    for role in ("fwd", "dq", "dkv"):
      b = r["bundles"][role]
      # a computed tile runs its loop's overhead and its matmuls: the MXU work is a floor
      # (to a few per cent: the bound counts one row per MXU per cycle)
      assert b["full"] > b["empty"] > 0
      assert b["full"] >= 0.9 * r["mxu_per_tile"][role], (role, b, r["mxu_per_tile"])
    assert r["fwd_bwd_s"] > r["fwd_s"] > r["estimate"]["fwd"]["mxu_bound_s"] > 0
  assert "vs_splash_fwd" in run["ratios"][0]
