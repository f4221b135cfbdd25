"""mask_mod, score_mod and sinks against a float64 NumPy reference over the dense grid.

Every ready-made mod of `jattn.mods` is written again here in NumPy, on the
whole [B, N, T, S] grid, and the attention formula with it:
  p = exp(l) / (exp(sinks[n]) + sum_s exp(l)) over the visible keys,
  l = score_mod(q . k * scale + bias), out = p @ v.
Shapes are small and odd (T=13, S=11, blocks of 4 x 3 that divide neither);
letters as everywhere: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.reference import reference_mods as reference
from jattn import mods
from tests.helpers import raises

B, T, S, N, K, H, D = 2, 13, 11, 4, 2, 8, 6
BS = jattn.BlockSizes(q=4, kv=3)
IMPLS = ["xla", "vmap", "blockwise"]
TOL = dict(rtol=2e-5, atol=2e-5)

_rng = np.random.default_rng(0)
Q = _rng.standard_normal((B, T, N, H)).astype(np.float32)
KEY = _rng.standard_normal((B, S, K, H)).astype(np.float32)
V = _rng.standard_normal((B, S, K, D)).astype(np.float32)
IDS_Q = np.sort(_rng.integers(0, 3, (B, T)), axis=-1).astype(np.int32)
IDS_KV = np.sort(_rng.integers(0, 3, (B, S)), axis=-1).astype(np.int32)
PREFIX = np.array([4, 0], np.int32)
SLOPES = np.array([0.5, 0.25, -0.125, 1.0], np.float32)
TABLE = _rng.standard_normal((N, 2 * 3 + 1)).astype(np.float32)
SINKS = np.array([0.3, -1.0, 2.0, 0.0], np.float32)

t_ = np.arange(T)[None, None, :, None]
s_ = np.arange(S)[None, None, None, :]
b_ = np.arange(B)[:, None, None, None]
n_ = np.arange(N)[None, :, None, None]

# name -> (mask_mod, allowed [B, N, T, S] in NumPy)
MASKS = {
    "causal": (mods.causal(), s_ <= t_),
    "sliding_window": (mods.sliding_window(3, 1), (s_ >= t_ - 3) & (s_ <= t_ + 1)),
    "chunked": (mods.chunked(5), t_ // 5 == s_ // 5),
    "prefix_lm": (mods.prefix_lm(PREFIX), (s_ <= t_) | (s_ < PREFIX[b_])),
    "document": (mods.document(IDS_Q, IDS_KV), IDS_Q[:, None, :, None] == IDS_KV[:, None, None, :]),
    "and_masks": (mods.and_masks(mods.causal(), mods.sliding_window(2)),
                  (s_ <= t_) & (s_ >= t_ - 2)),
    "or_masks": (mods.or_masks(mods.chunked(4), mods.sliding_window(1, 1)),
                 (t_ // 4 == s_ // 4) | (abs(s_ - t_) <= 1)),
    # a head-dependent mask under GQA: head n sees keys within n + 1 of the query
    "per_head": (lambda b, n, t, s: abs(s - t) <= n + 1, abs(s_ - t_) <= n_ + 1),
}
# name -> (score_mod, NumPy function of the logits grid [B, N, T, S])
SCORES = {
    "soft_cap": (mods.soft_cap(0.7), lambda l: 0.7 * np.tanh(l / 0.7)),
    "alibi": (mods.alibi(SLOPES), lambda l: l + SLOPES[n_] * (s_ - t_)),
    "relative_bias": (mods.relative_bias(TABLE),
                      lambda l: l + TABLE[n_, np.clip(s_ - t_, -3, 3) + 3]),
}


def _tiered(names, impls, default):
  """(name, impl) pairs; those not in `default` go to the thorough tier (compile time)."""
  return [pytest.param(n, i, marks=() if (n, i) in default or i == "xla"
                       else pytest.mark.thorough) for n in names for i in impls]


def attention(impl, q=Q, k=KEY, v=V, **kwargs):
  if impl == "blockwise":
    kwargs.setdefault("block_sizes", BS)
  return jattn.dot_product_attention(q, k, v, implementation=impl, **kwargs)


@pytest.mark.parametrize("name,impl", _tiered(sorted(MASKS), IMPLS, {
    ("per_head", "blockwise"), ("document", "blockwise"), ("or_masks", "blockwise"),
    ("per_head", "vmap")}))
def test_mask_mods_match_reference(impl, name):
  mask_mod, allowed = MASKS[name]
  out = attention(impl, mask_mod=mask_mod)
  np.testing.assert_allclose(out, reference(Q, KEY, V, allowed=allowed)[0], **TOL)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_mask_mods_with_three_rows_and_four_kv_heads(impl):
  """B = 3 and K = 4 kv heads of G = 3 query heads each (N = 12): a mask_mod that
  reads no batch or head index is evaluated once for every row or head, and its
  block must still meet all B rows, K kv heads and G heads of a group."""
  rng = np.random.default_rng(5)
  q = rng.standard_normal((3, T, 12, H)).astype(np.float32)
  k, v = (rng.standard_normal((3, S, 2 * K, d)).astype(np.float32) for d in (H, D))
  b3 = np.arange(3)[:, None, None, None]
  for name, mask_mod, allowed in (
      ("causal", mods.causal(), s_ <= t_),  # reads neither b nor n
      ("per_row", lambda b, n, t, s: s <= t + 2 * b, s_ <= t_ + 2 * b3),  # reads b only
      # reads b and t, not s (a flag for "reads b" taken from another argument
      # passed while every mask read s); rows past 5 + 3b see no key
      ("query_rows", lambda b, n, t, s: t < 5 + 3 * b, t_ < 5 + 3 * b3),
      # reads n and s, not t (the same for "reads n")
      ("per_head_keys", lambda b, n, t, s: s <= n, s_ <= np.arange(12)[None, :, None, None])):
    np.testing.assert_allclose(attention(impl, q, k, v, mask_mod=mask_mod),
                               reference(q, k, v, allowed=allowed)[0], **TOL, err_msg=name)


@pytest.mark.parametrize("name,impl", _tiered(sorted(SCORES), IMPLS, {
    ("relative_bias", "blockwise"), ("alibi", "vmap")}))
def test_score_mods_match_reference(impl, name):
  score_mod, score = SCORES[name]
  out = attention(impl, score_mod=score_mod, mask_mod=mods.causal())
  np.testing.assert_allclose(out, reference(Q, KEY, V, allowed=s_ <= t_, score=score)[0], **TOL)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_score_mod_without_any_mask(impl):
  """A score_mod alone: no mask_mod, block mask or structural mask to classify
  blocks by (blockwise asked the absent mask_mod which blocks it keeps)."""
  score_mod, score = SCORES["soft_cap"]
  out = attention(impl, score_mod=score_mod)
  np.testing.assert_allclose(out, reference(Q, KEY, V, score=score)[0], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_everything_at_once_in_order(impl):
  """bias -> score_mod -> masks (mask, mask_mod, lengths) -> softmax with sinks."""
  bias = _rng.standard_normal((1, N, T, S)).astype(np.float32)
  mask = _rng.random((B, 1, T, S)) > 0.2
  lengths = np.array([13, 7], np.int32)
  out = attention(impl, bias=bias, mask=mask, score_mod=mods.soft_cap(1.5),
                  mask_mod=mods.sliding_window(4, 2), sinks=SINKS, scale=0.4,
                  query_seq_lengths=lengths)
  allowed = mask & (s_ >= t_ - 4) & (s_ <= t_ + 2) & (t_ < lengths[b_])
  ref, _ = reference(Q, KEY, V, allowed=allowed, bias=bias, scale=0.4, sinks=SINKS,
                     score=lambda l: 1.5 * np.tanh(l / 1.5))
  np.testing.assert_allclose(out, ref, **TOL)
  assert float(np.abs(np.asarray(out)[1, 7:]).max()) == 0.0  # rows past the length


@pytest.mark.parametrize("impl", ["xla", "vmap"])
def test_return_weights_with_mods(impl):
  out, w = attention(impl, mask_mod=mods.causal(), score_mod=mods.alibi(SLOPES), sinks=SINKS,
                     return_weights=True)
  ref, ref_w = reference(Q, KEY, V, allowed=s_ <= t_, sinks=SINKS,
                         score=lambda l: l + SLOPES[n_] * (s_ - t_))
  np.testing.assert_allclose(out, ref, **TOL)
  np.testing.assert_allclose(w, ref_w, **TOL)


@pytest.mark.parametrize("layout,impl", _tiered(["BNHT", "TNH"], IMPLS, {
    ("BNHT", "blockwise"), ("BNHT", "vmap"), ("TNH", "vmap")}))
def test_layouts(impl, layout):
  to = lambda x: jnp.einsum(f"BTNH->{layout if 'B' in layout else 'B' + layout}", x)
  q, k, v = (to(x) for x in (Q, KEY, V))
  if "B" not in layout:
    q, k, v = q[0], k[0], v[0]
  out = attention(impl, q, k, v, layout=layout, mask_mod=MASKS["per_head"][0],
                  score_mod=mods.alibi(SLOPES), sinks=SINKS)
  ref, _ = reference(Q, KEY, V, allowed=MASKS["per_head"][1], sinks=SINKS,
                     score=lambda l: l + SLOPES[n_] * (s_ - t_))
  ref = np.einsum(f"BTND->{layout.replace('H', 'D') if 'B' in layout else 'B' + layout.replace('H', 'D')}", ref)
  np.testing.assert_allclose(out, ref if "B" in layout else ref[0], **TOL)


@pytest.mark.parametrize("impl", ["xla", pytest.param("vmap", marks=pytest.mark.thorough),
                                  "blockwise"])
def test_mods_equal_the_builtins_they_mirror(impl):
  pairs = [(dict(mask_mod=mods.causal()), dict(is_causal=True)),
           (dict(mask_mod=mods.sliding_window(3, 2)), dict(local_window_size=(3, 2))),
           (dict(mask_mod=mods.document(IDS_Q, IDS_KV)),
            dict(q_segment_ids=IDS_Q, kv_segment_ids=IDS_KV))]
  for with_mod, builtin in pairs:
    np.testing.assert_allclose(attention(impl, **with_mod), attention(impl, **builtin),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_are_zero_with_finite_gradients(impl):
  keep = lambda b, n, t, s: (t < 5) | (t > 9)  # rows 5..9 see no key
  def loss(q, k, v, sinks):
    out = attention(impl, q, k, v, mask_mod=keep, sinks=sinks, score_mod=mods.soft_cap(3.0))
    return jnp.sum(jnp.sin(out)), out
  (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(Q, KEY, V, SINKS)
  assert float(jnp.abs(out[:, 5:10]).max()) == 0.0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  assert float(jnp.abs(grads[0][:, 5:10]).max()) == 0.0


def test_mods_accept_numpy_or_jax_arrays():
  a = attention("xla", mask_mod=mods.document(IDS_Q, IDS_KV), score_mod=mods.alibi(SLOPES))
  b = attention("xla", mask_mod=mods.document(jnp.asarray(IDS_Q), jnp.asarray(IDS_KV)),
                score_mod=mods.alibi(jnp.asarray(SLOPES)))
  np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------- bad input

def test_mask_mod_must_return_a_bool():
  with raises(TypeError, "mask_mod", "bool"):
    attention("xla", mask_mod=lambda b, n, t, s: (s - t).astype(jnp.float32))


def test_score_mod_must_return_a_float_scalar():
  with raises(TypeError, "score_mod", "float"):
    attention("xla", score_mod=lambda x, b, n, t, s: jnp.stack([x, x]))


def test_wrong_arity_is_named():
  with raises(TypeError, "mask_mod", "4 positional"):
    attention("xla", mask_mod=lambda t, s: s <= t)
  with raises(TypeError, "score_mod", "5 positional"):
    attention("xla", score_mod=lambda x, t, s: x)


def test_sinks_must_be_one_per_head():
  with raises(ValueError, "sinks", "(4,)", "(2, 4)"):
    attention("xla", sinks=np.zeros((2, N), np.float32))
  with raises(TypeError, "sinks"):
    attention("xla", sinks=np.zeros(N, np.int32))


# A ready-made mod's array that does not fit the call: gathers past its end clamp, so it
# would silently lend rows, heads or positions another one's entry.
@pytest.mark.parametrize("argument,mod,needles", [
    ("mask_mod", lambda: mods.document(IDS_Q[:, :T - 2], IDS_KV), ("q_segment_ids", f"T = {T}", f"({B}, {T - 2})")),
    ("mask_mod", lambda: mods.document(IDS_Q, IDS_KV[:, :S - 1]), ("kv_segment_ids", f"S = {S}", f"({B}, {S - 1})")),
    ("mask_mod", lambda: mods.document(np.tile(IDS_Q, (2, 1))), ("q_segment_ids", f"B = {B}", f"({2 * B}, {T})")),
    ("mask_mod", lambda: mods.prefix_lm(np.array([1, 2, 3])), ("prefix_lengths", f"B = {B}", "(3,)")),
    ("mask_mod", lambda: mods.and_masks(mods.causal(), mods.or_masks(
        mods.chunked(4), mods.prefix_lm(np.zeros(B + 1, np.int32)))), ("prefix_lengths", f"({B + 1},)")),
    ("score_mod", lambda: mods.alibi(SLOPES[:3]), ("slopes", f"N = {N}", "(3,)")),
    ("score_mod", lambda: mods.relative_bias(TABLE[:3]), ("table", f"N = {N}", f"(3, {TABLE.shape[1]})")),
])
def test_a_ready_made_mods_arrays_must_fit_the_call(argument, mod, needles):
  with raises(ValueError, argument, *needles):
    attention("xla", **{argument: mod()})


def test_ready_made_arrays_broadcast_over_b_and_run_past_the_sequence():
  """What the fit allows gives the reference's answer: ids and prefix lengths with a
  leading 1 (one row for every batch row), and ids longer than T and S."""
  ids_q, ids_kv = IDS_Q[:1], np.concatenate([IDS_KV, np.full((B, 3), 7, np.int32)], 1)
  mask_mod = mods.and_masks(mods.document(ids_q, ids_kv), mods.prefix_lm(PREFIX[:1] + 2))
  allowed = ((ids_q[:, None, :, None] == ids_kv[:, None, None, :S])
             & ((s_ <= t_) | (s_ < PREFIX[0] + 2)))
  want, _ = reference(Q, KEY, V, allowed=np.broadcast_to(allowed, (B, N, T, S)))
  for impl in ("xla", "blockwise"):
    np.testing.assert_allclose(attention(impl, mask_mod=mask_mod), want, **TOL, err_msg=impl)


def test_cudnn_refuses_naming_the_argument():
  with raises(ValueError, "cudnn.*score_mod, sinks"):
    attention("cudnn", score_mod=mods.soft_cap(1.0), sinks=SINKS)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_dropout_with_mods_equals_dropout_with_the_builtin(impl):
  """The same rng draws the same keep mask: mods change only what they should."""
  kw = dict(dropout_rate=0.3, dropout_rng=jax.random.key(4))
  with_mod = attention(impl, mask_mod=mods.causal(), **kw)
  builtin = attention(impl, is_causal=True, **kw)
  np.testing.assert_allclose(with_mod, builtin, rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(with_mod - attention(impl, is_causal=True)).max()) > 1e-2


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.thorough),
                                  pytest.param("vmap", marks=pytest.mark.thorough),
                                  "blockwise"])
def test_bfloat16_with_mods_and_sinks(impl):
  """bf16 inputs: logits, mods and softmax in float32, output within bf16 rounding."""
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (Q, KEY, V))
  out = attention(impl, q, k, v, mask_mod=MASKS["per_head"][0], score_mod=mods.soft_cap(2.0),
                  sinks=SINKS)
  assert out.dtype == jnp.bfloat16
  ref, _ = reference(*(np.asarray(x, np.float32) for x in (q, k, v)),
                     allowed=MASKS["per_head"][1], sinks=SINKS,
                     score=lambda l: 2.0 * np.tanh(l / 2.0))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)
