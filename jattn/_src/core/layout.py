"""Axis layouts of the batched arrays, and the einsum subscripts built from them.

A layout is the order of the letters B, T, N, H in `query` (B may be absent).
`key` and `value` share it with S in place of T (and D in place of H for value);
the output shares the query's with D in place of H.
"""

from __future__ import annotations

import dataclasses

_LETTERS = frozenset("BTNH")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A validated query layout such as "BTNH", "BNTH", "BNHT" or "TNH"."""

  query: str

  @property
  def has_batch(self) -> bool:
    return "B" in self.query

  @property
  def key(self) -> str:
    return self.query.replace("T", "S").replace("N", "K")

  @property
  def value(self) -> str:
    return self.key.replace("H", "D")

  @property
  def out(self) -> str:
    return self.query.replace("H", "D")

  def axis(self, letter: str) -> int:
    """Position of a query-layout letter (S/K/D map to T/N/H)."""
    return self.query.index({"S": "T", "K": "N", "D": "H"}.get(letter, letter))

  def grouped(self, subscripts: str) -> str:
    """Splits the heads letter N into kv heads K and groups G, in place."""
    return subscripts.replace("N", "KG")

  def without_batch(self) -> "Layout":
    return Layout(self.query.replace("B", ""))


def parse_layout(layout: object, query_shape: tuple[int, ...]) -> Layout:
  """Checks `layout` against the query's rank; drops B when the query has none."""
  if not isinstance(layout, str):
    raise TypeError(f"layout must be a string such as 'BTNH', got {layout!r}")
  letters = set(layout)
  if (len(layout) != len(letters) or not letters <= _LETTERS
      or not {"T", "N", "H"} <= letters):
    raise ValueError(
        f"layout must order the letters B, T, N, H (B optional), each once, "
        f"e.g. 'BTNH', 'BNTH', 'BNHT' or 'TNH'; got {layout!r}")
  parsed = Layout(layout)
  if parsed.has_batch and len(query_shape) == 3:
    parsed = parsed.without_batch()
  if len(query_shape) != len(parsed.query):
    raise ValueError(
        f"query: expected rank {len(parsed.query)} for layout "
        f"{parsed.query!r}, got shape {tuple(query_shape)}")
  return parsed
