"""Which sequence chunks each device holds: a load balance read from the mask's block classes.

The sequence (T queries and S keys alike) is cut into C = c * P equal chunks and
each of the P devices of the sequence axis holds c of them, the same chunks of
the queries and of the keys/values. Whatever the order, the result is the same
(each chunk carries its global positions); only the work per device changes.
A device's work is the non-empty (PARTIAL or FULL) block pairs of its queries'
rows, against every key, so balancing it is a partition of the chunks' row
sums into P sets of c: number partitioning, solved greedily (largest first, to
the least loaded device with room: LPT), then improved by swaps.

On a ring the K/V chunks arrive one device's worth per step and each step ends
in a ppermute, so a step lasts as long as its busiest device: the critical path
is the sum over steps of the per-step maximum. The planner compares, for the
mask at hand, contiguous chunks (c = 1), zig-zag (c = 2: chunks i and 2P-1-i,
exact for causal), and LPT at c = 2, 4, 8, 16, and takes the fewest chunks
whose imbalance (max / mean work) is at most `TARGET` and whose critical path
is within 10% of the best candidate's: more chunks balance better but cost a
loop iteration per chunk pair on every ring step.

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
  P, C = table.shape[0], pairs.shape[0]
  member = np.zeros((P, C), np.int64)
  member[np.repeat(np.arange(P), table.shape[1]), table.reshape(-1)] = 1
  return member @ pairs @ member.T


def _work(table: np.ndarray, pairs: np.ndarray) -> Work:
  between = _device_pairs(table, pairs)
  P = between.shape[0]
  i = np.arange(P)
  steps = np.stack([between[i, (i - r) % P] for r in range(P)])  # [r, i]
  return Work(tuple(int(x) for x in between.sum(axis=1)),
              tuple(tuple(int(x) for x in row) for row in steps), int(steps.max(axis=1).sum()))


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


def improve(table: np.ndarray, pairs: np.ndarray, rounds: int = 4) -> np.ndarray:
  """Swaps that lower (max work, critical path): a chunk of the busiest device for one
  of another device, then the devices' places on the ring (which device follows which)."""
  table = table.copy()
  best = _score(_work(table, pairs))
  P, c = table.shape
  for _ in range(rounds):
    improved = False
    busiest = int(np.argmax(_work(table, pairs).per_device))
    for a in range(c):
      for j in range(P):
        if j == busiest:
          continue
        for b in range(c):
          table[busiest, a], table[j, b] = table[j, b], table[busiest, a]
          score = _score(_work(table, pairs))
          if score < best:
            best, improved = score, True
            break
          table[busiest, a], table[j, b] = table[j, b], table[busiest, a]
        if improved:
          break
      if improved:
        break
    for i in range(P):  # ring places: only the critical path can change
      for j in range(i + 1, P):
        table[[i, j]] = table[[j, i]]
        score = _score(_work(table, pairs))
        if score < best:
          best, improved = score, True
        else:
          table[[i, j]] = table[[j, i]]
    if not improved:
      break
  return np.sort(table, axis=1)


def candidates(P: int, chunks: tuple[int, ...]) -> list[ChunkOrder | int]:
  """The orders tried, fewest chunks first: contiguous, zig-zag, then LPT at each c."""
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
