"""int8 pages: `append` against a NumPy quantizer written here with loops, and
`decode_attention` ("split", "xla", and "paged_tpu" interpreted) against the
float64 full pass over the NumPy dequantization of the cache's pages.

The cache is tests/decode/test_decode_attention.py's (rows of 13, 4 and 9
tokens in pages of 4, interleaved in the pool), filled by a ragged prefill
then chunks of 3 and single tokens, so pages fill over several calls and are
requantized when a later token raises their amax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.decode.test_decode_attention import (B, CASES, FINAL, MAX_LENGTH, NUM_PAGES, PAGE,
                                                PROMPT, K, N, _data, _s, _t)
from tests.decode.test_paged_tpu import _tpu_devices
from tests.helpers import raises
from tests.reference import reference_mods


def _empty(dtype=jnp.int8, value_dtype=None):
  return jattn.paged.init_cache(B, MAX_LENGTH, num_kv_heads=K, head_dim=8, value_dim=6,
                                page_size=PAGE, num_pages=NUM_PAGES, dtype=dtype,
                                value_dtype=value_dtype)


class _NumpyPool:
  """The int8 pool of one of keys or values, kept by plain loops: per (page, kv head)
  scale = amax / 127 over the page's tokens, old tokens dequantized and requantized
  when a page's amax grows (never a smaller scale), slots past the length zero."""

  def __init__(self, shape):
    self.q = np.zeros(shape, np.int8)  # [P, K, S, H]
    self.scale = np.zeros(shape[:2], np.float32)  # [P, K]

  def append(self, table, length, x, new):
    """Row's table (after allocation), its old length, x [T, K, H] float32, new tokens."""
    if new == 0:
      return
    for j in range(length // PAGE, (length + new - 1) // PAGE + 1):
      page = table[j]
      for k in range(self.q.shape[1]):
        f = np.zeros(self.q.shape[2:], np.float32)  # [S, H]
        had = False
        for i in range(PAGE):
          pos = j * PAGE + i
          if pos < length:
            f[i] = self.q[page, k, i].astype(np.float32) * self.scale[page, k]
            had = True
          elif pos < length + new:
            f[i] = x[pos - length, k]
        scale = np.float32(np.abs(f).max()) / np.float32(127)
        if had:
          scale = max(scale, self.scale[page, k])
        div = scale if scale > 0 else np.float32(1)
        self.q[page, k] = np.clip(np.round(f / div), -127, 127).astype(np.int8)
        self.scale[page, k] = scale

  def dequantized(self):
    return self.q.astype(np.float64) * self.scale.astype(np.float64)[:, :, None, None]


def _fill(cache, k, v, calls, pools=None):
  """Appends each row's tokens in `calls` (lists of new tokens per row) from its own
  position; the NumPy pools follow. -> (cache, pools)."""
  pools = pools or (_NumpyPool(cache.key_pages.shape), _NumpyPool(cache.value_pages.shape))
  pos = np.asarray(cache.lengths).copy()
  for new in calls:
    new = np.asarray(new)
    T = max(int(new.max()), 1)
    at = np.minimum(pos[:, None] + np.arange(T)[None, :], k.shape[1] - 1)
    take = lambda x: x[np.arange(B)[:, None], at]
    cache = jattn.paged.append(cache, jnp.asarray(take(k)), jnp.asarray(take(v)),
                               jnp.asarray(new))
    table = np.asarray(cache.block_table)
    for b in range(B):
      for pool, x in zip(pools, (take(k), take(v))):
        pool.append(table[b], pos[b], x[b], new[b])
    pos = pos + new
  return cache, pools


_CALLS = [PROMPT, [3, 0, 3], [3, 0, 3], [1, 0, 1], [1, 0, 1]]  # to FINAL = 13, 4, 9


def _scaled(seed=0):
  """q, k, v with a later token per row larger (so pages' amax grows: requantized)."""
  q, k, v = _data(seed)
  k[:, 6], v[:, 6] = 3.0 * k[:, 6], -4.0 * v[:, 6]
  return q, k, v


def test_append_quantizes_as_numpy_over_several_calls():
  q, k, v = _scaled()
  cache, (kp, vp) = _fill(_empty(), k, v, _CALLS)
  np.testing.assert_array_equal(cache.lengths, FINAL)
  for got, scales, want in ((cache.key_pages, cache.key_scales, kp),
                            (cache.value_pages, cache.value_scales, vp)):
    np.testing.assert_allclose(np.asarray(scales), want.scale, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(np.asarray(got), want.q)


def test_old_tokens_stay_within_one_step_when_the_scale_grows():
  """A page's first tokens were quantized at a small scale; a larger token in a later
  call grew it: they were requantized, and stay within one step of their value."""
  q, k, v = _scaled()
  small, _ = _fill(_empty(), k, v, _CALLS[:2])  # rows at 8, 4, 4: token 6 is in
  first, _ = _fill(_empty(), k, v, _CALLS[:1])  # rows at 5, 4, 1: token 6 not yet
  page = int(np.asarray(first.block_table)[0, 1])  # row 0's second page: tokens 4..7
  grown, kept = np.asarray(small.key_scales)[page], np.asarray(first.key_scales)[page]
  assert (grown > 2 * kept).all()  # the page's scale grew (token 6 is 3x)
  deq = np.asarray(small.key_pages)[page, :, 0].astype(np.float32) * grown[:, None]
  err = np.abs(deq - k[0, 4])  # token 4, [K, H], quantized twice
  assert (err <= grown[:, None] * (1 + 1e-6)).all()
  assert (err > 0).any()  # not trivially exact


def test_freed_pages_start_from_a_fresh_scale():
  """Row 1's page held large values; freed and reused for small ones, its scale is
  theirs (the stale slots count for nothing) and the int8 entries are NumPy's."""
  q, k, v = _data(3)
  big = 100.0 * k
  cache, _ = _fill(_empty(), big, 100.0 * v, [[2, 4, 2]])
  page = int(np.asarray(cache.block_table)[1, 0])
  cache = jattn.paged.free(cache, jnp.array([False, True, False]))
  cache, (kp, vp) = _fill(cache, k, v, [[0, 2, 0]])  # 2 of 4 slots: 2 stale ones
  assert int(np.asarray(cache.block_table)[1, 0]) == page
  fresh, _ = _fill(_empty(), k, v, [[0, 2, 0]])
  fresh_page = int(np.asarray(fresh.block_table)[1, 0])
  np.testing.assert_allclose(np.asarray(cache.key_scales)[page],
                             np.asarray(fresh.key_scales)[fresh_page], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache.key_pages)[page, :, :2],
                                np.asarray(fresh.key_pages)[fresh_page, :, :2])
  np.testing.assert_allclose(np.abs(np.asarray(cache.key_scales)[page] * 127 -
                                    np.abs(k[1, :2]).max(axis=(0, 2))), 0, atol=1e-5)


def test_a_refused_append_under_jit_writes_nothing():
  q, k, v = _data(0)
  cache = jattn.paged.init_cache(B, MAX_LENGTH, num_kv_heads=K, head_dim=8, value_dim=6,
                                 page_size=PAGE, num_pages=3, dtype=jnp.int8)
  cache = jattn.paged.append(cache, jnp.asarray(k[:, :3]), jnp.asarray(v[:, :3]),
                             jnp.array([3, 3, 3]))
  grown = jax.jit(jattn.paged.append)(cache, jnp.asarray(k[:, 3:8]), jnp.asarray(v[:, 3:8]),
                                      jnp.array([5, 0, 0]))  # needs 1 more page: none free
  for a, b in zip(jax.tree.leaves(cache)[:5] + [cache.key_scales, cache.value_scales],
                  jax.tree.leaves(grown)[:5] + [grown.key_scales, grown.value_scales]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(grown.error) != 0


def _dense_from_pools(cache, pools):
  """(k [B, L, K, H], v [B, L, K, D]) float64 from the NumPy pools through the table."""
  L = int(FINAL.max())
  table = np.asarray(cache.block_table)
  out = []
  for pool in pools:
    deq = pool.dequantized()
    x = np.zeros((B, L) + (deq.shape[1], deq.shape[3]))
    for b in range(B):
      for s in range(FINAL[b]):
        x[b, s] = deq[table[b, s // PAGE], :, s % PAGE]
    out.append(x)
  return out


def _check(q, cache, pools, case, implementation, k=None, v=None, **extra):
  """Each row's last token against the full pass over the dequantized pages (tight),
  and, with the float k, v, against the full pass over them (quantization error)."""
  kwargs, causal, allowed, score, sinks = CASES[case]
  last = jnp.asarray(q[np.arange(B), FINAL - 1][:, None])  # [B, 1, N, H]
  got = np.asarray(jattn.decode_attention(last, cache, is_causal=causal,
                                          implementation=implementation, **kwargs,
                                          **extra))[:, 0]
  keep = (_s < FINAL[:, None, None, None]) & np.ones((1, N, 1, 1), bool)
  keep = keep & (_s <= _t) if causal else keep
  keep = keep if allowed is None else keep & allowed
  dk, dv = _dense_from_pools(cache, pools)
  want, _ = reference_mods(q, dk, dv, allowed=keep, score=score, sinks=sinks)
  np.testing.assert_allclose(got, want[np.arange(B), FINAL - 1], rtol=2e-5, atol=2e-5)
  if k is not None:
    exact, _ = reference_mods(q, k, v, allowed=keep, score=score, sinks=sinks)
    err = np.abs(got - exact[np.arange(B), FINAL - 1]).max()
    assert 0 < err < 0.05, err
  return got


@pytest.mark.parametrize("implementation", ["split", "xla"])
@pytest.mark.parametrize("case", ["user_mask", "sinks_window_alibi"])
def test_decode_equals_the_full_pass_over_the_dequantized_pages(implementation, case):
  q, k, v = _scaled(1)
  cache, pools = _fill(_empty(), k, v, _CALLS)
  _check(q, cache, pools, case, implementation, k, v)


@pytest.mark.interpret
@pytest.mark.parametrize("dtypes", [(jnp.int8, None), pytest.param(
    (jnp.float32, jnp.int8), marks=pytest.mark.thorough), pytest.param(
    (jnp.int8, jnp.float32), marks=pytest.mark.thorough)])
def test_paged_tpu_kernel_dequantizes_in_the_kernel(dtypes):
  """Keys and values int8 (CI), or one of them (thorough): the kernel's scales on the
  logits and on the probabilities, against float64. Two pages a step: row 0's first
  step is unmasked, row 2's last one short (its last page again, masked)."""
  q, k, v = _scaled(2)
  cache, pools = _fill_mixed(dtypes, k, v)
  with pallas_interpret():
    report = jattn.explain_decode(jnp.zeros((B, 1, N, 8)), cache, implementation="paged_tpu",
                                  is_causal=True, mask_mod=CASES["user_mask"][0]["mask_mod"])
    assert "dequantized in the kernel" in str(report.choices["cpu"].plan)
    _check(q, cache, pools, "none", "paged_tpu", k, v, pages_per_step=2)
    _check(q, cache, pools, "user_mask", "paged_tpu", k, v)


@pytest.mark.interpret
@pytest.mark.parametrize("dtypes", [(jnp.int8, None), pytest.param(
    (jnp.float32, jnp.int8), marks=pytest.mark.thorough), pytest.param(
    (jnp.int8, jnp.float32), marks=pytest.mark.thorough)])
def test_paged_gpu_kernel_dequantizes_in_the_kernel(dtypes):
  """The Triton kernel ("paged_gpu", interpreted): keys and values int8 (CI), or one of
  them (thorough); each key's page scale gathered by page id, on the logits and on the
  probabilities, against float64. Rows of 13, 4, 9 in pages of 4 (ragged, across page
  edges), G = 2 query heads per kv head; one page a step under a mask reading b and n,
  the default step (the entries past a row's list masked) with sinks, a window and
  ALiBi. Planted: the value scale left off the probabilities - this test failed."""
  q, k, v = _scaled(6)
  cache, pools = _fill_mixed(dtypes, k, v)
  with pallas_interpret():
    report = jattn.explain_decode(jnp.zeros((B, 1, N, 8)), cache, implementation="paged_gpu",
                                  is_causal=True)
    assert "dequantized in the kernel" in str(report.choices["cpu"].plan)
    _check(q, cache, pools, "user_mask", "paged_gpu", k, v, pages_per_step=1)
    _check(q, cache, pools, "sinks_window_alibi", "paged_gpu", k, v)


def _fill_mixed(dtypes, k, v):
  """_fill over pools of `dtypes` (keys, values; either may be float): a float pool's
  reference is its pages as they are."""
  cache, pools = _fill(_empty(*dtypes), k, v, _CALLS)
  if cache.key_scales is None:
    pools = (_Exact(cache.key_pages), pools[1])
  if cache.value_scales is None:
    pools = (pools[0], _Exact(cache.value_pages))
  return cache, pools


class _Exact:
  def __init__(self, pages):
    self.pages = np.asarray(pages)

  def dequantized(self):
    return self.pages.astype(np.float64)


@pytest.mark.compile
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_int8_kernel_compiles_for_tpu_without_a_dequantized_copy(generation):
  """The benchmark's shapes with int8 pages (B = 8 of up to 32k, N = 16, K = 4, H = 128,
  pages of 64, bfloat16 queries), compiled for a TPU from this host: the program calls
  the kernel, and its temporaries hold no dequantized pool (a pool's bytes in bfloat16
  would be 2x the int8 pool's). A query chunk with mods compiles too."""
  devices = _tpu_devices(generation)
  shard = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x",)), jax.P())
  B_, N_, K_, H_, ps, max_length, P_ = 8, 16, 4, 128, 64, 32768, 2400
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B_, max_length, num_kv_heads=K_, head_dim=H_, page_size=ps, num_pages=P_,
      dtype=jnp.int8))
  cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard), cache)
  int8_pool = 2 * P_ * ps * K_ * H_  # keys and values
  for T_, kwargs in ((1, dict(is_causal=True)),
                     (2, dict(mask_mod=jattn.mods.sliding_window(4000), sinks=jnp.zeros(N_),
                              score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N_))))):
    q = jax.ShapeDtypeStruct((B_, T_, N_, H_), jnp.bfloat16, sharding=shard)
    f = jax.jit(lambda q, c: jattn.decode_attention(q, c, implementation="paged_tpu", **kwargs))
    with jattn.lowering_for("tpu"):
      compiled = f.trace(q, cache).lower(lowering_platforms=("tpu",)).compile()
    assert "jattn_paged_decode_tpu" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < int8_pool / 8


