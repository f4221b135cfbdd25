"""A paged, ragged KV cache as a pure pytree: a pool of pages, a block table, lengths.

Row b's token at position p lives in page block_table[b, p // page_size], slot
p % page_size. Pages come from one fixed pool shared by the batch, so the
memory is the pool's (sized to the sum of the lengths), not B x max_length,
and every shape is static: allocate, append and free are jit-friendly array
updates with no Python loop over rows.

    key_pages    [P, K, page_size, H]   the pool (P pages), keys: each kv head's
                                        tokens contiguous within a page
    value_pages  [P, K, page_size, D]   values (their own dtype), likewise
    block_table  int32 [B, max_pages]   row b's pages in order; NO_PAGE after them
    lengths      int32 [B]              tokens cached per row
    page_free    bool [P]               the free list: True = not in any row
    error        int32 []               sticky: 0, or the bits of ERRORS (under jit)
    key_scales   float32 [P, K] or None int8 key pages only: page p, head k holds
                                        key_pages[p, k] * key_scales[p, k]
    value_scales float32 [P, K] or None likewise for int8 value pages

int8 pages (init_cache with dtype or value_dtype jnp.int8) are quantized
symmetrically per (page, kv head): scale = amax / 127 over the page's tokens.
A page fills over several appends, so `append` gathers only the pages it
touches (ceil((T - 1) / page_size) + 1 a row), dequantizes their tokens,
adds the new ones and requantizes the page to the scale of the new amax
(never smaller than the old one): earlier tokens of a page keep their value
within one quantization step of the new scale. Slots past a row's length do
not count, so a freed page starts from a fresh scale when reused.

A bad request (a full pool, lengths past the table) raises a ValueError when
the arrays are concrete. Under jit nothing can raise, so the request is
refused whole (the cache stays as it was) and its bit is set in `error`;
`check` raises it later with the same message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jattn._src.core.explicit_axes import explicit_axes, explicit_sharding, unsharded, zeros
from jattn._src.parallel.mesh import axes_at, devices_along

# A block-table entry with no page: negative, so it can never name a pool page.
NO_PAGE = -1
POOL_FULL, PAST_TABLE = 1, 2
ERRORS = {
    POOL_FULL: "the page pool is full: a request needed more pages than are free "
               "(free finished rows with free(), or init_cache with more num_pages)",
    PAST_TABLE: "lengths past the block table: a row would hold more than max_pages "
                "pages (init_cache with a larger max_length)",
}


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """The paged KV cache (a pytree; see the module docstring for the fields).

  Made by `jattn.paged.init_cache`, filled by `append`, emptied by `free`.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> cache = jattn.paged.init_cache(2, 64, num_kv_heads=1, head_dim=8, page_size=16,
    ...                                num_pages=5)
    >>> k = jnp.ones((2, 20, 1, 8))                                 # [B, T, K, H]
    >>> cache = jattn.paged.append(cache, k, k, jnp.array([20, 3]))
    >>> cache.lengths.tolist(), cache.block_table.tolist()
    ([20, 3], [[0, 1, -1, -1], [2, -1, -1, -1]])
  """

  key_pages: jax.Array
  value_pages: jax.Array
  block_table: jax.Array
  lengths: jax.Array
  page_free: jax.Array
  error: jax.Array
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.key_pages.shape[2]

  @property
  def num_pages(self) -> int:
    return self.key_pages.shape[0]

  @property
  def batch_size(self) -> int:
    return self.block_table.shape[0]

  @property
  def max_pages(self) -> int:
    return self.block_table.shape[1]

  @property
  def max_length(self) -> int:
    return self.max_pages * self.page_size

  def memory_bytes(self) -> int:
    """Bytes of the key and value pools and their scales (what the cache costs in memory)."""
    scales = sum(x.nbytes for x in (self.key_scales, self.value_scales) if x is not None)
    return self.key_pages.nbytes + self.value_pages.nbytes + scales


jax.tree_util.register_dataclass(
    PagedKVCache, data_fields=[f.name for f in dataclasses.fields(PagedKVCache)],
    meta_fields=[])


def init_cache(batch_size: int, max_length: int, *, num_kv_heads: int, head_dim: int,
               value_dim: int | None = None, page_size: int = 16,
               num_pages: int | None = None, dtype=jnp.float32,
               value_dtype=None, pool_sharding: NamedSharding | None = None) -> PagedKVCache:
  """An empty cache: B rows of up to max_length tokens sharing a pool of num_pages pages.

  num_pages defaults to enough for every row at max_length (the dense cache's
  memory); pass fewer, about sum(lengths) / page_size, to hold only what rows use.
  dtype (keys, and values unless value_dtype) is a float dtype or jnp.int8: int8
  pages with float32 scales per (page, kv head) (the module docstring), half the
  bytes of bfloat16 ones; decode_attention then takes a float query and computes
  in its dtype.

  pool_sharding: a NamedSharding of the pools [P, K, page_size, H] that splits only
  their kv heads, e.g. NamedSharding(mesh, P(None, "model")): each device then holds
  its kv heads' part of every page, made so (never whole on one device). The block table,
  lengths and free list stay whole on every device, since every row may take any page.
  """
  for name, value in (("batch_size", batch_size), ("max_length", max_length),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                      ("page_size", page_size)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
  max_pages = -(-max_length // page_size)
  num_pages = batch_size * max_pages if num_pages is None else num_pages
  if not isinstance(num_pages, int) or num_pages < 1:
    raise ValueError(f"init_cache: num_pages must be a positive int, got {num_pages!r}")
  D = head_dim if value_dim is None else value_dim
  P, K = num_pages, num_kv_heads
  dtypes = {"dtype": jnp.dtype(dtype),
            "value_dtype": jnp.dtype(dtype if value_dtype is None else value_dtype)}
  for name, d in dtypes.items():
    if not (jnp.issubdtype(d, jnp.floating) or d == jnp.int8):
      raise TypeError(f"init_cache: {name} must be a floating-point dtype or jnp.int8, "
                      f"got {d}")
  _check_pool_sharding(pool_sharding, K)
  scales_sharding = None if pool_sharding is None else NamedSharding(  # [P, K]: the pools'
      pool_sharding.mesh, PartitionSpec(*tuple(pool_sharding.spec)[:2]))
  scales = lambda d: zeros((P, K), jnp.float32, scales_sharding) if d == jnp.int8 else None
  return PagedKVCache(
      key_pages=zeros((P, K, page_size, head_dim), dtypes["dtype"], pool_sharding),
      value_pages=zeros((P, K, page_size, D), dtypes["value_dtype"], pool_sharding),
      block_table=jnp.full((batch_size, max_pages), NO_PAGE, jnp.int32),
      lengths=jnp.zeros((batch_size,), jnp.int32),
      page_free=jnp.ones((P,), bool),
      error=jnp.zeros((), jnp.int32),
      key_scales=scales(dtypes["dtype"]), value_scales=scales(dtypes["value_dtype"]))


def _check_pool_sharding(sharding, num_kv_heads: int) -> None:
  if sharding is None:
    return
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"init_cache: pool_sharding must be a jax.sharding.NamedSharding of the "
                    f"pools [P, K, page_size, H], got {sharding!r}")
  spec = tuple(sharding.spec)
  if len(spec) > 4 or any(entry is not None for i, entry in enumerate(spec) if i != 1):
    raise ValueError(f"init_cache: pool_sharding may split only the kv heads, axis 1 of "
                     f"the pools [P, K, page_size, H] (every row may take any page, any "
                     f"slot), got spec {sharding.spec}")
  names = axes_at(sharding.spec, 1, sharding.mesh.axis_names)
  devices = devices_along(sharding.mesh, names)
  if num_kv_heads % devices:
    raise ValueError(f"init_cache: pool_sharding splits the kv heads over {names} "
                     f"({devices} devices), which does not divide num_kv_heads = "
                     f"{num_kv_heads}")


def _concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def _refused(cache: PagedKVCache, new: PagedKVCache, bits) -> PagedKVCache:
  """new, or, where the request failed (bits != 0, traced), the old cache with the
  failure's bits added to `error`: a refused request writes nothing."""
  kept = jax.tree.map(lambda a, b: jnp.where(bits == 0, a, b), new, cache)
  return dataclasses.replace(kept, error=cache.error | bits)


