"""The "paged_tpu" implementation of `decode_attention`: its plan, and the call of
its Pallas TPU kernel (`paged_tpu_kernel`) with the split merge around it.

The work list is the split path's (`split.needed_pages`: pages past a row's
length, outside its causal range or window, or EMPTY under mask_mod are never
listed), compacted per row: row b's needed table slots first, in order, and
their pool pages. The kernel runs one program per (row, split); each split
takes a contiguous share of its row's list, reads only those pages from the
pool (never a gathered copy) and returns its partial softmax; the splits of a
row are merged here by log-sum-exp, and `tile.finish` divides and adds sinks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.decode import split as _split
from jattn._src.decode import tile as _tile
from jattn._src.kernels import kernel_inputs, tile_mods

LANES = 128
# Steps of pages in flight per program (DMA'd while the one before is computed).
DEPTH = 2
# Keys per loop step (step_pages = KEYS_PER_STEP // page_size pages): one matmul of
# [G T, 512] logits per kv head and the softmax bookkeeping once per 512 keys. At pages
# of 64 (bfloat16, K = 4, H = D = 128) the TPU compiler's schedule gives an unmasked
# step of 1 page 217 bundles (v5e; 268 v6e), of 8 pages 748 (707): 93 (88) a page,
# under the 240 (140) cycles its DMA takes (benchmarks/decode_tpu.py).
KEYS_PER_STEP = 512
# Rows x kv heads from which one split per row keeps a TPU busy: under it a row's
# pages are split in two, enough for the two TensorCores of a megacore chip
# (v4, v5p); a one-core chip (v5e, v6e) runs the grid in sequence either way.
# NOT MEASURED on a TPU.
SPLIT_BELOW = 4
# The VMEM the buffers and accumulators may take (v5e's default scoped VMEM is 16 MiB).
VMEM_BUDGET = 12 * 2**20
# SMEM entries for the work list (two int32 arrays of B * max_pages).
SMEM_ENTRIES = 1 << 15
_DTYPES = ("float32", "bfloat16")
# TPU tile rows of a page [page_size, 128 lanes] per dtype (sublanes x packing)
_TILE_ROWS = {"float32": 8, "bfloat16": 16, "int8": 32}


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
  splits: int
  depth: int
  step_pages: int
  num_pages: int
  mask_uses_n: bool
  score_uses_n: bool
  empty_pages: str
  interpret: bool
  key_int8: bool = False
  value_int8: bool = False

  def __str__(self):
    int8 = int8_pools(self.key_int8, self.value_int8)
    return (f"Pallas TPU kernel over the pool: {self.step_pages} page(s) a step, "
            + (f"int8 {int8} dequantized in the kernel (scales per page and kv head from "
               f"SMEM), " if int8 else "") +
            f"{self.depth} steps in flight by DMA, "
            f"{self.splits} split(s) per row merged by log-sum-exp, the G = {self.G} query "
            f"heads of a kv head in one tile; only the pages each row needs, EMPTY pages "
            f"{self.empty_pages}" + (" (interpreted)" if self.interpret else ""))


def mods_facts(mods) -> tuple:
  """(reason the kernel cannot evaluate these mods, or None; mask uses n; score uses n)."""
  if mods is None:
    return None, False, False
  mods = mods.traced()
  for kind, jaxpr, consts in (("mask_mod", mods.mask_jaxpr, mods.mask_consts),
                              ("score_mod", mods.score_jaxpr, mods.score_consts)):
    if jaxpr is None:
      continue
    got = tile_mods.check(jaxpr, tile_mods.consts_meta(consts), kind == "score_mod")
    if isinstance(got, str):
      return f"{kind}: {got}", False, False
    if got[1]:
      return (f"{kind} reads a per-token array by position (e.g. jattn.mods.document); "
              "the paged kernel does not take those yet"), False, False
    if got[2]:
      return (f"{kind} reads a table at a tile of indices (e.g. jattn.mods.relative_bias); "
              "the paged kernel does not take those yet"), False, False
    reason = tile_mods.check_consts(consts)
    if reason is not None:
      return f"{kind}: {reason}", False, False
  return (None, mods.mask_jaxpr is not None and mods.mask_uses(1),
          mods.score_jaxpr is not None and mods.score_uses(2))


def plan(call, platform: str):
  """A `Plan`, or the reason in words why the kernel cannot take the call."""
  missing = compat.missing("pallas_tpu")
  if missing is not None:
    return missing
  if call.mods_reason is not None:
    return call.mods_reason
  if call.return_max_logits:
    return "return_max_logits: the kernel does not write the max logits ('split' does)"
  # int8 pages compute in the query's dtype (call.dtype), dequantized in the kernel
  cache_dtype = call.cache_dtype or call.dtype
  value_dtype = call.value_cache_dtype or cache_dtype
  for got in (cache_dtype, value_dtype, call.dtype):
    if got not in _DTYPES + ("int8",) or (got == "int8" and got == call.dtype):
      return f"it takes float32, bfloat16 or int8 pages (float32 or bfloat16 queries), got {got}"
  if not call.interpret:
    if call.H % LANES or call.D % LANES:
      return (f"head dims H = {call.H}, D = {call.D}: the kernel's tiles [page_size, H] "
              f"span whole rows of the TPU's {LANES} lanes only when both are multiples "
              f"of 128")
    rows = max(_TILE_ROWS[cache_dtype], _TILE_ROWS[value_dtype])
    if call.page_size % rows:
      return (f"page_size {call.page_size}: a {cache_dtype}/{value_dtype} page is a whole "
              f"number of TPU tiles of {rows} rows only when page_size is a multiple of "
              f"{rows}")
  key_size = np.dtype(jnp.dtype(cache_dtype)).itemsize
  value_size = np.dtype(jnp.dtype(value_dtype)).itemsize
  itemsize = np.dtype(jnp.dtype(call.dtype)).itemsize
  G = call.N // call.K
  U = min(call.pages_per_step or max(1, KEYS_PER_STEP // call.page_size), call.max_pages)
  while True:
    # a step's buffer [K, U S, H] in VMEM: K U tiles of [S, H] (S a whole number of tiles)
    vmem = (DEPTH * U * call.K * call.page_size * (call.H * key_size + call.D * value_size)
            + 2 * call.K * G * call.T * (call.H * itemsize + call.D * 4 + 2 * LANES * 4
                                         + U * call.page_size * 4))
    if vmem <= VMEM_BUDGET or U == 1:
      break
    U = max(1, U // 2)
  if vmem > VMEM_BUDGET:
    return (f"{vmem / 2**20:.1f} MiB of VMEM for {DEPTH} pages in flight and the "
            f"accumulators, over the kernel's {VMEM_BUDGET // 2**20} MiB")
  int8 = (cache_dtype == "int8", value_dtype == "int8")
  # the work list, and each listed page's K scales per int8 pool, in SMEM
  entries = call.B * call.max_pages * (2 + call.K * sum(int8))
  if entries > 2 * SMEM_ENTRIES:
    return (f"a work list of B x max_pages = {call.B * call.max_pages} pages"
            + (f" and their int8 scales" if any(int8) else "")
            + f": {entries} entries, over the {2 * SMEM_ENTRIES} the kernel keeps in SMEM")
  splits = 1 if call.B * call.K >= SPLIT_BELOW else 2
  return Plan(call.B, call.T, call.K, G, call.H, call.D, call.page_size, call.max_pages,
              call.is_causal, call.window, splits, DEPTH, U, call.num_pages,
              call.mods_uses_n[0],
              call.mods_uses_n[1], _EMPTY_PAGES[call.mask], call.interpret, *int8)


def int8_pools(key_int8: bool, value_int8: bool) -> str:
  """"keys", "values", "keys and values" or "": which pools of a plan are int8."""
  return " and ".join(n for n, q in (("keys", key_int8), ("values", value_int8)) if q)


_EMPTY_PAGES = {"none": "(no mask_mod)", "closed form": "in closed form (jattn.mods)",
                "closed form unfit": "found by evaluating mask_mod on the pages in range "
                                     "(no closed form: the mask's arrays do not span the "
                                     "cache's max_pages x page_size keys)",
                "mask_mod": "found by evaluating mask_mod on the pages in range"}


def work_list(cache, needed):
  """needed bool [B, M] -> (pages, slots int32 [B * M]: each row's needed pool pages and
  table slots first, in order; counts int32 [B])."""
  B, M = needed.shape
  order = jnp.argsort(~needed, axis=1, stable=True).astype(jnp.int32)  # needed first
  pages = jnp.take_along_axis(cache.block_table, order, axis=1)
  listed = needed.sum(1, keepdims=True, dtype=jnp.int32)
  pages = jnp.where(jnp.arange(M, dtype=jnp.int32)[None, :] < listed, pages, 0)
  return (jnp.clip(pages, 0, cache.num_pages - 1).reshape(-1), order.reshape(-1),
          needed.sum(1, dtype=jnp.int32))


def _interpret_mode(interpret: bool):
  if not interpret:
    return False
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams() if hasattr(pltpu, "InterpretParams") else True


def run(p: Plan, query, cache, mods, options):
  """out [B, T, N, D] in options["dtype"]; see the module docstring."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jattn._src.decode import paged_tpu_kernel

  B, T, N, H = query.shape
  K, G, D, S, M, P = p.K, p.G, p.D, p.page_size, p.max_pages, cache.num_pages
  GT = G * T
  q_lengths = options["q_lengths"]
  mods = None if mods is None else mods.traced()
  _, q_pos, q_valid, q_first = _split._queries(query, cache, q_lengths)
  W = max(1, 1024 // S)
  needed = _split.needed_pages(mods, cache, q_first=q_first, q_pos=q_pos, q_valid=q_valid,
                               q_lengths=q_lengths, causal=p.causal, window=p.window, T=T,
                               N=N, W=W)
  pages, slots, counts = work_list(cache, needed)
  dtype = query.dtype  # the pages' (float pages are the query's dtype; int8 ones: any)
  # [B, T, K, G, H] -> [B, K, G T, H]: a kv head's G heads and T queries, one tile
  q = jnp.einsum("BTKGH->BKGTH", query.reshape(B, T, K, G, H)).reshape(B, K, GT, H)
  q = q.astype(dtype)
  C = p.step_pages * S  # the keys of one step
  rows = jnp.arange(GT, dtype=jnp.int32)[:, None]
  rows_t = jnp.broadcast_to(rows % T, (GT, C))
  rows_g = jnp.broadcast_to(rows // T, (GT, C))
  mask_jaxpr = None if mods is None else mods.mask_jaxpr
  score_jaxpr = None if mods is None else mods.score_jaxpr
  mask_consts = () if mask_jaxpr is None else tuple(mods.mask_consts)
  score_consts = () if score_jaxpr is None else tuple(mods.score_consts)
  tm = (mask_jaxpr, tile_mods.consts_meta(mask_consts), score_jaxpr,
        tile_mods.consts_meta(score_consts))
  smem = [kernel_inputs.flat(c) for c in mask_consts + score_consts]
  scalars = [pages, slots, counts, cache.lengths.astype(jnp.int32), q_first.astype(jnp.int32),
             q_lengths.astype(jnp.int32), jnp.asarray(options["scale"], jnp.float32).reshape(1)]
  # int8 pools: each listed page's K scales [B * M * K], in list order (never the pool's)
  scalars += [scales[pages].reshape(-1) for scales in (cache.key_scales, cache.value_scales)
              if scales is not None]
  scalars += smem
  whole = lambda shape: pl.BlockSpec(shape, lambda b, s, *_: (0,) * len(shape))
  stat = jax.ShapeDtypeStruct((B, p.splits, K, GT, LANES), jnp.float32)
  stat_spec = pl.BlockSpec((None, None, K, GT, LANES), lambda b, s, *_: (b, s, 0, 0, 0))
  m, l, o = pl.pallas_call(
      functools.partial(paged_tpu_kernel.kernel, p=p, tm=tm),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars),
          grid=(B, p.splits),
          in_specs=[pl.BlockSpec((None, K, GT, H), lambda b, s, *_: (b, 0, 0, 0)),
                    whole((GT, C)), whole((GT, C)),
                    pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=[stat_spec, stat_spec,
                     pl.BlockSpec((None, None, K, GT, D), lambda b, s, *_: (b, s, 0, 0, 0))],
          scratch_shapes=[pltpu.VMEM((p.depth, p.step_pages, K, S, H), cache.key_pages.dtype),
                          pltpu.VMEM((p.depth, p.step_pages, K, S, D), cache.value_pages.dtype),
                          pltpu.SemaphoreType.DMA((2, p.depth)),
                          pltpu.VMEM((K, GT, LANES), jnp.float32),
                          pltpu.VMEM((K, GT, LANES), jnp.float32),
                          pltpu.VMEM((K, GT, D), jnp.float32)]),
      out_shape=[stat, stat, jax.ShapeDtypeStruct((B, p.splits, K, GT, D), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=_interpret_mode(p.interpret),
      name="jattn_paged_decode_tpu",
  )(*scalars, q, rows_t, rows_g, cache.key_pages, cache.value_pages)
  # merge the splits [B, splits, K, GT] by log-sum-exp
  m, l = m[..., 0], l[..., 0]
  m_all = m.max(axis=1)
  f = jnp.exp(m - m_all[:, None])
  l = (l * f).sum(axis=1)
  o = (o * f[..., None]).sum(axis=1)
  carry = (m_all.reshape(B, K, G, T), l.reshape(B, K, G, T), o.reshape(B, K, G, T, D))
  return _tile.finish(carry, None if mods is None else mods.sinks, options["dtype"])
