"""The flex_mgpu Pallas Mosaic GPU kernels, in jax's GPU interpreter on this CPU (race
detection on) against float64 NumPy references; and exported for CUDA from this CPU.

The interpreter (jax >= 0.11) runs the kernels' warpgroups, TMA copies, barriers and
wgmma on NumPy: it checks values, gradients and the ordering of copies and loads (a race
raises), not GPU speed or compilation. It gives wgmma's SMEM operands no race check
(jax 0.12.0.1), so a missing wait before a wgmma shows only where the same wait also
guards rows read by loads (segment ids, mask_mod's x[t], x[s]: the cases below have
them). Export checks the lowering to Mosaic GPU (`mosaic_gpu_v2` custom calls, shared
memory within 227 KiB, no [T, S] tensor), not its compilation to PTX on a GPU.
Interpreted shapes are tiny (each program is simulated): 2 x 2 tiles of 64.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jattn
from jattn import mods
from jattn._src import compat
from jattn._src.impl.interpret import pallas_interpret
from tests.reference import reference_mods
from tests.reference_grads import reference_mods_vjp

needs_interpreter = pytest.mark.skipif(
    compat.missing("mosaic_gpu_interpret") is not None,
    reason=f"no Mosaic GPU interpreter: {compat.missing('mosaic_gpu_interpret')}")
needs_mosaic_gpu = pytest.mark.skipif(
    compat.missing("pallas_mosaic_gpu") is not None,
    reason=f"no Pallas Mosaic GPU: {compat.missing('pallas_mosaic_gpu')}")

B, T, S, N, K, H = 2, 100, 80, 2, 1, 64  # T, S unaligned to the 64-tiles; G = 2
MOSAIC = "mosaic_gpu_v2"
t_, s_ = np.arange(T)[:, None], np.arange(S)[None, :]
SLOPES = np.asarray([0.25, -0.5], np.float32)
Q_IDS = np.stack([np.arange(T) // 30, np.arange(T) // 45])
KV_IDS = np.stack([np.arange(S) // 20, np.arange(S) // 40])
DOC = np.stack([np.repeat(np.arange(4), [10, 40, 20, 30]), np.repeat(np.arange(2), [70, 30])])
PREFIX = np.asarray([7, 50])

# name -> (dot_product_attention kwargs, allowed [B|1, N|1, T, S], score, d score / d x)
CASES = {
    # rows t < 5 see no key (zeros, finite gradients); a per-head mask; ALiBi slopes read
    # one element at a time (their gradient by the blockwise backward)
    "hand_written_alibi_empty_rows": (
        dict(mask_mod=lambda b, n, t, s: ((t - s) % 3 != 1) & (t >= 5) & (s <= t + 20 * n),
             score_mod=mods.alibi(jnp.asarray(SLOPES))),
        ((t_ - s_) % 3 != 1) & (t_ >= 5) & (s_ <= t_ + 20 * np.arange(N)[:, None, None]),
        lambda x: x + SLOPES[None, :, None, None] * (s_ - t_), lambda x: 1.0),
    # built-in masks whose rows ride the kv pipeline (segment ids: their loads are raced)
    "window_lengths_segments_soft_cap_sinks": (
        dict(local_window_size=(30, 10), key_value_seq_lengths=jnp.asarray([60, 80]),
             q_segment_ids=Q_IDS, kv_segment_ids=KV_IDS, score_mod=mods.soft_cap(2.0),
             sinks=jnp.asarray([-1.0, 0.5])),
        ((t_ - 30 <= s_) & (s_ <= t_ + 10))[None, None]
        & (s_ < np.asarray([60, 80])[:, None, None, None])
        & (Q_IDS[:, None, :, None] == KV_IDS[:, None, None, :]),
        lambda x: 2.0 * np.tanh(x / 2.0), lambda x: 1.0 - np.tanh(x / 2.0) ** 2),
    # jattn.mods: per-token document ids (rows on both sides), prefix lengths (int scalars),
    # chunks, causal
    "document_or_prefix_lm_and_chunks": (
        dict(mask_mod=mods.and_masks(mods.or_masks(mods.document(jnp.asarray(DOC)),
                                                   mods.prefix_lm(jnp.asarray(PREFIX))),
                                     mods.or_masks(mods.chunked(32), mods.causal()))),
        ((DOC[:, :, None] == DOC[:, None, :S]) | (s_ <= t_) | (s_ < PREFIX[:, None, None]))[:, None]
        & ((t_ // 32 == s_ // 32) | (s_ <= t_)), None, None),
    "causal": (dict(is_causal=True), s_ <= t_, None, None),
}


def _inputs(dtype=jnp.bfloat16, seed=0, T=T, S=S):
  r = np.random.default_rng(seed)
  shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H))
  return tuple(jnp.asarray(r.normal(size=shape), dtype) for shape in shapes)


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _tolerance(want):
  """4 x the error of rounding the float64 answer to bfloat16: the kernel's inputs, its
  P tile and its output are 16-bit, its logits and softmax float32."""
  return 4 * float(np.max(np.abs(_f64(jnp.asarray(want, jnp.bfloat16)) - want)))


def _lse(q, k, allowed, score, sinks):
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, 2)) / np.sqrt(H)
  logits = score(logits) if score is not None else logits
  logits = np.where(np.broadcast_to(allowed, logits.shape), logits, -np.inf)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                           logits.shape[:3] + (1,))
    logits = np.concatenate([logits, sink], axis=-1)
  with np.errstate(divide="ignore"):
    return np.einsum("bnt->btn", np.log(np.sum(np.exp(logits), axis=-1)))


@needs_interpreter
@pytest.mark.parametrize("case", [
    "hand_written_alibi_empty_rows", "window_lengths_segments_soft_cap_sinks",
    "document_or_prefix_lm_and_chunks", pytest.param("causal", marks=pytest.mark.thorough)])
def test_values_and_lse_against_float64(case):
  kw, allowed, score, _ = CASES[case]
  q, k, v = _inputs()
  with pallas_interpret():
    out, lse = jattn.dot_product_attention(q, k, v, implementation="flex_mgpu",
                                           return_residual=True, **kw)
  sinks = kw.get("sinks")
  want, _ = reference_mods(_f64(q), _f64(k), _f64(v), allowed=allowed, score=score,
                           sinks=sinks)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(_f64(out), want, atol=_tolerance(want))
  want_lse = _lse(_f64(q), _f64(k), allowed, score, sinks)
  seen = np.isfinite(want_lse)
  # the residual comes in the value's dtype (as jax.nn's)
  np.testing.assert_allclose(_f64(lse)[seen], want_lse[seen], atol=_tolerance(want_lse[seen]))
  assert np.all(_f64(lse)[~seen] < -1e30)  # rows with no key: LARGE_NEGATIVE
  if case == "hand_written_alibi_empty_rows":
    assert not seen[:, :5].any() and np.all(_f64(out)[:, :5] == 0)


@needs_interpreter
@pytest.mark.parametrize("case", [
    "hand_written_alibi_empty_rows", "window_lengths_segments_soft_cap_sinks",
    pytest.param("document_or_prefix_lm_and_chunks", marks=pytest.mark.thorough)])
def test_gradients_by_the_kernels_against_float64(case):
  """dq by the dq kernel, dk and dv by the dk/dv kernel (the two query heads of the kv
  head summed in it), through jattn's custom VJP; against the float64 softmax backward."""
  kw, allowed, score, d_score = CASES[case]
  q, k, v = _inputs(seed=1)
  cot = np.random.default_rng(2).standard_normal((B, T, N, H))
  loss = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
      q, k, v, implementation="flex_mgpu", **kw).astype(jnp.float32) * cot)
  with pallas_interpret():
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  _, *want = reference_mods_vjp(_f64(q), _f64(k), _f64(v), cot, allowed=allowed,
                                score=score, d_score=None if d_score is None else (
                                    lambda x: np.broadcast_to(d_score(x), x.shape)),
                                sinks=kw.get("sinks"))
  for name, got, w in zip("qkv", grads, want):
    assert np.all(np.isfinite(_f64(got))), name
    np.testing.assert_allclose(_f64(got), w, atol=_tolerance(w), err_msg=f"d{name}")


