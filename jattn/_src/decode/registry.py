"""The implementations of `decode_attention`, and each platform's preference.

The same machinery as `dot_product_attention`'s (`jattn/_src/dispatch.py`): a
`DecodeCall` of static facts, a plan per implementation and platform (or the
reason it refuses), chosen when the program is lowered.

  "split": flash-decoding in pure JAX over the needed pages only (every platform);
  "xla":   every row's whole block table gathered, one dense tile (the reference);
  "paged_tpu": a Pallas TPU kernel DMA-ing the listed pages from the pool (`paged_tpu`),
           the default on TPU where it takes the call ("split" where it refuses).
  "paged_gpu": a Pallas Triton kernel reading the listed pages from the pool by page id
           (`paged_gpu`), selectable on CUDA by name.
"""

from __future__ import annotations

import dataclasses

from jattn._src.decode import paged_gpu as _paged_gpu
from jattn._src.decode import paged_tpu as _paged_tpu
from jattn._src.decode import split as _split
from jattn._src.impl.interpret import interpreting
from jattn._src.impl.registry import Implementation

# Keys gathered per step (W pages x page_size): 1024 keys are 4 MiB of float32 keys
# and values at K = 4, H = D = 128. Measured on the 2-core AMD EPYC of
# benchmarks/decode.py (B = 8, lengths 256..32k): 1024 to 2048 keys per step were
# fastest at pages of 16 to 128; 4096 was 3x slower (the pages no longer stay in cache).
KEYS_PER_STEP = 1024
# ... and logits of one step (W x page_size x N heads x T queries) at most 64k
# float32 entries (256 KiB), which bounds W for a chunk of many queries.
STEP_LOGITS = 1 << 16


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """The static facts of one `decode_attention` call (what a plan may depend on).

  mask: "none", "closed form" (a ready-made jattn.mods mask), "closed form unfit" (one
  whose arrays do not fit the cache's keys, so evaluated as a user's) or "mask_mod".
  return_max_logits: run also returns the max logits [B, T, N] (a plan that cannot
  refuses the call).
  mods_reason: why a kernel cannot evaluate the mods on a tile, or None;
  mods_uses_n: (mask_mod reads n, score_mod reads n); cache_dtype, value_cache_dtype:
  the key and value pages' (int8: quantized pages, dequantized by their scales).
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
  return_max_logits: bool = False
  mods_reason: str | None = None
  mods_uses_n: tuple[bool, bool] = (False, False)
  cache_dtype: str = ""
  value_cache_dtype: str = ""


def kernel_facts(mods, cache) -> dict:
  """The DecodeCall fields the kernels plan from, beyond the shapes: `interpret` (inside
  `pallas_interpret()`), what the tile evaluator makes of the mods, the pages' dtype."""
  reason, mask_n, score_n = _paged_tpu.mods_facts(mods)
  return dict(interpret=interpreting(), mods_reason=reason, mods_uses_n=(mask_n, score_n),
              cache_dtype=str(cache.key_pages.dtype),
              value_cache_dtype=str(cache.value_pages.dtype))


def default_pages_per_step(N: int, T: int, page_size: int) -> int:
  """W: pages per step, KEYS_PER_STEP keys, fewer if the logits pass STEP_LOGITS."""
  return max(1, min(KEYS_PER_STEP // page_size, STEP_LOGITS // (N * T * page_size)))


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
                "closed form unfit": "found by evaluating mask_mod on the pages in range "
                                     "(no closed form: the mask's arrays do not span the "
                                     "cache's max_pages x page_size keys)",
                "mask_mod": "found by evaluating mask_mod on the pages in range"}


def _split_plan(call: DecodeCall, platform: str):
  W = call.pages_per_step or default_pages_per_step(call.N, call.T, call.page_size)
  return SplitPlan(W, _EMPTY_PAGES[call.mask])


def _gather_all_plan(call: DecodeCall, platform: str):
  return GatherAllPlan(call.max_pages * call.page_size)


def _run_split(plan, query, cache, mods, options):
  return _split.differentiable(_split.split, query, cache, mods,
                               pages_per_step=plan.pages_per_step, **options)


def _run_dense(plan, query, cache, mods, options):
  return _split.dense(query, cache, mods, **options)


def _run_paged_tpu(plan, query, cache, mods, options):
  # gradients as the split path's: the dense recomputation's (the kernel has no backward)
  forward = lambda query, cache, mods, **options: _paged_tpu.run(plan, query, cache, mods,
                                                                 options)
  return _split.differentiable(forward, query, cache, mods, **options)


def _run_paged_gpu(plan, query, cache, mods, options):
  # gradients as the split path's: the dense recomputation's (the kernel has no backward)
  forward = lambda query, cache, mods, **options: _paged_gpu.run(plan, query, cache, mods,
                                                                 options)
  return _split.differentiable(forward, query, cache, mods, **options)


DECODE_IMPLEMENTATIONS = {
    "split": Implementation("split", _split_plan, _run_split),
    # (only the dense path batches under a vmap over an Explicit-sharded axis: jax's
    # batching of the split path's nested loops and of Pallas calls refuses that axis)
    "xla": Implementation("xla", _gather_all_plan, _run_dense, vmaps_over_explicit_axes=True),
    "paged_tpu": Implementation("paged_tpu", _paged_tpu.plan, _run_paged_tpu,
                                platforms=("tpu",), interpretable=True),
    "paged_gpu": Implementation("paged_gpu", _paged_gpu.plan, _run_paged_gpu,
                                platforms=("cuda",), interpretable=True),
}


def decode_preference(call: DecodeCall, platform: str) -> tuple[str, ...]:
  """Best first. On TPU the "paged_tpu" kernel where it takes the call (else "split"):
  the TPU compiler's schedule puts its step at 1.0x the HBM roofline on v5e and v6e
  (DMA-bound: about 90 bundles a page of 64 against 140 to 240 cycles of HBM time),
  3.7 to 4.2x faster than "split"'s bytes alone (benchmarks/decode_tpu.py,
  benchmarks/results/tpu_decode_estimates.json, docs/sampling.md; estimates, no TPU
  ran). On CUDA "paged_gpu" only when named: no card has timed it. Elsewhere the split
  path."""
  if platform == "tpu":
    return ("paged_tpu", "split", "xla")
  if platform == "cuda":  # NOT MEASURED on a GPU: "paged_gpu" only when named
    return ("split", "paged_gpu", "xla")
  return ("split", "xla")
