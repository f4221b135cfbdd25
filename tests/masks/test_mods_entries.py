"""Each ready-made mod of `jattn.mods` called by itself, on a whole index grid,
against the same formula written in NumPy (float64): no attention call, so a
wrong entry, sign, default or refusal shows in milliseconds.

The mods are elementwise in (b, n, t, s), so calling one with broadcast index
arrays gives its value at every entry of a [B, N, T, S] grid at once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import mods
from tests.helpers import raises

B, N, T, S = 3, 4, 19, 17
t_ = np.arange(T)[None, None, :, None]
s_ = np.arange(S)[None, None, None, :]
b_ = np.arange(B)[:, None, None, None]
n_ = np.arange(N)[None, :, None, None]
GRID = tuple(jnp.asarray(x, jnp.int32) for x in (b_, n_, t_, s_))

_rng = np.random.default_rng(3)
PREFIX = np.array([5, 0, 11], np.int32)
IDS_Q = np.sort(_rng.integers(0, 4, (B, T)), axis=-1).astype(np.int32)
IDS_KV = np.sort(_rng.integers(0, 4, (B, S)), axis=-1).astype(np.int32)
SLOPES = np.array([0.5, -0.25, 0.125, 2.0], np.float32)
TABLE = _rng.standard_normal((N, 2 * 3 + 1)).astype(np.float32)
LOGITS = (3 * _rng.standard_normal((B, N, T, S))).astype(np.float32)

MASKS = {
    "causal": (mods.causal(), s_ <= t_),
    "sliding_window": (mods.sliding_window(3, 2), (s_ >= t_ - 3) & (s_ <= t_ + 2)),
    "sliding_window_left_only": (mods.sliding_window(4), (s_ >= t_ - 4) & (s_ <= t_)),
    "chunked": (mods.chunked(5), t_ // 5 == s_ // 5),
    "chunked_1": (mods.chunked(1), t_ == s_),
    "prefix_lm": (mods.prefix_lm(PREFIX), (s_ <= t_) | (s_ < PREFIX[b_])),
    "document": (mods.document(IDS_Q, IDS_KV), IDS_Q[:, None, :, None] == IDS_KV[:, None, None, :]),
    "and_masks": (mods.and_masks(mods.causal(), mods.sliding_window(2)),
                  (s_ <= t_) & (s_ >= t_ - 2)),
    "and_of_three": (mods.and_masks(mods.chunked(6), mods.sliding_window(2, 2), mods.causal()),
                     (t_ // 6 == s_ // 6) & (abs(s_ - t_) <= 2) & (s_ <= t_)),
    "or_masks": (mods.or_masks(mods.chunked(4), mods.sliding_window(1, 1)),
                 (t_ // 4 == s_ // 4) | (abs(s_ - t_) <= 1)),
    "or_of_one": (mods.or_masks(mods.sliding_window(0, 3)), (s_ >= t_) & (s_ <= t_ + 3)),
}
SCORES = {
    "soft_cap": (mods.soft_cap(0.7), lambda l: 0.7 * np.tanh(l / 0.7)),
    "soft_cap_array": (mods.soft_cap(np.float32(2.5)), lambda l: 2.5 * np.tanh(l / 2.5)),
    "alibi": (mods.alibi(SLOPES), lambda l: l + SLOPES[n_] * (s_ - t_)),
    # distances up to +-18 against M = 3: the table's both ends are read
    "relative_bias": (mods.relative_bias(TABLE),
                      lambda l: l + TABLE[n_, np.clip(s_ - t_, -3, 3) + 3]),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_mod_on_the_grid(name):
  mod, allowed = MASKS[name]
  got = np.broadcast_to(np.asarray(mod(*GRID)), (B, N, T, S))
  np.testing.assert_array_equal(got, np.broadcast_to(allowed, (B, N, T, S)), err_msg=name)
  one = mod(jnp.int32(1), jnp.int32(2), jnp.int32(7), jnp.int32(6))  # one entry, as jattn calls it
  assert one.dtype == jnp.bool_ and one.shape == ()
  assert bool(one) == bool(np.broadcast_to(allowed, (B, N, T, S))[1, 2, 7, 6])


def test_and_or_of_no_masks():
  """and_masks() allows everything, or_masks() nothing (the empty AND / OR)."""
  assert bool(np.all(mods.and_masks()(*GRID)))
  assert not bool(np.any(mods.or_masks()(*GRID)))


def test_document_defaults_to_self_attention():
  mod = mods.document(IDS_Q)
  assert mod.kv_segment_ids is mod.q_segment_ids
  s = np.arange(T)[None, None, None, :]
  got = np.broadcast_to(np.asarray(mod(GRID[0], GRID[1], GRID[2], jnp.asarray(s))), (B, N, T, T))
  np.testing.assert_array_equal(
      got, np.broadcast_to(IDS_Q[:, None, :, None] == IDS_Q[:, None, None, :], (B, N, T, T)))


@pytest.mark.parametrize("name", sorted(SCORES))
def test_score_mod_on_the_grid(name):
  mod, score = SCORES[name]
  got = mod(jnp.asarray(LOGITS), *GRID)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float64), score(LOGITS.astype(np.float64)),
                             rtol=1e-6, atol=1e-6, err_msg=name)


def test_score_mods_keep_the_score_dtype():
  for name, (mod, _) in SCORES.items():
    out = mod(jnp.bfloat16(1.5), jnp.int32(0), jnp.int32(1), jnp.int32(4), jnp.int32(2))
    assert out.dtype == jnp.bfloat16, name


@pytest.mark.parametrize("num_heads", [1, 2, 3, 8])
def test_alibi_slopes_are_geometric(num_heads):
  want = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
  got = mods.alibi_slopes(num_heads)
  assert got.dtype == jnp.float32 and got.shape == (num_heads,)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)


def test_constructors_refuse_bad_parameters():
  for size in (0, -2):
    with raises(ValueError, "chunked", "size must be a positive int", repr(size)):
      mods.chunked(size)
  for cap in (0, 0.0, -1.5):
    with raises(ValueError, "soft_cap", "cap must be positive", repr(cap)):
      mods.soft_cap(cap)
  mods.soft_cap(1e-3)
  mods.soft_cap(jnp.float32(0.5))  # an array cap (learnable) is not checked on the host
  for slopes in (np.ones((2, 2), np.float32), np.float32(1.0)):
    with raises(ValueError, r"alibi: slopes must be \[N\]"):
      mods.alibi(slopes)
  for shape in ((4, 6), (4, 4), (7,), (2, 3, 5)):
    with raises(ValueError, r"relative_bias: table must be \[N, 2M \+ 1\]", str(shape)):
      mods.relative_bias(np.zeros(shape, np.float32))
  for width in (1, 3, 5, 9):  # M = 0 (the bias of distance 0 only), 1, 2, 4
    mods.relative_bias(np.zeros((2, width), np.float32))


def test_parameters_are_kept_as_given():
  assert (mods.sliding_window(5, 1).left, mods.sliding_window(5, 1).right) == (5, 1)
  assert mods.sliding_window(5).right == 0
  assert mods.chunked(7).size == 7
  assert mods.SlidingWindow(5).right == 0  # the public class's own default, as sliding_window's


def test_ready_made_mods_are_frozen_and_hashable():
  """Frozen values: those without arrays compare by their parameters (a jit may key on
  them), those with arrays by identity; every one can be hashed."""
  assert mods.sliding_window(3, 1) == mods.sliding_window(3, 1)
  assert mods.sliding_window(3, 1) != mods.sliding_window(3, 2)
  assert mods.causal() == mods.causal() and mods.chunked(4) == mods.chunked(4)
  assert mods.and_masks(mods.causal()) == mods.and_masks(mods.causal())
  assert mods.or_masks(mods.causal()) == mods.or_masks(mods.causal())
  assert len({mods.sliding_window(3, 1), mods.sliding_window(3, 1), mods.chunked(2)}) == 2
  with_arrays = [mods.prefix_lm(PREFIX), mods.document(IDS_Q, IDS_KV), mods.soft_cap(0.5),
                 mods.soft_cap(jnp.float32(0.5)), mods.soft_cap(jnp.float32(0.5)),
                 mods.alibi(SLOPES), mods.relative_bias(TABLE)]
  assert len(set(with_arrays)) == len(with_arrays)
  every = [mods.causal(), mods.sliding_window(1), mods.chunked(2), mods.and_masks(),
           mods.or_masks()] + with_arrays
  for mod in every:
    field = dataclasses.fields(mod)[0].name if dataclasses.fields(mod) else "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(mod, field, 1)


def test_pytrees_carry_arrays_as_leaves_and_ints_as_static():
  leaves = lambda m: jax.tree_util.tree_leaves(m)
  assert leaves(mods.causal()) == [] and leaves(mods.sliding_window(3, 1)) == []
  assert leaves(mods.chunked(4)) == []
  assert [x is PREFIX for x in leaves(mods.prefix_lm(PREFIX))] == [True]
  assert [x is y for x, y in zip(leaves(mods.document(IDS_Q, IDS_KV)), (IDS_Q, IDS_KV))] == [True, True]
  assert [x is SLOPES for x in leaves(mods.alibi(SLOPES))] == [True]
  assert [x is TABLE for x in leaves(mods.relative_bias(TABLE))] == [True]
  both = mods.and_masks(mods.prefix_lm(PREFIX), mods.or_masks(mods.document(IDS_Q), mods.causal()))
  assert len(leaves(both)) == 3
  # static ints differ -> different treedefs; arrays differ -> the same treedef
  treedef = lambda m: jax.tree_util.tree_structure(m)
  assert treedef(mods.sliding_window(3, 1)) != treedef(mods.sliding_window(3, 2))
  assert treedef(mods.chunked(3)) != treedef(mods.chunked(4))
  assert treedef(mods.alibi(SLOPES)) == treedef(mods.alibi(2 * SLOPES))
  # through jit, arrays traced: the values are those of the arrays passed
  f = jax.jit(lambda m, x: m(x, *GRID))
  np.testing.assert_allclose(np.asarray(f(mods.alibi(2 * SLOPES), jnp.asarray(LOGITS)), np.float64),
                             LOGITS + 2 * SLOPES[n_].astype(np.float64) * (s_ - t_), rtol=1e-6,
                             atol=1e-6)
