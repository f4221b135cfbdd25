"""`jattn.decode_attention`: new queries against a paged, ragged KV cache, with the training mods.

Checks every argument before any work, picks an implementation per platform
(`registry`, through the dispatch of `dot_product_attention`) and runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import dispatch
from jattn._src.call import local_window
from jattn._src.core import checks as _checks
from jattn._src.decode import paged_cache as _paged
from jattn._src.decode import registry as _registry
from jattn._src.decode import sharded_decode
from jattn._src.decode import work_list as _work_list
from jattn._src.masks.closed_form_blocks import is_closed_form
from jattn._src.core.softmax import logits_dtype
from jattn._src.masks.programmable import build_mods


def _check(query, cache, query_lengths, mask_mod, score_mod, sinks, is_causal,
           local_window_size, scale, pages_per_step, return_max_logits=False):
  """-> (DecodeCall, mods, q_lengths, scale): the checked call, before any work."""
  if not isinstance(cache, _paged.PagedKVCache):
    raise TypeError(f"cache must be a jattn.paged.PagedKVCache (jattn.paged.init_cache), "
                    f"got {type(cache).__name__}")
  if not hasattr(query, "shape") or len(query.shape) != 4:
    raise ValueError(f"query: expected rank 4 [B, T, N, H], got shape "
                     f"{getattr(query, 'shape', type(query).__name__)}")
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise TypeError(f"query must be a floating-point array, got dtype {query.dtype} with "
                    f"shape {query.shape}")
  B, T, N, H = query.shape
  if min(B, T, N, H) == 0:  # a step of no query: the caller has nothing to decode
    raise ValueError(f"query: a decode step needs B, T, N and H of at least 1, got shape "
                     f"{query.shape} [B, T, N, H]")
  P, K, ps, Hk = cache.key_pages.shape
  D = cache.value_pages.shape[3]
  if B != cache.batch_size:
    raise ValueError(f"query: batch B = {B} (shape {query.shape}) differs from the cache's "
                     f"block_table {tuple(cache.block_table.shape)}")
  if H != Hk:
    raise ValueError(f"query: depth H = {H} (shape {query.shape}) differs from the cache's "
                     f"key_pages [P, K, page_size, H] = {tuple(cache.key_pages.shape)}")
  # int8 pages (with their scales) compute in the query's dtype; float pages are it
  if any(pool.dtype not in (query.dtype, jnp.int8) for pool in (cache.key_pages,
                                                                cache.value_pages)):
    raise TypeError(f"query and the cache's float pages must share one dtype (as the "
                    f"query, key and value of dot_product_attention; int8 pages take any "
                    f"float query), got query {query.dtype} "
                    f"{query.shape}, key_pages {cache.key_pages.dtype} "
                    f"{tuple(cache.key_pages.shape)}, value_pages {cache.value_pages.dtype} "
                    f"{tuple(cache.value_pages.shape)}")
  if N % K:
    raise ValueError(f"query: N = {N} heads (shape {query.shape}) is not a multiple of the "
                     f"cache's K = {K} kv heads (key_pages {tuple(cache.key_pages.shape)})")
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if not isinstance(return_max_logits, bool):
    raise TypeError(f"return_max_logits must be a bool, got {return_max_logits!r}")
  window = local_window(local_window_size)
  if pages_per_step is not None and (not isinstance(pages_per_step, int)
                                     or pages_per_step < 1):
    raise ValueError(f"pages_per_step must be a positive int, got {pages_per_step!r}")
  if query_lengths is None:
    q_lengths = np.full((B,), T, np.int32)
  else:
    q_lengths = _checks.as_array("query_lengths", query_lengths)
    if not jnp.issubdtype(q_lengths.dtype, jnp.integer) or q_lengths.shape != (B,):
      raise ValueError(f"query_lengths: expected int [B] = ({B},), got {q_lengths.dtype} "
                       f"with shape {q_lengths.shape}")
    q_lengths = q_lengths.astype(jnp.int32)
  _paged.check_pages(cache)
  if _paged._concrete(q_lengths, cache.lengths):
    ql, lengths = np.asarray(q_lengths), np.asarray(cache.lengths)
    if (ql < 0).any() or (ql > T).any() or (ql > lengths).any():
      raise ValueError(f"query_lengths {ql.tolist()}: each row's queries are its last "
                       f"tokens in the cache, so 0 <= query_lengths <= min(T = {T}, "
                       f"cache.lengths {lengths.tolist()})")
  # a ready-made mask_mod stays untraced, for the jit of `_run` to cache on (Mods.traced)
  # (positions run to the cache's capacity: the mods' arrays are fitted to B and N alone)
  mods = build_mods(mask_mod, score_mod, sinks, None, N=N, B=B, defer_ready_made=True,
                    logits_dtype=logits_dtype(query.dtype))
  if scale is None:
    scale = 1.0 / float(np.sqrt(H))
  scale = _checks.scale(scale)
  # what the split path runs: a ready-made mask whose arrays do not fit the cache's
  # max_pages * page_size keys is evaluated like a user's mask_mod
  mask = "none" if mask_mod is None else (
      "closed form" if _work_list.closed_form_fits(mask_mod, B=B, T=T, page_size=ps,
                                                   max_pages=cache.max_pages)
      else "closed form unfit" if is_closed_form(mask_mod) else "mask_mod")
  call = _registry.DecodeCall(
      B=B, T=T, N=N, K=K, H=H, D=D, page_size=ps, max_pages=cache.max_pages, num_pages=P,
      dtype=str(jnp.dtype(query.dtype)), is_causal=is_causal, window=window, mask=mask,
      has_score=score_mod is not None, has_sinks=sinks is not None,
      pages_per_step=pages_per_step, return_max_logits=return_max_logits,
      **_registry.kernel_facts(mods, cache))
  return call, mods, q_lengths, scale


def _choices(call, implementation):
  if implementation is not None and implementation not in _registry.DECODE_IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of "
                     f"{tuple(_registry.DECODE_IMPLEMENTATIONS)}, got {implementation!r}")
  return dispatch.choose_all(call, implementation, registry=_registry.DECODE_IMPLEMENTATIONS,
                             order=_registry.decode_preference)


def decode_attention(query, cache, *, query_lengths=None, mask_mod=None, score_mod=None,
                     sinks=None, is_causal: bool = False, local_window_size=None, scale=None,
                     implementation=None, pages_per_step=None, return_max_logits=False):
  """New queries [B, T, N, H] against a paged, ragged KV cache -> out [B, T, N, D].

  Row b's queries are its last query_lengths[b] tokens (default all T), already
  appended to the cache (`jattn.paged.append`): query t sits at position
  cache.lengths[b] - query_lengths[b] + t, and slots t >= query_lengths[b]
  are padding (their output is 0). They attend row b's cached keys s <
  cache.lengths[b], masked as in training: mask_mod(b, n, t, s) and
  score_mod(score, b, n, t, s) see global positions, so the functions a model
  was trained with apply unchanged; sinks [N], is_causal, local_window_size
  (int or (left, right)) and scale as `dot_product_attention`'s (is_causal
  False by default there too: pass what the training call passed).

  The default implementation ("split", every platform) splits over keys as
  flash-decoding does: it lists the pages each row needs, skipping pages past
  its length, outside its window or causal range, and those mask_mod leaves
  EMPTY, reads only those, pages_per_step at a time (default from the sizes),
  and merges the partial softmaxes by log-sum-exp. Its work and reads grow
  with the sum of the row lengths, not B x max_length. Grouped heads read each
  kv head's page once. "xla" gathers every row's whole block table instead.

  Under jax.grad (eager or jitted) the gradients with respect to the query,
  the cache's key_pages and value_pages, sinks and the arrays the mods close
  over are those of the "xla" path: "split"'s backward gathers every row's
  whole block table (dense memory), its forward stays split.

  return_max_logits: also return each query's largest visible logit (after
  scale and score_mod), float32 [B, T, N] (float64 for a float64 query), no
  gradient (stopped), as `dot_product_attention`'s: a query with no visible key
  (padding slots t >= query_lengths[b] included) gets the finite -0.7 * float32
  max. Sinks do not count. Returns (out, max_logits) then.

  int8 pages (`jattn.paged.init_cache(..., dtype=jnp.int8)`) are dequantized
  by their per-(page, kv head) scales as they are read ("split", "xla" and
  "paged_tpu", in its kernel: HBM traffic is the int8 bytes); the query may be
  any float dtype, the computation and the output are in it.

  On a mesh (Explicit axes in the arrays' types, or Auto axes set by jax.set_mesh
  where a platform's choice is a Pallas kernel, which the compiler cannot
  partition): each device runs its rows (the query's B over the "data" axis, or
  as the query is sharded) and its query and kv heads (N with the pools' K over
  "model", where K divides) under jax.shard_map; the page pool is whole on each
  device of a row group, and the mods see global (b, n). See docs/scaling.md.

  Under jax.jit a row whose query_lengths is out of range (which raises
  eagerly) cannot raise: it reads nothing and its output (and max logits) is
  NaN in every slot, never a value at a wrong position.

  Raises:
    ValueError / TypeError, before any work, naming the argument and shapes:
      a query that does not fit the cache or whose dtype is not that of
      the cache's float pages,
      query_lengths out of range, a page id out of range or lengths past the
      table (a concrete cache), bad mods or sinks (as `dot_product_attention`).

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> cache = jattn.paged.init_cache(2, 64, num_kv_heads=1, head_dim=8, page_size=16)
    >>> kv = jax.random.normal(jax.random.key(0), (2, 5, 1, 8))          # [B, T, K, H]
    >>> cache = jattn.paged.append(cache, kv, kv, jnp.array([5, 2]))     # a ragged prompt
    >>> q = jnp.ones((2, 1, 4, 8))                                        # [B, T, N, H]
    >>> jattn.decode_attention(q, cache, mask_mod=jattn.mods.causal()).shape
    (2, 1, 4, 8)
  """
  call, mods, q_lengths, scale = _check(
      query, cache, query_lengths, mask_mod, score_mod, sinks, is_causal, local_window_size,
      scale, pages_per_step, return_max_logits)
  choices = _choices(call, implementation)
  mesh = sharded_decode.mesh_for(query, cache, mods, choices)
  if mesh is not None:  # each device its rows and kv heads, under shard_map
    return sharded_decode.run(
        query, cache, mods, q_lengths, mesh=mesh, mask_mod=mask_mod, score_mod=score_mod,
        options=dict(is_causal=is_causal, local_window_size=local_window_size, scale=scale,
                     implementation=implementation, pages_per_step=pages_per_step,
                     return_max_logits=return_max_logits),
        decode_attention=decode_attention)
  dispatch.record(choices)
  # A user's function traced for this call (a jaxpr in the mods) would never hit the
  # jit's cache, so it runs in the caller's trace; otherwise an eager call compiles once.
  run = _run if mods is None or mods.is_cacheable else _run.__wrapped__
  # the scale in the logits' dtype (float32; float64 for a float64 query)
  return run(jnp.asarray(query), cache, mods, q_lengths,
             jnp.asarray(scale, logits_dtype(query.dtype)),
             call=call, choices=choices)


@functools.partial(jax.jit, static_argnames=("call", "choices"))
def _run(query, cache, mods, q_lengths, scale, *, call, choices):
  """The checked call on every platform (its choice under platform_dependent), keyed on
  the call's static facts and the choices."""
  if mods is not None:
    mods = mods.traced()
  # Traced: nothing can raise, so an out-of-range row computes nothing (no query at a
  # negative position) and its output becomes NaN, never a plausible value.
  refused = (q_lengths < 0) | (q_lengths > call.T) | (q_lengths > cache.lengths)
  q_lengths = jnp.where(refused, 0, q_lengths)
  options = dict(causal=call.is_causal, window=call.window, dtype=query.dtype,
                 return_max_logits=call.return_max_logits)

  def branch(choice):
    if choice.implementation is None:
      return None
    run = _registry.DECODE_IMPLEMENTATIONS[choice.implementation].run

    def go(query, cache, mods, q_lengths, scale):
      # an implementation returns (out, max_logits) only when asked (its plan refuses a
      # call it cannot honour)
      got = run(choice.plan, query, cache, mods,
                dict(options, q_lengths=q_lengths, scale=scale))
      return got if call.return_max_logits else (got, None)
    return go

  branches = {c.platform: (c.key, branch(c)) for c in choices}
  out, max_logits = dispatch.per_platform(branches, query, cache, mods, q_lengths, scale)
  out = jnp.where(refused[:, None, None, None], jnp.nan, out)
  if not call.return_max_logits:
    return out
  return out, jax.lax.stop_gradient(jnp.where(refused[:, None, None], jnp.nan, max_logits))


