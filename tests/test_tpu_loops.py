"""benchmarks/tpu_loops.py: the loop nest of a final bundle schedule and the bundles it
issues for given trip counts, on a hand-written dump (any host, no libtpu)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import tpu_loops  # noqa: E402

# A prologue (0x0-0x1), an outer loop 0x2-0xf (back-edge at 0xf) holding a loop 0x4-0x6
# and a loop 0x8-0xc, which holds a loop 0x9-0xa; a forward branch at 0xd skips 0xe;
# an epilogue 0x10-0x11. Addresses past 0x9 are hex, as libtpu writes them.
_DUMP = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 }
     1   :  { %s2 = smov 0 }
     2 LB: > { %s3 = sadd.s32 1, %s2 } /* Start region 1 */
     3   : > { %s4 = smov 0 }
     4 LB: >> { %5 = dma.hbm_to_vmem %s1 } /* Start region 2 */
     5   : >> { %s6 = sadd.s32 1, %s4 }
     6   : >> { %7 = sbr.rel (%p1) target = $region2 }
     7   : > { %s8 = smov 0 }
     8 LB: >> { %v9 = vmatmul.bf16.gmra.mxu0 %v1 } /* Start region 3 */
     9 LB: >>> { %10 = dma.hbm_to_vmem %s1 } /* Start region 4 */
   0xa   : >>> { %11 = sbr.rel (%p2) target = $region4 }
   0xb   : >> { %v12 = vpop.f32.mrf.mxu0 }
   0xc   : >> { %13 = sbr.rel (%p3) target = $region3 }
   0xd   : > { %14 = sbr.rel (%p4) target = $region5 }
   0xe   : > { %15 = vst [vmem:[#a]] %v2 }
   0xf PF: > { %16 = sbr.rel (%p5) target = $region1 } /* Start region 5 */
  0x10   :  { %s17 = smov 0 }
  0x11   :  { %18 = vnop }
"""


def test_the_loop_nest_and_each_loops_own_bundles():
  listing = tpu_loops.parse(_DUMP)
  assert listing.total == 18
  spans = [(l.start, l.end, l.parent, l.depth) for l in listing.loops]
  assert spans == [(2, 15, None, 0), (4, 6, 0, 1), (8, 12, 0, 1), (9, 10, 2, 2)]
  # outer: 14 bundles less the two loops in it (3 + 5); the third loop: 5 less 2
  assert [listing.own(i) for i in range(4)] == [6, 3, 3, 2]
  assert listing.own(None) == 4  # 0, 1, 0x10, 0x11
  assert listing.count(2, r"vmatmul") == 1 and listing.count(2, r"dma\.") == 0
  assert listing.count(3, r"dma\.") == 1
  assert listing.skippable(0) == 1 and listing.skippable(2) == 0


def test_bundles_issued_for_the_trip_counts():
  listing = tpu_loops.parse(_DUMP)
  # outer twice; the first inner loop 3 times in all; the second 4; its inner loop 10
  assert tpu_loops.issued(listing, [2, 3, 4, 10]) == 4 + 6 * 2 + 3 * 3 + 3 * 4 + 2 * 10
  assert tpu_loops.issued(listing, [0, 0, 0, 0]) == 4
  with pytest.raises(ValueError, match="3 counts for 4 loops"):
    tpu_loops.issued(listing, [1, 1, 1])


def test_overlapping_loops_are_refused():
  crossed = _DUMP.replace("target = $region2 }", "target = $region3 }").replace(
      "   0xa   : >>> { %11 = sbr.rel (%p2) target = $region4 }",
      "   0xa   : >>> { %11 = sbr.rel (%p2) target = $region2 }")
  # loops [4, 10] and [8, 12] cross
  with pytest.raises(ValueError, match="overlap without nesting"):
    tpu_loops.parse(crossed.replace("     6   : >> { %7 = sbr.rel (%p1) target = $region3 }",
                                    "     6   : >> { %7 = vnop }"))


def test_no_bundles_is_an_error():
  with pytest.raises(ValueError, match="no bundles"):
    tpu_loops.parse("nothing here\n")


