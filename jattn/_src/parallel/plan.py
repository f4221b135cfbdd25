"""The plan of a context-parallel call: chunk order, each strategy's cost, and the choice.

For each strategy the plan models, per device of the sequence axis:
  work        non-empty block pairs (of the table's bq x bk blocks, all the
              device's batch rows and heads together) it computes;
  critical path  the ring only: each step ends in a ppermute, so the sum over
              steps of the busiest device's work;
  bytes sent  forward + backward, the collectives and the chunk moves of the
              balance (`relayout`);
  memory      the arrays it holds at once in the forward (its queries and
              output, the K/V it holds or receives, float32 accumulators), not
              the blockwise loop's per-block temporaries.
These are counts from shapes and the mask's block classes, not measurements.

The choice (strategy=None): among the strategies that can run, those whose
memory is within 2x the least; of those, the least work (ring: its critical
path; all-gather: the busiest device; Ulysses: an equal share of every block);
within 10% of it, the fewest bytes sent. The model does not credit the ring
for hiding its ppermutes behind compute.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jattn._src.parallel import balance as _balance
from jattn._src.parallel.relayout import bytes_moved

STRATEGIES = ("ring", "all_gather", "ulysses")
_TABLE_BLOCK = 256  # the work table's blocks: the finest chunk, cut to at most this
# Chunks shorter than this are not dealt (beyond zig-zag's two per device): each chunk
# pair is a blockwise call, whose blocks would shrink to the chunk and its fixed cost grow.
MIN_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class Sizes:
  """One call's sizes, as one device of the sequence axis sees them."""

  B: int  # batch rows on the device (after batch_axis_name)
  T: int
  S: int
  N: int  # query heads on the device (after head_axis_name)
  K: int
  H: int
  D: int
  itemsize: int
  P: int  # devices of the sequence axis


@dataclasses.dataclass(frozen=True)
class StrategyCost:
  """One strategy's modelled cost per device (see the module docstring), or its refusal."""

  strategy: str
  refused: str | None = None
  work: tuple[float, ...] = ()
  critical_path: float | None = None
  bytes_sent: tuple[int, ...] = ()
  memory: int = 0

  @property
  def max_work(self) -> float:
    return max(self.work)

  @property
  def mean_work(self) -> float:
    return float(np.mean(self.work))

  @property
  def imbalance(self) -> float:
    return self.max_work / self.mean_work if self.mean_work else 1.0

  @property
  def time_work(self) -> float:
    """The work that sets the step time: the ring's critical path, else the busiest device."""
    return self.max_work if self.critical_path is None else self.critical_path


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelPlan:
  """What `jattn.context_parallel_attention` runs for a call, and what each strategy costs.

  From `jattn.context_parallel_plan(...)` or `jattn.explain(..., mesh=mesh)`; `str()`
  gives a readable table.

  Attributes:
    strategy: the strategy that runs ("ring", "all_gather" or "ulysses").
    why: why it was chosen (strategy=None) or that it was asked for.
    order: the `ChunkOrder` of ring and all-gather (the load balance); pass it
      as `load_balance=` to reuse it (e.g. inside jit, where document ids are traced).
    notes: what the balance could not read, and what it did instead.
    costs: strategy -> `StrategyCost` (refused ones carry the reason).
    block: (bq, bk), the blocks the work is counted in.
    axis_name, P: the sequence axis and its size.
  """

  strategy: str
  why: str
  order: _balance.ChunkOrder
  notes: tuple[str, ...]
  costs: dict
  block: tuple[int, int]
  axis_name: str
  P: int

  def __str__(self) -> str:
    lines = [f"context parallel over mesh axis {self.axis_name!r} (P={self.P}): "
             f"{self.strategy} ({self.why})",
             f"  chunk order (ring, all_gather): {self.order}"]
    lines += [f"  note: {n}" for n in self.notes]
    lines.append(f"  work = non-empty {self.block[0]}x{self.block[1]} block pairs per device")
    for name in STRATEGIES:
      c = self.costs[name]
      if c.refused:
        lines.append(f"  {name:10s} refused: {c.refused}")
        continue
      path = "" if c.critical_path is None else f", ring critical path {c.critical_path:.0f}"
      lines.append(
          f"  {name:10s} work max {_count(c.max_work)} / mean {c.mean_work:.1f} "
          f"(imbalance {c.imbalance:.2f}){path}; sends {_mib(max(c.bytes_sent))} per device "
          f"(fwd+bwd); holds {_mib(c.memory)}")
    return "\n".join(lines)


def _count(x: float) -> str:
  """Block pairs: whole as counted, to a tenth where shared out (Ulysses' equal share)."""
  return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _mib(n) -> str:
  return f"{n / 2**20:.2f} MiB"


def divisibility(length: int, letter: str, chunks: int, P: int, axis_name: str) -> str | None:
  if length == 0:  # every row sees no key, or there is no row: nothing to share out
    return (f"length {letter}=0: no token to shard over mesh axis {axis_name!r} (on one "
            f"device, the call returns zeros)")
  if length % (chunks * P):
    return (f"length {letter}={length} must be divisible by {chunks * P} ({chunks} chunk(s) "
            f"for each of the {P} devices of mesh axis {axis_name!r})")
  return None


