"""The KV cache's pure functions (jattn/_src/nn/kv_cache.py) by themselves, against a
NumPy loop that writes token by token: per-row positions, lengths, writes that run
past the cache's end, both layouts, flax's scalar index, the decoding mask, and
what a decoding call refuses. Milliseconds each; the modules' decoding against
a full pass is in test_decode.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jattn._src.nn import kv_cache
from tests.helpers import raises

B, S, K, H = 4, 9, 2, 3


def written_by_hand(cache, new, index, lengths):
  """[B, S, K, H] rows layout: new[b, t] at index[b] + t for t < lengths[b], inside S."""
  out = np.array(cache, np.float64)
  for b in range(cache.shape[0]):
    for t in range(lengths[b]):
      if 0 <= index[b] + t < cache.shape[1]:
        out[b, index[b] + t] = new[b, t]
  return out


@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_write_puts_each_row_at_its_own_position(T, layout):
  rng = np.random.default_rng(T)
  cache = rng.standard_normal((B, S, K, H)).astype(np.float32)
  new = rng.standard_normal((B, T, K, H)).astype(np.float32)
  index = np.array([0, 2, S - 2, S], np.int32)  # the third runs past S, the last is full
  lengths = np.array([T, max(T - 1, 0), T, T], np.int32)
  want = written_by_hand(cache, new, index, lengths)
  if layout == "rows":
    got = kv_cache.write(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(index),
                         jnp.asarray(lengths), token_axis=1)
  else:  # [B, K, H, S]
    to = lambda x: np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))
    got = kv_cache.write(jnp.asarray(to(cache)), jnp.asarray(to(new)), jnp.asarray(index),
                         jnp.asarray(lengths), token_axis=-1)
    got = np.transpose(np.asarray(got), (0, 3, 1, 2))
  np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_write_casts_to_the_cache_dtype():
  cache = jnp.zeros((1, 4, 1, 2), jnp.bfloat16)
  new = jnp.full((1, 2, 1, 2), 1.25, jnp.float32)
  got = kv_cache.write(cache, new, jnp.array([1]), jnp.array([2]), token_axis=1)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32)[0, :, 0, 0], [0, 1.25, 1.25, 0])


def test_decode_mask_is_causal_from_each_rows_position():
  index, T, S_ = np.array([0, 3, 6]), 3, 8
  got = np.asarray(kv_cache.decode_mask(jnp.asarray(index), T, S_))
  want = np.arange(S_)[None, None, None, :] <= (index[:, None, None, None]
                                                   + np.arange(T)[None, None, :, None])
  assert got.shape == (3, 1, T, S_)
  np.testing.assert_array_equal(got, want)


def test_check_lengths():
  full = kv_cache.check_lengths(None, 3, 7)
  assert full.dtype == jnp.int32
  np.testing.assert_array_equal(full, [7, 7, 7])
  got = kv_cache.check_lengths(np.array([1, 0, 7], np.int64), 3, 7)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, [1, 0, 7])
  with raises(TypeError, "lengths must be an integer array", "float32", "(3,)"):
    kv_cache.check_lengths(np.ones(3, np.float32), 3, 7)
  with raises(ValueError, r"lengths: expected shape \[B\]", "(3,)", "(2,)"):
    kv_cache.check_lengths(np.ones(2, np.int32), 3, 7)
  with raises(ValueError, r"lengths: expected shape \[B\]", "(3, 1)"):
    kv_cache.check_lengths(np.ones((3, 1), np.int32), 3, 7)


def test_step_per_row_and_with_flaxs_scalar_index():
  rng = np.random.default_rng(0)
  T = 3
  ck, cv = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
  k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
  index, lengths = np.array([0, 1, 4, 6], np.int32), np.array([3, 2, 0, 3], np.int32)
  k2, v2, new_index, mask = kv_cache.step(ck, cv, jnp.asarray(index), k, v,
                                          jnp.asarray(lengths), token_axis=1)
  np.testing.assert_array_equal(k2, written_by_hand(ck, k, index, lengths))
  np.testing.assert_array_equal(v2, written_by_hand(cv, v, index, lengths))
  np.testing.assert_array_equal(new_index, index + lengths)
  np.testing.assert_array_equal(
      mask, np.arange(S)[None, None, None, :] <= (index[:, None, None, None]
                                                  + np.arange(T)[None, None, :, None]))
  # flax's protocol: one scalar position for the batch, every row writes all T tokens
  k2, v2, new_index, mask = kv_cache.step(ck, cv, jnp.int32(2), k, v, jnp.full((B,), T),
                                          token_axis=1)
  assert new_index.shape == () and int(new_index) == 2 + T
  np.testing.assert_array_equal(k2, written_by_hand(ck, k, [2] * B, [T] * B))
  np.testing.assert_array_equal(v2, written_by_hand(cv, v, [2] * B, [T] * B))
  assert mask.shape == (B, 1, T, S)
  np.testing.assert_array_equal(
      mask[0, 0], np.arange(S)[None, :] <= 2 + np.arange(T)[:, None])


def test_check_call_refuses_what_decoding_cannot_do():
  kv_cache.check_call(True, T=2, new_keys=2)  # accepted
  kv_cache.check_call(False, T=2, new_keys=2, per_row=False)  # flax's protocol: causal anyway
  with raises(ValueError, "same new tokens", "T = 2 queries and 3 keys"):
    kv_cache.check_call(True, T=2, new_keys=3)
  with raises(ValueError, "same new tokens"):
    kv_cache.check_call(True, T=2, new_keys=3, per_row=False)
  with raises(ValueError, "is_causal=True"):
    kv_cache.check_call(False, T=2, new_keys=2)
  with raises(ValueError, "lengths: a cache made by flax's init_cache"):
    kv_cache.check_call(True, T=2, new_keys=2, per_row=False, lengths=np.array([1]))


def test_check_batch_reads_the_batch_on_axis_0_of_either_layout():
  kv_cache.check_batch(B, (B, S, K, H))  # rows: accepted
  kv_cache.check_batch(B, (B, K, H, S))  # columns: accepted
  for shape in ((B, S, K, H), (B, K, H, S)):
    with raises(ValueError, "decode: inputs batch B = 3 does not match the cache",
                str(shape)):
      kv_cache.check_batch(3, shape)


def test_mods_from_positions_shift_the_query_position():
  start = jnp.array([0, 5], jnp.int32)
  mask_mod, score_mod = kv_cache.mods_from_positions(
      start, lambda b, n, t, s: s <= t, lambda x, b, n, t, s: x + (10 * t + s + 100 * n).astype(jnp.float32))
  for b, t, s in ((0, 1, 1), (0, 1, 2), (1, 1, 6), (1, 1, 7), (1, 0, 4)):
    want_t = int(start[b]) + t
    b, t, s = (jnp.int32(x) for x in (b, t, s))
    assert bool(mask_mod(b, jnp.int32(0), t, s)) == (int(s) <= want_t)
    assert float(score_mod(jnp.float32(0.5), b, jnp.int32(2), t, s)) == 0.5 + 10 * want_t + int(s) + 200
  assert kv_cache.mods_from_positions(start, None, None) == (None, None)