def _raise_if_refused(bits, detail: Callable[[], str]) -> None:
  """Eagerly (concrete bits): the ValueError of a failed request, naming its arrays
  (detail() says what was asked of which cache; only built for the error)."""
  if _concrete(bits) and int(bits):
    raise ValueError("new_tokens: " + "; ".join(ERRORS[b] for b in ERRORS if int(bits) & b)
                     + f" ({detail()})")


def check(cache: PagedKVCache) -> PagedKVCache:
  """Raises the ValueError of a request refused under jit (the `error` bits); else cache.

  Eagerly on a concrete cache (after the jitted step) it raises at once. Inside a
  jitted function it is a `jax.experimental.checkify` check: wrap the function in
  `checkify.checkify` and call `.throw()` on the error it returns. Traced without
  checkify, jax refuses to compile it ("Cannot abstractly evaluate a checkify.check
  which was not functionalized"): nothing under plain jit can raise.
  """
  if _concrete(cache.error):
    bits = int(cache.error)
    if bits:
      raise ValueError("cache.error: " + "; ".join(ERRORS[b] for b in ERRORS if bits & b))
    return cache
  from jax.experimental import checkify  # here: only a traced cache needs it
  for bit, message in ERRORS.items():
    checkify.check(cache.error & bit == 0, "cache.error: " + message)
  return cache