def _nest(spec):
  """A dump from a nest: spec is a list of (depth, ops) bundles in order, a loop opened by
  ("open", n) and closed by ("close", n) (its back-edge bundle)."""
  lines, address, opened = [], 0, {}
  for item in spec:
    if item[0] == "open":
      opened[item[1]] = address
      continue
    if item[0] == "close":
      lines.append(f"  {address:#x}   : {{ %b = sbr.rel (%p) target = $region{item[1]} }}")
      address += 1
      continue
    region = [n for n, a in opened.items() if a == address]
    tail = f" /* Start region {region[0]} */" if region else ""
    lines.append(f"  {address:#x}   : {{ {item[0]} }}{tail}")
    address += 1
  return tpu_loops.parse("\n".join(lines))


def _decode_kernel(prologue_refs=("q", "kv")):
  dma = {"q": ["%1 = dma.hbm_to_vmem %a"], "kv": ["%1 = dma.hbm_to_vmem %a"] * 2}
  spec = [("%s = vst %v",)] * 3 + [("open", 1), ("%s = sld %a",)]
  for n, r in enumerate(prologue_refs):
    spec += [("open", 10 + n)] + [(d,) for d in dma[r]] + [("close", 10 + n)]
  spec += [("open", 2), ("%v = vmatmul.bf16 %v",)]
  for n, r in enumerate(("q", "kv")):
    spec += [("open", 20 + n)] + [(d,) for d in dma[r]] + [("close", 20 + n)]
  spec += [("%v = vpop %v",), ("close", 2), ("close", 1), ("%s = smov 0",)]
  return _nest(spec)


def test_the_decode_kernels_loops_named_and_counted_from_the_schedule():
  from benchmarks import decode_tokamax_tpu as tk
  cfgs = dict(n_buffer=3, batch_size=1, bkv_p_cache=1, max_steps_ub=256)
  listing = _decode_kernel()
  trips, names = tk._decode_trips(listing, cfgs, 10)
  # one chunk; each ref's prologue lookahead fetches step 1; the grid loop 10 steps, in
  # which the lookahead loops fetch the 8 blocks the prologue did not
  assert trips == [1, 1, 1, 10, 8, 8]
  assert names[3].startswith("grid loop") and "pages" in names[2] and "query" in names[4]
  # 300 steps: two chunks of 256 and 44 steps (the second starts at 256: no prefix)
  assert tk._decode_trips(listing, cfgs, 300)[0] == [2, 2, 2, 300, 296, 296]
  assert tk._decode_trips(listing, cfgs, 1)[0] == [1, 0, 0, 1, 0, 0]
  with pytest.raises(RuntimeError, match="prologue lookahead"):
    tk._decode_trips(_decode_kernel(("q",)), cfgs, 10)
  with pytest.raises(RuntimeError, match="issues 2 DMAs"):
    tk._decode_trips(listing, dict(cfgs, bkv_p_cache=3), 10)


def test_the_scheduling_kernels_loops_and_its_flush_branch():
  from benchmarks import decode_tokamax_tpu as tk
  # seq > q > k; in k a flush branch over sadd, two loops and smov; the two final loops
  listing = _nest([
      ("%s = smov 0",), ("open", 1), ("%s = sld %a",), ("open", 2), ("%s = sld %a",),
      ("open", 3), ("%s = sst %a",), ("%s = sst %a",), ("%b = sbr.rel (%f) target = $region9",),
      ("%s = sadd %a",), ("open", 4), ("%s = sst %a",), ("close", 4), ("open", 5),
      ("%s = sst %a",), ("close", 5), ("%s = smov 0",), ("open", 9), ("%s = smov 1",),
      ("close", 3), ("close", 2), ("close", 1), ("open", 6), ("%s = sst %a",), ("close", 6),
      ("open", 7), ("%s = sst %a",), ("close", 7)])
  cfgs = dict(max_steps_ub=4, batch_size=2)
  # 8 rows, 8 query blocks, 19 key blocks: 2 flushes of 4 steps x 2 lanes, 3 blocks left
  # (one to mask out to fill the last step, 2 steps to count)
  trips, names, flush_own, flushes = tk._scheduler_trips(listing, cfgs, 8, 8, 19)
  assert trips == [8, 8, 19, 0, 8, 1, 2] and flushes == 2
  assert flush_own == 2 and names[2] == "k_loop"  # sadd and smov 0; the loops are nested
  with pytest.raises(RuntimeError, match="not schedule.py's"):
    tk._scheduler_trips(_decode_kernel(), cfgs, 8, 8, 19)
