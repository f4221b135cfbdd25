"""Which sequence chunks each device holds: a load balance read from the mask's block classes.

The sequence (T queries and S keys alike) is cut into C = c * P equal chunks and
each of the P devices of the sequence axis holds c of them, the same chunks of
the queries and of the keys/values. Whatever the order, the result is the same
(each chunk carries its global positions); only the work per device changes.
A device's work is the non-empty (PARTIAL or FULL) block pairs of its queries'
rows, against every key; the mean over devices is the least the busiest can do.

On a ring the K/V chunks arrive one device's worth per step and each step ends
in a ppermute, so a step lasts as long as its busiest device: the critical path
is the sum over steps of the per-step maximum, at least the mean work, and that
only where every step is balanced, not just each device's total. So the order
is searched for the ring's critical path itself: chunks dealt greedily by row
work (largest first, to the least loaded device with room: LPT), then a local
search that swaps chunks between devices and devices' places on the ring, and
keeps the busiest device's work within `TARGET` x mean (all-gather waits on it).
Planning runs at trace time, so each round weighs its swaps at once, each from
only the entries of the step table it changes rather than a recount, and only
the swaps that can lower the keys: those touching a device at a step's peak or
whose keys are met there (`_hot`). Up to 32 devices that is (nearly) all of them;
at pod scale a round weighs the most urgent devices' swaps within a budget
(`_round`), so 64 devices plan in about 1 s and 256 in about 5 s, not minutes.

The planner compares, for the mask at hand, contiguous chunks (c = 1), zig-zag
(c = 2: chunks i and 2P-1-i, exact for causal), and the search at c = 2, 4, 8,
16, and takes the fewest chunks whose imbalance (max / mean work) is at most
`TARGET` and whose critical path is within 10% of the best candidate's: more
chunks balance better but cost a loop iteration per chunk pair on every ring step.

Everything here is NumPy on static block tables: the order decides the
communication pattern compiled into the program, so it is fixed at trace time.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

TARGET = 1.05  # imbalance (max / mean non-empty blocks per device) the planner aims for
CHUNKS = (2, 4, 8, 16)  # chunks per device the planner tries besides one (contiguous)


@dataclasses.dataclass(frozen=True)
class ChunkOrder:
  """The sequence in C = P * c equal chunks; device i holds chunks `devices[i]`, ascending.

  Hashable: it is static (part of the compiled program). Pass one as
  `load_balance=` to fix the order yourself, e.g. computed outside jit for a batch
  whose document ids are traced inside it (`jattn.context_parallel_plan`).
  """

  devices: tuple[tuple[int, ...], ...]
  name: str = "balanced"  # "contiguous", "zig-zag" or "balanced", for reports

  def __post_init__(self):
    counts = {len(d) for d in self.devices}
    chunks = sorted(g for d in self.devices for g in d)
    if len(counts) != 1 or chunks != list(range(len(chunks))):
      raise ValueError(f"ChunkOrder.devices must give every device the same number of "
                       f"chunks and hold each chunk 0..C-1 once, got {self.devices}")

  @property
  def P(self) -> int:
    return len(self.devices)

  @property
  def c(self) -> int:
    """Chunks per device."""
    return len(self.devices[0])

  @property
  def C(self) -> int:
    return self.P * self.c

  def table(self) -> np.ndarray:
    """int [P, c]: the global chunk index of each device's local chunk."""
    return np.array(self.devices, np.int32)

  def device_of(self) -> np.ndarray:
    """int [C]: the device holding each chunk."""
    dev = np.empty(self.C, np.int32)
    for i, chunks in enumerate(self.devices):
      dev[list(chunks)] = i
    return dev

  def positions(self, length: int) -> np.ndarray:
    """int [length]: the global position at each place of the device-major (sharded) order."""
    size = length // self.C
    return (self.table().reshape(-1, 1) * size + np.arange(size)).reshape(-1)

  def __str__(self) -> str:
    return f"{self.name}, {self.c} chunk(s) per device"