def _new_tokens(cache: PagedKVCache, new_tokens) -> jax.Array:
  B = cache.batch_size
  new_tokens = jnp.asarray(new_tokens)
  if not jnp.issubdtype(new_tokens.dtype, jnp.integer) or new_tokens.shape != (B,):
    raise ValueError(f"new_tokens: expected int [B] = ({B},), got {new_tokens.dtype} "
                     f"with shape {new_tokens.shape}")
  # the checks of concrete arrays in NumPy: jnp's would compile an op each, eagerly
  if _concrete(new_tokens) and (np.asarray(new_tokens) < 0).any():
    raise ValueError(f"new_tokens must be >= 0, got {np.asarray(new_tokens).tolist()}")
  return new_tokens


def pages_held(cache: PagedKVCache) -> jax.Array:
  """int32 [B]: pages in each row's table (a prefix of it)."""
  return jnp.sum(cache.block_table != NO_PAGE, axis=1, dtype=jnp.int32)


def allocate(cache: PagedKVCache, new_tokens) -> PagedKVCache:
  """Pages for new_tokens[b] (int [B]) more tokens in each row, from the free list.

  Row b gets the lowest free pages, after the rows before it: a cumulative sum
  over the batch, no loop. Raises (or flags, under jit) a full pool or a row
  past its table.
  """
  new_tokens = _new_tokens(cache, new_tokens)
  grown, bits = _allocate(cache, new_tokens)
  _raise_if_refused(bits, lambda: _allocation(cache, new_tokens))
  return grown