def explain_decode(query, cache, *, implementation=None, **kwargs) -> dispatch.Explanation:
  """What `decode_attention(query, cache, **kwargs)` runs on each platform, and why.

  query and the cache's arrays may be jax.ShapeDtypeStruct (e.g. the cache
  from `jax.eval_shape(jattn.paged.init_cache, ...)`); nothing is computed.

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> cache = jax.eval_shape(lambda: jattn.paged.init_cache(
    ...     8, 32768, num_kv_heads=4, head_dim=128, page_size=64, num_pages=600))
    >>> q = jax.ShapeDtypeStruct((8, 1, 16, 128), jnp.float32)           # [B, T, N, H]
    >>> report = jattn.explain_decode(q, cache, is_causal=True)
    >>> report.implementation("tpu"), report.implementation("cpu")
    ('paged_tpu', 'split')
  """
  call = None

  def check(query, cache):
    nonlocal call
    call = _check(query, cache, kwargs.get("query_lengths"), kwargs.get("mask_mod"),
                  kwargs.get("score_mod"), kwargs.get("sinks"), kwargs.get("is_causal", False),
                  kwargs.get("local_window_size"), kwargs.get("scale"),
                  kwargs.get("pages_per_step"), kwargs.get("return_max_logits", False))[0]

  unknown = set(kwargs) - {"query_lengths", "mask_mod", "score_mod", "sinks", "is_causal",
                           "local_window_size", "scale", "pages_per_step",
                           "return_max_logits"}
  if unknown:
    raise TypeError(f"explain_decode got unexpected arguments {sorted(unknown)}")
  jax.eval_shape(check, query, cache)
  choices = _choices(call, implementation)
  return dispatch.Explanation({c.platform: c for c in choices})
