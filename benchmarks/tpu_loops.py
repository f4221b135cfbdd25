"""The loops of a TPU kernel's final bundle schedule, and the bundles it issues for given
trip counts (no TPU needed: the text libtpu writes with LIBTPU_INIT_ARGS=--xla_jf_dump_to).

A TensorCore issues one VLIW bundle a cycle from a static schedule, so a kernel whose
loops run data-dependent numbers of times issues

    (bundles outside every loop) + sum over loops of (its body's bundles outside the loops
    nested in it) x (the times its body runs in the whole call)

bundles. A loop is a backward branch (`sbr.rel ... target = $regionN` to a bundle at or
before the branch); its body runs from the target to the branch. Loops nest by address
range. Bundles behind a forward branch inside a body are counted as issued (`skippable`
gives how many are, for a lower bound). `tpu_schedule.py` reads a kernel with one grid
loop and its predicated steps; this file reads any nest of loops (tokamax's decode
kernel: a chunk loop, a grid loop, the pipeline's lookahead loops).
"""

from __future__ import annotations

import dataclasses
import re

_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?\s*:\s*>*\s*\{")
_BRANCH = re.compile(r"sbr\.rel\s*\(([^)]*)\)\s*target\s*=\s*\$region(\d+)")
_REGION = re.compile(r"Start(?:/End empty)? region (\d+)")


@dataclasses.dataclass(frozen=True)
class Loop:
  """A loop's body [start, end] (bundle addresses; `end` holds the back-edge), its
  enclosing loop (an index into `Listing.loops`, None at the top) and its depth."""

  start: int
  end: int
  parent: int | None
  depth: int

  @property
  def size(self) -> int:
    return self.end - self.start + 1


@dataclasses.dataclass(frozen=True)
class Listing:
  """A parsed `*-final_bundles.txt`: each bundle's text by address, its loops (sorted by
  start) and its forward branches (branch address, first bundle after the skip)."""

  bundles: dict
  loops: list
  forward: list

  @property
  def total(self) -> int:
    return len(self.bundles)

  def children(self, i):
    """Indices of the loops directly inside loop i (None: the top-level loops)."""
    return [j for j, loop in enumerate(self.loops) if loop.parent == i]

  def own(self, i) -> int:
    """Bundles of loop i's body outside its nested loops (None: outside every loop)."""
    inner = sum(self.loops[j].size for j in self.children(i))
    return (self.total if i is None else self.loops[i].size) - inner

  def _own_addresses(self, i):
    lo, hi = (0, max(self.bundles)) if i is None else (self.loops[i].start, self.loops[i].end)
    nested = [(self.loops[j].start, self.loops[j].end) for j in self.children(i)]
    return [a for a in self.bundles if lo <= a <= hi
            and not any(s <= a <= e for s, e in nested)]

  def count(self, i, pattern: str) -> int:
    """Matches of the regular expression in loop i's own bundles (None: outside loops)."""
    rx = re.compile(pattern)
    return sum(len(rx.findall(self.bundles[a])) for a in self._own_addresses(i))

  def skippable(self, i) -> int:
    """Loop i's own bundles that a forward branch in them can skip (None: outside loops)."""
    own = set(self._own_addresses(i))
    skipped = set()
    for branch, after in self.forward:
      if branch in own:
        skipped.update(a for a in range(branch + 1, after) if a in own)
    return len(skipped)


def parse(text: str) -> Listing:
  """The bundles, loops and forward branches of a final bundle schedule's text."""
  bundles, region_at, branches = {}, {}, []
  for line in text.splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    address = int(m.group(1), 0)
    bundles[address] = line
    for r in _REGION.findall(line):
      region_at.setdefault(int(r), address)
    for _, r in _BRANCH.findall(line):
      branches.append((address, int(r)))
  if not bundles:
    raise ValueError("no bundles found: not a final_bundles dump")
  jumps = [(a, region_at[r]) for a, r in branches if r in region_at]
  ends = {}
  for a, t in jumps:
    if t <= a:  # a back-edge: the loop's body is [t, a] (the last back-edge if several)
      ends[t] = max(ends.get(t, a), a)
  spans = sorted(ends.items(), key=lambda s: (s[0], -s[1]))
  loops = []
  for start, end in spans:
    outer = [j for j, o in enumerate(loops) if o.start <= start and end <= o.end]
    crossed = [o for o in loops if o.start < start <= o.end < end]
    if crossed:
      raise ValueError(f"loops [{crossed[0].start}, {crossed[0].end}] and [{start}, {end}] "
                       "overlap without nesting")
    parent = max(outer, key=lambda j: loops[j].start) if outer else None
    loops.append(Loop(start, end, parent, 0 if parent is None else loops[parent].depth + 1))
  forward = sorted((a, t) for a, t in jumps if t > a)
  return Listing(bundles, loops, forward)


def issued(listing: Listing, trips) -> int:
  """Bundles issued when loop i's body runs trips[i] times in all (not per iteration of
  its parent): the bundles outside loops once, each loop's own bundles trips[i] times."""
  if len(trips) != len(listing.loops):
    raise ValueError(f"trips: {len(trips)} counts for {len(listing.loops)} loops")
  return listing.own(None) + sum(listing.own(i) * int(t) for i, t in enumerate(trips))
