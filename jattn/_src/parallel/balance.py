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
Each round weighs every swap at once, from only the entries of the step table
it changes, rather than recounting the table per swap: planning runs at trace time.

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
  member = _members(table, pairs.shape[0])
  return member @ pairs @ member.T


def _members(table: np.ndarray, C: int) -> np.ndarray:
  """int [P, C]: 1 where device i holds chunk g."""
  P, c = table.shape
  member = np.zeros((P, C), np.int64)
  member[np.repeat(np.arange(P), c), table.reshape(-1)] = 1
  return member


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
  load, held = np.zeros(P, np.int64), [[] for _ in range(P)]
  for g in np.argsort(-rows, kind="stable"):
    room = [i for i in range(P) if len(held[i]) < c]
    i = min(room, key=lambda i: (load[i], i))
    held[i].append(int(g))
    load[i] += rows[g]
  return np.array([sorted(h) for h in held], np.int32)


def _keys(steps: np.ndarray, limit: int) -> tuple[np.ndarray, ...]:
  """The search's keys, least first, of candidates whose per-step work is `steps` (int
  [n, P, P], [., i, r]): the busiest device's work above `limit` (all-gather waits on it),
  the critical path (the ring waits on it), then the (device, step) entries at their step's
  peak: fewer leave fewer to lower before a step shortens, a way across the path's plateaus."""
  peak = steps.max(axis=1)  # [n, r]
  over = np.maximum(steps.sum(axis=2).max(axis=1) - limit, 0)
  return over, peak.sum(axis=1), (steps == peak[:, None]).sum(axis=(1, 2))


def _least(keys: tuple[np.ndarray, ...]) -> int:
  """The index of the least candidate, comparing the keys in turn."""
  pick = np.arange(len(keys[0]))
  for key in keys:
    pick = pick[key[pick] == key[pick].min()]
  return int(pick[0])


def _swap_keys(table: np.ndarray, pairs: np.ndarray, limit: int) -> tuple:
  """(a, b, keys): every swap of chunk a of device i for chunk b of device j (i < j) and its
  keys, from the entries of the step table that it changes (rows i and j, and at each step
  r the devices i + r and j + r that meet i's and j's keys) against the busiest of the rest."""
  P, c = table.shape
  C = pairs.shape[0]
  member = _members(table, C)
  chunk_rows = pairs @ member.T  # [g, d]: chunk g's queries against device d's keys
  chunk_cols = member @ pairs  # [d, g]: device d's queries against chunk g's keys
  between = member @ chunk_rows
  dev = np.empty(C, np.int64)
  dev[table.reshape(-1)] = np.repeat(np.arange(P), c)
  a, b = np.nonzero(dev[:, None] < dev[None, :])
  i, j = dev[a], dev[b]
  n = np.arange(len(a))
  d, r = np.arange(P)[:, None], np.arange(P)
  # [d * C + g, r]: chunk g against the keys device d meets at step r; device d + r (who
  # meets d's keys at step r) against chunk g
  row_of = chunk_rows[:, (d - r) % P].transpose(1, 0, 2).reshape(P * C, P)
  col_of = chunk_cols[(d + r) % P].transpose(0, 2, 1).reshape(P * C, P)
  steps, met = between[d, (d - r) % P], between[(d + r) % P, d]  # [d, r]
  row_i = steps[i] + row_of[i * C + b] - row_of[i * C + a]
  row_j = steps[j] - row_of[j * C + b] + row_of[j * C + a]
  col_i = met[i] + col_of[i * C + b] - col_of[i * C + a]
  col_j = met[j] - col_of[j * C + b] + col_of[j * C + a]
  # where rows i, j cross columns i, j the keys moved too, and a and b met each other
  both = pairs[a, a] + pairs[b, b] - pairs[a, b] - pairs[b, a]
  keys_i = chunk_cols[i, b] - chunk_cols[i, a]
  keys_j = chunk_cols[j, b] - chunk_cols[j, a]
  ij, ji = (i - j) % P, (j - i) % P  # the steps at which i meets j's keys, and j i's
  row_i[n, 0] += keys_i + both
  row_i[n, ij] -= keys_i + both
  row_j[n, ji] += keys_j - both
  row_j[n, 0] -= keys_j - both
  col_i[n, 0], col_i[n, ji] = -1, -1  # devices i and j: counted in their rows
  col_j[n, 0], col_j[n, ij] = -1, -1
  # per device pair and step: the busiest of the devices the swap leaves alone, and how many
  pi, pj = np.triu_indices(P, 1)
  pair = np.zeros((P, P), np.int64)
  pair[pi, pj] = np.arange(len(pi))
  step, device = np.arange(P)[:, None], np.arange(P)
  touched = lambda x: (device == x[:, None, None]) | (device == (x[:, None, None] + step) % P)
  rest = np.where(touched(pi) | touched(pj), -1, steps.T[None])  # [pair, r, d]
  rest_peak = rest.max(axis=2)
  rest_ties = (rest == rest_peak[..., None]).sum(axis=2)
  k = pair[i, j]
  peak = np.maximum(np.maximum(np.maximum(rest_peak[k], row_i), np.maximum(row_j, col_i)), col_j)
  ties = (np.where(rest_peak[k] == peak, rest_ties[k], 0) + (row_i == peak) + (row_j == peak)
          + (col_i == peak) + (col_j == peak)).sum(axis=1)
  work, rows = between.sum(axis=1), pairs.sum(axis=1)
  rest_work = np.where((d == pi) | (d == pj), -1, work[:, None]).max(axis=0)
  moved = rows[b] - rows[a]
  busiest = np.maximum(np.maximum(rest_work[k], work[i] + moved), work[j] - moved)
  return a, b, (np.maximum(busiest - limit, 0), peak.sum(axis=1), ties)


def improve(table: np.ndarray, pairs: np.ndarray, rounds: int = 64) -> np.ndarray:
  """Steepest descent from `table` on `_keys`: each round takes the swap of two chunks between
  devices, or of two devices' places on the ring, that lowers them most, until none does
  (within `rounds`, a bound on the planning time: 8 devices settle in about 10 to 35)."""
  P = table.shape[0]
  if P == 1:  # nothing to swap with
    return np.sort(table, axis=1)
  limit = int(TARGET * pairs.sum() / P)  # the most work a device may have: work is whole
  x, y = np.triu_indices(P, 1)
  places = np.tile(np.arange(P), (len(x), 1))
  places[np.arange(len(x)), x], places[np.arange(len(x)), y] = y, x
  table = table.copy()
  for _ in range(rounds):
    between = _device_pairs(table, pairs)
    now = tuple(k[0] for k in _keys(_steps(between)[None], limit))
    a, b, swaps = _swap_keys(table, pairs, limit)
    moved = _keys(_steps(between[places[:, :, None], places[:, None, :]]), limit)
    keys = tuple(np.concatenate(k) for k in zip(swaps, moved))
    best = _least(keys)
    if tuple(k[best] for k in keys) >= now:
      break
    if best < len(a):
      at_a, at_b = table == a[best], table == b[best]
      table[at_a], table[at_b] = b[best], a[best]
    else:
      table = table[places[best - len(a)]]
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