@needs_interpreter
@pytest.mark.thorough
def test_gradient_into_captured_slopes_against_float64_central_differences():
  """score_mod's captured slopes get their gradient from jattn's blockwise backward."""
  kw, allowed, _, _ = CASES["hand_written_alibi_empty_rows"]
  q, k, v = _inputs(seed=3)
  cot = np.random.default_rng(4).standard_normal((B, T, N, H))

  def loss(slopes):
    out = jattn.dot_product_attention(q, k, v, implementation="flex_mgpu",
                                      mask_mod=kw["mask_mod"], score_mod=mods.alibi(slopes))
    return jnp.sum(out.astype(jnp.float32) * cot)

  with pallas_interpret():
    got = jax.grad(loss)(jnp.asarray(SLOPES))
  reference = lambda slopes: np.sum(reference_mods(
      _f64(q), _f64(k), _f64(v), allowed=allowed,
      score=lambda x: x + slopes[None, :, None, None] * (s_ - t_))[0] * cot)
  for n in range(N):
    e = np.zeros(N)
    e[n] = 1e-4
    slopes = SLOPES.astype(np.float64)
    numeric = (reference(slopes + e) - reference(slopes - e)) / 2e-4
    # loose: the blockwise backward's rowsum(out * d_out) from the 16-bit out enters every
    # dS, summed with weights s - t up to 100 (jattn's "blockwise" in bfloat16: 12% off on
    # slope 1 here; "xla", differentiating in float32 inside, 0.3%)
    np.testing.assert_allclose(got[n], numeric, rtol=0.15)


