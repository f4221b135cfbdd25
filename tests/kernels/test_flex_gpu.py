"""The flex_gpu Pallas (Triton) kernels, in interpret mode on this CPU, against the
float64 NumPy reference; and exported for CUDA from this CPU.

Interpret mode runs the kernels' programs with NumPy-like semantics: it checks
values and gradients, not GPU speed. The export tests check the Pallas-to-Triton
lowering (`__gpu$xla.gpu.triton` custom calls, no [T, S] tensor), not Triton's own
compilation to PTX, which happens on a GPU.
"""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.impl.interpret import pallas_interpret
from jattn._src.kernels import flex_gpu, flex_gpu_call
from jattn._src.masks.programmable import build_mods
from tests.helpers import TRITON, exported_text
from tests.reference import reference_mods
from tests.reference_grads import reference_vjp, table_grad

B, T, S, N, K, H = 2, 40, 50, 4, 2, 24  # T, S and H not multiples of the tiles


def _inputs(T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32, seed=0):
  r = np.random.default_rng(seed)
  shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, D))
  return tuple(jnp.asarray(r.normal(size=shape), dtype) for shape in shapes)


def _grid(T=T, S=S):
  return np.arange(T)[:, None], np.arange(S)[None, :]


def _lse(q, k, allowed, score=None, sinks=None):
  """float64 [B, N, T]: log-sum-exp of the visible logits (and the sink); rows that see
  nothing (and no sink) get jattn's LARGE_NEGATIVE convention, checked apart."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, q.shape[2] // k.shape[2], 2))
  logits = logits / np.sqrt(q.shape[-1])
  logits = score(logits) if score is not None else logits
  logits = np.where(np.broadcast_to(allowed, logits.shape), logits, -np.inf)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                           logits.shape[:3] + (1,))
    logits = np.concatenate([logits, sink], axis=-1)
  with np.errstate(divide="ignore"):
    return np.log(np.sum(np.exp(logits), axis=-1))


# name -> (dot_product_attention kwargs, allowed [B|1, N|1, T, S], NumPy score fn, kv heads)
t_, s_ = _grid()
SLOPES = np.linspace(0.1, 0.4, N).astype(np.float32)
TABLE = np.linspace(-1.0, 1.0, N * 9).reshape(N, 9).astype(np.float32)  # s - t in [-4, 4]
Q_IDS = np.stack([np.arange(T) // 13, np.arange(T) // 7])
KV_IDS = np.stack([np.arange(S) // 16, np.arange(S) // 9])
CASES = {
    "no_mask_grouped_heads": (dict(), np.ones((1, 1, T, S), bool), None),
    "causal_T_ne_S": (dict(is_causal=True), s_ <= t_, None),
    # rows t < 5 see no key: zeros and finite gradients
    "hand_written_per_head": (
        dict(mask_mod=lambda b, n, t, s: ((t - s) % 3 != 1) & (t >= 5) & (s <= t + n)),
        ((t_ - s_) % 3 != 1) & (t_ >= 5) & (s_ <= t_ + np.arange(N)[:, None, None]), None),
    "alibi_prefix_lm_per_batch": (
        dict(mask_mod=mods.prefix_lm(jnp.asarray([7, 21])), score_mod=mods.alibi(SLOPES)),
        (s_ <= t_) | (s_ < np.asarray([7, 21])[:, None, None, None]),
        lambda l: l + SLOPES[None, :, None, None] * (s_ - t_)),
    "relative_bias_gathered": (
        dict(score_mod=mods.relative_bias(TABLE)), np.ones((1, 1, T, S), bool),
        lambda l: l + TABLE[np.arange(N)[:, None, None], np.clip(s_ - t_, -4, 4) + 4][None]),
    # the built-in masks jax's Pallas mha refuses: a window, kv lengths, segment ids that
    # differ between queries and keys, T != S
    "window_lengths_segments": (
        dict(local_window_size=(8, 4), key_value_seq_lengths=jnp.asarray([30, 50]),
             q_segment_ids=Q_IDS, kv_segment_ids=KV_IDS),
        ((t_ - 8 <= s_) & (s_ <= t_ + 4))[None, None]
        & (s_ < np.asarray([30, 50])[:, None, None, None])
        & (Q_IDS[:, None, :, None] == KV_IDS[:, None, None, :]), None),
    "soft_cap_sinks": (
        dict(is_causal=True, score_mod=mods.soft_cap(5.0), sinks=jnp.linspace(-1.0, 1.0, N)),
        s_ <= t_, lambda l: 5.0 * np.tanh(l / 5.0)),
    "chunks_or_window_and_causal": (
        dict(mask_mod=mods.and_masks(mods.or_masks(mods.chunked(16), mods.sliding_window(3)),
                                     mods.causal())),
        ((t_ // 16 == s_ // 16) | ((t_ - 3 <= s_) & (s_ <= t_))) & (s_ <= t_), None),
}


def _attention(q, k, v, **kw):
  return jattn.dot_product_attention(q, k, v, implementation="flex_gpu", return_residual=True,
                                     **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_lse_against_float64(case):
  _check_values_and_lse(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_on_a_gpu_values_and_lse_against_float64(case):
  """The same, compiled by Triton on an NVIDIA GPU (skipped where jax sees none)."""
  _check_values_and_lse(case, interpret=False)


def _check_values_and_lse(case, interpret):
  kw, allowed, score = CASES[case]
  q, k, v = _inputs()
  with pallas_interpret() if interpret else contextlib.nullcontext():
    out, lse = _attention(q, k, v, **kw)
  sinks = kw.get("sinks")
  want, _ = reference_mods(q, k, v, allowed=allowed, score=score, sinks=sinks)
  np.testing.assert_allclose(out, want, atol=2e-6)
  want_lse = np.einsum("bnt->btn", _lse(q, k, allowed, score, sinks))
  seen = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-5)
  assert np.all(np.asarray(lse)[~seen] < -1e30)  # rows with no key: LARGE_NEGATIVE
  if case == "hand_written_per_head":
    assert np.all(np.asarray(out)[:, :5] == 0) and not seen[:, :5].any()


@pytest.mark.parametrize("case", [
    "hand_written_per_head", "soft_cap_sinks",
    *(pytest.param(c, marks=pytest.mark.thorough) for c in (
        "relative_bias_gathered", "alibi_prefix_lm_per_batch", "window_lengths_segments"))])
def test_gradients_against_float64_central_differences(case):
  """d loss / d (q, k, v, sinks, score_mod's captured arrays) along random directions.
  soft_cap_sinks is the one case whose score_mod has a derivative other than 1: the dk/dv
  kernel's dS = (g P) (dP - delta) needs it (with P in place of g P, only it fails)."""
  kw, allowed, score = CASES[case]
  q, k, v = _inputs(seed=1)
  rng = np.random.default_rng(2)
  cot = rng.standard_normal((B, T, N, H))
  captured = {"alibi_prefix_lm_per_batch": ("slopes", SLOPES, mods.alibi),
              "relative_bias_gathered": ("table", TABLE, mods.relative_bias)}.get(case)
  sinks = kw.get("sinks")
  extra = np.asarray(sinks) if sinks is not None else None if captured is None else captured[1]

  def loss(q, k, v, extra):
    args = dict(kw)
    if sinks is not None:
      args["sinks"] = extra
    elif captured is not None:
      args["score_mod"] = captured[2](extra)
    out = jattn.dot_product_attention(q, k, v, implementation="flex_gpu", **args)
    return jnp.sum(out * cot)

  with pallas_interpret():
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, extra)
  assert all(np.all(np.isfinite(g)) for g in grads if g is not None)

  def reference(q, k, v, extra):
    fn = score
    if captured is not None:
      fn = {"slopes": lambda l: l + extra[None, :, None, None] * (s_ - t_),
            "table": lambda l: l + extra[np.arange(N)[:, None, None],
                                         np.clip(s_ - t_, -4, 4) + 4][None]}[captured[0]]
    out, _ = reference_mods(q, k, v, allowed=allowed, score=fn,
                            sinks=extra if sinks is not None else None)
    return np.sum(out * cot)

  primals = [np.asarray(x, np.float64) for x in (q, k, v)] + [extra]
  for i, g in enumerate(grads):
    if primals[i] is None:
      continue
    d = rng.standard_normal(np.shape(primals[i]))
    moved = lambda e: reference(*[x + e * d if j == i else x for j, x in enumerate(primals)])
    numeric = (moved(1e-4) - moved(-1e-4)) / 2e-4
    np.testing.assert_allclose(np.sum(np.asarray(g, np.float64) * d), numeric, rtol=2e-4,
                               atol=2e-4, err_msg=f"gradient {i}")


