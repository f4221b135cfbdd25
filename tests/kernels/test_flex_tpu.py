"""The flex_tpu Pallas kernel, in interpret mode on this CPU, against the float64 reference.

Values only: interpret mode runs the kernel's program per grid step with
NumPy-like semantics; it says nothing about TPU speed. The export tests check
the Pallas-to-Mosaic lowering (`tpu_custom_call`, no [T, S] tensor), not the
TPU compiler's last passes.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import flex_tpu, flex_tpu_call
from jattn._src.masks.programmable import build_mods
from jattn._src.masks.structural import MaskSpec
from tests.reference import reference_attention, reference_mask
from tests.reference_grads import reference_vjp, table_grad

B, T, S, N, K, H = 1, 200, 250, 2, 1, 128  # T, S not multiples of the tiles


def _inputs(T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32, seed=0):
  r = np.random.default_rng(seed)
  q = r.normal(size=(B, T, N, H))
  k = r.normal(size=(B, S, K, H))
  v = r.normal(size=(B, S, K, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _run(q, k, v, mask_mod=None, score_mod=None, sinks=None, structure=MaskSpec(),
         layout="BTNH", block_q=64, block_kv=128):
  lay = Layout(layout)
  Bq, Tq, Nq, Hq = (q.shape[lay.axis(c)] if c in lay.query else 1 for c in "BTNH")
  Sk, Kk, Dv = (v.shape[lay.axis(c)] for c in "TNH")
  mods = build_mods(mask_mod, score_mod, sinks, None, N=Nq)
  m = Modifiers(mods=mods, structure=structure, scale=1 / np.sqrt(Hq))
  p = flex_tpu.plan(B=Bq, T=Tq, S=Sk, N=Nq, K=Kk, H=Hq, D=Dv, dtype=q.dtype, modifiers=m,
                    block_q=block_q, block_kv=block_kv, interpret=True)
  assert not isinstance(p, str), p
  return flex_tpu_call.run(p, q, k, v, m, lay)[:3]  # (out, weights, lse): no max logits asked


def _lse(q, k, allowed, bias=None, cap=None):
  """float64 [B, N, T] log-sum-exp of the visible logits (-inf-free: rows with none skipped)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  G = q.shape[2] // k.shape[2]
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2)) / np.sqrt(q.shape[-1])
  if cap is not None:
    logits = cap * np.tanh(logits / cap)
  if bias is not None:
    logits = logits + bias
  logits = np.where(allowed, logits, -np.inf)
  mx = logits.max(-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0)
  total = np.exp(logits - mx).sum(-1, keepdims=True)
  return (mx + np.log(np.where(total > 0, total, 1.0)))[..., 0]


def _grid():
  return np.arange(T)[:, None], np.arange(S)[None, :]


def test_causal_mask_mod_matches_reference_values_and_lse():
  q, k, v = _inputs()
  out, weights, lse = _run(q, k, v, mask_mod=jattn.mods.causal())
  t, s = _grid()
  allowed = np.broadcast_to(s <= t, (B, N, T, S))
  np.testing.assert_allclose(out, reference_attention(q, k, v, mask=allowed), atol=2e-6)
  np.testing.assert_allclose(lse, _lse(q, k, allowed), atol=2e-5)
  assert weights is None and lse.dtype == jnp.float32 and lse.shape == (B, N, T)


def test_hand_written_mask_grouped_heads_and_fully_masked_rows():
  # N = 4 query heads on K = 2 kv heads; rows t < 5 see no key: zeros
  q, k, v = _inputs(N=4, K=2)
  mask = lambda b, n, t, s: ((t - s) % 3 != 1) & (t >= 5) & (s <= t + n)
  out, _, lse = _run(q, k, v, mask_mod=mask)
  t, s = _grid()
  n = np.arange(4)[:, None, None]
  allowed = np.broadcast_to(((t - s) % 3 != 1) & (t >= 5) & (s <= t + n), (B, 4, T, S))
  np.testing.assert_allclose(out, reference_attention(q, k, v, mask=allowed), atol=2e-6)
  assert np.all(np.asarray(out)[:, :5] == 0)
  np.testing.assert_allclose(np.asarray(lse)[:, :, 5:], _lse(q, k, allowed)[:, :, 5:], atol=2e-5)


def test_alibi_slopes_from_smem_and_prefix_lm_lengths():
  q, k, v = _inputs(N=4, K=2)
  slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
  prefix = jnp.asarray([37], jnp.int32)
  out, _, lse = _run(q, k, v, mask_mod=jattn.mods.prefix_lm(prefix),
                     score_mod=jattn.mods.alibi(slopes))
  t, s = _grid()
  bias = np.asarray(slopes, np.float64)[None, :, None, None] * (s - t)[None, None]
  allowed = np.broadcast_to((s <= t) | (s < 37), (B, 4, T, S))
  np.testing.assert_allclose(out, reference_attention(q, k, v, bias, allowed), atol=2e-6)
  np.testing.assert_allclose(lse, _lse(q, k, allowed, bias=bias), atol=2e-5)


def test_only_a_differentiated_call_pays_for_the_float32_residual(monkeypatch):
  """ALiBi reads a float array: under jax.grad into it the forward writes the float32 out
  (P V in float32) that the slopes' gradient needs; a call nothing differentiates, or
  one differentiated into q, k, v only, runs the plain forward (on v5e its FULL tile is
  about 1.4x cheaper: docs/tpu_kernel.md)."""
  from jattn._src.kernels import flex_tpu_kernels
  asked, real = [], flex_tpu_kernels.forward

  def spy(*args, **kwargs):
    asked.append(args[7] if len(args) > 7 else kwargs.get("accumulator_out", False))
    return real(*args, **kwargs)

  monkeypatch.setattr(flex_tpu_kernels, "forward", spy)
  q, k, v = _inputs(T=64, S=128, N=2, K=1, dtype=jnp.bfloat16)
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)
  f = lambda q, slopes: _run(q, k, v, score_mod=jattn.mods.alibi(slopes))[0]
  out = f(q, slopes)
  assert asked == [False]
  t, s = np.arange(64)[:, None], np.arange(128)[None, :]
  bias = np.asarray(slopes, np.float64)[None, :, None, None] * (s - t)[None, None]
  allowed = np.ones((1, 2, 64, 128), bool)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             reference_attention(q, k, v, bias, allowed), atol=2e-2)
  jax.grad(lambda slopes: f(q, slopes).astype(jnp.float32).sum())(slopes)
  assert asked[1:] == [True]
  # differentiated, but not into the slopes (ALiBi's fixed slopes): no residual either
  jax.grad(lambda q: f(q, slopes).astype(jnp.float32).sum())(q)
  assert asked[2:] == [False]


