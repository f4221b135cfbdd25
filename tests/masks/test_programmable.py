"""The programmable part's helpers (jattn/_src/masks/programmable.py) by themselves, against
NumPy: which arguments a traced mask_mod reads, score_mod over a grid at global offsets,
the sinks' softmax term and its gradient (float64 formulas and finite differences).
Milliseconds each; the attention tests in test_mods.py use them end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import mods
from jattn._src.masks import programmable as P
from tests.helpers import raises


def built(mask_mod=None, score_mod=None, sinks=None, N=4, **kw):
  return P.build_mods(mask_mod, score_mod, sinks, None, N=N, **kw)


@pytest.mark.parametrize("fn,reads", [
    (lambda b, n, t, s: s <= t, (2, 3)),
    (lambda b, n, t, s: t < 5 + 3 * b, (0, 2)),
    (lambda b, n, t, s: s <= n, (1, 3)),
    (lambda b, n, t, s: b == 1, (0,)),  # the output is the one equation's
    (lambda b, n, t, s: (b + n + t + s) >= 0, (0, 1, 2, 3)),
    (lambda b, n, t, s: jnp.bool_(True), ()),
    (mods.causal(), (2, 3)),
    (mods.prefix_lm(np.array([3, 1])), (0, 2, 3))])
def test_mask_uses_the_arguments_it_reads(fn, reads):
  m = built(mask_mod=fn)
  assert tuple(i for i in range(4) if m.mask_uses(i)) == reads


def test_mask_uses_an_argument_returned_as_is():
  """A mask that returns an argument itself (no equation reads it): still read."""
  m = P.Mods(mask_jaxpr=jax.make_jaxpr(lambda b, n, t, s: s)(*(jnp.bool_(True),) * 4).jaxpr)
  assert [m.mask_uses(i) for i in range(4)] == [False, False, False, True]


def test_nothing_given_builds_nothing():
  assert built() is None
  assert P.build_mods(None, None, None, None, N=2) is None


def test_ready_made_mask_deferred_and_traced():
  m = built(mask_mod=mods.sliding_window(2), defer_ready_made=True)
  assert m.mask_jaxpr is None and m.mask_mod == mods.sliding_window(2)
  assert m.has_mask and not m.is_traced and m.is_cacheable
  traced = m.traced()
  assert traced.is_traced and traced.mask_jaxpr is not None and not traced.is_cacheable
  assert traced.traced() is traced
  t, s = jnp.int32(5), jnp.int32(3)
  assert bool(traced.mask(jnp.int32(0), jnp.int32(0), t, s)) and not bool(
      traced.mask(jnp.int32(0), jnp.int32(0), t, jnp.int32(6)))
  m = built(mask_mod=mods.sliding_window(2))  # not deferred: traced at once
  assert m.is_traced and m.mask_jaxpr is not None and m.mask_mod == mods.sliding_window(2)
  hand = built(mask_mod=lambda b, n, t, s: s <= t)
  assert hand.mask_mod is None and hand.is_traced and not hand.is_cacheable
  assert built(sinks=np.zeros(4, np.float32)).is_cacheable
  assert not built(score_mod=mods.soft_cap(1.0)).is_cacheable
  assert built(score_mod=mods.soft_cap(1.0)).has_score and not built(mask_mod=mods.causal()).has_score


def test_sinks_must_be_one_per_head():
  with raises(ValueError, r"sinks: expected shape \[N\] = \(4,\)", "(3,)"):
    built(sinks=np.zeros(3, np.float32))
  assert built(sinks=np.zeros(4, np.float32)).sinks.shape == (4,)


def test_apply_score_at_global_offsets_and_grouped_heads():
  """score + 1000 n + 10 t + s over logits [B, K, G, T, S] from offsets (5, 7): n = k G + g."""
  B, K, G, T, S = 2, 2, 3, 4, 5
  m = built(score_mod=lambda x, b, n, t, s: x + (1000 * n + 10 * t + s + 100000 * b)
            .astype(x.dtype), N=K * G)
  logits = jnp.zeros((B, K, G, T, S), jnp.float32)
  got = jax.jit(lambda x: P.apply_score(m, x, "BKGTS", G, q_offset=5, kv_offset=7))(logits)
  b, k, g, t, s = np.meshgrid(*(np.arange(n) for n in (B, K, G, T, S)), indexing="ij")
  want = 1000 * (k * G + g) + 10 * (t + 5) + (s + 7) + 100000 * b
  np.testing.assert_array_equal(np.asarray(got), want)
  got = jax.jit(lambda x: P.apply_score(m, x, "BNTS", 1))(jnp.zeros((B, K * G, T, S)))  # N itself
  b, n, t, s = np.meshgrid(*(np.arange(x) for x in (B, K * G, T, S)), indexing="ij")
  np.testing.assert_array_equal(np.asarray(got), 1000 * n + 10 * t + s + 100000 * b)


def test_dense_mask_over_the_grid():
  m = built(mask_mod=lambda b, n, t, s: (s <= t + b) & (n != 1), N=3)
  got = np.asarray(jax.jit(lambda: P.dense_mask(m, 2, 3, 4, 5))())
  b, n, t, s = np.meshgrid(*(np.arange(x) for x in (2, 3, 4, 5)), indexing="ij")
  np.testing.assert_array_equal(got, (s <= t + b) & (n != 1))


@pytest.mark.parametrize("letters", ["BKGTS", "BTKGS", "KBTGS"])
def test_sinks_like_places_n_as_k_g(letters):
  K, G = 2, 3
  sinks = jnp.arange(K * G, dtype=jnp.float32)
  got = np.asarray(P.sinks_like(sinks, letters, K, jnp.float32))
  shape = [1] * 5
  shape[letters.index("K")], shape[letters.index("G")] = K, G
  assert got.shape == tuple(shape)
  kg = np.moveaxis(got, (letters.index("K"), letters.index("G")), (0, 1)).reshape(K, G)
  np.testing.assert_array_equal(kg, np.arange(K * G).reshape(K, G))


def _sinks_case():
  rng = np.random.default_rng(1)
  B, N, T, D = 2, 3, 4, 5
  out = rng.standard_normal((B, T, N, D)).astype(np.float32)  # "BTND"
  lse = rng.standard_normal((B, N, T)).astype(np.float32)
  lse[1, 2, 3] = -1e30  # a row that saw no key (LARGE_NEGATIVE)
  sinks = np.array([0.5, -1.0, 2.0], np.float32)
  return out, lse, sinks


def test_add_sinks_against_float64():
  out, lse, sinks = _sinks_case()
  got_out, got_lse = P.add_sinks(jnp.asarray(out), jnp.asarray(lse), jnp.asarray(sinks), "BTND")
  lse64 = np.logaddexp(lse.astype(np.float64), sinks[None, :, None])
  want = out * np.exp(lse - lse64).transpose(0, 2, 1)[..., None]
  np.testing.assert_allclose(got_lse, lse64, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_out, want, rtol=1e-6, atol=1e-6)
  assert float(got_lse[1, 2, 3]) == pytest.approx(2.0)  # the empty row: the sink's own logit
  assert float(jnp.abs(got_out[1, 3, 2]).max()) == 0.0
  # columns layout: the same numbers in another order
  cols = lambda x: np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))  # BTND -> BNDT
  got_cols, _ = P.add_sinks(jnp.asarray(cols(out)), jnp.asarray(lse), jnp.asarray(sinks), "BNDT")
  np.testing.assert_allclose(got_cols, cols(want), rtol=1e-6, atol=1e-6)


def test_sinks_grad_against_finite_differences():
  """d/d sinks of sum(d_out * out'), out' = out exp(lse - logaddexp(lse, sink)), with out and
  lse held fixed (as the backward pass holds the normalised output), by central differences
  in float64, given the final out' and lse' as sinks_grad takes them."""
  out, lse, sinks = _sinks_case()
  lse[1, 2, 3] = 0.3  # finite everywhere for the differences
  d_out = np.random.default_rng(2).standard_normal(out.shape)
  def loss(sk):
    lse_all = np.logaddexp(lse.astype(np.float64), sk[None, :, None])
    return np.sum(d_out * out * np.exp(lse - lse_all).transpose(0, 2, 1)[..., None])
  want = np.array([(loss(sinks + e) - loss(sinks - e)) / 2e-6
                   for e in np.eye(3) * 1e-6])
  final_out, final_lse = P.add_sinks(jnp.asarray(out), jnp.asarray(lse), jnp.asarray(sinks),
                                     "BTND")
  got = P.sinks_grad(final_out, final_lse, jnp.asarray(d_out, jnp.float32), jnp.asarray(sinks),
                     "BTND")
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gradients_cast_to_the_primal_dtypes():
  m = built(score_mod=mods.alibi(np.array([1.0, 2.0], np.float16)), mask_mod=mods.prefix_lm(
      np.array([2, 3])), sinks=np.zeros(2, np.float32), N=2)
  d = m.gradients(sinks=jnp.ones(2), score_consts=(jnp.ones(2, jnp.float32),))
  assert d.score_consts[0].dtype == jnp.float16
  assert d.mask_consts == (None,) * len(m.mask_consts) and len(m.mask_consts) >= 1
  assert d.mask_mod is None and d.block_mask is None
  assert m.without_score_consts().score_consts == ()


def test_a_block_mask_alone_brings_the_mask_it_was_made_from():
  import jattn
  bm = jattn.create_block_mask(lambda b, n, t, s: s <= t - 1, None, None, 8, 8,
                               block_sizes=jattn.BlockSizes(q=4, kv=4))
  m = P.build_mods(None, None, None, bm, N=2)
  assert m.has_mask and m.block_mask is bm and m.mask_jaxpr is bm.mask_jaxpr
  entry = lambda t, s: bool(m.mask(jnp.int32(0), jnp.int32(0), jnp.int32(t), jnp.int32(s)))
  assert entry(5, 4) and not entry(5, 5) and not entry(5, 6)
  # a mask_mod given too is the one evaluated
  m = P.build_mods(lambda b, n, t, s: s >= t, None, None, bm, N=2)
  assert m.mask_jaxpr is not bm.mask_jaxpr and entry(5, 6) and not entry(5, 4)
