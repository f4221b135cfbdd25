"""Ready-made mask mods are traced inside dot_product_attention's jit, which caches on
their static fields: a second call with new arrays compiles nothing new and uses the
new arrays (never the first call's), checked against the float64 reference."""

import numpy as np

import jattn
from jattn import mods
from jattn._src.dispatch import _compute
from tests.test_mods import KEY, Q, S, T, V, reference


def test_second_call_with_new_arrays_hits_the_cache_and_uses_them():
  rng = np.random.default_rng(5)
  # q ids [B, T]; the keys are the first S positions (S < T), kv ids i[:, :S]
  ids = [np.sort(rng.integers(0, 3, (Q.shape[0], T)), axis=-1).astype(np.int32)
         for _ in range(2)]
  calls = [dict(mask_mod=mods.and_masks(mods.document(i, i[:, :S]), mods.sliding_window(4)))
           for i in ids]
  before = _compute._cache_size()
  first = jattn.dot_product_attention(Q, KEY, V, implementation="xla", **calls[0])
  size = _compute._cache_size()
  assert size == before + 1  # compiled once (this static mask is used nowhere else)
  second = jattn.dot_product_attention(Q, KEY, V, implementation="xla", **calls[1])
  assert _compute._cache_size() == size  # no new compilation
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  for got, i in ((first, ids[0]), (second, ids[1])):
    allowed = (i[:, None, :, None] == i[:, None, None, :S]) & (s >= t - 4) & (s <= t)
    np.testing.assert_allclose(got, reference(Q, KEY, V, allowed=allowed)[0], rtol=2e-5,
                               atol=2e-5)