def test_traced_soft_cap_chunks_sinks_and_bfloat16():
  q, k, v = _inputs(dtype=jnp.bfloat16)
  cap, sinks = 2.0, jnp.asarray([0.5, -1.0], jnp.float32)

  @jax.jit
  def f(q, k, v, cap):  # the cap is a tracer: it reaches the kernel through SMEM
    return _run(q, k, v, mask_mod=jattn.mods.chunked(64), score_mod=jattn.mods.soft_cap(cap),
                sinks=sinks)

  out, _, lse = f(q, k, v, jnp.float32(cap))
  t, s = _grid()
  allowed = np.broadcast_to(t // 64 == s // 64, (B, N, T, S))
  ref_lse = np.logaddexp(_lse(q, k, allowed, cap=cap), np.asarray(sinks)[None, :, None])
  # softmax with the sink as one more key of no value, in float64
  qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = cap * np.tanh(np.einsum("btnh,bsnh->bnts", qf, np.repeat(kf, N, 2)) / np.sqrt(H) / cap)
  w = np.where(allowed, np.exp(logits - ref_lse[..., None]), 0)
  ref = np.einsum("bnts,bsnd->btnd", w, np.repeat(vf, N, 2))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-2)


def test_head_sizes_layouts_and_structure():
  # H = 64 != D = 192 (not multiples of 128), BNTH layout, is_causal and a window
  q, k, v = _inputs(H=64, D=192)
  q, k, v = (jnp.einsum("btnh->bnth", x) for x in (q, k, v))
  out, _, _ = _run(q, k, v, layout="BNTH",
                   structure=MaskSpec(is_causal=True, local_window=(30, 0)))
  t, s = _grid()
  allowed = np.broadcast_to((s <= t) & (s >= t - 30), (B, N, T, S))
  qb, kb, vb = (np.einsum("bnth->btnh", x) for x in (q, k, v))
  np.testing.assert_allclose(np.einsum("bnth->btnh", out),
                             reference_attention(qb, kb, vb, mask=allowed), atol=2e-6)


def test_unbatched_layout():
  q, k, v = (x[0] for x in _inputs(T=24, S=40))
  out, _, lse = _run(q, k, v, layout="TNH", mask_mod=jattn.mods.sliding_window(4, 4))
  t, s = np.arange(24)[:, None], np.arange(40)[None]
  allowed = np.broadcast_to(np.abs(t - s) <= 4, (N, 24, 40))
  np.testing.assert_allclose(out, reference_attention(q, k, v, mask=allowed), atol=2e-6)
  assert lse.shape == (N, 24)


@pytest.mark.thorough
def test_gradients_match_dense_float64_reference():
  q, k, v = _inputs(T=40, S=72)
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)
  sinks = jnp.asarray([0.3, -0.2], jnp.float32)

  def loss(q, k, v, slopes, sinks):
    out = _run(q, k, v, mask_mod=jattn.mods.causal(), score_mod=jattn.mods.alibi(slopes),
               sinks=sinks, block_q=16)[0]
    return jnp.sum(out * jnp.cos(out))

  def dense(q, k, v, slopes, sinks):  # plain float64 jnp, written here
    t, s = jnp.arange(40)[:, None], jnp.arange(72)[None]
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N, 2)) / np.sqrt(H)
    logits = logits + slopes[None, :, None, None] * (s - t).astype(q.dtype)
    logits = jnp.where(s <= t, logits, -jnp.inf)
    full = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None],
                                                     logits.shape[:3] + (1,))], -1)
    w = jax.nn.softmax(full, -1)[..., :-1]
    out = jnp.einsum("bnts,bsnd->btnd", w, jnp.repeat(v, N, 2))
    return jnp.sum(out * jnp.cos(out))

  args = (q, k, v, slopes, sinks)
  got = jax.grad(loss, argnums=range(5))(*args)
  with jax.enable_x64(True):
    want = jax.grad(dense, argnums=range(5))(*(jnp.asarray(a, jnp.float64) for a in args))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def test_folded_constants_of_a_score_mod_values_and_gradients():
  """score_mod's multiplies and divides by constants (literals and a traced scalar), its
  negations and sums are folded with the scale and the softmax's log2(e) into one multiply
  per term (tile_mods.Linear); the logits run in base 2. out, lse and the gradients into
  q, k, v and the traced scalar against float64 (jattn's lse carries no gradient)."""
  q, k, v = _inputs(T=40, S=72)

  def mod(c):
    return lambda x, b, n, t, s: (20.0 * jnp.tanh(x / 20.0) - (x * 0.5) / -4.0
                                  + c * (s - t).astype(x.dtype) / 8.0 - (-x) * c)

  def loss(q, k, v, c):
    out, _, lse = _run(q, k, v, score_mod=mod(c), structure=MaskSpec(is_causal=True),
                       block_q=16)
    return jnp.sum(out * jnp.cos(out)), lse

  def dense(q, k, v, c):  # plain float64 jnp, written here
    t, s = jnp.arange(40)[:, None], jnp.arange(72)[None]
    x = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N, 2)) / np.sqrt(H)
    logits = 20.0 * jnp.tanh(x / 20.0) + x / 8.0 + c * (s - t).astype(x.dtype) / 8.0 + x * c
    logits = jnp.where(s <= t, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, -1)
    out = jnp.einsum("bnts,bsnd->btnd", jnp.exp(logits - lse[..., None]), jnp.repeat(v, N, 2))
    return jnp.sum(out * jnp.cos(out)), lse

  args = (q, k, v, jnp.float32(0.3))
  (value, lse), got = jax.jit(jax.value_and_grad(loss, argnums=range(4), has_aux=True))(*args)
  with jax.enable_x64(True):
    (want_value, want_lse), want = jax.value_and_grad(dense, argnums=range(4), has_aux=True)(
        *(jnp.asarray(a, jnp.float64) for a in args))
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_mod, score_mod, words", [
    (lambda: (lambda ok: lambda b, n, t, s: ok[(s - t) % 4])(jnp.asarray([1, 0, 1, 1]) > 0),
     None, "through arithmetic"),
    (None, lambda: jattn.mods.relative_bias(jnp.zeros((N, 257))), "block_kv = 256 entries"),
    (None, lambda: (lambda pos: lambda x, b, n, t, s: x + pos[t])(jnp.arange(T, dtype=jnp.float32)),
     "in score_mod"),
    (lambda: (lambda b, n, t, s: jnp.arange(4)[t % 4] > 0), None, "not evaluated on a tile"),
])
def test_refused_with_a_reason(mask_mod, score_mod, words):
  mods = build_mods(mask_mod and mask_mod(), score_mod and score_mod(), None, None, N=N)
  p = flex_tpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32,
                    modifiers=Modifiers(mods=mods))
  assert isinstance(p, str) and words in p, p


def test_refuses_bias_dropout_weights():
  m = Modifiers(bias=jnp.zeros((1, 1, T, S)))
  assert "bias" in flex_tpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32,
                                 modifiers=m)
  assert "weights" in flex_tpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32,
                                    modifiers=Modifiers(), return_weights=True)


def _export_text(mask_mod, score_mod, sinks, dtype=jnp.bfloat16, T=1024, S=2048):
  q = jax.ShapeDtypeStruct((2, T, 4, 128), dtype)
  k = jax.ShapeDtypeStruct((2, S, 2, 128), dtype)

  def f(q, k, v):
    m = Modifiers(mods=build_mods(mask_mod, score_mod, sinks, None, N=4), scale=0.1)
    p = flex_tpu.plan(B=2, T=T, S=S, N=4, K=2, H=128, D=128, dtype=dtype, modifiers=m)
    return flex_tpu_call.run(p, q, k, v, m, Layout("BTNH"))[0]

  return jax.export.export(jax.jit(f), platforms=["tpu"])(q, k, k).mlir_module()