def test_gradients_into_captured_arrays_in_the_kernel_same_bits_twice():
  """A traced soft-cap and a per-[B, N] slope table read one element at a time: their
  gradients come from the dq kernel's per-program partials, summed by a one-hot
  contraction; against float64 central differences, and bit for bit on a rerun."""
  T2, S2 = 100, 140  # several query and kv tiles: partials summed over both
  q, k, v = _inputs(T=T2, S=S2, seed=5)
  t, s = _grid(T2, S2)
  rng = np.random.default_rng(6)
  cot = rng.standard_normal((B, T2, N, H))
  cap0, table0 = np.float32(3.0), rng.standard_normal((B, N)).astype(np.float32)

  def loss(q, k, v, cap, table):
    out = jattn.dot_product_attention(
        q, k, v, implementation="flex_gpu", is_causal=True,
        score_mod=lambda x, b, n, t, s: cap * jnp.tanh(x / cap)
        + table[b, n] * (s - t).astype(jnp.float32) / T2)
    return jnp.sum(out * cot)

  grad = jax.jit(jax.grad(loss, argnums=(3, 4)))
  with pallas_interpret():
    d_cap, d_table = grad(q, k, v, cap0, table0)
    again = grad(q, k, v, cap0, table0)
  assert np.array_equal(d_cap, again[0]) and np.array_equal(d_table, again[1])

  def reference(cap, table):
    out, _ = reference_mods(q, k, v, allowed=s <= t,
                            score=lambda l: cap * np.tanh(l / cap)
                            + table[:, :, None, None] * (s - t) / T2)
    return np.sum(out * cot)

  cap, table = float(cap0), table0.astype(np.float64)  # steps of 1e-4 exact in float64
  numeric_cap = (reference(cap + 1e-4, table) - reference(cap - 1e-4, table)) / 2e-4
  np.testing.assert_allclose(d_cap, numeric_cap, rtol=2e-4, atol=2e-4)
  numeric_table = np.zeros((B, N))
  for index in np.ndindex(B, N):
    e = np.zeros((B, N))
    e[index] = 1e-4
    numeric_table[index] = (reference(cap, table + e) - reference(cap, table - e)) / 2e-4
  np.testing.assert_allclose(d_table, numeric_table, rtol=2e-4, atol=2e-4)