@pytest.mark.parametrize("implementation", ["split", pytest.param(
    "paged_tpu", marks=pytest.mark.interpret), pytest.param(
    "paged_gpu", marks=pytest.mark.interpret)])
def test_nan_scales_and_full_int8_in_unread_pages_are_harmless(implementation):
  """NaN scales and 127s in every page the rows do not hold (free pages), and in the
  stale slots past each row's length (int8: as large as a value gets): the output is
  the full pass over what the rows hold."""
  q, k, v = _scaled(4)
  cache, pools = _fill(_empty(), k, v, _CALLS)
  table, free = np.asarray(cache.block_table), np.asarray(cache.page_free)
  stale = np.zeros((NUM_PAGES, PAGE), bool)
  for b in range(B):
    for j, page in enumerate(table[b]):
      if page >= 0:
        stale[page] = j * PAGE + np.arange(PAGE) >= FINAL[b]
  poison = free[:, None] | stale  # [P, S]
  cache = cache.__class__(
      jnp.where(poison[:, None, :, None], jnp.int8(127), cache.key_pages),
      jnp.where(poison[:, None, :, None], jnp.int8(-127), cache.value_pages),
      cache.block_table, cache.lengths, cache.page_free, cache.error,
      jnp.where(free[:, None], jnp.nan, cache.key_scales),
      jnp.where(free[:, None], jnp.nan, cache.value_scales))
  assert free.any() and stale.any()
  with pallas_interpret():
    got = _check(q, cache, pools, "sinks_window_alibi", implementation)
  assert np.isfinite(got).all()


