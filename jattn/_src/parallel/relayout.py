"""Moving sequence chunks between devices inside shard_map: to a `ChunkOrder` and back.

shard_map hands device i the i-th contiguous slice of the sequence, i.e. chunks
i*c .. i*c+c-1 of the C = P * c chunks. `to_order` sends every chunk to the
device and slot the order gives it; `from_order` sends it back, so the caller
sees its arrays in their own order (and mask_mod its global positions).

The moves form a bipartite multigraph (source device -> target device) in which
every device sends c chunks and receives c, so its edges split into c perfect
matchings (Konig): c rounds, each one `jax.lax.ppermute` in which every device
sends one chunk and receives one. Each chunk moves once, so a device sends at
most its own T / P tokens; a chunk that stays is a copy in place. Zig-zag is
the case c = 2; the contiguous order moves nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.parallel.balance import ChunkOrder


@dataclasses.dataclass(frozen=True)
class Round:
  """One ppermute: device i sends its slot send[i] to device to[i], which stores it
  in slot store[to[i]]."""

  send: tuple[int, ...]
  to: tuple[int, ...]
  store: tuple[int, ...]

  @property
  def moves(self) -> bool:
    return any(i != j for i, j in enumerate(self.to))


@functools.lru_cache(maxsize=256)
def rounds(order: ChunkOrder) -> tuple[Round, ...]:
  """The c rounds that take the contiguous layout to `order`."""
  P, c = order.P, order.c
  target = {g: (i, slot) for i, chunks in enumerate(order.devices)
            for slot, g in enumerate(chunks)}
  # edges[i]: the (source slot, target device, target slot) device i still has to send
  edges = [[(s, *target[i * c + s]) for s in range(c)] for i in range(P)]
  out = []
  for _ in range(c):
    match = _perfect_matching([[e[1] for e in es] for es in edges], P)
    send, to, store = [0] * P, [0] * P, [0] * P
    for i, k in enumerate(match):  # device i sends its k-th remaining edge
      s, j, t = edges[i].pop(k)
      send[i], to[i], store[j] = s, j, t
    out.append(Round(tuple(send), tuple(to), tuple(store)))
  return tuple(out)


def _perfect_matching(targets: list[list[int]], P: int) -> list[int]:
  """For each source i, an index into targets[i] so that every target is hit once
  (augmenting paths; one exists since every device has as many edges out as in)."""
  owner = [-1] * P  # target device -> source matched to it
  pick = [-1] * P

  def augment(i, seen):
    for k, j in enumerate(targets[i]):
      if j in seen:
        continue
      seen.add(j)
      if owner[j] < 0 or augment(owner[j], seen):
        owner[j], pick[i] = i, k
        return True
    return False

  for i in range(P):
    if not augment(i, set()):
      raise AssertionError(f"no perfect matching for {targets}")  # regular: cannot happen
  return pick


def _apply(x, axis: int, axis_name: str, c: int, steps):
  """Moves the c chunks of x along `axis` by `steps`, a list of (send, pairs, store)."""
  me = jax.lax.axis_index(axis_name)
  parts = jnp.stack(jnp.split(x, c, axis=axis))  # [c, ...]: the local chunks
  out = jnp.zeros_like(parts)
  for send, pairs, store in steps:
    piece = parts[jnp.asarray(send, jnp.int32)[me]]
    if any(i != j for i, j in pairs):
      piece = jax.lax.ppermute(piece, axis_name, pairs)
    out = out.at[jnp.asarray(store, jnp.int32)[me]].set(piece)
  return jnp.concatenate(list(out), axis=axis)


def _is_contiguous(order: ChunkOrder) -> bool:
  return all(chunks == tuple(range(i * order.c, (i + 1) * order.c))
             for i, chunks in enumerate(order.devices))


def to_order(x, axis: int, axis_name: str, order: ChunkOrder):
  """Inside shard_map: the local slice of x (contiguous layout) -> its chunks in `order`."""
  if _is_contiguous(order):
    return x
  steps = [(r.send, list(enumerate(r.to)), r.store) for r in rounds(order)]
  return _apply(x, axis, axis_name, order.c, steps)


def from_order(x, axis: int, axis_name: str, order: ChunkOrder):
  """The inverse of `to_order`: every chunk back to its contiguous place."""
  if _is_contiguous(order):
    return x
  steps = []
  for r in rounds(order):  # each round reversed: device to[i] sends slot store[to[i]] to i
    back = {j: i for i, j in enumerate(r.to)}
    steps.append((tuple(r.store[j] for j in range(order.P)),
                  [(j, back[j]) for j in range(order.P)], r.send))
  return _apply(x, axis, axis_name, order.c, steps)


def bytes_moved(order: ChunkOrder) -> np.ndarray:
  """int [P]: chunks each device sends away (to another device) on the way to `order`."""
  sent = np.zeros(order.P, np.int64)
  for r in rounds(order):
    for i, j in enumerate(r.to):
      sent[i] += i != j
  return sent
