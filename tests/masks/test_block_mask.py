"""create_block_mask against a dense NumPy classification; BlockMask as a pytree under
jit; block skipping in "blockwise"; memory linear in T and S; bad input.
Block sizes (4 x 3, 5 x 7) divide neither T nor S. Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.kernels import blockwise_loop as _blockwise
from jattn._src.core.layout import Layout
from jattn._src.masks.structural import MaskSpec
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import build_mods
from tests.reference_grads import reference_vjp
from tests.helpers import raises
from tests.masks.test_mods import B, BS, IDS_KV, IDS_Q, KEY, MASKS, N, Q, S, T, V, reference

EMPTY, PARTIAL, FULL = 0, 1, 2


def dense_classes(allowed, bq, bk):
  """int [B, N, nq, nk] from a dense bool [B, N, T, S] grid, block by block."""
  Bm, Nm, T_, S_ = allowed.shape
  nq, nk = -(-T_ // bq), -(-S_ // bk)
  out = np.zeros((Bm, Nm, nq, nk), int)
  for i in range(nq):
    for j in range(nk):
      block = allowed[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      out[:, :, i, j] = np.where(block.all((2, 3)), FULL, np.where(block.any((2, 3)), PARTIAL, EMPTY))
  return out


@pytest.mark.parametrize("sizes", [(4, 3), (5, 7)])
@pytest.mark.parametrize("name", ["causal", "document", "per_head", "or_masks", "prefix_lm"])
def test_classes_match_dense_numpy(name, sizes):
  mask_mod, allowed = MASKS[name]
  allowed = np.broadcast_to(allowed, (B, N, T, S))
  bm = jattn.create_block_mask(mask_mod, B, N, T, S, block_sizes=jattn.BlockSizes(*sizes))
  want = dense_classes(allowed, *sizes)
  np.testing.assert_array_equal(bm.classes, want)
  assert bm.sparsity() == pytest.approx(np.mean(want == EMPTY))


@pytest.mark.parametrize("entries_per_step", [1, 3 * N * 4 * 3], ids=["under_a_block", "three_blocks"])
def test_classes_match_dense_numpy_a_few_key_blocks_per_step(monkeypatch, entries_per_step):
  """Long rows are classified a few key blocks at a time (at least one, and the
  last step padded when they do not divide the row); the small shapes here fit
  one step, so the step is made small. per_head reads n: N = 4 heads of 4 x 3."""
  from jattn._src.masks import block_mask as _block_mask
  monkeypatch.setattr(_block_mask, "_ENTRIES_PER_STEP", entries_per_step)
  mask_mod, allowed = MASKS["per_head"]
  bm = jattn.create_block_mask(mask_mod, B, N, T, S, block_sizes=jattn.BlockSizes(4, 3))
  np.testing.assert_array_equal(bm.classes, dense_classes(np.broadcast_to(allowed, (B, N, T, S)), 4, 3))


def test_one_query_and_one_key():
  bm = jattn.create_block_mask(mods.causal(), None, None, 1, 1, block_sizes=BS)
  np.testing.assert_array_equal(bm.classes, [[[[FULL]]]])


def test_b_and_n_none_give_size_one_axes():
  bm = jattn.create_block_mask(mods.causal(), None, None, T, S, block_sizes=BS)
  assert bm.classes.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(bm.classes[0, 0], dense_classes(MASKS["causal"][1], 4, 3)[0, 0])


def test_made_inside_jit_and_passed_into_jit():
  """Built in one jitted function from traced ids, reused by another (a pytree)."""
  make = jax.jit(lambda q_ids, kv_ids: jattn.create_block_mask(
      mods.document(q_ids, kv_ids), B, None, T, S, block_sizes=BS))
  bm = make(IDS_Q, IDS_KV)
  assert isinstance(bm, jattn.BlockMask)
  allowed = IDS_Q[:, None, :, None] == IDS_KV[:, None, None, :]
  np.testing.assert_array_equal(bm.classes, dense_classes(allowed, 4, 3))

  @jax.jit
  def two_layers(q, k, v, bm):
    out = jattn.dot_product_attention(q, k, v, implementation="blockwise", block_mask=bm)
    return jattn.dot_product_attention(out, k, v, implementation="blockwise", block_mask=bm)
  got = two_layers(Q, KEY, KEY, bm)
  first, _ = reference(Q, KEY, KEY, allowed=allowed)
  second, _ = reference(first.astype(np.float32), KEY, KEY, allowed=allowed)
  np.testing.assert_allclose(got, second, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("user_mask", [False, True], ids=["alone", "with_a_user_mask"])
def test_mask_mod_is_not_called_on_full_blocks(user_mask):
  """A block mask of causal() with a mask_mod that also drops odd keys: blocks the
  block mask calls full keep their odd keys (mask_mod is not evaluated there), in
  the forward and the backward alike: also the last blocks, which hold padding
  (T = 13, S = 11 with 4 x 3 blocks) and so run masked, and when a user mask (all
  True) makes every block run masked."""
  bm = jattn.create_block_mask(mods.causal(), None, None, T, S, block_sizes=BS)
  even = lambda b, n, t, s: (s <= t) & (s % 2 == 0)
  extra = dict(mask=jnp.ones((1, 1, T, S), bool)) if user_mask else {}
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="blockwise", block_mask=bm, mask_mod=even, **extra)
  out, pullback = jax.vjp(fn, Q, KEY, V)
  d_out = np.random.default_rng(3).standard_normal(out.shape).astype(np.float32)
  grads = pullback(jnp.asarray(d_out))
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  full = np.kron(np.asarray(bm.classes[0, 0]) == FULL, np.ones((4, 3), bool))[:T, :S]
  allowed = np.where(full, s <= t, (s <= t) & (s % 2 == 0))
  want = reference_vjp(Q, KEY, V, d_out, mask=np.broadcast_to(allowed, (1, 1, T, S)))
  for name, got, ref in zip(("out", "d_query", "d_key", "d_value"), (out, *grads), want):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=name)
  assert full.any() and not np.array_equal(allowed, (s <= t) & (s % 2 == 0))


def _count(mask_mod, T_, S_, block, structure=MaskSpec()):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, T_, 2, 4)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, S_, 2, 4)), jnp.float32)
  modifiers = Modifiers(mods=build_mods(mask_mod, None, None, None, N=2), scale=0.5,
                        structure=structure)
  _, _, count = _blockwise.forward_with_count(
      q, k, k, modifiers, Layout("BTNH"), 0, 0, jattn.BlockSizes(block, block))
  return int(count)


def test_empty_blocks_are_skipped():
  ids = np.repeat(np.arange(4), 16)[None]  # 4 documents of 16 tokens, T = S = 64
  assert _count(mods.document(ids, ids), 64, 64, 8) == 4 * 4
  assert _count(mods.causal(), 64, 64, 8) == 8 * 9 // 2
  assert _count(mods.and_masks(mods.causal(), mods.sliding_window(8)), 64, 64, 8) == 8 + 7
  assert _count(lambda b, n, t, s: s < 0, 64, 64, 8) == 0
  # the mask_mod's classes and the structural plan together: causal within each
  # document, 3 of its 2 x 2 blocks
  assert _count(mods.document(ids, ids), 64, 64, 8, MaskSpec(is_causal=True)) == 4 * 3


def test_working_memory_is_linear_in_t_and_s():
  """Compiled temp memory of create_block_mask: doubling T = S at most doubles it
  (a [T, S] grid would quadruple), and stays far below T * S bytes."""
  def temp(L):
    f = jax.jit(lambda ids: jattn.create_block_mask(
        mods.document(ids, ids), 1, None, L, L, block_sizes=jattn.BlockSizes(128, 128)).classes)
    return f.lower(jnp.zeros((1, L), jnp.int32)).compile().memory_analysis().temp_size_in_bytes
  small, large = temp(4096), temp(8192)
  assert large <= 2.2 * small + 4096, (small, large)
  assert large < 8192 * 8192 / 8, large


@pytest.mark.thorough
def test_65536_squared_inside_jit():
  """T = S = 65536 under jit: causal classes exactly, and bounded compiled memory."""
  L = 65536
  f = jax.jit(lambda: jattn.create_block_mask(mods.causal(), None, None, L, L,
                                              block_sizes=jattn.BlockSizes(512, 256)).classes)
  assert f.lower().compile().memory_analysis().temp_size_in_bytes < 64 << 20
  classes = np.asarray(f())[0, 0]
  i, j = np.arange(128)[:, None], np.arange(256)[None, :]
  expected = np.where(j * 256 + 255 <= i * 512, FULL, np.where(j * 256 <= i * 512 + 511, PARTIAL, EMPTY))
  np.testing.assert_array_equal(classes, expected)


# ----------------------------------------------------------------- bad input

def test_block_mask_for_other_sizes_is_refused():
  bm = jattn.create_block_mask(mods.causal(), None, None, T + 1, S, block_sizes=BS)
  with raises(ValueError, "block_mask", "(None, None, 14, 11)", "(2, 4, 13, 11)"):
    jattn.dot_product_attention(Q, KEY, V, implementation="blockwise", block_mask=bm)
  bm = jattn.create_block_mask(mods.causal(), None, None, T, S, block_sizes=BS)
  with raises(ValueError, "block_sizes.*block_mask"):
    jattn.dot_product_attention(Q, KEY, V, implementation="blockwise", block_mask=bm,
                                block_sizes=jattn.BlockSizes(8, 8))
  with raises(TypeError, "block_mask"):
    jattn.dot_product_attention(Q, KEY, V, block_mask=np.ones((1, 1, 4, 4)))


def test_unbatched_call_takes_a_block_mask_of_one_row_not_two():
  q, k, v = Q[0], KEY[0], V[0]  # TNH
  call = lambda bm: jattn.dot_product_attention(q, k, v, implementation="blockwise",
                                                layout="TNH", block_mask=bm)
  out = call(jattn.create_block_mask(mods.causal(), 1, None, T, S, block_sizes=BS))
  np.testing.assert_allclose(out, reference(Q, KEY, V, allowed=MASKS["causal"][1])[0][0],
                             rtol=2e-5, atol=2e-5)
  with raises(ValueError, "block_mask", "(2, None, 13, 11)"):
    call(jattn.create_block_mask(mods.causal(), 2, None, T, S, block_sizes=BS))


def test_create_block_mask_checks_its_arguments():
  with raises(TypeError, "mask_mod", "bool"):
    jattn.create_block_mask(lambda b, n, t, s: t - s, None, None, T, S)
  with raises(TypeError, "mask_mod", "4 positional"):
    jattn.create_block_mask(lambda t, s: t >= s, None, None, T, S)
  with raises(ValueError, "T must be a positive int"):
    jattn.create_block_mask(mods.causal(), None, None, 0, S)
  with raises(ValueError, "B must be a positive int or None", "0"):
    jattn.create_block_mask(mods.causal(), 0, None, T, S)
  with raises(ValueError, "N must be a positive int or None", "2.0"):
    jattn.create_block_mask(mods.causal(), None, 2.0, T, S)
  with raises(ValueError, "mask_mod", "q_segment_ids", f"T = {T}"):
    jattn.create_block_mask(mods.document(IDS_Q[:, :4], IDS_KV), B, None, T, S)


def test_b_or_n_none_is_refused_for_a_mask_that_reads_them():
  """With B or N None the classes are those of b = 0 or n = 0: for a mask that reads
  that index they would skip blocks another row or head sees."""
  per_head = lambda b, n, t, s: (s <= t) & (s >= t - 2 * n - 1)
  with raises(ValueError, "N is None", "reads its index n"):
    jattn.create_block_mask(per_head, B, None, T, S, block_sizes=BS)
  with raises(ValueError, "B is None", "reads its index b"):
    jattn.create_block_mask(lambda b, n, t, s: t >= s + b, None, N, T, S, block_sizes=BS)
  with raises(ValueError, "B is None", "reads its index b"):
    jattn.create_block_mask(mods.document(IDS_Q, IDS_KV), None, None, T, S, block_sizes=BS)
  # ready-made masks never read n, and arrays of one row do not depend on b
  one_row = mods.and_masks(mods.document(IDS_Q[:1], IDS_KV[:1]), mods.prefix_lm(np.array([3])))
  bm = jattn.create_block_mask(one_row, None, None, T, S, block_sizes=BS)
  assert bm.classes.shape[:2] == (1, 1)