@needs_interpreter
@pytest.mark.thorough
def test_float16_and_the_columns_layout():
  kw, allowed, score, _ = CASES["causal"]
  q, k, v = _inputs(dtype=jnp.float16)
  cols = [jnp.einsum("btnh->bnht", x) for x in (q, k, v)]
  with pallas_interpret():
    out = jattn.dot_product_attention(*cols, implementation="flex_mgpu", layout="BNHT", **kw)
  want, _ = reference_mods(_f64(q), _f64(k), _f64(v), allowed=allowed)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(np.einsum("bndt->btnd", _f64(out)), want, atol=2e-2)


def _exported(kw, fn, E=128, T=384):
  q = jax.ShapeDtypeStruct((2, T, 4, E), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, T, 2, E), jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="flex_mgpu", **kw)
  if fn == "grad":
    f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2),
                 argnums=(0, 1, 2))
  # no abstract GPU needed (the Mosaic GPU lowering reads no device); the same as users
  with jattn.lowering_for("cuda"):
    return export.export(jax.jit(f), platforms=["cuda"])(q, kv, kv).mlir_module()


EXPORTED = {
    "hand_written_E64": (dict(mask_mod=lambda b, n, t, s: (s <= t) & ((t - s) % 3 != 1)), 64),
    "document_soft_cap_sinks_E256": (
        dict(mask_mod=mods.document(jnp.zeros((2, 384), jnp.int32)),
             score_mod=mods.soft_cap(20.0), sinks=jnp.linspace(-1.0, 1.0, 4)), 256),
    "alibi_prefix_lm": (dict(mask_mod=mods.prefix_lm(jnp.asarray([100, 7])),
                             score_mod=mods.alibi(jnp.linspace(0.1, 0.4, 4))), 128),
    "window_segments_lengths": (dict(local_window_size=(64, 0),
                                     q_segment_ids=np.zeros((2, 384), int),
                                     kv_segment_ids=np.zeros((2, 384), int),
                                     key_value_seq_lengths=jnp.asarray([300, 384])), 128),
}


@needs_mosaic_gpu
@pytest.mark.parametrize("case", [
    "hand_written_E64", "document_soft_cap_sinks_E256",
    *(pytest.param(c, marks=pytest.mark.thorough)
      for c in ("alibi_prefix_lm", "window_segments_lengths"))])
def test_export_for_cuda_has_the_mosaic_gpu_kernels_and_no_TS_tensor(case):
  """Forward: one Mosaic GPU kernel; gradient: forward, dq and dk/dv; nothing [T, S]."""
  kw, E = EXPORTED[case]
  for fn, kernels in (("forward", {"fwd"}), ("grad", {"fwd", "dq", "dkv"})):
    text = _exported(kw, fn, E)
    assert set(re.findall(r"jattn_flex_mgpu_(fwd|dq|dkv)", text)) == kernels, fn
    assert text.count(MOSAIC) == len(kernels), fn
    assert not re.search(r"tensor<[^>]*384x384", text), fn


