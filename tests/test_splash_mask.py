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
