"""The closed-form block classes of jattn.mods' ready-made masks against a brute-force
NumPy classification of the dense grid: odd sizes, blocks that divide neither T nor S,
ranges at global offsets (a ring's), block edges on the mask edges. Exact where the
formula is; where it may only be conservative (documents with skipped ids, and/or of
parts), never wrong: EMPTY only for an empty block, FULL only for a full one.
"""

import numpy as np
import pytest

from jattn import mods
from jattn._src.masks.closed_form_blocks import closed_form_classes
from tests.masks.test_block_mask import dense_classes

EMPTY, PARTIAL, FULL = 0, 1, 2
B, T, S, BQ, BK = 2, 23, 19, 5, 4
# (T, S, bq, bk, q_offset, kv_offset): a range's first query / key sits at the offset,
# globally. The first puts no block edge on a mask edge; the others do (with blocks
# of 4 x 3 from 0: the last key of a block equals the first query of another
# (causal), a key block starts 2 after a query block ends (window right = 2), one
# after it (prefix), and at the prefix length 12). A FULL demoted to PARTIAL
# exactly there passed the first alone.
GEOMETRIES = {"offsets": (T, S, BQ, BK, 7, 3), "edges_on_edges": (23, 19, 4, 3, 0, 0),
              "keys_ahead": (17, 22, 3, 4, 5, 0)}
_rng = np.random.default_rng(0)
PACKED = np.repeat(np.arange(9), 5)[None, :40].repeat(B, 0)  # documents 0, 1, 2.. of 5
PACKED[1] = np.repeat(np.arange(5), 8)[:40]
GAPPY = np.sort(_rng.integers(0, 6, (B, 40)), axis=-1)  # sorted, may skip ids
PREFIX = np.array([12, 0])


def _allowed(name, T, S, q_offset, kv_offset):
  """bool [B|1, T, S], written plainly from each mask's definition."""
  t = (q_offset + np.arange(T))[None, :, None]
  s = (kv_offset + np.arange(S))[None, None, :]
  b = np.arange(B)[:, None, None]
  return {
      "causal": s <= t,
      "sliding_window": (s >= t - 6) & (s <= t + 2),
      "chunked": t // 6 == s // 6,
      "prefix_lm": (s <= t) | (s < PREFIX[b]),
      "prefix_lm_shared": (s <= t) | (s < PREFIX[0]),
      "document": PACKED[b, t] == PACKED[b, s],
      "document_shared": PACKED[0, t] == PACKED[0, s],
      "document_gappy": GAPPY[b, t] == GAPPY[b, s],
      "and": (s <= t) & (PACKED[b, t] == PACKED[b, s]),
      "or": ((s >= t - 1) & (s <= t)) | (t // 6 == s // 6),
  }[name]


MODS = {
    "causal": mods.causal(), "sliding_window": mods.sliding_window(6, 2),
    "chunked": mods.chunked(6), "prefix_lm": mods.prefix_lm(PREFIX),
    "document": mods.document(PACKED), "document_gappy": mods.document(GAPPY),
    # arrays of one row, shared by every batch row: classified too (not left to mask_mod)
    "prefix_lm_shared": mods.prefix_lm(PREFIX[:1]),
    "document_shared": mods.document(PACKED[:1]),
    "and": mods.and_masks(mods.causal(), mods.document(PACKED)),
    "or": mods.or_masks(mods.sliding_window(1, 0), mods.chunked(6)),
}
EXACT = {"causal", "sliding_window", "chunked", "prefix_lm", "document", "prefix_lm_shared",
         "document_shared"}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("name", sorted(MODS))
def test_closed_form_matches_brute_force(name, geometry):
  T, S, bq, bk, q_offset, kv_offset = GEOMETRIES[geometry]
  got = np.asarray(closed_form_classes(MODS[name], B, T, S, bq, bk, q_offset, kv_offset))
  assert got.shape[1] == 1
  allowed = _allowed(name, T, S, q_offset, kv_offset)[:, None]  # [B|1, 1, T, S]
  want = np.broadcast_to(dense_classes(allowed, bq, bk)[:, 0], (B,) + got.shape[2:])
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


IDS = PACKED[:, :T]  # [B, T]: fits queries and keys (S < T)
MISFITS = {  # ready-made masks whose arrays do not fit a call with B = 2 rows
    "prefix of 3 rows": mods.prefix_lm(np.array([1, 2, 3])),
    "prefix [B, 1]": mods.prefix_lm(PREFIX[:, None]),
    "query ids of 3 rows": mods.document(np.concatenate([IDS, IDS[:1]]), IDS),
    "key ids of 3 rows": mods.document(IDS, np.concatenate([IDS, IDS[:1]])),
    "query ids [B, T, 1]": mods.document(IDS[..., None], IDS),
    "key ids [B, T, 1]": mods.document(IDS, IDS[..., None]),
    "query ids shorter than T": mods.document(IDS[:, :T - 1], IDS),
    "key ids shorter than S": mods.document(IDS, IDS[:, :S - 1]),
    "and of a misfit": mods.and_masks(mods.causal(), mods.prefix_lm(np.array([1, 2, 3]))),
}


@pytest.mark.parametrize("name", sorted(MISFITS))
def test_ready_made_masks_whose_arrays_do_not_fit_are_left_to_mask_mod(name):
  """None, so that the caller evaluates mask_mod (which reports or handles the
  shapes), rather than classes computed from arrays read the wrong way."""
  assert closed_form_classes(MISFITS[name], B, T, S, BQ, BK) is None


def test_blockwise_uses_the_closed_form_not_mask_mod_on_every_block(monkeypatch):
  """A ready-made mask passed in the call is classified without evaluating mask_mod on
  the whole grid (that path is made to fail here), and the result is still right."""
  import jattn
  from jattn._src.kernels import blockwise_loop as _blockwise
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