def test_dispatch_flex_gpu_stays_the_default_and_the_refusals_in_words():
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  report = jattn.explain(q, q, q, score_mod=mods.alibi(jnp.ones(4)))
  assert report.implementation("cuda") == "flex_gpu"
  asked = jattn.explain(q, q, q, implementation="flex_mgpu", score_mod=mods.alibi(jnp.ones(4)))
  reason = compat.missing("pallas_mosaic_gpu")
  if reason is None:
    assert asked.implementation("cuda") == "flex_mgpu"
  else:
    assert reason in str(asked)
  for kw, words in (
      (dict(dtype=jnp.float32), "dtype float32: the kernel takes bfloat16 and float16 "
                                "(wgmma would round float32 to TF32; flex_gpu takes float32)"),
      (dict(score_mod=mods.relative_bias(jnp.zeros((4, 9)))),
       "score_mod reads a table at positions (a relative bias): Mosaic GPU has no gather "
       "load; flex_gpu takes it"),
      (dict(mask_mod=mods.document(jnp.zeros((300, 256), jnp.int32))),
       "300 per-token rows (segment ids, mask_mod's x[t], x[s]) on one side: a TMA copy "
       "takes up to 256")):
    dtype = kw.pop("dtype", jnp.bfloat16)
    x = jax.ShapeDtypeStruct((300 if "mask_mod" in kw else 1, 256, 4, 64), dtype)
    report = jattn.explain(x, x, x, implementation="flex_mgpu", **kw)
    assert (reason or words) in str(report), str(report)
  with pytest.raises(ValueError, match="flex_mgpu.*NVIDIA GPU"):
    x = jnp.ones((1, 8, 1, 64), jnp.bfloat16)
    jattn.dot_product_attention(x, x, x, implementation="flex_mgpu")


def test_a_gpu_before_hopper_is_refused(monkeypatch):
  """The plan reads the compute capability of a GPU this process sees (none here)."""
  from jattn._src.kernels import flex_mgpu
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (8, 0))
  report = jattn.explain(q, q, q, implementation="flex_mgpu", is_causal=True)
  if compat.missing("pallas_mosaic_gpu") is None:
    assert ("this GPU has compute capability 8.0: TMA and wgmma need 9.0 (Hopper) or newer; "
            "flex_gpu runs there") in str(report), str(report)
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (9, 0))
  assert "compute capability" not in str(jattn.explain(q, q, q, implementation="flex_mgpu"))


# ---------------------------------------------------------------- flex_mgpu_ws

needs_ws = pytest.mark.skipif(
    compat.missing("pallas_mosaic_gpu_ws") is not None,
    reason=f"no warp-specialised Mosaic GPU API: {compat.missing('pallas_mosaic_gpu_ws')}")


def _exported_ws(kw, fn, E=128, T=384, S=384):
  q = jax.ShapeDtypeStruct((2, T, 4, E), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, S, 2, E), jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="flex_mgpu_ws", **kw)
  if fn == "grad":
    f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2),
                 argnums=(0, 1, 2))
  with jattn.lowering_for("cuda"):
    return export.export(jax.jit(f), platforms=["cuda"])(q, kv, kv).mlir_module()


@needs_ws
@pytest.mark.parametrize("case", [
    "hand_written_E64", "document_soft_cap_sinks_E256",
    *(pytest.param(c, marks=pytest.mark.thorough)
      for c in ("alibi_prefix_lm", "window_segments_lengths"))])
def test_ws_export_for_cuda_has_its_forward_and_the_reference_backward(case):
  """flex_mgpu_ws lowers (Mosaic's layouts, SMEM) to one warp-specialised forward
  kernel; its gradient adds flex_mgpu's dq and dk/dv kernels; nothing [T, S]. T = 200
  (unaligned to the 128-row programs) against S = 384."""
  kw, E = EXPORTED[case]
  kw = {key: (np.zeros((2, 200), int) if key == "q_segment_ids" else x) for key, x in kw.items()}
  if "mask_mod" in kw and "document" in case:
    kw["mask_mod"] = mods.document(jnp.zeros((2, 200), jnp.int32), jnp.zeros((2, 384), jnp.int32))
  for fn, kernels in (("forward", {"ws_fwd"}), ("grad", {"ws_fwd", "dq", "dkv"})):
    text = _exported_ws(kw, fn, E, T=200)
    assert set(re.findall(r"jattn_flex_mgpu_(ws_fwd|fwd|dq|dkv)", text)) == kernels, fn
    assert text.count(MOSAIC) == len(kernels), fn
    assert not re.search(r"tensor<[^>]*(200x384|384x384)", text), fn