@pytest.mark.parametrize("case", ["alibi", "softcap_sinks", "prefix_lm", "hand"])
def test_export_for_tpu_is_one_mosaic_kernel_without_a_TS_tensor(case):
  mask_mod, score_mod, sinks = {
      "alibi": (jattn.mods.causal(), jattn.mods.alibi(jnp.ones(4)), None),
      "softcap_sinks": (None, jattn.mods.soft_cap(jnp.float32(30.0)), jnp.zeros(4)),
      "prefix_lm": (jattn.mods.prefix_lm(jnp.asarray([3, 500])), None, None),
      "hand": (lambda b, n, t, s: ((t - s) % 3 != 1) & (s <= t + b), None, None),
  }[case]
  text = _export_text(mask_mod, score_mod, sinks)
  assert text.count("tpu_custom_call") >= 1
  assert not re.search(r"tensor<[^>]*\b1024x2048", text)


def test_score_mod_alone_padded_keys_take_no_weight():
  # no mask at all: only the kernel's padding mask hides keys 250..255 of the last tile
  q, k, v = _inputs()
  out, _, lse = _run(q, k, v, score_mod=lambda x, b, n, t, s: x * 0.5)
  allowed = np.ones((B, N, T, S), bool)
  np.testing.assert_allclose(out, reference_attention(q, k, v, scale=0.5 / np.sqrt(H)),
                             atol=2e-6)
  np.testing.assert_allclose(lse, _lse(q, k * 0.5, allowed), atol=2e-5)


def test_pallas_backward_grouped_heads_soft_cap_and_empty_rows():
  # no float array captured: every gradient comes from the two Pallas backward kernels.
  # N = 4 on K = 2 (dk, dv summed over each group), T = 40 and S = 200 padded,
  # two kv tiles, rows t < 3 see no key (zero, finite gradients).
  Tg, Sg, Ng, Kg = 40, 200, 4, 2
  q, k, v = _inputs(T=Tg, S=Sg, N=Ng, K=Kg, seed=1)
  mask = lambda b, n, t, s: (s <= 4 * t + n) & (t >= 3)
  cap = lambda x, b, n, t, s: 3.0 * jnp.tanh(x / 3.0)

  def loss(q, k, v):
    out = _run(q, k, v, mask_mod=mask, score_mod=cap, block_q=16)[0]
    return jnp.sum(out * jnp.cos(out))

  def dense(q, k, v):  # plain float64 jnp, written here
    t, s = jnp.arange(Tg)[:, None], jnp.arange(Sg)[None]
    n = jnp.arange(Ng)[:, None, None]
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) / np.sqrt(H)
    logits = 3.0 * jnp.tanh(logits / 3.0)
    allowed = (s <= 4 * t + n) & (t >= 3)
    w = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1)
    w = jnp.where(allowed, w, 0.0)
    out = jnp.einsum("bnts,bsnd->btnd", w, jnp.repeat(v, 2, 2))
    return jnp.sum(out * jnp.cos(out))

  got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  with jax.enable_x64(True):
    want = jax.grad(dense, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float64) for a in (q, k, v)))
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, np.nan_to_num(w), atol=2e-5, rtol=1e-4)
  assert np.all(np.asarray(got[0])[:, :3] == 0)


def test_export_of_the_gradient_has_the_backward_kernels():
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    m = Modifiers(mods=build_mods(jattn.mods.prefix_lm(jnp.asarray([100])),
                                  jattn.mods.soft_cap(20.0), jnp.zeros(4), None, N=4),
                  scale=0.1)
    p = flex_tpu.plan(B=1, T=512, S=1024, N=4, K=2, H=128, D=128, dtype=q.dtype, modifiers=m)
    return jnp.sum(flex_tpu_call.run(p, q, k, v, m, Layout("BTNH"))[0].astype(jnp.float32))

  text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                           platforms=["tpu"])(q, k, k).mlir_module()
  for name in ("jattn_flex_tpu_fwd", "jattn_flex_tpu_dq", "jattn_flex_tpu_dkv"):
    assert name in text, name
  assert text.count("tpu_custom_call") >= 3
  assert not re.search(r"tensor<[^>]*\b512x1024", text)


def test_gradients_into_captured_arrays_cap_and_per_batch_head_table():
  # score_mod reads a traced cap (0-d) and a [B, N] table at (b, n): their gradients come
  # from the dq kernel's per-program partials, summed outside; B = 2, three kv tiles,
  # T = 20 padded to 24: the padded query rows' logits reach 0.5 * 300 (exp overflows)
  Bg, Tg, Sg = 2, 20, 300
  r = np.random.default_rng(2)
  q, k, v = (jnp.asarray(r.normal(size=(Bg, n_, N, H)), jnp.float32) for n_ in (Tg, Sg, Sg))
  table = jnp.asarray([[0.5, -0.02], [0.03, 0.005]], jnp.float32)

  def mod(cap, table):
    return lambda x, b, n, t, s: cap * jnp.tanh(x / cap) + table[b, n] * (s - t).astype(x.dtype)

  def loss(q, k, v, cap, table):
    out = _run(q, k, v, score_mod=mod(cap, table), block_q=8)[0]
    return jnp.sum(out * jnp.cos(out))

  def dense(q, k, v, cap, table):  # plain float64 jnp, written here
    t, s = jnp.arange(Tg)[:, None], jnp.arange(Sg)[None]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    logits = cap * jnp.tanh(logits / cap) + table[:, :, None, None] * (s - t).astype(q.dtype)
    out = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, -1), v)
    return jnp.sum(out * jnp.cos(out))

  args = (q, k, v, jnp.float32(2.5), table)
  got = jax.jit(jax.grad(loss, argnums=range(5)))(*args)
  with jax.enable_x64(True):
    want = jax.grad(dense, argnums=range(5))(*(jnp.asarray(a, jnp.float64) for a in args))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4)
  again = jax.jit(jax.grad(loss, argnums=(3, 4)))(*args)  # deterministic: the same bits
  assert np.array_equal(again[0], got[3]) and np.array_equal(again[1], got[4])


def test_block_classes_drive_the_kernel_empty_skipped_full_unmasked():
  # A block mask of causal whose classes are edited: (1, 0), FULL, marked EMPTY, and
  # the diagonal (1, 1), partial, marked FULL. The kernel must follow the classes: no
  # contribution from tile (1, 0) at all, and tile (1, 1) with no mask applied.
  import dataclasses as dc
  from jattn._src.core.block_sizes import BlockSizes
  Tb = Sb = 256
  q, k, v = _inputs(T=Tb, S=Sb)
  bm = jattn.create_block_mask(jattn.mods.causal(), None, None, Tb, Sb,
                               block_sizes=BlockSizes(128, 128))
  assert bm.classes.tolist() == [[[[1, 0], [2, 1]]]]  # PARTIAL, EMPTY / FULL, PARTIAL
  bm = dc.replace(bm, classes=jnp.asarray([[[[1, 0], [0, 2]]]], jnp.int8))
  mods = build_mods(jattn.mods.causal(), None, None, bm, N=N)
  m = Modifiers(mods=mods, scale=1 / np.sqrt(H))
  p = flex_tpu.plan(B=B, T=Tb, S=Sb, N=N, K=K, H=H, D=H, dtype=q.dtype, modifiers=m,
                    block_q=128, block_kv=128, interpret=True)
  out = flex_tpu_call.run(p, q, k, v, m, Layout("BTNH"))[0]
  t, s = np.arange(Tb)[:, None], np.arange(Sb)[None]
  allowed = s <= t
  allowed[128:, :128] = False  # EMPTY: skipped
  allowed[128:, 128:] = True  # FULL: no mask_mod
  want = reference_attention(q, k, v, mask=np.broadcast_to(allowed, (B, N, Tb, Sb)))
  np.testing.assert_allclose(out, want, atol=2e-6)
  assert p.skip


