"""The implementations of `decode_attention`, and each platform's preference.

The same machinery as `dot_product_attention`'s (`jattn/_src/dispatch.py`): a
`DecodeCall` of static facts, a plan per implementation and platform (or the
reason it refuses), chosen when the program is lowered.

  "split": flash-decoding in pure JAX over the needed pages only (every platform);
  "xla":   every row's whole block table gathered, one dense tile (the reference).
"""

from __future__ import annotations

import dataclasses

from jattn._src.decode import split as _split
from jattn._src.impl.registry import Implementation

# Logits of one step (W pages x N heads x T queries x page_size keys) at most:
# 64k float32 entries, 256 KiB, stay in a CPU core's L2 cache beside the pages.
STEP_LOGITS = 1 << 16
# ... and at most this many pages per step: past it the last step's padding (up
# to W - 1 pages of masked work) costs more than the loop's per-step overhead saves.
MAX_PAGES_PER_STEP = 64


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """The static facts of one `decode_attention` call (what a plan may depend on).

  mask: "none", "closed form" (a ready-made jattn.mods mask) or "mask_mod" (a user's).
  """

  B: int
  T: int
  N: int
  K: int
  H: int
  D: int
  page_size: int
  max_pages: int
  num_pages: int
  dtype: str
  is_causal: bool
  window: tuple[int, int] | None
  mask: str
  has_score: bool
  has_sinks: bool
  pages_per_step: int | None
  interpret: bool = False


def default_pages_per_step(N: int, T: int, page_size: int) -> int:
  """W: pages per step, so that a step's logits stay within STEP_LOGITS."""
  return max(1, min(MAX_PAGES_PER_STEP, STEP_LOGITS // (N * T * page_size)))


@dataclasses.dataclass(frozen=True)
class SplitPlan:
  pages_per_step: int
  empty_pages: str

  def __str__(self):
    return (f"split over keys, {self.pages_per_step} pages per step, only the pages each "
            f"row needs; EMPTY pages {self.empty_pages}")


@dataclasses.dataclass(frozen=True)
class GatherAllPlan:
  keys_per_row: int

  def __str__(self):
    return f"every row's whole block table, {self.keys_per_row} keys per row, in one tile"


_EMPTY_PAGES = {"none": "(no mask_mod)", "closed form": "in closed form (jattn.mods)",
                "mask_mod": "found by evaluating mask_mod on the pages in range"}


def _split_plan(call: DecodeCall, platform: str):
  W = call.pages_per_step or default_pages_per_step(call.N, call.T, call.page_size)
  return SplitPlan(W, _EMPTY_PAGES[call.mask])


def _gather_all_plan(call: DecodeCall, platform: str):
  return GatherAllPlan(call.max_pages * call.page_size)


def _run_split(plan, query, cache, mods, options):
  return _split.split(query, cache, mods, pages_per_step=plan.pages_per_step, **options)


def _run_dense(plan, query, cache, mods, options):
  return _split.dense(query, cache, mods, **options)


DECODE_IMPLEMENTATIONS = {
    "split": Implementation("split", _split_plan, _run_split),
    "xla": Implementation("xla", _gather_all_plan, _run_dense),
}


def decode_preference(call: DecodeCall, platform: str) -> tuple[str, ...]:
  """Best first: the split path everywhere until a kernel of its own lands."""
  return ("split", "xla")