@needs_ws
def test_ws_backward_export_has_the_warp_specialised_kernels():
  """Inside flex_mgpu.ws_dq() the gradient's dq comes from jattn_flex_mgpu_ws_dq, inside
  ws_dkv() dk, dv from jattn_flex_mgpu_ws_dkv; outside, from flex_mgpu's kernels. Over
  E = 128 (their tiles would not fit SMEM) flex_mgpu's kernels run."""
  from jattn._src.kernels import flex_mgpu
  kw, E = EXPORTED["alibi_prefix_lm"]
  kernels = lambda text: set(re.findall(r"jattn_flex_mgpu_(ws_fwd|ws_dq|ws_dkv|fwd|dq|dkv)\b",
                                        text))
  with flex_mgpu.ws_dq():
    assert kernels(_exported_ws(kw, "grad", E, T=200)) == {"ws_fwd", "ws_dq", "dkv"}
  with flex_mgpu.ws_dkv():
    assert kernels(_exported_ws(kw, "grad", E, T=200)) == {"ws_fwd", "dq", "ws_dkv"}
  with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    text = _exported_ws(kw, "grad", E, T=200)
  assert kernels(text) == {"ws_fwd", "ws_dq", "ws_dkv"}
  assert text.count(MOSAIC) == 3
  assert not re.search(r"tensor<[^>]*(200x384|384x384)", text)
  with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    assert kernels(_exported_ws(kw, "grad", 256, T=200)) == {"ws_fwd", "dq", "dkv"}


def test_ws_refuses_a_gpu_other_than_hopper(monkeypatch):
  """flex_mgpu_ws, named, refuses a GPU other than Hopper, with the reason."""
  from jattn._src.kernels import flex_mgpu
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  reason = compat.missing("pallas_mosaic_gpu") or compat.missing("pallas_mosaic_gpu_ws")
  for capability, words in (((8, 0), "TMA and wgmma need 9.0"),
                            ((10, 0), "written for Hopper's wgmma and setmaxnreg (9.x)")):
    monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda c=capability: c)
    text = str(jattn.explain(q, q, q, implementation="flex_mgpu_ws", is_causal=True))
    assert (reason or words) in text, text
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (9, 0))
  report = jattn.explain(q, q, q, implementation="flex_mgpu_ws", is_causal=True)
  if reason is None:
    assert report.implementation("cuda") == "flex_mgpu_ws", str(report)


@pytest.mark.parametrize("capability, dtype, heads, default", [
    ((9, 0), jnp.bfloat16, 128, "flex_mgpu_ws"),  # a Hopper GPU, what the H100 run checked
    (None, jnp.bfloat16, 128, "flex_gpu"),  # no GPU seen (an export): portable
    ((8, 0), jnp.bfloat16, 128, "flex_gpu"),  # Ampere: flex_gpu, ws not even tried
    ((10, 0), jnp.bfloat16, 128, "flex_gpu"),  # Blackwell
    ((9, 0), jnp.bfloat16, 64, "flex_gpu"),  # outside what the card checked
    ((9, 0), jnp.float16, 128, "flex_gpu"),
])
def test_the_default_takes_ws_on_hopper_within_what_the_card_checked(
    monkeypatch, capability, dtype, heads, default):
  """implementation=None on CUDA, for a mask function: flex_mgpu_ws before flex_gpu where
  the process sees a Hopper GPU and the call is bfloat16 with H = D = 128, with the
  figures in explain's "why"; flex_gpu elsewhere (a jax without ws's API: flex_gpu, and
  the reason among those passed over)."""
  from jattn._src.kernels import flex_mgpu
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: capability)
  q = jax.ShapeDtypeStruct((1, 256, 4, heads), dtype)
  report = jattn.explain(q, q, q, mask_mod=mods.document(jnp.zeros((1, 256), jnp.int32)))
  choice = report.choices["cuda"]
  tried = [name for name, _ in choice.passed_over]
  reason = compat.missing("pallas_mosaic_gpu") or compat.missing("pallas_mosaic_gpu_ws")
  if default == "flex_mgpu_ws" and reason is not None:
    assert choice.implementation == "flex_gpu" and "flex_mgpu_ws" in tried, str(report)
    return
  assert choice.implementation == default, str(report)
  if default == "flex_mgpu_ws":
    assert "0.49x to 0.75x of flex_gpu's forward time" in str(report), str(report)
  else:
    assert "flex_mgpu_ws" not in tried, str(report)


