"""decode_attention in pure JAX: split over keys (flash-decoding), reading only needed pages.

The pages a call needs (`work_list`) are listed row by row; a loop whose trip
count is traced (ceil(needed pages / W)) takes W of them per step, gathers
just those W pages of keys and values from the pool, computes each page's
partial softmax in parallel (`tile`) and merges them into every row's running
(max, sum, output) by log-sum-exp. The work is proportional to the pages
needed (about sum of the lengths / page_size), not to B x max_length.

"xla" (`dense`) is the reference path: every row gathers its whole block table
[B, max_pages * page_size] and one tile computes it (dense work and memory).
It is also split's backward (`differentiable`): a loop with a traced trip count
has no reverse-mode derivative under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.decode import paged_cache as _paged
from jattn._src.decode import tile as _tile
from jattn._src.decode import work_list as _work_list
from jattn._src.core.softmax import logits_dtype


def _queries(query, cache, q_lengths):
  """query [B, T, N, H] -> (q [B, T, K, G, H], q_pos, q_valid int/bool [B, T], q_first [B])."""
  B, T, N, H = query.shape
  K = cache.key_pages.shape[1]
  q_first = cache.lengths - q_lengths  # [B]: row b's queries are its last q_lengths tokens
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  return (query.reshape(B, T, K, N // K, H), q_first[:, None] + t, t < q_lengths[:, None],
          q_first)


def needed_pages(mods, cache, *, q_first, q_pos, q_valid, q_lengths, causal, window, T, N, W):
  """bool [B, max_pages]: the pages the call reads (`work_list`'s rules)."""
  needed = _work_list.in_range(cache, q_first=q_first, q_lengths=q_lengths, causal=causal,
                               window=window)
  if mods is None or not mods.has_mask:
    return needed
  closed = (None if mods.mask_mod is None else
            _work_list.closed_form_nonempty(mods.mask_mod, cache, q_first=q_first, T=T))
  if closed is not None:
    return needed & closed
  return _work_list.mask_nonempty(mods, cache, needed, q_pos=q_pos, q_valid=q_valid,
                                  causal=causal, window=window, N=N, W=W)


def _outputs(carry, mods, dtype, return_max_logits: bool):
  """The running (m, l, o) -> out [B, T, N, D], and with return_max_logits the max
  visible logits float32 [B, T, N] (float64 for a float64 query; m: LARGE_NEGATIVE where
  none), no gradient."""
  out = _tile.finish(carry, None if mods is None else mods.sinks, dtype)
  if not return_max_logits:
    return out
  m = lax.stop_gradient(carry[0])  # [B, K, G, T]
  return out, jnp.einsum("BKGT->BTKG", m).reshape(out.shape[:3])


def differentiable(forward, query, cache, mods, *, q_lengths, scale, **static):
  """forward(query, cache, mods, q_lengths=, scale=, **static) with `dense`'s gradients.

  The same values (dense computes what forward does, reading every page of the
  table); jax.grad, eager or jitted, differentiates the dense path's recomputation
  with respect to every float leaf of (query, cache, mods, scale).
  """
  dense_static = {k: v for k, v in static.items() if k != "pages_per_step"}

  @jax.custom_vjp
  def run(query, cache, mods, q_lengths, scale):
    return forward(query, cache, mods, q_lengths=q_lengths, scale=scale, **static)

  def run_fwd(*args):
    return run(*args), args

  def run_bwd(args, d_out):
    reference = lambda query, cache, mods, q_lengths, scale: dense(
        query, cache, mods, q_lengths=q_lengths, scale=scale, **dense_static)
    return jax.vjp(reference, *args)[1](d_out)

  run.defvjp(run_fwd, run_bwd)
  return run(query, cache, mods, q_lengths, scale)


def split(query, cache, mods, *, q_lengths, causal: bool, window, scale, pages_per_step: int,
          dtype, return_max_logits: bool = False):
  """out [B, T, N, D] (and max logits [B, T, N] if asked); see the module docstring."""
  B, T, N, H = query.shape
  K, D, ps, W = cache.key_pages.shape[1], cache.value_pages.shape[3], cache.page_size, \
      pages_per_step
  q, q_pos, q_valid, q_first = _queries(query, cache, q_lengths)
  needed = needed_pages(mods, cache, q_first=q_first, q_pos=q_pos, q_valid=q_valid,
                        q_lengths=q_lengths, causal=causal, window=window, T=T, N=N, W=W)
  rows, slots, count = _work_list.items(needed, W)

  def step(i, carry):
    r, j, valid = _work_list.at_step(rows, slots, count, i, W)
    page = cache.block_table[r, j]  # [W]: pool pages, all in the list
    s_pos = j[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]  # [W, S]
    s_valid = (s_pos < cache.lengths[r][:, None]) & valid[:, None]
    keys, values = _paged.read_pages(cache, page, q.dtype)  # int8 pages dequantized
    partial = _tile.tile(q[r], keys, values, mods, rows=r,
                         q_pos=q_pos[r], q_valid=q_valid[r], s_pos=s_pos, s_valid=s_valid,
                         causal=causal, window=window, scale=scale)
    return _tile.merge(carry, *partial, r, B)

  carry = lax.fori_loop(0, _work_list.steps(count, W), step,
                        _tile.empty(B, K, N // K, T, D, logits_dtype(query.dtype)))
  return _outputs(carry, mods, dtype, return_max_logits)


def dense(query, cache, mods, *, q_lengths, causal: bool, window, scale, dtype,
          return_max_logits: bool = False):
  """out [B, T, N, D] (and max logits [B, T, N] if asked) from every row's whole block
  table (reads every slot of it)."""
  B, T, N, H = query.shape
  M, ps = cache.max_pages, cache.page_size
  q, q_pos, q_valid, _ = _queries(query, cache, q_lengths)
  table = cache.block_table
  page = jnp.clip(table, 0, cache.num_pages - 1)  # [B, M]; a missing page is masked below
  # [B, M, K, S, H] -> [B, K, M S, H]: each row's keys of a head in table order
  keys, values = _paged.read_pages(cache, page, q.dtype)  # int8 pages dequantized
  keys = jnp.einsum("BMKSH->BKMSH", keys).reshape(
      (B, cache.key_pages.shape[1], M * ps, cache.key_pages.shape[3]))
  values = jnp.einsum("BMKSD->BKMSD", values).reshape(
      (B, cache.value_pages.shape[1], M * ps, cache.value_pages.shape[3]))
  s_pos = jnp.broadcast_to(jnp.arange(M * ps, dtype=jnp.int32), (B, M * ps))  # [B, S]
  s_valid = (s_pos < cache.lengths[:, None]) & jnp.repeat(table >= 0, ps, axis=1)
  rows = jnp.arange(B, dtype=jnp.int32)
  partial = _tile.tile(q, keys, values, mods, rows=rows, q_pos=q_pos, q_valid=q_valid,
                       s_pos=s_pos, s_valid=s_valid, causal=causal, window=window, scale=scale)
  return _outputs(partial, mods, dtype, return_max_logits)
