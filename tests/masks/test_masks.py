"""Mask helpers against plain NumPy constructions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import make_qkv
from tests.reference import reference_attention


def _np_causal(T, S):
  return np.array([[j <= i for j in range(S)] for i in range(T)])


def _np_local(T, S, left, right):
  return np.array([[i - left <= j <= i + right for j in range(S)]
                   for i in range(T)])


@pytest.mark.parametrize("T,S", [(4, 4), (3, 5), (5, 3), (1, 1)])
def test_causal_mask(T, S):
  mask = jattn.causal_mask(T, S)
  assert mask.shape == (T, S) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask, _np_causal(T, S))


@pytest.mark.parametrize("T,S,window,left_right", [
    (5, 5, 0, (0, 0)),
    (5, 5, 1, (1, 1)),
    (6, 4, (2, 0), (2, 0)),
    (4, 7, (0, 3), (0, 3)),
    (5, 5, (1, 2), (1, 2)),
])
def test_local_mask(T, S, window, left_right):
  mask = jattn.local_mask(T, S, window)
  assert mask.shape == (T, S) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask, _np_local(T, S, *left_right))


@pytest.mark.parametrize("q_lengths,kv_lengths", [
    ([2, 4], [3, 5]), ([1, 4], None), (None, [0, 5])])
def test_padding_mask(q_lengths, kv_lengths):
  T, S = 4, 5
  mask = jattn.padding_mask(
      None if q_lengths is None else jnp.asarray(q_lengths, jnp.int32),
      None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32), T, S)
  assert mask.shape == (2, 1, T, S) and mask.dtype == jnp.bool_
  want = np.ones((2, 1, T, S), bool)
  for b in range(2):
    for t in range(T):
      for s in range(S):
        if q_lengths is not None and t >= q_lengths[b]:
          want[b, 0, t, s] = False
        if kv_lengths is not None and s >= kv_lengths[b]:
          want[b, 0, t, s] = False
  np.testing.assert_array_equal(mask, want)


def test_padding_mask_under_jit():
  f = jax.jit(jattn.padding_mask, static_argnums=(2, 3))
  mask = f(jnp.array([1, 3], jnp.int32), jnp.array([2, 2], jnp.int32), 3, 4)
  want = np.zeros((2, 1, 3, 4), bool)
  want[0, 0, :1, :2] = True
  want[1, 0, :3, :2] = True
  np.testing.assert_array_equal(mask, want)


def test_segment_mask():
  q_ids = np.array([[0, 0, 1], [2, 3, 3]], np.int32)
  kv_ids = np.array([[0, 1, 1, 1], [3, 2, 2, 5]], np.int32)
  mask = jattn.segment_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  assert mask.shape == (2, 1, 3, 4) and mask.dtype == jnp.bool_
  want = np.zeros((2, 1, 3, 4), bool)
  for b in range(2):
    for t in range(3):
      for s in range(4):
        want[b, 0, t, s] = q_ids[b, t] == kv_ids[b, s]
  np.testing.assert_array_equal(mask, want)


def test_combine_masks():
  rng = np.random.default_rng(0)
  a = rng.random((2, 1, 4, 5)) < 0.6
  b = _np_causal(4, 5)
  c = rng.random((1, 3, 4, 1)) < 0.8
  combined = jattn.combine_masks(jnp.asarray(a), None, jnp.asarray(b),
                                 jnp.asarray(c))
  assert combined.dtype == jnp.bool_
  np.testing.assert_array_equal(combined, a & b & c)


def test_combine_masks_none_and_single():
  assert jattn.combine_masks() is None
  assert jattn.combine_masks(None, None) is None
  a = np.array([[True, False], [False, True]])
  np.testing.assert_array_equal(jattn.combine_masks(None, jnp.asarray(a)), a)


def test_masks_compose_into_attention():
  """Helper masks passed as `mask` equal the corresponding keyword options."""
  rng = np.random.default_rng(1)
  q, k, v = make_qkv(rng, B=2, T=5, S=5, N=2, H=4)
  q_len = np.array([3, 5], np.int32)
  kv_len = np.array([4, 2], np.int32)
  seg = np.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]], np.int32)
  mask = jattn.combine_masks(
      jattn.causal_mask(5, 5), jattn.local_mask(5, 5, (2, 0)),
      jattn.padding_mask(jnp.asarray(q_len), jnp.asarray(kv_len), 5, 5),
      jattn.segment_mask(jnp.asarray(seg), jnp.asarray(seg)))
  out = jattn.dot_product_attention(q, k, v, mask=mask)
  want = reference_attention(
      q, k, v, is_causal=True, local_window_size=(2, 0),
      query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
      q_segment_ids=seg, kv_segment_ids=seg)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  keywords = jattn.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(2, 0),
      query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
      q_segment_ids=seg, kv_segment_ids=seg)
  np.testing.assert_allclose(out, keywords, atol=1e-6, rtol=1e-6)


def test_padding_mask_with_one_side_unpadded_broadcasts_over_any_batch():
  """lengths on one side only, B = 3: [B, 1, T, S], True where the given side is valid."""
  T, S = 4, 5
  got = np.asarray(jattn.padding_mask(np.array([1, 4, 0]), None, T, S))
  want = (np.arange(T)[None, :, None] < np.array([1, 4, 0])[:, None, None]).repeat(S, 2)
  np.testing.assert_array_equal(got, want[:, None])
  got = np.asarray(jattn.padding_mask(None, np.array([2, 5, 0]), T, S))
  want = (np.arange(S)[None, None, :] < np.array([2, 5, 0])[:, None, None]).repeat(T, 1)
  np.testing.assert_array_equal(got, want[:, None])