def test_gradients_through_int8_pages_are_those_of_the_dequantized_cache():
  """jax.grad with respect to the query works (the "xla" path's, as float pages'):
  equal to the gradient over a float cache holding the dequantized values."""
  q, k, v = _scaled(5)
  cache, _ = _fill(_empty(), k, v, _CALLS)
  deq = cache.__class__(
      (cache.key_pages.astype(jnp.float32) * cache.key_scales[:, :, None, None]),
      (cache.value_pages.astype(jnp.float32) * cache.value_scales[:, :, None, None]),
      cache.block_table, cache.lengths, cache.page_free, cache.error)
  last = jnp.asarray(q[np.arange(B), FINAL - 1][:, None])
  loss = lambda q, c: jnp.sum(jnp.sin(jattn.decode_attention(q, c, is_causal=True)))
  got, want = jax.grad(loss)(last, cache), jax.grad(loss)(last, deq)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_dtypes_raise_or_refuse_with_the_reason():
  with raises(TypeError, "dtype", "int32"):
    _empty(jnp.int32)
  with raises(TypeError, "value_dtype", "uint8"):
    _empty(jnp.float32, jnp.uint8)
  cache = _empty(jnp.int8, jnp.float32)
  with raises(TypeError, "query", "bfloat16", "value_pages float32"):  # float pages: its dtype
    jattn.decode_attention(jnp.zeros((B, 1, N, 8), jnp.bfloat16), cache)
  with raises(TypeError, "query", "int8"):
    jattn.decode_attention(jnp.zeros((B, 1, N, 8), jnp.int8), _empty())
  with raises(ValueError, "paged_tpu", "float16"):
    jattn.explain_decode(jnp.zeros((B, 1, N, 8), jnp.float16), _empty(),
                         implementation="paged_tpu")
  # compiled (not interpreted), int8 pages of head dims 8 and 6 are no Triton tiles
  with raises(ValueError, "paged_gpu", "power-of-two sides"):
    jattn.explain_decode(jnp.zeros((B, 1, N, 8)), _empty(), implementation="paged_gpu")
