"""The splash mask's block classes in closed form (jattn/_src/impl/splash_mask.py),
against the expression evaluated on every entry of each block, in NumPy."""

import itertools

import numpy as np
import pytest

from jattn._src.impl.splash_mask import EMPTY, FULL, PARTIAL, block_class, evaluate, splash_mask

EXPRESSIONS = [
    ("causal",), ("local", 3, 0), ("local", 0, 2), ("local", 5, 4), ("chunk", 3),
    ("chunk", 8), ("full",), ("and",), ("and", ("causal",), ("local", 4, 0)),
    ("or", ("chunk", 4), ("local", 1, 1)), ("and", ("or", ("chunk", 6), ("causal",)),
                                            ("local", 7, 2)),
]


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=str)
def test_block_classes_are_exact_where_they_say_full_or_empty(expr):
  T, S = 20, 23
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  dense = np.broadcast_to(evaluate(expr, t, s), (T, S))
  seen = set()
  for t0, s0, bt, bs in itertools.product(range(0, T, 3), range(0, S, 2), (1, 4, 7), (1, 5)):
    t1, s1 = min(T, t0 + bt), min(S, s0 + bs)
    block = dense[t0:t1, s0:s1]
    got = block_class(expr, t0, t1, s0, s1)
    seen.add(got)
    if got == FULL:
      assert block.all(), (t0, t1, s0, s1)
    elif got == EMPTY:
      assert not block.any(), (t0, t1, s0, s1)
    else:  # partial may be conservative, but not for a one-entry block
      assert got == PARTIAL and (block.size > 1 or expr[0] in ("and", "or")), (t0, s0)
  if expr[0] in ("causal", "local", "chunk"):
    assert {FULL, EMPTY} <= seen  # the sweep reaches both closed forms


def test_the_splash_mask_gives_the_expression_per_block():
  expr = ("or", ("chunk", 4), ("local", 2, 0))
  mask = splash_mask(expr, 16, 12)
  dense = evaluate(expr, np.arange(16)[:, None], np.arange(12)[None, :])
  for t0, s0 in itertools.product(range(0, 16, 4), range(0, 12, 4)):
    block = mask[t0:t0 + 4, s0:s0 + 4]
    np.testing.assert_array_equal(block, dense[t0:t0 + 4, s0:s0 + 4])
    assert bool(block.any()) == bool(dense[t0:t0 + 4, s0:s0 + 4].any())
    assert bool(block.all()) == bool(dense[t0:t0 + 4, s0:s0 + 4].all())
  assert mask == splash_mask(expr, 16, 12) and hash(mask) == hash(splash_mask(expr, 16, 12))
  assert mask != splash_mask(("chunk", 4), 16, 12)