def test_table_gradients_in_the_dq_kernel_against_float64():
  """score_mod reads a [N, 2M+1] table at clip(s - t), a [2L+1] table at clip(t - s) and
  a slope at n: each dq program sums a gradient row per table read over its kv tiles,
  and XLA sums the programs'. Grouped heads, T != S, 16 x 16 tiles (three query tiles,
  four kv tiles, some EMPTY), against the float64 gradient of the bias the tables add
  and float64 central differences; the same bits twice."""
  M, L = 6, 2
  q, k, v = _inputs(seed=7)
  rng = np.random.default_rng(7)
  table = jnp.asarray(rng.standard_normal((N, 2 * M + 1)), jnp.float32)
  table1 = jnp.asarray(rng.standard_normal(2 * L + 1), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0.0, 0.1, N), jnp.float32)
  cot = rng.standard_normal((B, T, N, H))
  index, index1 = np.clip(s_ - t_, -M, M) + M, np.clip(t_ - s_, -L, L) + L  # [T, S]
  allowed = np.broadcast_to(s_ <= t_ + 20, (B, N, T, S))

  def loss(table, table1, slopes):
    def score(x, b, n, t, s):
      rel = table[n, jnp.clip(s - t, -M, M) + M] + 0.5 * table1[jnp.clip(t - s, -L, L) + L]
      return x + rel + slopes[n] * (s - t).astype(x.dtype)
    m = Modifiers(mods=build_mods(lambda b, n, t, s: s <= t + 20, score, None, None, N=N),
                  scale=1 / np.sqrt(H))
    p = flex_gpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=q.dtype, modifiers=m,
                      block_q=16, block_kv=16, interpret=True)
    assert p.table_reads and p.score_reads, p
    return jnp.sum(flex_gpu_call.run(p, q, k, v, m, Layout("BTNH"))[0] * cot)

  def bias(table, table1, slopes):  # float64 [B, N, T, S]
    return np.broadcast_to(table[:, index] + 0.5 * table1[index1] + slopes[:, None, None]
                           * (s_ - t_), (B, N, T, S))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = grad(table, table1, slopes)
  plain = [np.asarray(x, np.float64) for x in (table, table1, slopes)]
  *_, d_bias = reference_vjp(q, k, v, cot, bias(*plain), mask=allowed)
  want = (table_grad(d_bias, index, 2 * M + 1), table_grad(d_bias, index1, 2 * L + 1).sum(0)
          * 0.5, np.einsum("bnts,ts->n", d_bias, (s_ - t_) * 1.0))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
  d = rng.standard_normal(table.shape)  # central differences along d, float64
  moved = lambda e: np.sum(reference_vjp(q, k, v, cot, bias(plain[0] + e * d, *plain[1:]),
                                         mask=allowed)[0] * cot)
  np.testing.assert_allclose(np.sum(got[0] * d), (moved(1e-4) - moved(-1e-4)) / 2e-4,
                             rtol=1e-4)
  again = grad(table, table1, slopes)
  assert all(np.array_equal(a, b) for a, b in zip(again, got))


