"""decode_attention at its edges: calls refused under jit, dtypes, gradients, max logits.

Everything is compared with float64 NumPy (tests/reference.py, tests/reference_grads.py)
over the dense sequences the paged cache holds: row b's keys read back through its
block table, its queries at positions lengths[b] - query_lengths[b] + t.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jattn
from jattn._src.core.softmax import LARGE_NEGATIVE
from jattn._src.decode import work_list
from tests.helpers import raises
from tests.reference import reference_max_logits
from tests.reference_grads import reference_mods_vjp

B, T, N, K, H, D, PAGE, MAX_LENGTH = 2, 2, 4, 2, 8, 8, 4, 12
LENGTHS = np.array([9, 3])
Q_LENGTHS = np.array([2, 1])
CAP = 1.5


def _cache(dtype=jnp.float32):
  """Rows of 9 and 3 tokens, appended in two ragged steps so their pages interleave."""
  rng = np.random.default_rng(0)
  kv = lambda width: jnp.asarray(rng.standard_normal((B, 5, K, width)), dtype)
  cache = jattn.paged.init_cache(B, MAX_LENGTH, num_kv_heads=K, head_dim=H, page_size=PAGE,
                                 num_pages=6, dtype=dtype)
  cache = jattn.paged.append(cache, kv(H), kv(D), jnp.array([5, 2]))
  return jattn.paged.append(cache, kv(H), kv(D), jnp.array([4, 1]))


def _query(seed=1, dtype=jnp.float32):
  return jnp.asarray(2.0 * np.random.default_rng(seed).standard_normal((B, T, N, H)), dtype)


def _dense(cache):
  """float64 keys, values [B, S, K, *] read back through the block table, and (page,
  slot) int [B, S] of each position (-1 past the row's length)."""
  S = MAX_LENGTH
  table, lengths = np.asarray(cache.block_table), np.asarray(cache.lengths)
  s = np.arange(S)
  page = np.where(s[None, :] < lengths[:, None], table[:, s // PAGE], -1)
  slot = np.broadcast_to(s % PAGE, (B, S))
  take = lambda pages: np.where((page >= 0)[..., None, None],
                                np.asarray(pages, np.float64)[page, :, slot], 0.0)
  return take(cache.key_pages), take(cache.value_pages), page, slot


def _allowed(cache, q_lengths, causal=True):
  """bool [B, 1, T, S]: the keys each query of the call sees."""
  lengths = np.asarray(cache.lengths)
  t, s = np.arange(T)[None, :, None], np.arange(MAX_LENGTH)[None, None, :]
  q_pos = (lengths - q_lengths)[:, None, None] + t
  keep = (s < lengths[:, None, None]) & (t < q_lengths[:, None, None])
  if causal:
    keep = keep & (s <= q_pos)
  return keep[:, None]


def test_out_of_range_query_lengths_under_jit_give_nan_rows_not_values():
  cache, q = _cache(), _query()
  call = jax.jit(lambda q, cache, lengths: jattn.decode_attention(
      q, cache, query_lengths=lengths, is_causal=True, return_max_logits=True))
  want, want_max = jattn.decode_attention(q, cache, query_lengths=jnp.asarray(Q_LENGTHS),
                                          is_causal=True, return_max_logits=True)
  # eagerly each raises; under jit the bad row is NaN in every slot, the others exact
  for bad in ([2, 4], [2, 3], [2, -1]):  # > the row's length 3, > T = 2, < 0
    with raises(ValueError, "query_lengths"):
      jattn.decode_attention(q, cache, query_lengths=jnp.array(bad), is_causal=True)
    out, top = call(q, cache, jnp.array(bad))
    assert np.isnan(np.asarray(out[1])).all() and np.isnan(np.asarray(top[1])).all()
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(top[0], want_max[0])


def test_check_raises_under_jit_through_checkify():
  cache = _cache()
  kv = jnp.ones((B, 4, K, H))
  refused = jax.jit(jattn.paged.append)(cache, kv, kv)  # row 0: 13 tokens > max_length 12
  assert checkify.checkify(jax.jit(jattn.paged.check))(cache)[0].get() is None
  error = checkify.checkify(jax.jit(jattn.paged.check))(refused)[0].get()
  assert "cache.error" in error and "past the block table" in error
  with pytest.raises(ValueError, match="checkify"):  # plain jit: jax names checkify
    jax.jit(jattn.paged.check)(refused)
  with raises(ValueError, "cache.error", "past the block table"):
    jattn.paged.check(refused)


def test_query_dtype_must_be_the_caches():
  cache = _cache()
  with raises(TypeError, "query", "bfloat16", "key_pages float32"):
    jattn.decode_attention(_query(dtype=jnp.bfloat16), cache)
  with raises(TypeError, "query", "bfloat16"):  # as dot_product_attention
    jattn.dot_product_attention(_query(dtype=jnp.bfloat16), _query(), _query())


def test_unfit_mods_a_scale_that_is_no_number_and_an_empty_query_are_refused():
  """As dot_product_attention's (tests/masks/test_mods.py, tests/core/test_errors.py); mods
  must fit the cache's rows and the query heads; positions are not checked:
  they run to the cache's capacity, and ids past a row's length are never read."""
  cache = _cache()
  with raises(ValueError, "score_mod", "slopes", f"N = {N}", "(3,)"):
    jattn.decode_attention(_query(), cache, score_mod=jattn.mods.alibi(jnp.ones(3)))
  with raises(TypeError, "scale", "str"):
    jattn.decode_attention(_query(), cache, scale="x")
  with raises(ValueError, "query", "at least 1", f"({B}, 0, {N}, {H})"):
    jattn.decode_attention(_query()[:, :0], cache, query_lengths=np.zeros(B, np.int32))
  with raises(ValueError, "mask_mod", "q_segment_ids", f"B = {B}", f"({B + 1}, {MAX_LENGTH})"):
    jattn.decode_attention(_query(), cache, mask_mod=jattn.mods.document(
        jnp.zeros((B + 1, MAX_LENGTH), jnp.int32)))


@pytest.mark.parametrize("implementation", ["split", "xla"])
def test_gradients_eager_and_jitted_equal_float64(implementation):
  cache, q = _cache(), _query()
  d_out = np.random.default_rng(2).standard_normal((B, T, N, D)).astype(np.float32)

  def loss(q, key_pages, value_pages):
    c = cache.__class__(key_pages, value_pages, *jax.tree.leaves(cache)[2:])
    out = jattn.decode_attention(q, c, query_lengths=jnp.asarray(Q_LENGTHS), is_causal=True,
                                 score_mod=jattn.mods.soft_cap(CAP),
                                 implementation=implementation)
    return jnp.sum(out * d_out)

  k, v, page, slot = _dense(cache)
  _, dq, dk, dv = reference_mods_vjp(
      q, k, v, d_out, allowed=_allowed(cache, Q_LENGTHS),
      score=lambda x: CAP * np.tanh(x / CAP), d_score=lambda x: 1 - np.tanh(x / CAP) ** 2)
  want_k, want_v = np.zeros(cache.key_pages.shape), np.zeros(cache.value_pages.shape)
  for b, s in zip(*np.nonzero(page >= 0)):
    want_k[page[b, s], :, slot[b, s]] += dk[b, s]  # pages [P, K, S, H]
    want_v[page[b, s], :, slot[b, s]] += dv[b, s]
  args = (q, cache.key_pages, cache.value_pages)
  for grad in (jax.grad(loss, (0, 1, 2)), jax.jit(jax.grad(loss, (0, 1, 2)))):
    got = grad(*args)
    for g, want in zip(got, (dq, want_k, want_v)):
      np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_max_logits_equal_float64():
  cache, q = _cache(), _query()
  k, _, _, _ = _dense(cache)
  for causal in (True, False):
    want = reference_max_logits(q, k, allowed=_allowed(cache, Q_LENGTHS, causal),
                                score=lambda x: CAP * np.tanh(x / CAP))  # [B, N, T]
    want = np.where(np.isfinite(want), want, LARGE_NEGATIVE).transpose(0, 2, 1)
    for implementation in ("split", "xla"):
      out, top = jax.jit(lambda q, c: jattn.decode_attention(
          q, c, query_lengths=jnp.asarray(Q_LENGTHS), is_causal=causal,
          score_mod=jattn.mods.soft_cap(CAP), sinks=jnp.ones(N),
          implementation=implementation, return_max_logits=True))(q, cache)
      assert top.dtype == jnp.float32 and top.shape == (B, T, N)
      np.testing.assert_allclose(top, want, rtol=1e-5)


def test_flax_attention_fn_returns_max_logits_and_lse():
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 5, N, H)), jnp.float32) for _ in range(3))
  out, lse, top = jattn.flax_attention_fn(q, k, v, is_causal=True, return_residual=True,
                                          return_max_logits=True)
  flat = lambda x: np.asarray(x).reshape((6,) + x.shape[2:])
  causal = np.tril(np.ones((5, 5), bool))
  want = reference_max_logits(flat(q), flat(k), allowed=causal).transpose(0, 2, 1)
  assert out.shape == (2, 3, 5, N, H) and top.shape == lse.shape == (2, 3, 5, N)
  np.testing.assert_allclose(flat(top), want, rtol=1e-5)
  assert (np.asarray(lse) >= np.asarray(top)).all()  # the lse bounds the max from above


def test_explain_decode_says_what_runs_when_the_ids_are_no_whole_pages():
  ids = jnp.asarray(np.arange(10) // 4)[None].repeat(B, 0)  # [B, 10]: max_length 10
  cache = jattn.paged.init_cache(B, 10, num_kv_heads=K, head_dim=H, page_size=4)
  mask = jattn.mods.document(ids)
  report = str(jattn.explain_decode(jnp.ones((B, 1, N, H)), cache, mask_mod=mask))
  # the pool holds 3 pages of 4 = 12 keys, the ids 10: no closed form for this cache
  assert work_list.closed_form_nonempty(mask, cache, q_first=jnp.zeros(B, jnp.int32),
                                        T=1) is None
  assert "evaluating mask_mod" in report and "in closed form (jattn.mods)" not in report
  whole = jattn.paged.init_cache(B, 12, num_kv_heads=K, head_dim=H, page_size=4)
  whole_ids = jattn.mods.document(jnp.concatenate([ids, ids[:, -2:]], axis=1))
  assert "in closed form (jattn.mods)" in str(jattn.explain_decode(
      jnp.ones((B, 1, N, H)), whole, mask_mod=whole_ids))