@pytest.mark.thorough
def test_skipping_changes_no_value():
  # the same calls with and without block skipping, against the reference: a hand-written
  # mask (classes from mask_mod block by block) with empty tiles on both sides
  q, k, v = _inputs(T=256, S=384, N=4, K=2)
  mask = lambda b, n, t, s: (jnp.abs(t - s + 64 * n) < 40) | (s < 3)
  t, s = np.arange(256)[:, None], np.arange(384)[None]
  n = np.arange(4)[:, None, None]
  want = reference_attention(q, k, v, mask=((np.abs(t - s + 64 * n) < 40) | (s < 3))[None])
  for block_q in (64, 128):
    out = _run(q, k, v, mask_mod=mask, block_q=block_q)[0]
    np.testing.assert_allclose(out, want, atol=2e-6)


def test_per_batch_classes_prefix_lm_two_rows():
  # prefix_lm's classes differ per batch row (prefix 200 vs 3): the tables are [B, 1, nq, nk]
  r = np.random.default_rng(3)
  q, k, v = (jnp.asarray(r.normal(size=(2, 256, N, H)), jnp.float32) for _ in range(3))
  prefix = jnp.asarray([200, 3], jnp.int32)
  out = _run(q, k, v, mask_mod=jattn.mods.prefix_lm(prefix), block_q=128)[0]
  t, s = np.arange(256)[:, None], np.arange(256)[None]
  allowed = np.stack([(s <= t) | (s < 200), (s <= t) | (s < 3)])[:, None]
  np.testing.assert_allclose(out, reference_attention(q, k, v, mask=allowed), atol=2e-6)


def _documents(B_, L, count, seed):
  """int32 [B_, L]: `count` packed documents of random lengths per row."""
  r = np.random.default_rng(seed)
  cuts = np.sort(r.choice(np.arange(1, L), size=(B_, count - 1)), axis=1)
  return jnp.asarray((np.arange(L)[None, None] >= cuts[:, :, None]).sum(1), jnp.int32)


def test_document_mask_per_token_ids_as_blocks():
  # segment ids [B, T] and [B, S] reach the kernel as blocks beside q and k (x[b, t]
  # along the lanes, x[b, s] along the sublanes); T = 200 != S = 250, B = 2, padded
  q_ids, kv_ids = _documents(2, T, 5, 0), _documents(2, S, 5, 1)
  r = np.random.default_rng(4)
  q, k, v = (jnp.asarray(r.normal(size=(2, n_, N, H)), jnp.float32) for n_ in (T, S, S))
  mask = jattn.mods.document(q_ids, kv_ids)
  out, _, lse = _run(q, k, v, mask_mod=mask)
  want = reference_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  np.testing.assert_allclose(out, want, atol=2e-6)


@pytest.mark.thorough
def test_document_mask_gradients():
  q_ids, kv_ids = _documents(2, T, 5, 0), _documents(2, S, 5, 1)
  r = np.random.default_rng(4)
  q, k, v = (jnp.asarray(r.normal(size=(2, n_, N, H)), jnp.float32) for n_ in (T, S, S))
  mask = jattn.mods.document(q_ids, kv_ids)

  def loss(q, k, v):
    o = _run(q, k, v, mask_mod=mask)[0]
    return jnp.sum(o * jnp.cos(o))

  def dense(q, k, v):
    allowed = (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    w = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1)
    w = jnp.where(allowed, w, 0.0)
    o = jnp.einsum("bnts,bsnd->btnd", w, v)
    return jnp.sum(o * jnp.cos(o))

  got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  with jax.enable_x64(True):
    want = jax.grad(dense, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float64) for a in (q, k, v)))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, np.nan_to_num(w), atol=2e-5, rtol=1e-4)


def test_document_mask_export_has_no_TS_tensor():
  ids = jnp.asarray(np.repeat(np.arange(16), 128)[None].repeat(2, 0), jnp.int32)  # [2, 2048]
  text = _export_text(jattn.mods.document(ids[:, :1024], ids), None, None)
  assert text.count("tpu_custom_call") >= 1
  assert not re.search(r"tensor<[^>]*\b1024x2048", text)


# ---------------------------------------------------------------- lengths and segment ids


def _lengths_and_documents(is_causal=True, q_ids=None, kv_ids=None, q_lengths=(150, 200),
                           kv_lengths=(250, 100)):
  """MaskSpec: causal, 4 documents per row (or the ids given), query lengths (150, 200)
  and key lengths (250, 100) for B = 2 rows of T = 200 queries and S = 250 keys: rows
  past a length, and rows whose document has no key left, see no key."""
  return MaskSpec(is_causal=is_causal, q_lengths=jnp.asarray(q_lengths, jnp.int32),
                  kv_lengths=jnp.asarray(kv_lengths, jnp.int32),
                  q_segment_ids=_documents(2, T, 4, 5) if q_ids is None else q_ids,
                  kv_segment_ids=_documents(2, S, 4, 6) if kv_ids is None else kv_ids)


def _structure_allowed(st, user=None):
  """bool [2, N, T, S]: the float64 reference's mask of `st`, ANDed with `user` [T, S]."""
  return reference_mask(2, N, T, S, mask=user, is_causal=st.is_causal,
                        q_lengths=st.q_lengths, kv_lengths=st.kv_lengths,
                        q_segment_ids=st.q_segment_ids, kv_segment_ids=st.kv_segment_ids)


USER_MASKS = {  # mask_mod, and the same mask [T, S] in NumPy
    "none": (None, None),
    "ready_made_window": (jattn.mods.sliding_window(60), lambda t, s: s >= t - 60),
    "hand_written": (lambda b, n, t, s: (t - s) % 3 != 1, lambda t, s: (t - s) % 3 != 1)}