# Eager calls run these whole, compiled once per shape, instead of op by op (seconds
# on a CPU for append's first call); traced, they inline into the caller's program.
@jax.jit
def _allocate(cache: PagedKVCache, new_tokens):
  """-> (the cache with the pages allocated, or as it was with `error` flagged if the
  request was refused; this request's error bits, int32, 0 if granted)."""
  P, ps, M = cache.num_pages, cache.page_size, cache.max_pages
  new_tokens = jnp.maximum(new_tokens.astype(jnp.int32), 0)
  held = pages_held(cache)
  wanted = -(-(cache.lengths + new_tokens) // ps)  # [B] pages each row needs in all
  need = jnp.maximum(wanted - held, 0)  # [B]
  free_ids = jnp.nonzero(cache.page_free, size=P, fill_value=P)[0].astype(jnp.int32)  # [P]
  first = jnp.cumsum(need, dtype=jnp.int32) - need  # [B]: row b's share starts in free_ids
  j = jnp.arange(M, dtype=jnp.int32)[None, :]  # [1, M] table slots
  fresh = (j >= held[:, None]) & (j < (held + need)[:, None])  # [B, M]
  picked = free_ids[jnp.clip(first[:, None] + j - held[:, None], 0, P - 1)]  # [B, M]
  table = jnp.where(fresh, picked, cache.block_table)
  taken = jnp.where(fresh, picked, P).reshape(-1)  # P: dropped by the scatter
  page_free = cache.page_free.at[taken].set(False, mode="drop")
  pages_free = jnp.sum(cache.page_free, dtype=jnp.int32)
  bits = (jnp.where(jnp.sum(need, dtype=jnp.int32) > pages_free, POOL_FULL, 0)
          | jnp.where(jnp.any(wanted > M), PAST_TABLE, 0)).astype(jnp.int32)
  new = dataclasses.replace(cache, block_table=table.astype(jnp.int32), page_free=page_free)
  return _refused(cache, new, bits), bits


def _allocation(cache: PagedKVCache, new_tokens) -> str:
  """What a refused request asked of which cache (its error message's detail)."""
  return (f"new_tokens {_show(new_tokens)}, lengths {_show(cache.lengths)}, "
          f"{_show(np.sum(np.asarray(cache.page_free)))} of {cache.num_pages} pages free, "
          f"page_size {cache.page_size}, max_pages {cache.max_pages}")


def _show(x):
  return np.asarray(x).tolist() if _concrete(x) else "(traced)"


def append(cache: PagedKVCache, key, value, new_tokens=None) -> PagedKVCache:
  """Writes key [B, T, K, H] / value [B, T, K, D] after each row's tokens; lengths += new_tokens.

  new_tokens int [B] (default all T): row b takes key[b, :new_tokens[b]], the
  rest is padding (a prefill of different lengths, then 1 or a few per step).
  Pages are allocated as needed (`allocate`).
  """
  B = cache.batch_size
  K, H, D = cache.key_pages.shape[1], cache.key_pages.shape[3], cache.value_pages.shape[3]
  key, value = jnp.asarray(key), jnp.asarray(value)
  if key.ndim != 4 or key.shape[0] != B or key.shape[2:] != (K, H):
    raise ValueError(f"key: expected [B, T, K, H] = ({B}, T, {K}, {H}) for the cache's "
                     f"key_pages {tuple(cache.key_pages.shape)}, got shape {key.shape}")
  if value.shape != key.shape[:2] + (K, D):
    raise ValueError(f"value: expected [B, T, K, D] = {key.shape[:2] + (K, D)} for the "
                     f"cache's value_pages {tuple(cache.value_pages.shape)}, got shape "
                     f"{value.shape}")
  T = key.shape[1]
  new_tokens = np.full((B,), T, np.int32) if new_tokens is None else _new_tokens(
      cache, new_tokens)
  if _concrete(new_tokens) and (np.asarray(new_tokens) > T).any():
    raise ValueError(f"new_tokens: at most T = {T} tokens per row (key {key.shape}), got "
                     f"{_show(new_tokens)}")
  appended, bits = _append(cache, key, value, new_tokens)
  _raise_if_refused(bits, lambda: _allocation(cache, new_tokens))
  return appended


@jax.jit
def _append(cache: PagedKVCache, key, value, new_tokens):
  """-> (append's cache, or as it was with `error` flagged; the request's error bits)."""
  M, ps, T = cache.max_pages, cache.page_size, key.shape[1]
  # the rows share one free list: their counts whole on every device (Explicit axes)
  new_tokens = jnp.minimum(jnp.maximum(unsharded(new_tokens).astype(jnp.int32), 0), T)
  grown, bits = _allocate(cache, new_tokens)
  refused = bits != 0  # the allocation was refused: write nothing
  pos = grown.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  page = jnp.take_along_axis(grown.block_table, jnp.clip(pos // ps, 0, M - 1), axis=1)
  t = jnp.arange(T, dtype=jnp.int32)
  written = (t[None, :] < new_tokens[:, None]) & ~refused  # [B, T]
  page = jnp.where(written & (page != NO_PAGE), page, cache.num_pages)  # out of range: dropped
  slot = pos % ps
  # token (b, t) goes to [page[b, t], :, slot[b, t]]: the two index arrays [B, T] around
  # the heads' slice select the [B, T, K, H] entries key fills (the K axis a slice, so it
  # keeps the pool's sharding on Explicit axes)
  at = (page, slice(None), slot)
  out = {}
  for name, x in (("key", key), ("value", value)):
    pool, scales = getattr(grown, name + "_pages"), getattr(grown, name + "_scales")
    x = _laid_out_as_pool(x, pool)
    if scales is None:
      out[name + "_pages"] = pool.at[at].set(x.astype(pool.dtype), mode="drop")
    else:
      out[name + "_pages"], out[name + "_scales"] = _append_quantized(
          grown, pool, scales, x, new_tokens, refused)
  lengths = grown.lengths + jnp.where(refused, 0, new_tokens)
  return dataclasses.replace(grown, lengths=lengths, **out), bits


def _laid_out_as_pool(x, pool):
  """x [B, T, K, H] with its rows whole and K sharded as the pool's [P, K, page_size, H]
  K, on Explicit axes (any row may write any page: the scatter's update must be laid out
  as the pool); x itself off them."""
  mesh, used = explicit_axes(x)
  pool_sharding = explicit_sharding(pool)
  if pool_sharding is None and not used:
    return x
  heads = None if pool_sharding is None else pool_sharding.spec[1]  # the pool's K
  mesh = mesh if pool_sharding is None else pool_sharding.mesh
  return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(None, None, heads, None)))


def quantize(x, amax):
  """float x [..., S, H] and its amax [...] -> (int8 x, float32 scale [...]): x ~ q * scale,
  symmetric, scale = amax / 127 (0 for an all-zero page)."""
  scale = amax.astype(jnp.float32) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)[..., None, None]
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / safe), -127, 127).astype(jnp.int8)
  return q, scale


