"""Ready-made mask mods are traced inside dot_product_attention's jit, which caches on
their static fields: a second call with new arrays compiles nothing new and uses the
new arrays (never the first call's), checked against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import mods
from jattn._src.dispatch import _compute
from tests.masks.test_mods import KEY, Q, S, T, V, reference


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


def test_a_block_mask_made_per_batch_compiles_the_step_once():
  """A jitted step taking a block mask made outside it, batch after batch (document
  ids change, shapes do not), compiles once, for a ready-made and for a hand-written
  mask_mod, and each batch's output is its own mask's (float64 reference)."""
  rng = np.random.default_rng(7)
  step = jax.jit(lambda q, k, v, bm: jattn.dot_product_attention(
      q, k, v, block_mask=bm, implementation="blockwise",
      block_sizes=jattn.BlockSizes(q=4, kv=4)))

  def hand_written(ids):
    return lambda b, n, t, s: (ids[b, t] == ids[b, s]) & (s <= t)

  for make in (lambda ids: mods.and_masks(mods.document(ids, ids[:, :S]), mods.causal()),
               hand_written):
    before = step._cache_size()
    for _ in range(3):
      ids = np.sort(rng.integers(0, 3, (Q.shape[0], T)), axis=-1).astype(np.int32)
      bm = jattn.create_block_mask(make(jnp.asarray(ids)), Q.shape[0], None, T, S,
                                   block_sizes=jattn.BlockSizes(q=4, kv=4))
      got = step(Q, KEY, V, bm)
      t, s = np.arange(T)[:, None], np.arange(S)[None, :]
      allowed = (ids[:, None, :, None] == ids[:, None, None, :S]) & (s <= t)
      np.testing.assert_allclose(got, reference(Q, KEY, V, allowed=allowed)[0], rtol=2e-5,
                                 atol=2e-5)
    assert step._cache_size() == before + 1