def table_blocks(T: int, S: int, P: int, given=None) -> tuple[tuple[int, ...], int, int]:
  """(chunks per device that divide T and S and are at least `MIN_CHUNK` long beyond two,
  the table's bq and bk): the table's blocks are the finest chunk, cut down to at most
  `_TABLE_BLOCK` tokens. given: a `ChunkOrder` of the caller's, whose chunks are the
  table's (where they divide T and S)."""
  chunks = tuple(c for c in (1,) + _balance.CHUNKS if T % (c * P) == 0 and S % (c * P) == 0
                 and (c <= 2 or min(T, S) // (c * P) >= MIN_CHUNK))
  if given is not None and T % given.C == 0 and S % given.C == 0:  # the caller's order
    chunks = (given.c,)

  def block(length):
    finest = length // (max(chunks) * P)
    cut = next(k for k in range(1, finest + 1) if finest % k == 0 and finest // k <= _TABLE_BLOCK)
    return finest // cut
  return chunks, block(T), block(S)


def order_for(blocks, notes, load_balance, sizes: Sizes, chunks, axis_name):
  """(ChunkOrder or None, reason it is None, notes) for ring and all-gather."""
  P = sizes.P
  if isinstance(load_balance, _balance.ChunkOrder):
    if load_balance.P != P:
      return None, (f"load_balance is a ChunkOrder for {load_balance.P} devices, but mesh axis "
                    f"{axis_name!r} has {P}"), notes
    for L, letter in ((sizes.T, "T"), (sizes.S, "S")):
      reason = divisibility(L, letter, load_balance.c, P, axis_name)
      if reason:
        return None, reason, notes
    return load_balance, None, notes
  if not load_balance or blocks.all():
    return _balance.contiguous(P), None, notes
  if max(chunks) < 2:
    for L, letter in ((sizes.T, "T"), (sizes.S, "S")):
      reason = divisibility(L, letter, 2, P, axis_name)
      if reason:
        return None, (f"{reason} for the load balance of this mask (load_balance=False keeps "
                      f"one contiguous chunk per device)"), notes
  order, _ = _balance.plan(blocks, P, chunks)
  return order, None, notes


def _bytes_ring(z: Sizes, order, moved):
  kv = z.B * z.S // z.P * z.K * (z.H + z.D)  # one device's K/V, elements
  hops = (z.P - 1) * kv * z.itemsize * 2 + z.P * kv * 4  # fwd K/V; bwd K/V and f32 dK, dV
  chunk = z.B * z.T // order.C
  moves = moved * chunk * 2 * (z.N * (z.H + z.D) + z.K * (z.H + z.D)) * z.itemsize
  return tuple(int(hops + m) for m in moves)


def _bytes_all_gather(z: Sizes, order, moved):
  kv = z.B * z.S * z.K * (z.H + z.D) * (z.P - 1) // z.P * z.itemsize  # all-gather, reduce-scatter
  chunk = z.B * z.T // order.C
  moves = moved * chunk * 2 * z.N * (z.H + z.D) * z.itemsize  # q, out; d_out, dq
  return tuple(int(2 * kv + m) for m in moves)


def _bytes_ulysses(z: Sizes):
  share = z.B * (z.T // z.P * z.N * (2 * z.H + 2 * z.D) + z.S // z.P * z.K * 2 * (z.H + z.D))
  return (int(share * (z.P - 1) // z.P * z.itemsize),) * z.P  # each way, fwd and bwd


def _memory(z: Sizes, strategy: str) -> int:
  b, t = z.itemsize, z.B * z.T // z.P
  queries = t * z.N * (z.H + z.D) * b + t * z.N * (z.D + 1) * 4  # q, out, f32 out and lse
  if strategy == "ring":  # its own K/V and the one arriving
    return queries + 2 * z.B * z.S // z.P * z.K * (z.H + z.D) * b
  if strategy == "all_gather":
    return queries + z.B * z.S * z.K * (z.H + z.D) * b
  # Ulysses: every position of N / P heads, before and after each all-to-all
  return 2 * queries + 2 * z.B * z.S * (z.K // z.P) * (z.H + z.D) * b


def costs(z: Sizes, blocks, order, order_refusal, ulysses_refusal) -> dict:
  out = {}
  for name in ("ring", "all_gather"):
    if order is None:
      out[name] = StrategyCost(name, refused=order_refusal)
      continue
    work = _balance.work_of(order, blocks)
    moved = bytes_moved(order)
    out[name] = StrategyCost(
        name, work=tuple(float(w) for w in work.per_device),
        critical_path=float(work.critical_path) if name == "ring" else None,
        bytes_sent=(_bytes_ring if name == "ring" else _bytes_all_gather)(z, order, moved),
        memory=_memory(z, name))
  if ulysses_refusal:
    out["ulysses"] = StrategyCost("ulysses", refused=ulysses_refusal)
  else:  # every device sees the whole mask for its heads: an equal share
    out["ulysses"] = StrategyCost("ulysses", work=(float(blocks.sum()) / z.P,) * z.P,
                                  bytes_sent=_bytes_ulysses(z), memory=_memory(z, "ulysses"))
  return out


def choose(costs: dict) -> tuple[str | None, str]:
  """(the strategy for strategy=None, why); None when every strategy refused."""
  able = [c for c in costs.values() if not c.refused]
  if not able:
    return None, "; ".join(f"{c.strategy}: {c.refused}" for c in costs.values())
  least_memory = min(c.memory for c in able)
  fits = [c for c in able if c.memory <= 2 * least_memory]
  least_work = min(c.time_work for c in fits)
  close = [c for c in fits if c.time_work <= 1.1 * least_work]
  best = min(close, key=lambda c: max(c.bytes_sent))
  dropped = [c.strategy for c in able if c not in fits]
  why = (f"chosen: least work within 10% ({best.time_work:.0f} block pairs), then fewest "
         f"bytes sent, among strategies within 2x the least memory")
  if dropped:
    why += f" ({', '.join(dropped)} would hold over 2x the memory)"
  return best.strategy, why