@needs_ws
def test_ws_dkv_query_rows_follow_the_mods(monkeypatch):
  """The warp-specialised dk/dv kernel takes 32-row query tiles for a score_mod or a
  mask_mod that divides (with 64 they spilled: the compile tier), 64 otherwise;
  ws_dkv_rows forces either and refuses another count, naming it."""
  from jattn._src.kernels import flex_mgpu
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (9, 0))
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  rows = lambda **kw: re.search(r"dkv_rows=(\d+)", str(jattn.explain(
      q, q, q, implementation="flex_mgpu_ws", **kw))).group(1)
  with flex_mgpu.ws_dkv():
    assert rows(is_causal=True) == "64"
    assert rows(mask_mod=mods.causal()) == "64"
    assert rows(is_causal=True, score_mod=mods.soft_cap(30.0)) == "32"
    assert rows(mask_mod=mods.chunked(32)) == "32"  # a floor division
    assert rows(mask_mod=lambda b, n, t, s: (t - s) % 3 != 1) == "32"  # a remainder
    with flex_mgpu.ws_dkv_rows(64):
      assert rows(is_causal=True, score_mod=mods.soft_cap(30.0)) == "64"
    with flex_mgpu.ws_dkv_rows(32):
      assert rows(is_causal=True) == "32"
  with pytest.raises(ValueError, match="rows must be 32 or 64, got 48"):
    flex_mgpu.ws_dkv_rows(48)


@needs_interpreter
@needs_ws
@pytest.mark.parametrize("columns", [16, pytest.param(64, marks=pytest.mark.thorough),
                                     pytest.param(128, marks=pytest.mark.thorough)])
def test_ws_exp2_on_the_fma_pipe_against_float64(columns, monkeypatch):
  """ws_exp2_fma: the fast forward's exp2 of the last `columns` of each kv tile by
  fma_exp2 (the FP32 pipe), interpreted; out and lse against float64 on the hand-written
  mask with ALiBi and rows that see no key (their out exactly 0: masked entries give 0,
  not 2**-125); dq, dk, dv under jax.grad against float64. The plan names the count; a
  count that is not a multiple of 16 from 0 to 128 is refused, naming it."""
  from jattn._src.kernels import flex_mgpu
  kw, allowed, score, _ = CASES["hand_written_alibi_empty_rows"]
  q, k, v = _inputs(seed=7)
  with pallas_interpret(), flex_mgpu.ws_exp2_fma(columns):
    out, lse = jattn.dot_product_attention(q, k, v, implementation="flex_mgpu_ws",
                                           return_residual=True, **kw)
  want, _ = reference_mods(_f64(q), _f64(k), _f64(v), allowed=allowed, score=score)
  np.testing.assert_allclose(_f64(out), want, atol=_tolerance(want))
  empty = ~np.any(np.broadcast_to(allowed, (B, N, T, S)), axis=-1)  # [B, N, T]
  assert empty.any() and np.all(_f64(out).transpose(0, 2, 1, 3)[empty] == 0.0)
  want_lse = _lse(_f64(q), _f64(k), allowed, score, None)
  seen = np.isfinite(want_lse)
  np.testing.assert_allclose(_f64(lse)[seen], want_lse[seen], atol=_tolerance(want_lse[seen]))
  # under jax.grad: the backward reads this forward's out and lse
  cot = np.random.default_rng(8).standard_normal((B, T, N, H))
  loss = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
      q, k, v, implementation="flex_mgpu_ws", **kw).astype(jnp.float32) * cot)
  with pallas_interpret(), flex_mgpu.ws_exp2_fma(columns):
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  _, *want_grads = reference_mods_vjp(_f64(q), _f64(k), _f64(v), cot, allowed=allowed,
                                      score=score, d_score=None)
  for name, got, w in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(_f64(got), w, atol=_tolerance(w), err_msg=f"d{name}")
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (9, 0))
  shape = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  explain = lambda: str(jattn.explain(shape, shape, shape, implementation="flex_mgpu_ws",
                                      is_causal=True))
  assert "exp2_fma=0" in explain()
  with flex_mgpu.ws_exp2_fma(columns):
    assert f"exp2_fma={columns}" in explain()
  for bad in (24, 144, -16, 64.0, True):
    with pytest.raises(ValueError, match=f"columns must be a multiple of 16 from 0 to 128, "
                                         f"got {re.escape(repr(bad))}"):
      flex_mgpu.ws_exp2_fma(bad)