def contiguous(P: int, c: int = 1) -> ChunkOrder:
  return ChunkOrder(tuple(tuple(range(i * c, (i + 1) * c)) for i in range(P)), "contiguous")


def zigzag(P: int) -> ChunkOrder:
  """Device i holds chunks i and 2P-1-i: one early and one late causal row."""
  return ChunkOrder(tuple((i, 2 * P - 1 - i) for i in range(P)), "zig-zag")


@dataclasses.dataclass(frozen=True)
class Work:
  """The non-empty block pairs of an order: per device, per ring step, and their summaries."""

  per_device: tuple[int, ...]  # each device's queries against every key
  per_step: tuple[tuple[int, ...], ...]  # [step r][device i]: against device i-r's keys
  critical_path: int  # sum over ring steps of the busiest device's work

  @property
  def imbalance(self) -> float:
    mean = float(np.mean(self.per_device))
    return float(max(self.per_device)) / mean if mean else 1.0

  @property
  def max(self) -> int:
    return int(max(self.per_device))

  @property
  def mean(self) -> float:
    return float(np.mean(self.per_device))


def chunk_pairs(blocks: np.ndarray, C: int) -> np.ndarray:
  """bool [nq, nk] non-empty blocks (nq, nk multiples of C) -> int [C, C] counts per chunk pair."""
  nq, nk = blocks.shape
  return blocks.reshape(C, nq // C, C, nk // C).sum(axis=(1, 3), dtype=np.int64)


def work_of(order: ChunkOrder, blocks: np.ndarray) -> Work:
  """The work of `order` on the non-empty block table `blocks` (bool [nq, nk])."""
  return _work(order.table(), chunk_pairs(blocks, order.C))


def _device_pairs(table: np.ndarray, pairs: np.ndarray) -> np.ndarray:
  """int [P, P]: non-empty blocks of device i's queries against device j's keys."""
  P, c = table.shape
  flat = table.reshape(-1)
  return pairs[np.ix_(flat, flat)].reshape(P, c, P, c).sum(axis=(1, 3))


def _steps(between: np.ndarray) -> np.ndarray:
  """int [..., P, P] device pairs' work -> [..., i, r]: device i's work at ring step r, against
  the keys of device i - r (they arrive after r hops)."""
  P = between.shape[-1]
  i = np.arange(P)[:, None]
  return between[..., i, (i - np.arange(P)) % P]


def _work(table: np.ndarray, pairs: np.ndarray) -> Work:
  between = _device_pairs(table, pairs)
  steps = _steps(between)
  return Work(tuple(int(x) for x in between.sum(axis=1)),
              tuple(tuple(int(x) for x in step) for step in steps.T),
              int(steps.max(axis=0).sum()))


def _score(work: Work) -> tuple:
  return (work.max, work.critical_path)


def lpt(pairs: np.ndarray, P: int) -> np.ndarray:
  """int [P, c]: chunks by falling row work, each to the least loaded device with room."""
  C = pairs.shape[0]
  c = C // P
  rows = pairs.sum(axis=1)
  held = [[] for _ in range(P)]
  room = [(0, i) for i in range(P)]  # (load, device) of the devices with room: a heap
  for g in np.argsort(-rows, kind="stable"):
    load, i = heapq.heappop(room)
    held[i].append(int(g))
    if len(held[i]) < c:
      heapq.heappush(room, (load + int(rows[g]), i))
  return np.array([sorted(h) for h in held], np.int32)


def _keys(steps: np.ndarray, limit: int) -> tuple[np.ndarray, ...]:
  """The search's keys, least first, of candidates whose per-step work is `steps` (int
  [n, P, P], [., i, r]): the busiest device's work above `limit` (all-gather waits on it),
  the critical path (the ring waits on it), then the (device, step) entries at their step's
  peak: fewer leave fewer to lower before a step shortens, a way across the path's plateaus."""
  peak = steps.max(axis=1)  # [n, r]
  over = np.maximum(steps.sum(axis=2).max(axis=1) - limit, 0)
  return over, peak.sum(axis=1), (steps == peak[:, None]).sum(axis=(1, 2))


_TOP = 5  # per step, the busiest devices kept: a swap changes at most 4 entries of a step
_BATCH = 1 << 21  # step-table entries weighed at once: bounds the search's memory


def _round(P: int) -> int:
  """Step-table entries weighed per round: up to 8 devices all the swaps that can lower the
  keys, up to 32 most of them (paths within 1% of the full search's), beyond that fewer,
  so that planning stays within seconds on a pod (64 devices about 1 s, 256 about 6 s)."""
  return max(1 << 15, min(1 << 18, (1 << 28) // (P * P)))


def _tops(steps: np.ndarray) -> tuple[np.ndarray, ...]:
  """(devices, their work, how many devices have it) [r, k]: each step's `_TOP` busiest."""
  cols = steps.T  # [r, d]
  top = np.argsort(-cols, axis=1, kind="stable")[:, :_TOP]
  vals = np.take_along_axis(cols, top, axis=1)
  return top, vals, (cols[:, None, :] == vals[:, :, None]).sum(axis=2)


def _rest(steps: np.ndarray, tops: tuple, i: np.ndarray, j: np.ndarray) -> tuple:
  """(peak, ties) [n, r]: per step, the busiest device's work among those a swap between
  devices i and j leaves alone (all but i, j, i + r and j + r), and how many devices have it,
  from each step's busiest (`_tops`) rather than a recount per swap."""
  P = steps.shape[0]
  top, vals, counts = tops
  r = np.arange(P)
  out = [np.broadcast_to(i[:, None], (len(i), P)), np.broadcast_to(j[:, None], (len(j), P)),
         (i[:, None] + r) % P, (j[:, None] + r) % P]  # [n, r] each
  left = np.ones(out[0].shape + (top.shape[1],), bool)  # [n, r, k]
  for o in out:
    left &= top[None] != o[..., None]
  k = np.argmax(left, axis=2)  # the first of the top devices left alone
  found = left.any(axis=2)
  peak = np.where(found, vals[r, k], -1)
  ties = np.where(found, counts[r, k], 0)
  for x, o in enumerate(out):  # the devices taken out that had that work, each once
    fresh = np.ones_like(o, bool)
    for prev in out[:x]:
      fresh &= o != prev
    ties -= fresh & (steps[o, r] == peak)
  return peak, ties


def _combine(rest: tuple, entries: tuple, busiest: np.ndarray, limit: int) -> tuple:
  """(index, keys) of the least of a batch of swaps, from the busiest of the untouched devices
  per step and the changed entries (int [n, r] each, -1 where counted elsewhere). The ties
  are counted only for the swaps that lead on the first two keys: most do not."""
  rest_peak, rest_ties = rest
  peak = rest_peak
  for e in entries:
    peak = np.maximum(peak, e)
  over, path = np.maximum(busiest - limit, 0), peak.sum(axis=1)
  pick = np.nonzero(over == over.min())[0]
  pick = pick[path[pick] == path[pick].min()]
  top = peak[pick]
  ties = np.where(rest_peak[pick] == top, rest_ties[pick], 0)
  for e in entries:
    ties = ties + (e[pick] == top)
  ties = ties.sum(axis=1)
  best = int(pick[np.argmax(ties == ties.min())])
  return best, (int(over[best]), int(path[best]), int(ties.min()))


def _first_least(found: list) -> tuple:
  """The least (index, keys) of batches' bests [(offset, (index, keys))], the first on ties."""
  best = None
  for offset, (index, keys) in found:
    if best is None or keys < best[1]:
      best = (offset + index, keys)
  return best


def _pick(table: np.ndarray, dev: np.ndarray, hot: np.ndarray, budget: int) -> tuple:
  """(a, b, devices taken): the swaps of chunk a for chunk b, on devices dev[a] < dev[b], of a
  chunk of the `hot` devices (most urgent first) with any other device's, whole devices while at most `budget` swaps; where
  the first alone has more, its swaps with the chunks of the most urgent others. All of the
  hot devices' swaps where they fit: those are all the swaps that can lower the keys."""
  P, c = table.shape
  C = P * c
  count = np.cumsum(np.full(len(hot), c * (C - c)))
  take = hot[:max(1, int(np.searchsorted(count, budget, side="right")))]
  a = table[take].reshape(-1, 1)
  if len(take) == 1 and count[0] > budget:  # partners: the hot, then the rest, by index
    others = np.concatenate([hot[1:], np.setdiff1d(np.arange(P), hot)])
    b = table[others].reshape(1, -1)[:, :max(1, budget // c)]
  else:
    b = np.arange(C)[None]
  a, b = np.broadcast_arrays(a, b)
  a, b = a[dev[a] != dev[b]], b[dev[a] != dev[b]]
  low = np.where(dev[a] < dev[b], a, b)
  key = np.unique(low * C + np.where(dev[a] < dev[b], b, a))  # in the order of the full search
  return key // C, key % C, take


def _tables(table: np.ndarray, pairs: np.ndarray) -> tuple[np.ndarray, ...]:
  """(int [C, P] chunk g's queries against device d's keys, [P, C] device d's queries
  against chunk g's keys, [P, P] device pairs' work) of the order `table`."""
  chunk_rows = pairs[:, table].sum(axis=2)
  return chunk_rows, pairs[table].sum(axis=1), chunk_rows[table].sum(axis=1)


def _swap_keys(table: np.ndarray, pairs: np.ndarray, tables: tuple, tops: tuple, limit: int,
               a: np.ndarray, b: np.ndarray) -> tuple:
  """The keys of the swaps of chunk a of device i for chunk b of device j (i < j, from
  `_pick`; `tables` from `_tables`), from the entries of the step table that each changes
  (rows i and j, and at each step r the devices i + r and j + r that meet i's and j's keys)
  against the busiest of the rest."""
  P, c = table.shape
  chunk_rows, chunk_cols, between = tables
  dev = np.empty(table.size, np.int64)
  dev[table.reshape(-1)] = np.repeat(np.arange(P), c)
  d, r = np.arange(P)[:, None], np.arange(P)
  steps, met = between[d, (d - r) % P], between[(d + r) % P, d]  # [d, r]
  work, rows = between.sum(axis=1), pairs.sum(axis=1)
  # [g, x, r]: chunk g against the keys device x meets at step r (those of x - r), and device
  # x + r (who meets x's keys at step r) against chunk g: windows of the doubled tables, of
  # the chunks swapped only
  used = np.unique(np.concatenate([a, b]))
  at_used = np.zeros(table.size, np.int64)
  at_used[used] = np.arange(len(used))
  window = np.lib.stride_tricks.sliding_window_view
  rows_at = window(np.tile(chunk_rows[used][:, (-r) % P], 2), P, axis=1)
  cols_at = window(np.tile(chunk_cols[:, used].T, 2), P, axis=1)
  top3 = np.argsort(-work, kind="stable")[:3]  # the busiest devices, for the rest's busiest
  keys = []
  for at in range(0, len(a), max(1, _BATCH // P)):
    a_, b_ = a[at:at + _BATCH // P], b[at:at + _BATCH // P]
    i, j = dev[a_], dev[b_]
    n = np.arange(len(a_))
    ii, jj = i[:, None], j[:, None]
    row_of = lambda x, g: rows_at[at_used[g], (P - x[:, 0]) % P]
    col_of = lambda x, g: cols_at[at_used[g], x[:, 0]]
    row_i = steps[i] + row_of(ii, b_) - row_of(ii, a_)
    row_j = steps[j] - row_of(jj, b_) + row_of(jj, a_)
    col_i = met[i] + col_of(ii, b_) - col_of(ii, a_)
    col_j = met[j] - col_of(jj, b_) + col_of(jj, a_)
    # where rows i, j cross columns i, j the keys moved too, and a and b met each other
    both = pairs[a_, a_] + pairs[b_, b_] - pairs[a_, b_] - pairs[b_, a_]
    keys_i = chunk_cols[i, b_] - chunk_cols[i, a_]
    keys_j = chunk_cols[j, b_] - chunk_cols[j, a_]
    ij, ji = (i - j) % P, (j - i) % P  # the steps at which i meets j's keys, and j i's
    row_i[n, 0] += keys_i + both
    row_i[n, ij] -= keys_i + both
    row_j[n, ji] += keys_j - both
    row_j[n, 0] -= keys_j - both
    col_i[n, 0], col_i[n, ji] = -1, -1  # devices i and j: counted in their rows
    col_j[n, 0], col_j[n, ij] = -1, -1
    # the busiest device the swap leaves alone: one of the three busiest
    left = (top3 != ii) & (top3 != jj)
    other = np.where(left.any(axis=1), work[top3[np.argmax(left, axis=1)]], -1)
    moved = rows[b_] - rows[a_]
    busiest = np.maximum(np.maximum(other, work[i] + moved), work[j] - moved)
    # the rest depends on the devices only: weighed once per device pair
    pair, at_pair = np.unique(i * P + j, return_inverse=True)
    rest = tuple(x[at_pair] for x in _rest(steps, tops, pair // P, pair % P))
    keys.append((at, _combine(rest, (row_i, row_j, col_i, col_j), busiest, limit)))
  return _first_least(keys)


def _place_keys(between: np.ndarray, tops: tuple, x: np.ndarray, y: np.ndarray,
                limit: int) -> tuple:
  """The keys of swapping devices x and y's places on the ring (x < y): the entries of rows
  x and y and, at step r, of devices x + r and y + r, read from `between` permuted."""
  P = between.shape[0]
  d, r = np.arange(P)[:, None], np.arange(P)
  steps = between[d, (d - r) % P]
  work = between.sum(axis=1)
  keys = []
  for at in range(0, len(x), max(1, _BATCH // P)):
    x_, y_ = x[at:at + _BATCH // P], y[at:at + _BATCH // P]
    xx, yy = x_[:, None], y_[:, None]
    n = np.arange(len(x_))
    swap = lambda v: np.where(v == xx, yy, np.where(v == yy, xx, v))  # the transposition
    row_x = between[yy, swap((xx - r) % P)]  # x now holds y's chunks, and meets swapped keys
    row_y = between[xx, swap((yy - r) % P)]
    col_x = between[swap((xx + r) % P), yy]  # who meets x's (now y's) keys at step r
    col_y = between[swap((yy + r) % P), xx]
    xy, yx = (x_ - y_) % P, (y_ - x_) % P
    col_x[n, 0], col_x[n, yx] = -1, -1  # devices x and y: counted in their rows
    col_y[n, 0], col_y[n, xy] = -1, -1
    keys.append((at, _combine(_rest(steps, tops, x_, y_), (row_x, row_y, col_x, col_y),
                              np.full(len(x_), work.max()), limit)))
  return _first_least(keys)


def _hot(steps: np.ndarray, work: np.ndarray, limit: int) -> np.ndarray:
  """int [P]: the devices a swap must touch to lower the keys, most urgent first: those at a
  step's peak and those whose keys they meet there (by how many peak entries they are in),
  the busiest first where it is over `limit`. A swap between two others changes none of those
  entries, so cannot lower the path or its ties."""
  P = steps.shape[0]
  d, r = np.nonzero(steps == steps.max(axis=0))
  score = np.bincount(d, minlength=P) + np.bincount((d - r) % P, minlength=P)
  if work.max() > limit:
    score[work == work.max()] += 2 * P * P
  hot = np.nonzero(score)[0]
  return hot[np.argsort(-score[hot], kind="stable")]


def improve(table: np.ndarray, pairs: np.ndarray, rounds: int = 64) -> np.ndarray:
  """Steepest descent from `table` on `_keys`: each round takes the swap of two chunks between
  devices, or of two devices' places on the ring, that lowers them most among those `_pick`
  weighs (all that can, where they fit `_round`), until none does (within `rounds`, a bound
  on the planning time: 8 devices settle in about 10 to 35)."""
  P = table.shape[0]
  if P == 1:  # nothing to swap with
    return np.sort(table, axis=1)
  limit = int(TARGET * pairs.sum() / P)  # the most work a device may have: work is whole
  table = table.copy()
  chunk_rows, chunk_cols, between = _tables(table, pairs)
  for _ in range(rounds):
    steps = _steps(between)
    now = tuple(int(k[0]) for k in _keys(steps[None], limit))
    hot = _hot(steps, between.sum(axis=1), limit)
    dev = np.empty(table.size, np.int64)
    dev[table.reshape(-1)] = np.repeat(np.arange(P), table.shape[1])
    a, b, took = _pick(table, dev, hot, _round(P) // P)
    tops = _tops(steps)
    swaps = _swap_keys(table, pairs, (chunk_rows, chunk_cols, between), tops, limit, a, b)
    near = np.isin(np.arange(P), took)
    x, y = np.triu_indices(P, 1)
    x, y = x[near[x] | near[y]], y[near[x] | near[y]]
    moved = _place_keys(between, tops, x, y, limit)
    best, keys = swaps if moved is None or swaps[1] <= moved[1] else (len(a) + moved[0], moved[1])
    if keys >= now:
      break
    if best < len(a):  # the tables follow the swap in O(C P), not a recount
      g, h = a[best], b[best]
      i, j = dev[g], dev[h]
      at_g, at_h = table == g, table == h
      table[at_g], table[at_h] = h, g
      for d, sign in ((i, 1), (j, -1)):
        chunk_rows[:, d] += sign * (pairs[:, h] - pairs[:, g])
        chunk_cols[d] += sign * (pairs[h] - pairs[g])
      between = chunk_rows[table].sum(axis=1)
    else:
      places = np.arange(P)
      places[x[best - len(a)]], places[y[best - len(a)]] = y[best - len(a)], x[best - len(a)]
      table, chunk_rows, chunk_cols = table[places], chunk_rows[:, places], chunk_cols[places]
      between = between[places][:, places]
  return np.sort(table, axis=1)


def candidates(P: int, chunks: tuple[int, ...]) -> list[ChunkOrder | int]:
  """The orders tried, fewest chunks first: contiguous, zig-zag, then the search at each c."""
  out = [contiguous(P)] if 1 in chunks else []
  if 2 in chunks:
    out.append(zigzag(P))
  return out + [c for c in chunks if c >= 2]


def plan(blocks: np.ndarray, P: int, chunks: tuple[int, ...]) -> tuple[ChunkOrder, Work]:
  """The order for the non-empty block table `blocks` (bool [nq, nk], nq and nk multiples
  of P * max(chunks)), among those with `chunks` per device; and its work."""
  tried = []
  for candidate in candidates(P, chunks):
    if isinstance(candidate, ChunkOrder):
      order = candidate
    else:
      pairs = chunk_pairs(blocks, candidate * P)
      table = improve(lpt(pairs, P), pairs)
      order = ChunkOrder(tuple(tuple(int(g) for g in row) for row in table))
    tried.append((order, work_of(order, blocks)))
  shortest = min(w.critical_path for _, w in tried)
  for order, work in tried:
    if work.imbalance <= TARGET and work.critical_path <= 1.1 * shortest:
      return order, work
  return min(tried, key=lambda ow: (_score(ow[1]), ow[0].c))