@pytest.mark.parametrize("user", list(USER_MASKS))
def test_lengths_and_segment_ids_as_mask_mods_values_lse_and_gradients(user):
  """Sequence lengths and segment ids, which the kernel reads as mask mods
  (`structure_mods`): alone, ANDed with a ready-made mask_mod (block classes in closed
  form) and with a hand-written one (one jaxpr of both). out, lse and the gradients of
  q, k and v against float64 NumPy; rows that see no key give zeros."""
  mask_mod, numpy_mask = USER_MASKS[user]
  st = _lengths_and_documents()
  user_allowed = None if numpy_mask is None else numpy_mask(*_grid())
  allowed = _structure_allowed(st, user_allowed)
  r = np.random.default_rng(7)
  q, k, v = (jnp.asarray(r.normal(size=(2, n_, N, H)), jnp.float32) for n_ in (T, S, S))
  d_out = r.normal(size=(2, T, N, H))
  (out, _, lse), pullback = jax.vjp(
      lambda q, k, v: _run(q, k, v, mask_mod=mask_mod, structure=st), q, k, v)
  grads = pullback((jnp.asarray(d_out, jnp.float32), None, jnp.zeros_like(lse)))
  want, *want_grads, _ = reference_vjp(
      q, k, v, d_out, mask=user_allowed, is_causal=True, query_seq_lengths=st.q_lengths,
      key_value_seq_lengths=st.kv_lengths, q_segment_ids=st.q_segment_ids,
      kv_segment_ids=st.kv_segment_ids)
  np.testing.assert_allclose(out, want, atol=2e-6)
  seen = allowed.any(-1)  # [2, N, T]
  assert not seen.all() and seen.any()
  assert np.all(np.asarray(out).transpose(0, 2, 1, 3)[~seen] == 0)
  np.testing.assert_allclose(np.asarray(lse)[seen], _lse(q, k, allowed)[seen], atol=2e-5)
  for name, g, w in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_lengths_and_segment_ids_classify_the_tiles_exactly():
  """The tiles' classes with lengths and documents (numbered 0, 1, 2, ..) equal the
  classes counted from the float64 reference's dense mask: EMPTY where a tile sees no
  entry, FULL where it sees every one (its part inside T and S), so the kernel skips the
  tiles past a length and between documents (not causal, 2 documents cut at a tile's
  edge: FULL tiles too; lengths at a tile's first and last position)."""
  from jattn._src.kernels.tile_classes import tile_classes
  from jattn._src.masks.structure_mods import as_mask_mods
  ids = lambda L: jnp.asarray(np.broadcast_to(np.arange(L) >= 128, (2, L)), jnp.int32)
  st = _lengths_and_documents(is_causal=False, q_ids=ids(T), kv_ids=ids(S),
                              q_lengths=(128, 191), kv_lengths=(250, 127))
  m = Modifiers(structure=st, scale=1.0)
  p = flex_tpu.plan(B=2, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32, modifiers=m,
                    block_q=64, block_kv=128)
  assert not isinstance(p, str) and p.skip and p.has_mask_mod, p
  got = np.asarray(tile_classes(p, as_mask_mods(m).mods.traced()))
  allowed = _structure_allowed(st)[:, 0]  # [2, T, S]
  pad = np.zeros((2, p.T_padded, p.S_padded), bool)
  inside = np.zeros_like(pad)
  pad[:, :T, :S], inside[:, :T, :S] = allowed, True
  tiles = lambda x: x.reshape(2, p.T_padded // 64, 64, p.S_padded // 128, 128)
  count, total = tiles(pad).sum((2, 4)), tiles(inside).sum((2, 4))
  want = np.where(count == 0, 0, np.where(count == total, 2, 1))
  assert got.shape == (2, 1) + want.shape[1:]
  np.testing.assert_array_equal(got[:, 0], want)
  assert (want == 0).any() and (want == 2).any(), want  # both kinds occur


def test_a_block_mask_with_segment_ids_is_not_trusted_for_full_tiles():
  """A block_mask of causal calls some tiles FULL that the documents cut: the kernel
  must classify the call's whole mask again (a FULL tile would skip the documents)."""
  from jattn._src.core.block_sizes import BlockSizes
  st = dataclasses.replace(_lengths_and_documents(), is_causal=False, q_lengths=None,
                           kv_lengths=None)
  bm = jattn.create_block_mask(jattn.mods.causal(), None, None, T, S,
                               block_sizes=BlockSizes(64, 128))
  assert (np.asarray(bm.classes) == 2).any()
  r = np.random.default_rng(8)
  q, k, v = (jnp.asarray(r.normal(size=(2, n_, N, H)), jnp.float32) for n_ in (T, S, S))
  m = Modifiers(mods=build_mods(jattn.mods.causal(), None, None, bm, N=N), structure=st,
                scale=1 / np.sqrt(H))
  p = flex_tpu.plan(B=2, T=T, S=S, N=N, K=N, H=H, D=H, dtype=q.dtype, modifiers=m,
                    block_q=64, block_kv=128, interpret=True)
  out = flex_tpu_call.run(p, q, k, v, m, Layout("BTNH"))[0]
  want = reference_attention(q, k, v, is_causal=True, q_segment_ids=st.q_segment_ids,
                             kv_segment_ids=st.kv_segment_ids)
  np.testing.assert_allclose(out, want, atol=2e-6)


def test_a_ring_steps_chunks_of_lengths_and_segment_ids_are_left_to_the_ring():
  """At ring offsets the structure holds one chunk's ids (the ring passes the global
  arrays as mask mods where it can, `context_parallel.run`)."""
  st = _lengths_and_documents()
  p = flex_tpu.plan(B=2, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32,
                    modifiers=Modifiers(structure=st), offsets=True)
  assert isinstance(p, str) and "ring's blockwise step applies them" in p, p


@pytest.mark.parametrize("gradients", [
    False, pytest.param(True, marks=pytest.mark.thorough)])
def test_relative_bias_table_gathered_in_the_kernel(gradients):
  # table [N, 2M+1] at clip(s - t, -M, M) + M: a gather along the lanes of a VMEM tile;
  # its gradient by the blockwise backward (dq, dk, dv by the Pallas kernels)
  M, Tr, Sr = 6, 40, 200
  r = np.random.default_rng(5)
  q, k, v = _inputs(T=Tr, S=Sr, N=4, K=2, seed=5)
  table = jnp.asarray(r.normal(size=(4, 2 * M + 1)), jnp.float32)
  t, s = np.arange(Tr)[:, None], np.arange(Sr)[None]
  bias = np.asarray(table, np.float64)[:, np.clip(s - t, -M, M) + M][None]  # [1, N, T, S]
  mask = np.broadcast_to(s <= t + 100, (B, 4, Tr, Sr))

  def run(q, k, v, table):
    return _run(q, k, v, score_mod=jattn.mods.relative_bias(table),
                mask_mod=lambda b, n, t, s: s <= t + 100, block_q=16)

  out, _, lse = run(q, k, v, table)
  np.testing.assert_allclose(out, reference_attention(q, k, v, bias, mask), atol=2e-6)
  np.testing.assert_allclose(lse, _lse(q, k, mask, bias=bias), atol=2e-5)
  if not gradients:
    return

  def loss(q, k, v, table):
    o = run(q, k, v, table)[0]
    return jnp.sum(o * jnp.cos(o))

  def dense(q, k, v, table):
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) / np.sqrt(H)
    logits = logits + table[:, np.clip(s - t, -M, M) + M][None]
    w = jax.nn.softmax(jnp.where(s <= t + 100, logits, -jnp.inf), -1)
    o = jnp.einsum("bnts,bsnd->btnd", w, jnp.repeat(v, 2, 2))
    return jnp.sum(o * jnp.cos(o))

  got = jax.grad(loss, argnums=range(4))(q, k, v, table)
  with jax.enable_x64(True):
    want = jax.grad(dense, argnums=range(4))(
        *(jnp.asarray(a, jnp.float64) for a in (q, k, v, table)))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def test_relative_bias_wider_than_a_vreg_against_float64():
  """A table of 141 entries (two 128-lane vregs) on kv tiles of 256: the kernel gathers
  per 128-lane chunk of the table and of the tile (Mosaic gathers from one source vreg)
  and merges the chunks; the entries past lane 128 and the clip at both ends are read."""
  M, Tr, Sr = 70, 40, 300
  r = np.random.default_rng(9)
  q, k, v = _inputs(T=Tr, S=Sr, N=2, K=1, seed=9)
  table = jnp.asarray(r.normal(size=(2, 2 * M + 1)), jnp.float32)
  t, s = np.arange(Tr)[:, None], np.arange(Sr)[None]
  bias = np.asarray(table, np.float64)[:, np.clip(s - t, -M, M) + M][None]
  out, _, lse = _run(q, k, v, score_mod=jattn.mods.relative_bias(table), block_q=40,
                     block_kv=256)
  allowed = np.ones((B, 2, Tr, Sr), bool)
  np.testing.assert_allclose(out, reference_attention(q, k, v, bias, allowed), atol=2e-6)
  np.testing.assert_allclose(lse, _lse(q, k, allowed, bias=bias), atol=2e-5)