# The same expressions written again in NumPy, independently of `evaluate`.
BY_HAND = {
    ("causal",): lambda t, s: s <= t,
    ("local", 3, 0): lambda t, s: (s >= t - 3) & (s <= t),
    ("local", 0, 2): lambda t, s: (s >= t) & (s <= t + 2),
    ("local", 5, 4): lambda t, s: (s >= t - 5) & (s <= t + 4),
    ("chunk", 3): lambda t, s: t // 3 == s // 3,
    ("chunk", 8): lambda t, s: t // 8 == s // 8,
    ("full",): lambda t, s: np.ones(np.broadcast(t, s).shape, bool),
    ("and",): lambda t, s: np.ones(np.broadcast(t, s).shape, bool),
    ("or",): lambda t, s: np.zeros(np.broadcast(t, s).shape, bool),  # or of nothing: no key
    ("and", ("causal",), ("local", 4, 0)): lambda t, s: (s <= t) & (s >= t - 4),
    ("or", ("chunk", 4), ("local", 1, 1)): lambda t, s: (t // 4 == s // 4) | (abs(s - t) <= 1),
    ("and", ("or", ("chunk", 6), ("causal",)), ("local", 7, 2)):
        lambda t, s: ((t // 6 == s // 6) | (s <= t)) & (s >= t - 7) & (s <= t + 2),
    ("or", ("causal",)): lambda t, s: s <= t,
    ("and", ("local", 2, 2)): lambda t, s: abs(s - t) <= 2,
    ("or", ("local", 0, 0), ("chunk", 5), ("local", 3, 0)):
        lambda t, s: (s == t) | (t // 5 == s // 5) | ((s >= t - 3) & (s <= t)),
    ("and", ("chunk", 7), ("local", 6, 6), ("causal",)):
        lambda t, s: (t // 7 == s // 7) & (abs(s - t) <= 6) & (s <= t),
}


@pytest.mark.parametrize("expr", sorted(BY_HAND, key=str), ids=str)
def test_evaluate_matches_numpy_by_hand(expr):
  T, S = 20, 23
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  want = np.broadcast_to(BY_HAND[expr](t, s), (T, S))
  np.testing.assert_array_equal(np.broadcast_to(evaluate(expr, t, s), (T, S)), want)
  import jax.numpy as jnp  # the kernel calls it on jax arrays
  got = evaluate(expr, jnp.asarray(t, jnp.int32), jnp.asarray(s, jnp.int32))
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), (T, S)), want)


@pytest.mark.parametrize("expr", [e for e in BY_HAND if e[0] not in ("and", "or") or len(e) <= 2],
                         ids=str)
def test_block_classes_of_one_part_are_exact(expr):
  """Causal, local, chunk and full (alone, or the one part of an and / or) are classified
  exactly: a block that is wholly True is FULL, wholly False EMPTY, else PARTIAL."""
  T, S = 21, 25
  dense = np.broadcast_to(BY_HAND[expr](np.arange(T)[:, None], np.arange(S)[None, :]), (T, S))
  for t0, s0, bt, bs in itertools.product(range(0, T, 2), range(0, S, 3), (1, 2, 5, 8), (1, 3, 6)):
    t1, s1 = min(T, t0 + bt), min(S, s0 + bs)
    block = dense[t0:t1, s0:s1]
    want = FULL if block.all() else EMPTY if not block.any() else PARTIAL
    assert block_class(expr, t0, t1, s0, s1) == want, (t0, t1, s0, s1)


def test_the_splash_mask_outside_whole_blocks():
  """Uniform blocks answer any/all with an axis too, and a block past the grid's end is clipped."""
  expr = ("causal",)
  mask = splash_mask(expr, 16, 16)
  dense = np.arange(16)[None, :] <= np.arange(16)[:, None]
  full, empty, partial = mask[8:16, 0:8], mask[0:8, 8:16], mask[4:12, 4:12]
  for got, want in ((full.any(axis=0), np.ones(8, bool)), (full.any(0), np.ones(8, bool)),
                    (empty.all(axis=1), np.zeros(8, bool)), (empty.all(1), np.zeros(8, bool)),
                    (empty.any(1, keepdims=True), np.zeros((8, 1), bool))):
    assert np.shape(got) == want.shape  # an axis asked for: one value per row or column
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(full.all(axis=(0, 1)), True)
  assert bool(full.all()) and not bool(empty.any()) and full.shape == empty.shape == (8, 8)
  one_full, one_empty = mask[5:6, 2:3], mask[2:3, 5:6]  # blocks of one entry
  assert bool(one_full.all()) and bool(one_full.any()) and one_full.shape == (1, 1)
  assert not bool(one_empty.any()) and not bool(one_empty.all())
  np.testing.assert_array_equal(partial, dense[4:12, 4:12])
  np.testing.assert_array_equal(mask[12:20, 0:4], dense[12:16, 0:4])  # clipped to T
  np.testing.assert_array_equal(mask[:, :], dense)
  assert mask.shape == (16, 16)
  assert mask != ("causal",) and mask != splash_mask(expr, 16, 8)


@pytest.mark.parametrize("T,S", [(4, 8), (8, 4)])
def test_the_splash_mask_when_t_and_s_differ(T, S):
  """Open slices run to T on the query axis and to S on the key axis."""
  for expr in (("full",), ("causal",), ("local", 3, 0)):
    mask = splash_mask(expr, T, S)
    dense = np.broadcast_to(BY_HAND[expr](np.arange(T)[:, None], np.arange(S)[None, :]), (T, S))
    for t, s in ((slice(None), slice(None)), (slice(2, None), slice(1, None)),
                 (slice(0, T), slice(0, S))):
      block = mask[t, s]
      assert np.shape(block) == dense[t, s].shape, (expr, t, s)
      np.testing.assert_array_equal(block, dense[t, s])


def test_the_splash_mask_takes_only_slices():
  """As splash's own computable masks: an index that is not two slices is refused."""
  mask = splash_mask(("causal",), 8, 8)
  for idx in ((3, slice(0, 4)), (slice(0, 4), 3), (3, 3)):
    with pytest.raises(NotImplementedError):
      mask[idx]