# The GPU interpreter runs each warpgroup as an XLA:CPU program on its own Python thread,
# and a barrier wait blocks one of XLA:CPU's executor threads, of which there are as many
# as the host has cores: with fewer cores than the kernel's 3 warpgroups, two waiting
# warpgroups can hold every executor thread while the third, the one they wait for,
# never runs. On this 2-core host the cases with per-token rows (segment ids, documents:
# more waits at once) deadlocked in about half the runs, and causal in none; pinned to
# one core (taskset) causal deadlocked every time. The compiled kernel ran 4 documents
# and unaligned documents on an H100. Those cases run interpreted where the host has
# cores for every warpgroup.
_FEW_CORES = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 3,
    reason="the GPU interpreter can deadlock with fewer cores than the kernel's 3 "
           "warpgroups when they wait on per-token rows (see above)")


@needs_interpreter
@needs_ws
@pytest.mark.parametrize("case", [
    "hand_written_alibi_empty_rows",
    pytest.param("causal", marks=pytest.mark.thorough),
    pytest.param("document_or_prefix_lm_and_chunks", marks=[pytest.mark.thorough, _FEW_CORES]),
    pytest.param("window_lengths_segments_soft_cap_sinks",
                 marks=[pytest.mark.thorough, _FEW_CORES])])
def test_ws_interpreted_values_and_fast_backward_against_float64(case):
  """flex_mgpu_ws in the GPU interpreter (race detection on): its producer and two
  consumer warpgroups, their barriers, the tables and side inputs, and with ws_dq /
  ws_dkv the warp-specialised dq and dk/dv kernels; out, lse and dq, dk, dv against
  float64. The interpreter has no register operand of wgmma: P and dS go through SMEM
  there (the card ran the compiled forward: docs/gpu_kernel.md)."""
  from jattn._src.kernels import flex_mgpu
  kw, allowed, score, d_score = CASES[case]
  q, k, v = _inputs(seed=5)
  with pallas_interpret():
    out, lse = jattn.dot_product_attention(q, k, v, implementation="flex_mgpu_ws",
                                           return_residual=True, **kw)
  want, _ = reference_mods(_f64(q), _f64(k), _f64(v), allowed=allowed, score=score,
                           sinks=kw.get("sinks"))
  np.testing.assert_allclose(_f64(out), want, atol=_tolerance(want))
  want_lse = _lse(_f64(q), _f64(k), allowed, score, kw.get("sinks"))
  seen = np.isfinite(want_lse)
  np.testing.assert_allclose(_f64(lse)[seen], want_lse[seen], atol=_tolerance(want_lse[seen]))
  assert np.all(_f64(lse)[~seen] < -1e30)
  cot = np.random.default_rng(6).standard_normal((B, T, N, H))
  loss = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
      q, k, v, implementation="flex_mgpu_ws", **kw).astype(jnp.float32) * cot)
  with pallas_interpret(), flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  _, *want = reference_mods_vjp(_f64(q), _f64(k), _f64(v), cot, allowed=allowed,
                                score=score, d_score=None if d_score is None else (
                                    lambda x: np.broadcast_to(d_score(x), x.shape)),
                                sinks=kw.get("sinks"))
  for name, got, w in zip("qkv", grads, want):
    assert np.all(np.isfinite(_f64(got))), name
    np.testing.assert_allclose(_f64(got), w, atol=_tolerance(w), err_msg=f"d{name}")


# ---------------------------------------------------------------- in place (both kernels)

_T_IN = 128  # whole 128-row programs of flex_mgpu_ws: q, k, v read where they lie
_IN_PLACE = dict(mask_mod=lambda b, n, t, s: ((t - s) % 3 != 1) & (s <= t + 20 * n),
                 score_mod=mods.alibi(jnp.asarray(SLOPES)))


def _in_place_reference(q, k, v, cot):
  t, s = np.arange(_T_IN)[:, None], np.arange(_T_IN)[None, :]
  allowed = ((t - s) % 3 != 1) & (s <= t + 20 * np.arange(N)[:, None, None])
  score = lambda x: x + SLOPES[None, :, None, None] * (s - t)
  want, _ = reference_mods(q, k, v, allowed=allowed, score=score)
  _, *grads = reference_mods_vjp(q, k, v, cot, allowed=allowed, score=score, d_score=None)
  return want, grads