def test_relative_bias_export_fwd_and_grad():
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((4, 65), jnp.float32)

  def loss(q, k, v, table):
    m = Modifiers(mods=build_mods(jattn.mods.causal(), jattn.mods.relative_bias(table), None,
                                  None, N=4), scale=0.1)
    p = flex_tpu.plan(B=1, T=512, S=1024, N=4, K=2, H=128, D=128, dtype=q.dtype, modifiers=m)
    assert not isinstance(p, str), p
    return jnp.sum(flex_tpu_call.run(p, q, k, v, m, Layout("BTNH"))[0].astype(jnp.float32))

  text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                           platforms=["tpu"])(q, k, k, table).mlir_module()
  for name in ("jattn_flex_tpu_fwd", "jattn_flex_tpu_dq", "jattn_flex_tpu_dkv"):
    assert name in text, name
  assert not re.search(r"tensor<[^>]*\b512x1024", text)


def test_table_gradients_in_the_dq_kernel_against_float64():
  """score_mod reads a [N, 2M+1] table at clip(s - t), a [2L+1] table at clip(t - s) and
  a slope at n: the dq kernel gives each table read a gradient row per query tile, summed
  outside. Grouped heads, B = 2, T != S (three query tiles, two kv tiles: a row of
  query tile 0 skips the EMPTY kv tile 1), against the float64 gradient of the bias the
  tables add and float64 central differences; the same bits twice."""
  Bg, Tg, Sg, Ng, M, L = 2, 40, 200, 4, 6, 2
  r = np.random.default_rng(7)
  q, k, v = (jnp.asarray(r.normal(size=(Bg, n_, h, 32)), jnp.float32)
             for n_, h in ((Tg, Ng), (Sg, 2), (Sg, 2)))
  table = jnp.asarray(r.normal(size=(Ng, 2 * M + 1)), jnp.float32)
  table1 = jnp.asarray(r.normal(size=(2 * L + 1,)), jnp.float32)
  slopes = jnp.asarray(r.uniform(0.0, 0.1, Ng), jnp.float32)
  cot = r.normal(size=(Bg, Tg, Ng, 32))
  t, s = np.arange(Tg)[:, None], np.arange(Sg)[None]
  index, index1 = np.clip(s - t, -M, M) + M, np.clip(t - s, -L, L) + L  # [T, S]
  allowed = np.broadcast_to(s <= t + 100, (Bg, Ng, Tg, Sg))

  def mod(table, table1, slopes):
    def score(x, b, n, t, s):
      rel = table[n, jnp.clip(s - t, -M, M) + M] + 0.5 * table1[jnp.clip(t - s, -L, L) + L]
      return x + rel + slopes[n] * (s - t).astype(x.dtype)
    return score

  def loss(table, table1, slopes):
    out = _run(q, k, v, score_mod=mod(table, table1, slopes),
               mask_mod=lambda b, n, t, s: s <= t + 100, block_q=16)[0]
    return jnp.sum(out * cot)

  def bias(table, table1, slopes):  # float64 [B, N, T, S]
    return np.broadcast_to(table[:, index] + 0.5 * table1[index1] + slopes[:, None, None]
                           * (s - t), (Bg, Ng, Tg, Sg))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = grad(table, table1, slopes)
  plain = [np.asarray(x, np.float64) for x in (table, table1, slopes)]
  out, *_, d_bias = reference_vjp(q, k, v, cot, bias(*plain), mask=allowed)
  want = (table_grad(d_bias, index, 2 * M + 1), table_grad(d_bias, index1, 2 * L + 1).sum(0)
          * 0.5, np.einsum("bnts,ts->n", d_bias, (s - t) * 1.0))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
  d = r.normal(size=table.shape)  # central differences along d, float64
  moved = lambda e: np.sum(reference_vjp(q, k, v, cot, bias(plain[0] + e * d, *plain[1:]),
                                         mask=allowed)[0] * cot)
  np.testing.assert_allclose(np.sum(got[0] * d), (moved(1e-4) - moved(-1e-4)) / 2e-4,
                             rtol=1e-4)
  again = grad(table, table1, slopes)
  assert all(np.array_equal(a, b) for a, b in zip(again, got))


def test_block_tables_past_the_smem_budget_turn_skipping_off():
  # a per-batch, per-head mask at B = 8, N = 32, T = S = 8192 would need 3 x 8 x 32 x 64 x 16
  # int32 table entries in SMEM: the plan runs every tile instead; causal needs one [nq, nk]
  def plan_for(mask_mod):
    m = Modifiers(mods=build_mods(mask_mod, None, None, None, N=32))
    return flex_tpu.plan(B=8, T=8192, S=8192, N=32, K=8, H=128, D=128, dtype=jnp.bfloat16,
                         modifiers=m)
  assert not plan_for(lambda b, n, t, s: (s <= t + n) & (t >= b)).skip
  assert plan_for(jattn.mods.causal()).skip


def test_through_dot_product_attention_values_and_gradients():
  """implementation="flex_tpu" by name (interpreted): a hand-written mask with grouped heads,
  ALiBi and sinks, values and gradients of q, k, v and sinks against float64 NumPy."""
  from jattn import mods
  from jattn._src.impl.interpret import pallas_interpret
  from tests.reference import reference_mods

  rng = np.random.default_rng(3)
  B, T, N, K, H = 1, 40, 4, 2, 16
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in "kv")
  slopes, sinks = np.linspace(0.1, 0.4, N).astype(np.float32), np.linspace(-1, 1, N).astype(np.float32)
  mask_mod = lambda b, n, t, s: (s <= t) & ((t - s) % 3 != 1)
  t_, s_ = np.arange(T)[:, None], np.arange(T)[None, :]
  allowed = (s_ <= t_) & ((t_ - s_) % 3 != 1)
  score = lambda l: l + slopes[None, :, None, None] * (s_ - t_)
  cot = rng.standard_normal((B, T, N, H))

  def loss(q, k, v, sinks):
    out = jattn.dot_product_attention(q, k, v, implementation="flex_tpu", mask_mod=mask_mod,
                                      score_mod=mods.alibi(slopes), sinks=sinks)
    return jnp.sum(out * cot), out

  with pallas_interpret():
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, sinks)
  want, _ = reference_mods(q, k, v, allowed=allowed, score=score, sinks=sinks)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  # gradients by central differences of the float64 reference along random directions
  for i, (x, g) in enumerate(zip((q, k, v, sinks), grads)):
    d = rng.standard_normal(x.shape)
    f = lambda e: np.sum(reference_mods(*[y + e * d if j == i else y for j, y in
                                          enumerate((q, k, v))], allowed=allowed, score=score,
                                        sinks=sinks + e * d if i == 3 else sinks)[0] * cot)
    numeric = (f(1e-4) - f(-1e-4)) / 2e-4
    np.testing.assert_allclose(np.sum(np.asarray(g, np.float64) * d), numeric, rtol=2e-4,
                               atol=2e-4, err_msg=f"gradient {i}")


