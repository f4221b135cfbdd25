"""Block edges on purpose: "blockwise" against a float64 NumPy reference (values and
the plainly written gradient of tests/reference_grads.py), for every mask, with
block sizes that divide neither T nor S, T != S, and ranges at global offsets
(the ring's contract), so that block edges fall inside the masked regions.

An off-by-one in which blocks a pass visits drops or adds a whole row or column
of one block; the shapes below make every residue of a mask edge modulo the
block sizes occur, so some block edge meets it. Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.kernels import blockwise_loop as _blockwise
from jattn._src.core.layout import Layout
from jattn._src.masks.programmable import build_mods
from jattn._src.masks.structural import MaskSpec
from jattn._src.masks.modifiers import Modifiers
from tests.reference_grads import reference_vjp

B, N, K, H = 2, 2, 1, 4  # G = 2 query heads per kv head
TOL = dict(rtol=1e-5, atol=1e-5)
# (T, S, bq, bk): no block size divides its length, T != S both ways, and
# bq, bk coprime so block edges of q and kv meet every mask edge.
SHAPES = [(11, 14, 4, 3), (14, 9, 3, 5)]


def _inputs(T, S, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, d_out = (rng.standard_normal(shape).astype(np.float32) for shape in (
      (B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
  return q, k, v, d_out


def _masks(name, T, S, seed=1):
  """The mask arguments of case `name` for lengths T, S: edges off the block grid."""
  rng = np.random.default_rng(seed)
  ids = lambda L, cuts: np.searchsorted(np.array(cuts), np.arange(L), side="right")[None].repeat(B, 0)
  return {
      "causal": dict(is_causal=True),
      "window": dict(local_window_size=(3, 2)),
      "causal_window": dict(is_causal=True, local_window_size=4),
      "lengths": dict(query_seq_lengths=np.array([T - 2, 7]),
                      key_value_seq_lengths=np.array([S - 1, 5])),
      "segments": dict(q_segment_ids=ids(T, [2, 7]), kv_segment_ids=ids(S, [5, 6])),
      "mask": dict(mask=rng.random((B, 1, T, S)) < 0.6),
  }[name]


MASKS = ["causal", "window", "causal_window", "lengths", "segments", "mask"]


def _to_jax(kwargs):
  return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}


# Blocks of one query (every query is a block's first and last) and of two keys.
SINGLE_ROWS = [(name, (7, 5, 1, 2)) for name in ("lengths", "mask")]


def _case(name, shape, thorough=False):
  return pytest.param(name, shape, id="{}-T{}S{}bq{}bk{}".format(name, *shape),
                      marks=[pytest.mark.thorough] if thorough else [])


@pytest.mark.parametrize("name,shape", [_case(n, SHAPES[0]) for n in MASKS]
                         + [_case(n, SHAPES[1], thorough=True) for n in MASKS]
                         + [_case(n, shape) for n, shape in SINGLE_ROWS])
def test_blockwise_matches_float64_reference_at_block_edges(name, shape):
  T, S, bq, bk = shape
  q, k, v, d_out = _inputs(T, S)
  masks = _masks(name, T, S)
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="blockwise", block_sizes=jattn.BlockSizes(q=bq, kv=bk),
      **_to_jax(masks))
  out, pullback = jax.vjp(fn, q, k, v)
  grads = pullback(jnp.asarray(d_out))
  want = reference_vjp(q, k, v, d_out, **masks)
  np.testing.assert_allclose(out, want[0], **TOL, err_msg="out")
  for label, got, ref in zip(("d_query", "d_key", "d_value"), grads, want[1:4]):
    np.testing.assert_allclose(got, ref, **TOL, err_msg=label)


# ----------------------------------------------------------------- global offsets

def _ranges(q, k, v, d_out, spec_of, q_cut, kv_cut, sizes, scale, mods=None):
  """Queries and keys each cut in two ranges at global offsets; per query range the
  kv ranges' results are combined by lse, and backward contributions summed.
  mods: a `Mods` (mask_mod of global positions) for every range alike."""
  T, S = q.shape[1], k.shape[1]
  lay = Layout("BTNH")
  q_parts, kv_parts = [(0, q_cut), (q_cut, T)], [(0, kv_cut), (kv_cut, S)]
  outs, grads_q = [], []
  grads_k, grads_v = jnp.zeros(k.shape), jnp.zeros(v.shape)
  for t0, t1 in q_parts:
    partial = [_blockwise.forward(
        q[:, t0:t1], k[:, s0:s1], v[:, s0:s1],
        Modifiers(structure=spec_of(t0, t1, s0, s1), mods=mods, scale=scale), lay, t0, s0,
        sizes) for s0, s1 in kv_parts]
    lse = jnp.logaddexp(*(l for _, l in partial))  # [B, N, t]
    out = sum(o * jnp.exp(l - lse).transpose(0, 2, 1)[..., None] for o, l in partial)
    dq = 0.0
    for s0, s1 in kv_parts:
      g = _blockwise.backward(
          q[:, t0:t1], k[:, s0:s1], v[:, s0:s1],
          Modifiers(structure=spec_of(t0, t1, s0, s1), mods=mods, scale=scale), lay, t0, s0,
          sizes, out, lse, d_out[:, t0:t1])
      dq = dq + g[0]
      grads_k = grads_k.at[:, s0:s1].add(g[1])
      grads_v = grads_v.at[:, s0:s1].add(g[2])
    outs.append(out)
    grads_q.append(dq)
  return (jnp.concatenate(outs, 1), jnp.concatenate(grads_q, 1), grads_k, grads_v)


@pytest.mark.parametrize("name", ["causal_window", "lengths",
                                  pytest.param("segments", marks=pytest.mark.thorough)])
def test_ranges_at_global_offsets_match_float64_reference(name):
  """The raw primitives on ranges that start mid-block of the others: what a ring runs."""
  T, S, bq, bk, q_cut, kv_cut = 13, 12, 3, 4, 5, 7
  q, k, v, d_out = _inputs(T, S, seed=3)
  masks = dict(_masks(name, T, S))
  if name == "lengths":  # plus causal, so lengths and offsets cross
    masks["is_causal"] = True

  def spec_of(t0, t1, s0, s1):
    return MaskSpec(
        is_causal=masks.get("is_causal", False),
        local_window=(4, 4) if "local_window_size" in masks else None,
        q_lengths=None if name != "lengths" else jnp.asarray(masks["query_seq_lengths"]),
        kv_lengths=None if name != "lengths" else jnp.asarray(masks["key_value_seq_lengths"]),
        q_segment_ids=None if name != "segments" else jnp.asarray(masks["q_segment_ids"][:, t0:t1]),
        kv_segment_ids=None if name != "segments" else jnp.asarray(masks["kv_segment_ids"][:, s0:s1]))
  # one jit for the eight raw calls: one compilation instead of eight
  got = jax.jit(lambda *a: _ranges(*a, spec_of, q_cut, kv_cut, jattn.BlockSizes(q=bq, kv=bk),
                                   0.5))(q, k, v, d_out)
  want = reference_vjp(q, k, v, d_out, scale=0.5, **masks)
  for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
    np.testing.assert_allclose(g, w, **TOL, err_msg=label)


def test_hand_written_mask_mod_at_global_offsets_matches_float64_reference():
  """A lambda (classified by evaluating it, not by a closed form) on ranges that start
  mid-block, with blocks that divide no range: its block classes and its values must
  both be taken at global positions. It depends on b, n and t, s apart (no shift of
  both keeps it), and leaves FULL, PARTIAL and EMPTY blocks among the range pairs."""
  T, S, bq, bk, q_cut, kv_cut = 13, 12, 3, 4, 5, 7
  q, k, v, d_out = _inputs(T, S, seed=5)
  mask_mod = lambda b, n, t, s: ((s <= t + b) & (s + 5 + n >= t)) | (s < 2)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  b, n = np.arange(B)[:, None, None, None], np.arange(N)[None, :, None, None]
  allowed = ((s <= t + b) & (s + 5 + n >= t)) | (s < 2)  # [B, N, T, S]
  mods = build_mods(mask_mod, None, None, None, N=N)
  got = jax.jit(lambda *a: _ranges(*a, lambda *_: MaskSpec(), q_cut, kv_cut,
                                   jattn.BlockSizes(q=bq, kv=bk), 0.5, mods))(q, k, v, d_out)
  want = reference_vjp(q, k, v, d_out, scale=0.5, mask=allowed)
  for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
    np.testing.assert_allclose(g, w, **TOL, err_msg=label)


# ----------------------------------------------------------------- rows with no key

def _alone(name, T, S):
  """One mask argument alone, leaving some query rows with no key at all."""
  return {
      # rows t > S - 1 + 1 see nothing; right > left, so a rule on the right side fails
      "window_past_the_keys": dict(local_window_size=(1, 6)),
      "q_lengths": dict(query_seq_lengths=np.array([T - 3, 0])),
      "kv_lengths": dict(key_value_seq_lengths=np.array([0, S - 2])),
      "segments": dict(q_segment_ids=np.repeat([[0, 1, 2]], B, 0).repeat([4, 4, T - 8], 1),
                       kv_segment_ids=np.repeat([[0, 1]], B, 0).repeat([2, S - 2], 1)),
  }[name]


@pytest.mark.parametrize("impl", ["xla", "vmap", "blockwise"])
@pytest.mark.parametrize("name", ["window_past_the_keys", "q_lengths", "kv_lengths",
                                  "segments"])
def test_each_mask_alone_with_rows_that_see_no_key(name, impl):
  """Each mask argument on its own (no other mask to hide a mistake), with rows that
  may attend to no key: zeros there, the reference elsewhere, finite gradients."""
  T, S = 11, 5
  q, k, v, d_out = _inputs(T, S, seed=4)
  masks = _alone(name, T, S)
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation=impl,
      block_sizes=jattn.BlockSizes(q=4, kv=3) if impl == "blockwise" else None,
      **_to_jax(masks))
  out, pullback = jax.vjp(fn, q, k, v)
  got = (out,) + pullback(jnp.asarray(d_out))
  want = reference_vjp(q, k, v, d_out, **masks)
  assert np.any(np.all(want[0] == 0, axis=(2, 3))), "some row sees no key"
  for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
    np.testing.assert_allclose(g, w, **TOL, err_msg=label)