@needs_interpreter
@pytest.mark.parametrize("impl,layout", [
    ("flex_mgpu", "BTNH"), ("flex_mgpu_ws", "BTNH"),
    *(pytest.param(i, lay, marks=pytest.mark.thorough)
      for i, lay in (("flex_mgpu", "BNTH"), ("flex_mgpu_ws", "BNTH"), ("flex_mgpu", "TNH")))])
def test_in_place_values_and_gradients_against_float64(impl, layout):
  """T = S = 128 and H = 64: both kernels read q, k, v, dO and write out, dq, dk, dv in the
  caller's layout by TMA (flex_mgpu_ws with its warp-specialised dq and dk/dv kernels,
  the dk/dv kernel's 64-row query tiles: the other interpreted ws test takes 32 for its
  score_mod); against float64. "TNH" has no batch axis."""
  if impl == "flex_mgpu_ws" and compat.missing("pallas_mosaic_gpu_ws"):
    pytest.skip(compat.missing("pallas_mosaic_gpu_ws"))
  from jattn._src.kernels import flex_mgpu
  q, k, v = _inputs(seed=7, T=_T_IN, S=_T_IN)
  cot = np.random.default_rng(8).standard_normal((B, _T_IN, N, H))
  bs = slice(None) if "B" in layout else 0  # "TNH": the first batch row alone
  to = lambda x: jnp.einsum(f"BTNH->{layout if 'B' in layout else 'B' + layout}", x)[bs]
  back = lambda x: np.einsum(f"{layout if 'B' in layout else 'B' + layout}->BTNH",
                             _f64(x) if "B" in layout else _f64(x)[None])
  attend = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl,
                                                       layout=layout, **_IN_PLACE)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * to(cot))
  with pallas_interpret(), flex_mgpu.ws_dq(), flex_mgpu.ws_dkv(), flex_mgpu.ws_dkv_rows(64):
    out = attend(to(q), to(k), to(v))
    grads = jax.grad(loss, argnums=(0, 1, 2))(to(q), to(k), to(v))
  b = slice(None) if "B" in layout else slice(0, 1)
  want, want_grads = _in_place_reference(*(_f64(x)[b] for x in (q, k, v)), cot[b])
  np.testing.assert_allclose(back(out), want, atol=_tolerance(want))
  for name, got, w in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(back(got), w, atol=_tolerance(w), err_msg=f"d{name}")


def _big_moves(text: str, T: int, E: int = 128) -> list[str]:
  """The exported program's transposes and pads of arrays with a T (or its padding to
  256) and an E axis: q, k, v, out and their gradients (not the block tables, nor a [B,
  N, T] row statistic)."""
  big = lambda dims: bool({T, 256} & set(dims)) and E in dims
  return [line.strip()[:160] for line in text.splitlines()
          if re.search(r"stablehlo\.(transpose|pad)\b", line)
          and any(big([int(d) for d in m.split("x")])
                  for m in re.findall(r"tensor<((?:\d+x)+)", line) for m in [m[:-1]])]


@needs_mosaic_gpu
@pytest.mark.parametrize("impl", ["flex_mgpu", "flex_mgpu_ws"])
def test_export_in_place_moves_no_q_k_v_or_out(impl):
  """At T = 384, H = 128 in "BTNH" the forward and the gradient (flex_mgpu_ws with its
  warp-specialised backward) hold the kernels and no transpose or pad of a rank-4 array;
  at T = 200 (unaligned: zero-padded tiles) they do, so the check can fail."""
  if impl == "flex_mgpu_ws" and compat.missing("pallas_mosaic_gpu_ws"):
    pytest.skip(compat.missing("pallas_mosaic_gpu_ws"))
  from jattn._src.kernels import flex_mgpu
  kw = dict(mask_mod=mods.causal())
  export_ = _exported_ws if impl == "flex_mgpu_ws" else (
      lambda kw, fn, E, T: _exported(kw, fn, E, T))
  with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    for fn in ("forward", "grad"):
      text = export_(kw, fn, 128, T=384)
      assert MOSAIC in text and not _big_moves(text, 384), (fn, _big_moves(text, 384))
    assert _big_moves(export_(kw, "forward", 128, T=200), 200)
