"""The "paged_gpu" implementation of `decode_attention`: its plan, and the call of its
Pallas Triton kernel (`paged_gpu_kernel`) with the split merge around it.

The work list is the TPU kernel's (`paged_tpu.work_list` over
`split.needed_pages`: pages past a row's length, outside its causal range or
window, or EMPTY under mask_mod are never listed), compacted per row. The
kernel runs one program per (row, kv head, split): split s of row b takes the
row's list entries [s C, (s + 1) C), C = `per_split` pages, so a long row is
spread over many programs and a short one takes one (the rest of its splits
are empty programs that read and write nothing); each program reads its pages
straight from the pool by page id (no gathered copy), the G query heads of its
kv head together, and returns its partial softmax. The splits are merged here
by log-sum-exp, and `tile.finish` divides and adds sinks.

Why Pallas Triton and not Mosaic GPU (TMA): a decode step is bound by HBM
reads, and a page of one kv head is one small contiguous block ([S, H] in the
[P, K, S, H] pool), which a TMA copy by page index could fetch as one box;
Triton's gather load takes a step's pages by their ids as 16-byte loads and its
software pipeliner (num_stages) overlaps the next step's loads with this
step's math (cp.async), which is what TMA would buy here. Triton also runs on
Ampere as on Hopper, in interpret mode on jax 0.10 (the GPU interpreter of
Mosaic GPU needs jax >= 0.11), and shares `tile_mods` and its conventions
with "flex_gpu". Mosaic GPU's wgmma wants 64 query rows per warpgroup, where a
decode tile has G T (4 at N = 16, K = 4, T = 1). NOT MEASURED on a GPU: none
was lent to this session; "split" stays the CUDA default until a card's
timing says otherwise (docs/sampling.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.core.softmax import LARGE_NEGATIVE as _LARGE_NEGATIVE
from jattn._src.decode import paged_tpu as _paged_tpu
from jattn._src.decode import split as _split
from jattn._src.decode import tile as _tile
from jattn._src.kernels import kernel_inputs, tile_mods

# Keys a step reads (W pages of S): 64 keys x H = 128 of bfloat16 are 16 KiB of keys and
# 16 KiB of values a stage. NOT MEASURED on a GPU.
KEYS_PER_STEP = 64
# Keys a split reads at most: a 32k row in 32 splits x K = 4 kv heads = 128 programs,
# about one per H100 SM (132). NOT MEASURED on a GPU.
KEYS_PER_SPLIT = 1024
_MIN_TILE = 16  # Triton's dot takes operands of at least 16 x 16
NUM_WARPS = 4
NUM_STAGES = 2
# Shared memory the pipelined key and value tiles may take (stages x W S x (H + D)): an
# H100's 227 KiB less room for the rest.
SMEM_BUDGET = 160 * 2**10
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the kernel is built from (hashable)."""

  B: int
  T: int
  K: int
  G: int
  H: int
  D: int
  page_size: int
  max_pages: int
  causal: bool
  window: tuple | None
  pages_per_step: int  # W
  per_split: int  # C: list entries (pages) a split takes, a multiple of W
  rows: int  # R: the query tile's rows, G T padded to a power of two >= 16
  mask_uses_n: bool
  score_uses_n: bool
  empty_pages: str
  interpret: bool
  num_warps: int = NUM_WARPS
  num_stages: int = NUM_STAGES

  num_pages: int = 0  # the pool's P
  key_int8: bool = False  # int8 pools: dequantized in the kernel by their [P, K] scales
  value_int8: bool = False

  @property
  def splits(self) -> int:
    """The most chunks one row can take."""
    return -(-self.max_pages // self.per_split)

  @property
  def chunks(self) -> int:
    """The grid's chunks: every row's listed pages in chunks of C, at most
    sum_b ceil(count_b / C) <= (pages listed + B (C - 1)) / C, and the pages listed
    are at most min(P, B M) (no pool page in two rows)."""
    listed = min(self.num_pages, self.B * self.max_pages)
    return max(1, min(self.B * self.splits,
                      (listed + self.B * (self.per_split - 1)) // self.per_split))

  def __str__(self):
    int8 = _paged_tpu.int8_pools(self.key_int8, self.value_int8)
    return (f"Pallas Triton kernel over the pool: {self.pages_per_step} page(s) of "
            f"{self.page_size} keys a step gathered by page id, up to {self.per_split} "
            f"pages a program ({self.chunks} chunks of rows' pages on the grid, up to "
            f"{self.splits} a row), merged by log-sum-exp, the "
            f"G = {self.G} query heads of a kv head in one tile; only the pages each row "
            f"needs, EMPTY pages {self.empty_pages}"
            + (f"; int8 {int8} dequantized in the kernel (each key's page scale gathered "
               f"by page id)" if int8 else "")
            + (" (interpreted)" if self.interpret else ""))


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def plan(call, platform: str):
  """A `Plan`, or the reason in words why the kernel cannot take the call."""
  missing = compat.missing("pallas_triton")
  if missing is not None:
    return missing
  if call.mods_reason is not None:
    return call.mods_reason
  # int8 pages compute in the query's dtype (call.dtype), dequantized in the kernel
  cache_dtype = call.cache_dtype or call.dtype
  value_dtype = call.value_cache_dtype or cache_dtype
  for got in (cache_dtype, value_dtype):
    if got not in _DTYPES + ("int8",):
      return f"it takes float32, bfloat16, float16 or int8 pages, got {got}"
  if call.dtype not in _DTYPES:
    return f"it takes float32, bfloat16 or float16 queries, got {call.dtype}"
  S = call.page_size
  if not call.interpret:
    if not (_pow2(call.H) and _pow2(call.D) and min(call.H, call.D) >= _MIN_TILE):
      return (f"head dims H = {call.H}, D = {call.D}: Triton's tiles have power-of-two "
              f"sides of at least {_MIN_TILE}")
    if not _pow2(S):
      return f"page_size {S}: a step's keys are a Triton tile, so a power of two"
    if max(call.H, call.D) > 256:
      return f"head dims H = {call.H}, D = {call.D}: the kernel takes up to 256"
  W = max(1, KEYS_PER_STEP // S)
  if not call.interpret and W * S < _MIN_TILE:
    return f"page_size {S}: under {_MIN_TILE} keys a step"
  if call.pages_per_step is not None:  # the caller's W, a power of two for Triton
    W = call.pages_per_step
    if not call.interpret and (not _pow2(W) or W * S < _MIN_TILE):
      return (f"pages_per_step {W}: the kernel's step of W x page_size keys is a Triton "
              f"tile, so W a power of two with W x {S} >= {_MIN_TILE}")
  size = lambda dtype: np.dtype(jnp.dtype(dtype)).itemsize
  smem = NUM_STAGES * W * S * (call.H * size(cache_dtype) + call.D * size(value_dtype))
  if not call.interpret and smem > SMEM_BUDGET:
    return (f"{smem // 1024} KiB of shared memory for {NUM_STAGES} stages of {W * S} keys "
            f"and values (H = {call.H}, D = {call.D}, {cache_dtype} / {value_dtype}), "
            f"over the kernel's "
            f"{SMEM_BUDGET // 1024} KiB: a smaller page_size or pages_per_step")
  C = max(W, KEYS_PER_SPLIT // S // W * W)
  G = call.N // call.K
  rows = max(_MIN_TILE, 1 << max(0, (G * call.T - 1).bit_length()))
  return Plan(call.B, call.T, call.K, G, call.H, call.D, S, call.max_pages, call.is_causal,
              call.window, W, C, rows, call.mods_uses_n[0], call.mods_uses_n[1],
              _paged_tpu._EMPTY_PAGES[call.mask], call.interpret, num_pages=call.num_pages,
              key_int8=cache_dtype == "int8", value_int8=value_dtype == "int8")


def chunks(counts, per_split: int, capacity: int):
  """counts int32 [B] (each row's listed pages) -> (row, lo, n int32 [capacity]: chunk c
  takes entries lo .. lo + n - 1 of its row's list, n <= per_split, rows in order, 0
  entries past the last chunk; overflow bool [B]: rows with a chunk past `capacity`,
  which only a block table holding one page twice can make)."""
  B = counts.shape[0]
  per_row = (counts + per_split - 1) // per_split  # [B]
  ends = jnp.cumsum(per_row, dtype=jnp.int32)  # [B]: each row's chunks end here
  c = jnp.arange(capacity, dtype=jnp.int32)
  row = jnp.minimum(jnp.searchsorted(ends, c, side="right"), B - 1).astype(jnp.int32)
  lo = (c - (ends[row] - per_row[row])) * per_split
  n = jnp.where(c < ends[-1], jnp.clip(counts[row] - lo, 0, per_split), 0)
  return row, lo, n.astype(jnp.int32), ends > capacity


def run(p: Plan, query, cache, mods, options):
  """out [B, T, N, D] in options["dtype"] (and with options["return_max_logits"] the max
  logits float32 [B, T, N], the chunks' running maxima merged); see the module docstring."""
  mods = None if mods is None else mods.traced()
  inputs, tm, chunk_table = prepare(p, query, cache, mods, options)
  return merge(p, *call_kernel(p, tm, inputs), *chunk_table, mods, options)


def prepare(p: Plan, query, cache, mods, options):
  """What the kernel reads, made by XLA before it -> (inputs, tm, (row, n int32 [chunks],
  overflow bool [B])); mods traced (`Mods.traced`) or None."""
  B, T, N, H = query.shape
  K, G, R = p.K, p.G, p.rows
  GT = G * T
  q_lengths = options["q_lengths"]
  _, q_pos, q_valid, q_first = _split._queries(query, cache, q_lengths)
  needed = _split.needed_pages(mods, cache, q_first=q_first, q_pos=q_pos, q_valid=q_valid,
                               q_lengths=q_lengths, causal=p.causal, window=p.window, T=T,
                               N=N, W=max(1, 1024 // p.page_size))
  pages, slots, counts = _paged_tpu.work_list(cache, needed)
  row, lo, n, overflow = chunks(counts, p.per_split, p.chunks)
  # [B, T, K, G, H] -> [B, K, G T, H]: a kv head's G heads and T queries, one tile, padded
  q = jnp.einsum("BTKGH->BKGTH", query.reshape(B, T, K, G, H)).reshape(B, K, GT, H)
  # the math's dtype: float pages' (the query's too), the query's over int8 pages
  q = jnp.pad(q.astype(query.dtype), ((0, 0), (0, 0), (0, R - GT), (0, 0)))
  mask_jaxpr = None if mods is None else mods.mask_jaxpr
  score_jaxpr = None if mods is None else mods.score_jaxpr
  mask_consts = () if mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if score_jaxpr is None else tuple(mods.score_consts)
  tm = (mask_jaxpr, tile_mods.consts_meta(mask_consts), score_jaxpr,
        tile_mods.consts_meta(score_consts))
  inputs = [q, row, lo, n, pages, slots, cache.lengths.astype(jnp.int32),
            q_first.astype(jnp.int32), q_lengths.astype(jnp.int32),
            jnp.asarray(options["scale"], jnp.float32).reshape(1), cache.key_pages,
            cache.value_pages]
  # int8 pools: their scales [P, K] whole, gathered in the kernel by the same page ids
  inputs += [x for x, q in ((cache.key_scales, p.key_int8), (cache.value_scales, p.value_int8))
             if q]
  inputs += [kernel_inputs.flat(x) for x in mask_consts + score_consts]
  return inputs, tm, (row, n, overflow)


def call_kernel(p: Plan, tm, inputs):
  """The Pallas Triton kernel on `prepare`'s inputs -> (m, l float32 [chunks, K, R],
  o float32 [chunks, K, R, D]): each chunk's partial softmax (unwritten where n = 0)."""
  from jax.experimental import pallas as pl
  from jattn._src.decode import paged_gpu_kernel
  plgpu = compat.load("pallas_triton")
  K, R, D, capacity = p.K, p.rows, p.D, p.chunks
  whole = lambda x: pl.BlockSpec(x.shape, lambda c, k: (0,) * x.ndim)
  stat = pl.BlockSpec((None, None, R), lambda c, k: (c, k, 0))
  return pl.pallas_call(
      functools.partial(paged_gpu_kernel.kernel, p=p, tm=tm),
      grid=(capacity, K),
      in_specs=[whole(x) for x in inputs],  # q too: chunk c's row is known in the kernel
      out_specs=[stat, stat, pl.BlockSpec((None, None, R, D), lambda c, k: (c, k, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((capacity, K, R), jnp.float32)] * 2
      + [jax.ShapeDtypeStruct((capacity, K, R, D), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      interpret=p.interpret,
      name="jattn_paged_decode_gpu",
  )(*inputs)


def merge(p: Plan, m, l, o, row, n, overflow, mods, options):
  """The chunks of each row merged by log-sum-exp, then `tile.finish` (sinks) -> `run`'s
  result. A chunk that read no page wrote nothing (its outputs are whatever the buffer
  held): left out. The sums are a one-hot contraction (no scatter, no atomics: the same
  bits every run)."""
  B, K, G, T, D = overflow.shape[0], p.K, p.G, p.T, p.D
  GT = G * T
  wrote = (n > 0)[:, None, None]  # [C, 1, 1]
  m = jnp.where(wrote, m[..., :GT], -jnp.inf)
  m_all = jnp.maximum(jax.ops.segment_max(m, row, num_segments=B), _LARGE_NEGATIVE)
  f = jnp.where(wrote, jnp.exp(m - m_all[row]), 0.0)  # [C, K, GT]
  l = jnp.where(wrote, l[..., :GT], 0.0) * f
  o = jnp.where(wrote[..., None], o[..., :GT, :], 0.0) * f[..., None]
  onehot = (row[None, :] == jnp.arange(B, dtype=jnp.int32)[:, None]).astype(jnp.float32)
  exact = jax.lax.Precision.HIGHEST
  l = jnp.einsum("BC,CKR->BKR", onehot, l, precision=exact)
  o = jnp.einsum("BC,CKRD->BKRD", onehot, o, precision=exact)
  carry = (m_all.reshape(B, K, G, T), l.reshape(B, K, G, T), o.reshape(B, K, G, T, D))
  got = _split._outputs(carry, mods, options["dtype"], options.get("return_max_logits", False))
  # a row with more chunks than the grid holds (a page listed twice): NaN, never a
  # value missing some of its keys
  nan = lambda x: jnp.where(overflow.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x)
  return tuple(map(nan, got)) if isinstance(got, tuple) else nan(got)
