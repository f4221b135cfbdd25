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
