"""The closed-form block classes of jattn.mods' ready-made masks against a brute-force
NumPy classification of the dense grid: odd sizes, blocks that divide neither T nor S,
ranges at global offsets (a ring's). Exact where the formula is; where it may only be
conservative (documents with skipped ids, and/or of parts), never wrong: EMPTY only
for an empty block, FULL only for a full one.
"""

import numpy as np
import pytest

from jattn import mods
from jattn._closed_form_blocks import closed_form_classes

EMPTY, PARTIAL, FULL = 0, 1, 2
B, T, S, BQ, BK = 2, 23, 19, 5, 4
Q_OFF, KV_OFF = 7, 3  # this range's first query / key, globally
_rng = np.random.default_rng(0)
PACKED = np.repeat(np.arange(9), 5)[None, :40].repeat(B, 0)  # documents 0, 1, 2.. of 5
PACKED[1] = np.repeat(np.arange(5), 8)[:40]
GAPPY = np.sort(_rng.integers(0, 6, (B, 40)), axis=-1)  # sorted, may skip ids
PREFIX = np.array([12, 0])


def _grid():
  t = (Q_OFF + np.arange(T))[None, :, None]
  s = (KV_OFF + np.arange(S))[None, None, :]
  return t, s


def _allowed(name):
  """bool [B|1, T, S], written plainly from each mask's definition."""
  t, s = _grid()
  b = np.arange(B)[:, None, None]
  return {
      "causal": s <= t,
      "sliding_window": (s >= t - 6) & (s <= t + 2),
      "chunked": t // 6 == s // 6,
      "prefix_lm": (s <= t) | (s < PREFIX[b]),
      "document": PACKED[b, t] == PACKED[b, s],
      "document_gappy": GAPPY[b, t] == GAPPY[b, s],
      "and": (s <= t) & (PACKED[b, t] == PACKED[b, s]),
      "or": ((s >= t - 1) & (s <= t)) | (t // 6 == s // 6),
  }[name]


MODS = {
    "causal": mods.causal(), "sliding_window": mods.sliding_window(6, 2),
    "chunked": mods.chunked(6), "prefix_lm": mods.prefix_lm(PREFIX),
    "document": mods.document(PACKED), "document_gappy": mods.document(GAPPY),
    "and": mods.and_masks(mods.causal(), mods.document(PACKED)),
    "or": mods.or_masks(mods.sliding_window(1, 0), mods.chunked(6)),
}
EXACT = {"causal", "sliding_window", "chunked", "prefix_lm", "document"}


def _brute(allowed):
  nq, nk = -(-T // BQ), -(-S // BK)
  out = np.zeros((allowed.shape[0], nq, nk), int)
  for i in range(nq):
    for j in range(nk):
      block = allowed[:, i * BQ:(i + 1) * BQ, j * BK:(j + 1) * BK]
      out[:, i, j] = np.where(block.all((1, 2)), FULL,
                              np.where(block.any((1, 2)), PARTIAL, EMPTY))
  return out


@pytest.mark.parametrize("name", sorted(MODS))
def test_closed_form_matches_brute_force(name):
  got = np.asarray(closed_form_classes(MODS[name], B, T, S, BQ, BK, Q_OFF, KV_OFF))
  assert got.shape[1] == 1
  want = np.broadcast_to(_brute(_allowed(name)), (B,) + got.shape[2:])
  got = np.broadcast_to(got[:, 0], want.shape)
  if name in EXACT:
    np.testing.assert_array_equal(got, want)
  else:  # conservative: a wrong EMPTY would drop keys, a wrong FULL skip the mask
    assert not np.any((got == EMPTY) & (want != EMPTY))
    assert not np.any((got == FULL) & (want != FULL))


def test_unrecognised_masks_are_left_to_mask_mod():
  assert closed_form_classes(lambda b, n, t, s: s <= t, B, T, S, BQ, BK) is None
  assert closed_form_classes(mods.and_masks(mods.causal(), lambda b, n, t, s: s > 0),
                             B, T, S, BQ, BK) is None


def test_blockwise_uses_the_closed_form_not_mask_mod_on_every_block(monkeypatch):
  """A ready-made mask passed in the call is classified without evaluating mask_mod on
  the whole grid (that path is made to fail here), and the result is still right."""
  import jattn
  from jattn import _blockwise
  from tests.test_mods import BS, IDS_KV, IDS_Q, KEY, Q, V, reference

  def refuse(*args, **kwargs):
    raise AssertionError("mask_mod evaluated on every block of a ready-made mask")

  monkeypatch.setattr(_blockwise, "classify", refuse)
  mask_mod = mods.and_masks(mods.document(IDS_Q, IDS_KV), mods.causal())
  got = jattn.dot_product_attention(Q, KEY, V, mask_mod=mask_mod, implementation="blockwise",
                                    block_sizes=BS)
  t, s = np.arange(Q.shape[1])[:, None], np.arange(KEY.shape[1])[None, :]
  allowed = (IDS_Q[:, None, :, None] == IDS_KV[:, None, None, :]) & (s <= t)
  np.testing.assert_allclose(got, reference(Q, KEY, V, allowed=allowed)[0], rtol=2e-5,
                             atol=2e-5)