@pytest.mark.parametrize("T_, S_, structure", [
    pytest.param(400, 400, MaskSpec(is_causal=True, local_window=(100, 0)),
                 marks=pytest.mark.thorough),
    (400, 400, MaskSpec(is_causal=True, local_window=(150, 0))),
    (300, 400, MaskSpec(local_window=(90, 60))),
], ids=["causal_window", "wide_causal_window", "wide_two_sided_window"])
def test_window_grid_over_only_the_nonempty_tiles(T_, S_, structure):
  """The grids run only each row's (column's) non-empty tiles (`grid_widths` fewer than
  the tiles), and the band mask (`band_keep`: the wide windows, 150 and 90 + 60 >= 16 +
  128 - 2, test one bound per tile): values, lse and the gradients of q, k, v and ALiBi's slopes, grouped heads,
  against float64 NumPy (the slopes' by central differences of the float64 forward)."""
  from jattn._src.kernels.tile_classes import grid_widths
  from tests.reference_grads import reference_mods_vjp
  N_, K_, H_ = 2, 1, 32
  q, k, v = _inputs(T=T_, S=S_, N=N_, K=K_, H=H_, D=H_)
  cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T_, N_, H_)), jnp.float32)
  slopes = np.asarray([0.03, -0.02], np.float32)
  lay = Layout("BTNH")

  def run(q, k, v, slopes):
    mods = build_mods(None, jattn.mods.alibi(slopes), None, None, N=N_)
    m = Modifiers(mods=mods, structure=structure, scale=1 / np.sqrt(H_))
    p = flex_tpu.plan(B=B, T=T_, S=S_, N=N_, K=K_, H=H_, D=H_, dtype=q.dtype, modifiers=m,
                      block_q=16, block_kv=128, interpret=True)
    assert not isinstance(p, str) and p.skip, p
    W, Wq = grid_widths(p)
    assert W < p.S_padded // 128 and Wq < p.T_padded // 16, (W, Wq)  # the grids shrink
    out, _, lse = flex_tpu_call.run(p, q, k, v, m, lay)[:3]
    return jnp.sum(out * cot), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(run, argnums=(0, 1, 2, 3), has_aux=True)(
      q, k, v, jnp.asarray(slopes))
  t, s = np.arange(T_)[:, None], np.arange(S_)[None, :]
  left, right = structure.local_window
  allowed = (s >= t - left) & (s <= t + right)
  if structure.is_causal:
    allowed &= s <= t
  allowed = allowed[None, None]
  score = lambda sl: (lambda x: x + np.asarray(sl, np.float64)[None, :, None, None] * (s - t))
  want, dq, dk, dv = reference_mods_vjp(q, k, v, cot, allowed=allowed, score=score(slopes))
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
  bias = slopes[None, :, None, None].astype(np.float64) * (s - t)
  np.testing.assert_allclose(lse, _lse(q, k, allowed, bias=bias), atol=2e-5, rtol=1e-5)
  for g, w in zip(grads[:3], (dq, dk, dv)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
  for n in range(N_):
    e = np.zeros(N_)
    e[n] = 1e-4
    f = lambda x: np.sum(reference_mods_vjp(q, k, v, cot, allowed=allowed,
                                            score=score(slopes + x))[0] * np.asarray(cot))
    np.testing.assert_allclose(grads[3][n], (f(e) - f(-e)) / 2e-4, rtol=1e-3, atol=1e-4)


def _most_nonempty_tiles(allowed, T_, S_, bq, bk, q0=0, k0=0):
  """(most non-empty kv tiles of a row, most query tiles of a column), at least 1, counted
  by brute force from the dense mask allowed(t, s) at global positions from q0, k0."""
  ok = allowed(q0 + np.arange(T_)[:, None], k0 + np.arange(S_)[None, :])
  nq, nk = -(-T_ // bq), -(-S_ // bk)
  tiles = np.pad(ok, ((0, nq * bq - T_), (0, nk * bk - S_))).reshape(
      nq, bq, nk, bk).any(axis=(1, 3))
  return max(tiles.sum(1).max(), 1), max(tiles.sum(0).max(), 1)


def test_grid_widths_are_the_most_nonempty_tiles_of_a_row_and_a_column():
  """`grid_widths` against the dense mask's tiles counted by brute force: exact without
  offsets, and an upper bound at any offsets (a ring step's traced positions)."""
  from jattn._src.kernels.tile_classes import grid_widths

  def brute(T_, S_, bq, bk, causal, window, q0=0, k0=0):
    def allowed(t, s):
      ok = np.ones(np.broadcast_shapes(t.shape, s.shape), bool)
      if causal:
        ok &= s <= t
      if window is not None:
        ok &= (s >= t - window[0]) & (s <= t + window[1])
      return ok
    return _most_nonempty_tiles(allowed, T_, S_, bq, bk, q0, k0)

  rng = np.random.default_rng(0)
  for _ in range(40):
    T_, S_ = (int(x) for x in rng.integers(1, 700, 2))
    bq, bk = int(rng.choice([8, 16, 64])), int(rng.choice([128, 256]))
    causal = bool(rng.integers(2))
    window = None if rng.integers(4) == 0 else tuple(int(x) for x in rng.integers(0, 300, 2))
    if not causal and window is None:
      continue
    m = Modifiers(structure=MaskSpec(is_causal=causal, local_window=window), scale=1.0)
    for offsets in (False, True):
      p = flex_tpu.plan(B=1, T=T_, S=S_, N=1, K=1, H=8, D=8, dtype=jnp.float32, modifiers=m,
                        block_q=bq, block_kv=bk, interpret=True, offsets=offsets)
      got = grid_widths(p)
      if not offsets:
        assert got == brute(T_, S_, bq, bk, causal, window), (T_, S_, bq, bk, causal, window)
        continue
      for q0, k0 in rng.integers(0, 2000, (5, 2)):
        want = brute(T_, S_, bq, bk, causal, window, int(q0), int(k0))
        assert got[0] >= want[0] and got[1] >= want[1], (T_, S_, bq, bk, window, q0, k0)


# Ready-made masks and their dense form, for the grid widths their band narrows.
_BANDED_MASKS = {
    "sliding_window": (lambda: jattn.mods.sliding_window(150, 40),
                       lambda t, s: (s >= t - 150) & (s <= t + 40)),
    "chunked": (lambda: jattn.mods.chunked(96), lambda t, s: t // 96 == s // 96),
    "causal_and_window": (
        lambda: jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.sliding_window(130)),
        lambda t, s: (s <= t) & (s >= t - 130)),
    "window_or_chunk": (
        lambda: jattn.mods.or_masks(jattn.mods.sliding_window(20), jattn.mods.chunked(64)),
        lambda t, s: ((s >= t - 20) & (s <= t)) | (t // 64 == s // 64)),
}


def test_grid_widths_of_ready_made_masks_are_the_most_nonempty_tiles():
  """A ready-made mask_mod's band (`tile_classes.mask_band`) narrows the grids as causal
  and the window do: against the dense mask's tiles counted by brute force, exact for a
  window (the mask is its band), an upper bound for chunks and at ring offsets; a mask
  with no band (documents, a hand-written function, or_masks with one) keeps every
  tile."""
  from jattn._src.kernels.tile_classes import grid_widths

  def plan(mask_mod, T_, S_, bq, bk, offsets=False):
    m = Modifiers(mods=build_mods(mask_mod, None, None, None, N=1), scale=1.0)
    return flex_tpu.plan(B=1, T=T_, S=S_, N=1, K=1, H=8, D=8, dtype=jnp.float32,
                         modifiers=m, block_q=bq, block_kv=bk, interpret=True,
                         offsets=offsets)

  rng = np.random.default_rng(3)
  for name, (mask_mod, allowed) in _BANDED_MASKS.items():
    for _ in range(8):
      T_, S_ = (int(x) for x in rng.integers(1, 900, 2))
      bq, bk = int(rng.choice([8, 16, 64])), int(rng.choice([128, 256]))
      got = grid_widths(plan(mask_mod(), T_, S_, bq, bk))
      want = _most_nonempty_tiles(allowed, T_, S_, bq, bk)
      if name in ("sliding_window", "causal_and_window"):  # the mask is its band: exact
        assert got == want, (name, T_, S_, bq, bk)
      else:  # chunks inside the band: at least the count
        assert got[0] >= want[0] and got[1] >= want[1], (name, T_, S_, bq, bk)
      at_offsets = grid_widths(plan(mask_mod(), T_, S_, bq, bk, offsets=True))
      for q0, k0 in rng.integers(0, 2000, (4, 2)):
        want = _most_nonempty_tiles(allowed, T_, S_, bq, bk, int(q0), int(k0))
        assert at_offsets[0] >= want[0] and at_offsets[1] >= want[1], (name, q0, k0)
  ids = jnp.zeros((1, 700), jnp.int32)
  for unbounded in (jattn.mods.document(ids), lambda b, n, t, s: s <= t + 5,
                    jattn.mods.or_masks(jattn.mods.causal(), jattn.mods.chunked(64))):
    p = plan(unbounded, 700, 700, 64, 128)
    assert grid_widths(p) == (6, 11), unbounded


@pytest.mark.parametrize("name, block_mask", [
    ("sliding_window", None), ("chunked", None), ("causal_and_window", "conservative"),
    pytest.param("window_or_chunk", None, marks=pytest.mark.thorough)])
def test_ready_made_mask_grid_values_and_gradients(name, block_mask):
  """The kernel over a ready-made mask_mod's narrowed grid (fewer steps than tiles), the
  classes the mask's own closed forms; with a block mask that calls every tile PARTIAL
  (valid: the kernel evaluates the mask on each) the kernel follows the block mask as
  given, over every tile. out, lse and dq, dk, dv, grouped heads, against float64 NumPy."""
  from jattn._src.kernels.tile_classes import grid_widths
  from tests.reference_grads import reference_mods_vjp
  T_, S_, N_, K_, H_, bq, bk = 300, 640, 2, 1, 32, 16, 128
  q, k, v = _inputs(T=T_, S=S_, N=N_, K=K_, H=H_, D=H_)
  d_out = jnp.asarray(np.random.default_rng(8).normal(size=(B, T_, N_, H_)), jnp.float32)
  mask_mod, allowed = _BANDED_MASKS[name]
  if block_mask is not None:
    made = jattn.create_block_mask(mask_mod(), None, None, T_, S_,
                                   block_sizes=jattn.BlockSizes(q=bq, kv=bk))
    block_mask = dataclasses.replace(made, classes=jnp.ones_like(made.classes))  # PARTIAL
  m = Modifiers(mods=build_mods(mask_mod(), None, None, block_mask, N=N_),
                scale=1 / np.sqrt(H_))
  p = flex_tpu.plan(B=B, T=T_, S=S_, N=N_, K=K_, H=H_, D=H_, dtype=q.dtype, modifiers=m,
                    block_q=bq, block_kv=bk, interpret=True)
  assert not isinstance(p, str) and p.skip, p
  W, Wq = grid_widths(p)
  if block_mask is None:
    assert W < p.S_padded // bk and Wq < p.T_padded // bq, (W, Wq)  # the grids shrink
  else:
    assert (W, Wq) == (p.S_padded // bk, p.T_padded // bq), (W, Wq)
  lay = Layout("BTNH")

  def loss(q, k, v):
    out, _, lse = flex_tpu_call.run(p, q, k, v, m, lay)[:3]
    return jnp.sum(out * d_out), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  ok = allowed(np.arange(T_)[:, None], np.arange(S_)[None, :])[None, None]
  want, dq, dk, dv = reference_mods_vjp(q, k, v, d_out, allowed=ok)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(lse, _lse(q, k, np.broadcast_to(ok, (B, N_, T_, S_))),
                             atol=2e-5, rtol=1e-5)
  for g, w in zip(grads, (dq, dk, dv)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def test_window_grid_at_ring_offsets_values_and_gradients():
  """A ring step (traced global offsets) with causal and a wide window: the grid widths
  from the band's width alone (fewer than the tiles), the band's one bound per tile at
  global positions; out, lse and dq, dk, dv against float64 NumPy."""
  from jattn._src.kernels.tile_classes import grid_widths
  from tests.reference_grads import reference_mods_vjp
  T_, S_, H_, q0, k0 = 400, 640, 32, 300, 100
  q, k, v = _inputs(T=T_, S=S_, H=H_, D=H_)
  d_out = jnp.asarray(np.random.default_rng(7).normal(size=(B, T_, N, H_)), jnp.float32)
  m = Modifiers(structure=MaskSpec(is_causal=True, local_window=(150, 0)), scale=1 / np.sqrt(H_))
  p = flex_tpu.plan(B=B, T=T_, S=S_, N=N, K=K, H=H_, D=H_, dtype=q.dtype, modifiers=m,
                    block_q=16, block_kv=128, interpret=True, offsets=True)
  assert not isinstance(p, str) and p.skip, p
  assert grid_widths(p) == (3, 19)  # of 5 kv tiles and 25 query tiles
  lay = Layout("BTNH")
  step = jax.jit(lambda q, k, v, a, c: flex_tpu_call.step_forward(p, lay, q, k, v, None, a, c))
  out, lse, _ = step(q, k, v, q0, k0)
  grads = jax.jit(lambda q, k, v, a, c, o, l, d: flex_tpu_call.step_backward(
      p, lay, q, k, v, m, a, c, o, l, d))(q, k, v, q0, k0, out, lse, d_out)
  t, s = q0 + np.arange(T_)[:, None], k0 + np.arange(S_)[None, :]
  allowed = ((s <= t) & (s >= t - 150))[None, None]
  want, dq, dk, dv = reference_mods_vjp(q, k, v, d_out, allowed=allowed)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(lse, _lse(q, k, allowed), atol=2e-5, rtol=1e-5)
  for g, w in zip(grads[:3], (dq, dk, dv)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