@pytest.mark.parametrize("dtype", [
    jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.thorough)])
def test_half_precision_and_the_columns_layout(dtype):
  """Half precision against float64 (float32 logits and softmax inside), tokens as columns
  (BNHT: each tile read after one transpose), H != D."""
  kw, allowed, score = CASES["alibi_prefix_lm_per_batch"]
  q, k, v = _inputs(D=40, dtype=dtype)
  cols = [jnp.einsum("btnh->bnht", x) for x in (q, k, v)]
  with pallas_interpret():
    out = jattn.dot_product_attention(*cols, implementation="flex_gpu", layout="BNHT", **kw)
  want, _ = reference_mods(q, k, v, allowed=allowed, score=score)
  assert out.dtype == dtype
  np.testing.assert_allclose(np.einsum("bndt->btnd", np.asarray(out, np.float32)), want,
                             atol=3e-2)


def test_block_classes_drive_the_kernels_empty_skipped_full_unmasked():
  """Causal classes edited: tile (3, 0), FULL, marked EMPTY, and the diagonal tile (1, 1),
  PARTIAL, marked FULL. Forward and gradients must follow the classes: no contribution
  from tile (3, 0), and tile (1, 1) unmasked."""
  L = 64
  q, k, v = _inputs(T=L, S=L)
  bm = jattn.create_block_mask(mods.causal(), None, None, L, L, block_sizes=BlockSizes(16, 16))
  classes = np.array(bm.classes)
  assert classes[0, 0, 3, 0] == 2 and classes[0, 0, 1, 1] == 1  # FULL, PARTIAL
  classes[0, 0, 3, 0], classes[0, 0, 1, 1] = 0, 2
  bm = dataclasses.replace(bm, classes=jnp.asarray(classes))
  m = Modifiers(mods=build_mods(mods.causal(), None, None, bm, N=N), scale=1 / np.sqrt(H))
  p = flex_gpu.plan(B=B, T=L, S=L, N=N, K=K, H=H, D=H, dtype=q.dtype, modifiers=m,
                    block_q=16, block_kv=16, interpret=True)
  assert p.skip and (p.block_q, p.block_kv) == (16, 16)
  t, s = _grid(L, L)
  allowed = s <= t
  allowed[48:, :16] = False  # EMPTY: skipped
  allowed[16:32, 16:32] = True  # FULL: no mask_mod
  cot = np.random.default_rng(4).standard_normal((B, L, N, H))
  loss = lambda q, k, v: jnp.sum(flex_gpu_call.run(p, q, k, v, m, Layout("BTNH"))[0] * cot)
  out = flex_gpu_call.run(p, q, k, v, m, Layout("BTNH"))[0]
  want, _ = reference_mods(q, k, v, allowed=allowed)
  np.testing.assert_allclose(out, want, atol=2e-6)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  # d/dv of sum(out * cot) is exactly W^T cot: the classes must drive dk/dv's loops too
  _, w = reference_mods(q, k, v, allowed=allowed)
  dv = np.einsum("bnts,btnd->bsnd", w, cot).reshape(B, L, K, N // K, H).sum(3)
  np.testing.assert_allclose(grads[2], dv, atol=2e-5)
  d_q_rows = np.asarray(grads[0])[:, 16:32]
  assert np.all(np.isfinite(d_q_rows)) and np.any(d_q_rows != 0)


def test_sixteen_documents_visit_about_a_sixteenth_of_the_tiles():
  """The block lists of a 16-document packed batch: each query tile visits only the kv
  tiles of its own document (the skipping's work, counted from the kernel's tables)."""
  from jattn._src.kernels.flex_gpu_kernels import _extras
  L, tile = 1024, 64
  ids = jnp.asarray(np.repeat(np.arange(16), L // 16)[None], jnp.int32)
  m = Modifiers(mods=build_mods(mods.document(ids), None, None, None, N=1), scale=0.1)
  p = flex_gpu.plan(B=1, T=L, S=L, N=1, K=1, H=64, D=64, dtype=jnp.bfloat16, modifiers=m)
  assert (p.block_q, p.block_kv) == (tile, tile)
  _, extras = _extras(p, m, m.mods.traced())
  visited = int(jnp.sum(extras[2]))  # kv tiles visited, over every query tile
  assert visited == (L // tile)  # one tile per query tile: 1/16 of 16 x 16


def _exported(kw, fn, dtype=jnp.bfloat16, T=384, N=4, K=2, Hd=128):
  q = jax.ShapeDtypeStruct((2, T, N, Hd), dtype)
  kv = jax.ShapeDtypeStruct((2, T, K, Hd), dtype)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)
  if fn == "grad":
    f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2),
                 argnums=(0, 1, 2))
  return exported_text(f, "cuda", q, kv, kv)


EXPORTED = {
    "alibi": dict(is_causal=True, score_mod=mods.alibi(jnp.linspace(0.1, 0.4, 4))),
    "soft_cap_sinks": dict(is_causal=True, score_mod=mods.soft_cap(20.0),
                           sinks=jnp.linspace(-1.0, 1.0, 4)),
    "prefix_lm": dict(mask_mod=mods.prefix_lm(jnp.asarray([100, 7]))),
    "hand_written": dict(mask_mod=lambda b, n, t, s: (s <= t) & ((t - s) % 3 != 1)),
    "relative_bias": dict(is_causal=True, score_mod=mods.relative_bias(
        jnp.linspace(-1.0, 1.0, 4 * 33).reshape(4, 33))),
    "window_segments": dict(local_window_size=(64, 0), q_segment_ids=np.zeros((2, 384), int),
                            kv_segment_ids=np.zeros((2, 384), int)),
}


# tests/impl/test_lowering.py exports every case for CUDA; here the kernels are named
@pytest.mark.parametrize("case", [
    "hand_written", *(pytest.param(c, marks=pytest.mark.thorough)
                      for c in EXPORTED if c != "hand_written")])
def test_export_for_cuda_has_the_triton_kernels_and_no_TS_tensor(case, host_without_cuda):
  """implementation=None, exported for CUDA from this CPU host: the forward is one Triton
  kernel, the gradient adds the dq and dk/dv kernels; nothing [T, S]-shaped is formed."""
  kw = EXPORTED[case]
  q = jax.ShapeDtypeStruct((2, 384, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, 128), jnp.bfloat16)
  assert jattn.explain(q, kv, kv, **kw).implementation("cuda") == "flex_gpu"
  for fn, kernels in (("forward", {"fwd"}), ("grad", {"fwd", "dq", "dkv"})):
    text = _exported(kw, fn)
    assert set(re.findall(r"jattn_flex_gpu_(fwd|dq|dkv)", text)) == kernels, fn
    assert text.count(TRITON) == len(kernels), fn
    assert not re.search(r"tensor<[^>]*384x384", text), fn


def test_dispatch_on_cuda_and_the_refusals_in_words():
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  report = jattn.explain(q, q, q, score_mod=mods.alibi(jnp.ones(4)))
  assert report.implementation("cuda") == "flex_gpu"
  assert "flex_gpu" not in report.reasons("cuda")
  report = jattn.explain(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  assert "dropout" in report.reasons("cuda")["flex_gpu"]
  assert report.implementation("cuda") != "flex_gpu"
  report = jattn.explain(q, q, q, score_mod=lambda x, b, n, t, s: x + jnp.sum(jnp.arange(3.0)))
  assert report.implementation("cuda") != "flex_gpu"
  assert "score_mod" in report.reasons("cuda")["flex_gpu"]
  with pytest.raises(ValueError, match="flex_gpu.*NVIDIA GPU"):
    jattn.dot_product_attention(jnp.ones((1, 8, 1, 16)), jnp.ones((1, 8, 1, 16)),
                                jnp.ones((1, 8, 1, 16)), implementation="flex_gpu")


def test_a_table_too_wide_for_the_dq_kernels_row_is_refused_in_words():
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  wide = jattn.explain(q, q, q, score_mod=mods.relative_bias(jnp.zeros((4, 1025))))
  assert wide.reasons("cuda")["flex_gpu"] == (
      "score_mod: a table of width 1025 read at positions; the dq kernel sums its gradient "
      "in a row of at most 1024 entries")
  fits = jattn.explain(q, q, q, score_mod=mods.relative_bias(jnp.zeros((4, 1023))))
  assert fits.implementation("cuda") == "flex_gpu"


def test_float32_heads_past_128_are_refused():
  """On an H200, float32 tiles of a 256-wide head overflowed shared memory; 128 ran."""
  for H, dtype, refused in ((256, jnp.float32, True), (129, jnp.float32, True),
                            (128, jnp.float32, False), (256, jnp.bfloat16, False)):
    q = jax.ShapeDtypeStruct((1, 64, 2, H), dtype)
    report = jattn.explain(q, q, q, local_window_size=(3, 3))
    reason = report.reasons("cuda").get("flex_gpu")
    if refused:
      assert reason == (f"head sizes H = {H}, D = {H}: its 32-bit tiles take heads of up "
                        f"to 128 (GPU shared memory)"), reason
    else:
      assert report.implementation("cuda") == "flex_gpu", str(report)


@pytest.mark.parametrize("implementation", ["flex_gpu", "flex_tpu"])
def test_document_mask_through_the_call(implementation):
  """mods.document(ids) passes one array for queries and keys: the plan (traced outside
  jit) sees one captured array, the run (inside jit) two. Both kernels must read the
  rows of the trace they run (a KeyError before)."""
  L = 64
  ids = np.repeat(np.arange(5), [3, 20, 1, 30, 10])[None].repeat(B, 0)
  q, k, v = _inputs(T=L, S=L)
  with pallas_interpret():
    out = jattn.dot_product_attention(q, k, v, implementation=implementation,
                                      mask_mod=mods.document(jnp.asarray(ids)))
  want, _ = reference_mods(q, k, v, allowed=(ids[:, :, None] == ids[:, None, :])[:, None])
  np.testing.assert_allclose(out, want, atol=2e-6)



def test_under_vmap_and_jit_with_captured_arrays_batched():
  """jax.vmap over three (q, k, v, slopes) sets, jitted: the kernels and the captured
  slopes are batched; values and d slopes per set against float64 central differences."""
  r = np.random.default_rng(7)
  L = 24
  q, k, v = (r.standard_normal((3, 1, L, 2, 16)).astype(np.float32) for _ in range(3))
  slopes = r.standard_normal((3, 2)).astype(np.float32)
  cot = r.standard_normal((3, 1, L, 2, 16))
  t, s = _grid(L, L)

  def loss(q, k, v, slopes, cot):
    out = jattn.dot_product_attention(q, k, v, implementation="flex_gpu", is_causal=True,
                                      score_mod=mods.alibi(slopes))
    return jnp.sum(out * cot), out

  step = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=3, has_aux=True)))
  with pallas_interpret():
    (_, out), d_slopes = step(q, k, v, slopes, cot)

  def reference(i, slopes_i):
    want, _ = reference_mods(q[i], k[i], v[i], allowed=s <= t,
                             score=lambda l: l + slopes_i[None, :, None, None] * (s - t))
    return want

  for i in range(3):
    np.testing.assert_allclose(out[i], reference(i, slopes[i].astype(np.float64)), atol=2e-6)
    d = r.standard_normal(2)
    moved = lambda e: np.sum(reference(i, slopes[i].astype(np.float64) + e * d) * cot[i])
    numeric = (moved(1e-4) - moved(-1e-4)) / 2e-4
    np.testing.assert_allclose(np.dot(d_slopes[i], d), numeric, rtol=2e-4, atol=2e-4)