def dequantize(q, scale, dtype):
  """int8 q [..., S, H] and scale [...] -> q * scale in dtype."""
  return (q.astype(jnp.float32) * scale[..., None, None]).astype(dtype)


def read_pages(cache: PagedKVCache, page, dtype):
  """The pool pages `page` (int array [...]) -> (keys [..., K, S, H], values [..., K, S, D])
  in dtype, int8 pages dequantized by their scales."""
  out = []
  for pool, scales in ((cache.key_pages, cache.key_scales),
                       (cache.value_pages, cache.value_scales)):
    out.append(pool[page].astype(dtype) if scales is None else
               dequantize(pool[page], scales[page], dtype))
  return tuple(out)


def _append_quantized(grown, pool, scales, x, new_tokens, refused):
  """-> (pool, scales) with row b's new tokens x [B, T, K, H] written into its int8 pages.

  Only the pages the call touches (J a row, static) are gathered: their old tokens
  dequantized, the new ones added, slots past the new length zeroed (a reused page's
  stale tokens do not count), and the page requantized at scale max(new amax / 127,
  old scale) (scales only grow, so old tokens move by at most one step).
  """
  B, T = x.shape[:2]
  P, M, ps = grown.num_pages, grown.max_pages, grown.page_size
  J = min((ps + T - 2) // ps + 1, M)  # pages tokens [L, L + T) can touch
  old_len, new_len = grown.lengths, grown.lengths + new_tokens  # [B]
  j = old_len[:, None] // ps + jnp.arange(J, dtype=jnp.int32)[None, :]  # [B, J] table slots
  touched = (j * ps < new_len[:, None]) & (j < M) & (new_tokens > 0)[:, None] & ~refused
  page = jnp.take_along_axis(grown.block_table, jnp.clip(j, 0, M - 1), axis=1)  # [B, J]
  touched = touched & (page != NO_PAGE)
  page = jnp.where(touched, page, P)  # out of range: gathers clipped, scatters dropped
  gather = jnp.clip(page, 0, P - 1)
  old = dequantize(pool[gather], scales[gather], jnp.float32)  # [B, J, K, S, H]
  pos = j[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, None, :]  # [B, J, S]
  t = pos - old_len[:, None, None]  # [B, J, S]: the new token at this slot, if t >= 0
  new = jnp.take_along_axis(x.astype(jnp.float32), jnp.clip(t, 0, T - 1).reshape(B, -1)[
      :, :, None, None], axis=1).reshape(B, J, ps, *x.shape[2:])  # [B, J, S, K, H]
  new = jnp.einsum("BJSKH->BJKSH", new)
  held = (pos < old_len[:, None, None])[:, :, None, :, None]  # [B, J, 1, S, 1]
  valid = (pos < new_len[:, None, None])[:, :, None, :, None]
  # where, not arithmetic: a stale page's NaN or scale must not reach the new one
  page_x = jnp.where(held, old, jnp.where(valid, new, 0.0))
  had = jnp.where(jnp.any(held, axis=(3, 4)), scales[gather], 0.0)  # [B, J, K]
  q, scale = quantize(page_x, jnp.maximum(jnp.max(jnp.abs(page_x), axis=(3, 4)), 127.0 * had))
  return (pool.at[page].set(q, mode="drop"), scales.at[page].set(scale, mode="drop"))


def free(cache: PagedKVCache, rows) -> PagedKVCache:
  """Returns the pages of rows (bool [B], True = finished) to the free list; their
  lengths become 0 and their tables empty, ready for a new prompt."""
  rows = jnp.asarray(rows)
  if rows.dtype != jnp.bool_ or rows.shape != (cache.batch_size,):
    raise ValueError(f"rows: expected bool [B] = ({cache.batch_size},), got {rows.dtype} "
                     f"with shape {rows.shape}")
  return _free(cache, rows)


@jax.jit
def _free(cache: PagedKVCache, rows) -> PagedKVCache:
  table = cache.block_table
  released = jnp.where(rows[:, None] & (table != NO_PAGE), table, cache.num_pages)
  page_free = cache.page_free.at[released.reshape(-1)].set(True, mode="drop")
  return dataclasses.replace(
      cache, page_free=page_free, block_table=jnp.where(rows[:, None], NO_PAGE, table),
      lengths=jnp.where(rows, 0, cache.lengths))


def check_pages(cache: PagedKVCache) -> None:
  """Before any work, on a concrete cache: every page a row holds is a pool page
  (0 <= id < P), and lengths fit the pages held."""
  if not _concrete(cache.block_table, cache.lengths):
    return
  table, lengths = np.asarray(cache.block_table), np.asarray(cache.lengths)
  P, ps = cache.num_pages, cache.page_size
  held = -(-lengths // ps)
  used = np.arange(cache.max_pages)[None, :] < held[:, None]
  bad = used & ((table < 0) | (table >= P))
  if bad.any():
    b, j = map(int, np.argwhere(bad)[0])
    raise ValueError(f"cache.block_table: page id {int(table[b, j])} at row {b}, slot {j} "
                     f"is out of range [0, {P}) (lengths {lengths.tolist()}, page_size {ps})")
  if (lengths < 0).any() or (held > cache.max_pages).any():
    raise ValueError(f"cache.lengths {lengths.tolist()} past the block table "
                     f"{table.shape} of pages of {ps} tokens")
