"""Every CUDA implementation compiled on an NVIDIA GPU, against the float64 reference.

cudnn, pallas (jax's Pallas `mha`), flex_gpu (jattn's Triton kernel), flex_mgpu (jattn's
Mosaic GPU kernel), xla, blockwise and
implementation=None; forward and `jax.grad` into q, k, v; the built-in masks and every
`jattn.mods` mask and score function, sinks, hand-written mods, a row with no visible
key; float32, bfloat16 and float16; H = 64 and 128, T != S, unaligned T, grouped heads.
A case an implementation's plan refuses on "cuda" is skipped with the plan's reason
(reported as skipped, never as passed). `test_what_runs_is_what_explain_names` reads the
kernels in the lowered program and compares them with `jattn.explain(...)`'s choice.

Marked `gpu`: skipped where jax sees no GPU (CI), run by `tools/gpu_check.py` on a lent
one. `JATTN_GPU_REHEARSAL=1` runs a small subset on a CPU instead, with the Pallas
kernels interpreted and the CUDA program exported from the host (`tools/gpu_check.py
--smoke`, in the CI tier), so that this file cannot rot between GPU sessions.
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret
from tests.helpers import exported_text
from tests.reference import reference_max_logits
from tests.reference_grads import reference_mods_vjp, reference_vjp

ON_GPU = any(d.platform == "gpu" for d in jax.devices())
REHEARSAL = not ON_GPU and os.environ.get("JATTN_GPU_REHEARSAL") == "1"
_NEEDS_GPU = pytest.mark.skipif(not (ON_GPU or REHEARSAL),
                                reason="needs an NVIDIA GPU (or JATTN_GPU_REHEARSAL=1)")

IMPLEMENTATIONS = ("cudnn", "pallas", "flex_gpu", "flex_mgpu", "xla", "blockwise", None)
# relative error ||x - ref|| / ||ref|| allowed per dtype: float32 computed at full
# precision; the half types round P (and the output) to 8 or 11 bits
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 5e-3}
# jax's Pallas mha has no precision argument: Triton's float32 dot is TF32 (10 bits)
TF32_TOLERANCE = 3e-3

# shapes: name -> (B, T, S, N, K, H); the rehearsal's are smaller (interpreted kernels)
SHAPES = ({"base": (2, 256, 256, 4, 2, 64), "h128": (1, 256, 256, 4, 2, 128),
           "cross": (2, 192, 320, 4, 2, 64), "unaligned": (2, 200, 200, 4, 1, 64)}
          if not REHEARSAL else
          {"base": (1, 96, 96, 2, 1, 32), "h128": (1, 64, 64, 2, 1, 128),
           "cross": (1, 48, 80, 2, 1, 32), "unaligned": (1, 72, 72, 2, 1, 32)})


def _case(name, B, T, S, N):
  """-> (kwargs of dot_product_attention, allowed [B|1, N|1, T, S], score, d_score, sinks)."""
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  rng = np.random.default_rng(7)
  ids_q = np.sort(rng.integers(0, 4, (B, T)), axis=1).astype(np.int32)
  ids_kv = ids_q if T == S else np.sort(rng.integers(0, 4, (B, S)), axis=1).astype(np.int32)
  lengths = np.array([S - 5, S // 2, S // 3][:B], np.int32)
  prefix = np.array([T // 5, T // 2, 3][:B], np.int32)
  slopes = np.linspace(0.05, 0.4, N).astype(np.float32)
  table = np.linspace(-1.0, 1.0, N * 17).reshape(N, 17).astype(np.float32)
  sinks = np.linspace(-1.0, 1.0, N).astype(np.float32)
  causal = (s <= t)[None, None]
  tanh_cap = lambda c: (lambda x: c * np.tanh(x / c), lambda x: 1 - np.tanh(x / c) ** 2)
  one = lambda x: np.ones_like(x)
  cases = {
      "none": (dict(), None, None, None, None),
      "causal": (dict(is_causal=True), causal, None, None, None),
      "window": (dict(local_window_size=(16, 8)), ((t - 16 <= s) & (s <= t + 8))[None, None],
                 None, None, None),
      "kv_lengths": (dict(key_value_seq_lengths=jnp.asarray(lengths)),
                     (s[None] < lengths[:, None, None])[:, None], None, None, None),
      "segments": (dict(q_segment_ids=jnp.asarray(ids_q), kv_segment_ids=jnp.asarray(ids_kv)),
                   (ids_q[:, :, None] == ids_kv[:, None, :])[:, None], None, None, None),
      "mods_causal": (dict(mask_mod=mods.causal()), causal, None, None, None),
      "mods_sliding_window": (dict(mask_mod=mods.sliding_window(16)),
                              ((t - 16 <= s) & (s <= t))[None, None], None, None, None),
      "mods_chunked": (dict(mask_mod=mods.chunked(32)), (t // 32 == s // 32)[None, None],
                       None, None, None),
      "mods_prefix_lm": (dict(mask_mod=mods.prefix_lm(jnp.asarray(prefix))),
                         ((s <= t)[None] | (s[None] < prefix[:, None, None]))[:, None],
                         None, None, None),
      "mods_document": (dict(mask_mod=mods.document(jnp.asarray(ids_q), jnp.asarray(ids_kv))),
                        (ids_q[:, :, None] == ids_kv[:, None, :])[:, None], None, None, None),
      "mods_and_or": (dict(mask_mod=mods.and_masks(
          mods.or_masks(mods.chunked(32), mods.sliding_window(8)), mods.causal())),
          (((t // 32 == s // 32) | ((t - 8 <= s) & (s <= t))) & (s <= t))[None, None],
          None, None, None),
      "soft_cap": (dict(is_causal=True, score_mod=mods.soft_cap(2.0)), causal,
                   *tanh_cap(2.0), None),
      "alibi": (dict(is_causal=True, score_mod=mods.alibi(jnp.asarray(slopes))), causal,
                lambda x: x + slopes[None, :, None, None] * (s - t), one, None),
      "relative_bias": (dict(is_causal=True, score_mod=mods.relative_bias(jnp.asarray(table))),
                        causal, lambda x: x + table[:, np.clip(s - t, -8, 8) + 8][None],
                        one, None),
      "sinks": (dict(is_causal=True, sinks=jnp.asarray(sinks)), causal, None, None, sinks),
      "hand_written": (dict(mask_mod=lambda b, n, t, s: (s <= t) & ((t - s) % 3 != 1),
                            score_mod=lambda x, b, n, t, s: x - 0.25 * n.astype(x.dtype)),
                       ((s <= t) & ((t - s) % 3 != 1))[None, None],
                       lambda x: x - 0.25 * np.arange(N)[None, :, None, None], one, None),
      # queries t < 8 see no key: zeros, finite gradients
      "empty_rows": (dict(mask_mod=lambda b, n, t, s: s < t - 7), (s < t - 7)[None, None],
                     None, None, None),
  }
  return cases[name]


CASES = ("none", "causal", "window", "kv_lengths", "segments", "mods_causal",
         "mods_sliding_window", "mods_chunked", "mods_prefix_lm", "mods_document",
         "mods_and_or", "soft_cap", "alibi", "relative_bias", "sinks", "hand_written",
         "empty_rows")


def _matrix():
  """(implementation, case, dtype, shape): every case in bfloat16 at the base shape, the
  other dtypes and shapes on a few cases that exercise different kernel paths."""
  rows = [(i, c, "bfloat16", "base") for i in IMPLEMENTATIONS for c in CASES]
  rows += [(i, c, d, "base") for i in IMPLEMENTATIONS
           for c in ("causal", "mods_document", "alibi", "empty_rows")
           for d in ("float32", "float16")]
  rows += [(i, c, "bfloat16", shape) for i in IMPLEMENTATIONS
           for c in ("none", "causal", "mods_document", "sinks", "empty_rows")
           for shape in ("h128", "cross", "unaligned")]
  if REHEARSAL:  # a few of each kind, interpreted
    keep = {("flex_gpu", "alibi", "bfloat16", "base"), ("flex_gpu", "empty_rows", "float32", "base"),
            ("pallas", "causal", "float16", "base"), ("xla", "sinks", "bfloat16", "cross"),
            ("flex_mgpu", "mods_document", "bfloat16", "cross"),
            ("blockwise", "mods_document", "bfloat16", "unaligned"),
            (None, "causal", "bfloat16", "h128"), ("cudnn", "causal", "bfloat16", "base")}
    rows = [r for r in rows if r in keep]
  return rows


def _inputs(shape, dtype, seed=0):
  B, T, S, N, K, H = SHAPES[shape]
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H))
  k, v = (rng.standard_normal((B, S, K, H)) for _ in "kv")
  cot = rng.standard_normal((B, T, N, H))
  # the reference sees the inputs as the implementation does: rounded to the dtype
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  return q, k, v, cot


def _interpreting():
  return pallas_interpret() if REHEARSAL else contextlib.nullcontext()


def _skip_unless_cuda_takes(q, k, v, implementation, **kw):
  """Skips (with the plan's reason) a call the implementation refuses on "cuda"; -> the
  implementation that runs it here (cuda on a GPU, cpu in the rehearsal)."""
  with _interpreting():
    report = jattn.explain(q, k, v, implementation=implementation, **kw)
  if report.implementation("cuda") is None:
    pytest.skip(f"refused on cuda: {report.choices['cuda'].error}")
  ran = report.implementation("cpu" if REHEARSAL else "cuda")
  if ran is None:  # the rehearsal, where cuDNN is installed: it has no CPU version
    pytest.skip(f"the rehearsal has no GPU: {report.choices['cpu'].error}; its CUDA "
                f"program is checked by test_what_runs_is_what_explain_names")
  return ran


def _relative_error(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


@_NEEDS_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("implementation,case,dtype,shape", _matrix())
def test_values_and_gradients_against_float64(implementation, case, dtype, shape):
  B, T, S, N, K, H = SHAPES[shape]
  kw, allowed, score, d_score, sinks = _case(case, B, T, S, N)
  q, k, v, cot = _inputs(shape, dtype)
  ran = _skip_unless_cuda_takes(q, k, v, implementation, **kw)

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation=implementation, **kw)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  with _interpreting():
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
  want = reference_mods_vjp(q.astype(jnp.float32), k.astype(jnp.float32),
                            v.astype(jnp.float32), cot, allowed=allowed, score=score,
                            d_score=d_score, sinks=sinks)
  tol = TOLERANCE[dtype]
  if dtype == "float32" and ran == "pallas":
    tol = TF32_TOLERANCE
  assert out.dtype == jnp.dtype(dtype)
  for name, got, ref in zip(("out", "d_query", "d_key", "d_value"), (out, *grads), want):
    assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{name} is not finite"
    err = _relative_error(got, ref)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({ran})"
  if allowed is not None:  # a row with no visible key is zero
    empty = ~np.broadcast_to(allowed, (B, N, T, S)).any(-1)  # [B, N, T]
    assert np.all(np.asarray(out, np.float32)[np.einsum("bnt->btn", empty)] == 0)


# ---- what runs is what explain names: the kernels in the lowered CUDA program

KERNEL_NAMES = {  # implementation -> (a forward kernel, a backward kernel) in the program
    "cudnn": ("__cudnn$fmha", "Backward"),
    "pallas": ("mha_forward", "mha_backward"),
    "flex_gpu": ("jattn_flex_gpu_fwd", "jattn_flex_gpu_dq"),
    "flex_mgpu": ("jattn_flex_mgpu_fwd", "jattn_flex_mgpu_dq"),
    "flex_mgpu_ws": ("jattn_flex_mgpu_ws_fwd", "jattn_flex_mgpu_dq"),  # flex_mgpu's backward
}


def kernels_in(text: str) -> str:
  """The implementation a lowered CUDA program runs, read from its custom calls."""
  if "__cudnn$fmha" in text:
    return "cudnn"
  # a Triton call's kernel name is its `name` attribute (the serialized kernels also carry
  # source locations, which may name other kernels' functions)
  kernels = set(re.findall(r'\bname = "(\w+)"', text))
  if KERNEL_NAMES["flex_mgpu_ws"][0] in text:
    return "flex_mgpu_ws"
  if KERNEL_NAMES["flex_mgpu"][0] in text:  # a Mosaic GPU call carries its kernel's name
    return "flex_mgpu"
  for name in ("pallas", "flex_gpu"):
    if KERNEL_NAMES[name][0] in kernels:
      return name
  # no kernel: the blockwise loop is a while loop over kv blocks, "xla" has none
  return "blockwise" if "stablehlo.while" in text else "xla"


def _lowered_for_cuda(fn, *args) -> str:
  if ON_GPU:
    return jax.jit(fn).lower(*args).as_text()
  return exported_text(fn, "cuda", *args)


DISPATCH_CASES = (("causal", "bfloat16", "base"), ("none", "float16", "h128"),
                  ("mods_document", "bfloat16", "base"), ("alibi", "bfloat16", "base"),
                  ("window", "bfloat16", "base"), ("segments", "bfloat16", "cross"),
                  ("causal", "float32", "base"), ("empty_rows", "bfloat16", "unaligned"))
# on a Hopper card, bfloat16 at H = 128 with a mask or score function: flex_mgpu_ws
# (registry.hopper_fast_path); on the CPU's rehearsal they would repeat flex_gpu's rows
DISPATCH_CASES += (("mods_document", "bfloat16", "h128"), ("soft_cap", "bfloat16", "h128"),
                   ("sinks", "bfloat16", "h128")) if ON_GPU else ()


@_NEEDS_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype,shape", DISPATCH_CASES)
def test_what_runs_is_what_explain_names(case, dtype, shape):
  B, T, S, N, K, H = SHAPES[shape]
  kw = _case(case, B, T, S, N)[0]
  q, k, v, _ = _inputs(shape, dtype)
  named = jattn.explain(q, k, v, **kw).implementation("cuda")
  forward = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)
  grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)), (0, 1, 2))
  forward_text, grad_text = _lowered_for_cuda(forward, q, k, v), _lowered_for_cuda(grad, q, k, v)
  assert kernels_in(forward_text) == named, f"explain names {named}"
  assert kernels_in(grad_text) == named, f"explain names {named}"
  if named in ("pallas", "flex_gpu"):  # the backward is the kernel's too
    assert KERNEL_NAMES[named][1] in re.findall(r'\bname = "(\w+)"', grad_text)
  elif named in ("flex_mgpu", "flex_mgpu_ws"):
    assert KERNEL_NAMES[named][1] in grad_text
  elif named == "cudnn":
    assert re.search(r"__cudnn\$fmha\w*Backward", grad_text)


# ---- in CI, on the CPU: every case's CUDA program lowers (Pallas -> Triton) from this host.
# Interpret mode does not run Triton's lowering rules; a rule that refuses what the kernel
# emits (the H200 run found one: a negated literal from mods.chunked's floor division)
# breaks only on a GPU, or here.

LOWERED_SHAPE = (1, 128, 128, 2, 1, 64)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("mods_") or c in (
    "soft_cap", "alibi", "relative_bias", "hand_written", "empty_rows")])
def test_every_mods_case_lowers_for_cuda_forward_and_backward(case):
  B, T, S, N, K, H = LOWERED_SHAPE
  kw = _case(case, B, T, S, N)[0]
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
  named = jattn.explain(q, kv, kv, **kw).implementation("cuda")
  assert named in ("pallas", "flex_gpu"), named  # a mask or score function: a kernel
  forward = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)
  grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)), (0, 1, 2))
  text = _lowered_for_cuda(grad, q, kv, kv)
  assert set(KERNEL_NAMES[named]) <= set(re.findall(r'\bname = "(\w+)"', text))


# ---- landed after the H200 run, so never yet compiled by Triton or Mosaic GPU: the max
# logits (an extra output of the forward kernels) and the relative-bias table's gradient
# (summed in flex_gpu's dq kernel; flex_mgpu takes it from the blockwise backward)

NEW_SINCE_THE_H200_RUN = ("flex_gpu", "flex_mgpu", None)
EMPTY_ROW = np.float32(-0.7 * np.finfo(np.float32).max)  # the documented lse of no key


@_NEEDS_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("implementation", NEW_SINCE_THE_H200_RUN)
def test_max_logits_against_float64(implementation):
  """Each row's largest visible logit after soft-cap; rows t < 8 see no key (the lse's
  empty-row constant). A max taken before the cap or over masked keys is off by > 0.5."""
  B, T, S, N, K, H = SHAPES["base"]
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  kw = dict(mask_mod=lambda b, n, t, s: s < t - 7, score_mod=mods.soft_cap(2.0),
            return_max_logits=True)
  q, k, v, _ = _inputs("base", "bfloat16")
  ran = _skip_unless_cuda_takes(q, k, v, implementation, **kw)
  attend = jax.jit(lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation=implementation, **kw))
  with _interpreting():
    _, got = attend(q, k, v)
  want = reference_max_logits(q.astype(jnp.float32), k.astype(jnp.float32),
                              allowed=(s < t - 7)[None, None],
                              score=lambda x: 2.0 * np.tanh(x / 2.0))
  want = np.where(np.isfinite(want), want, EMPTY_ROW)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, np.einsum("bnt->btn", want), rtol=1e-5, atol=1e-2,
                             err_msg=f"ran {ran}")


@_NEEDS_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("implementation", NEW_SINCE_THE_H200_RUN)
def test_relative_bias_table_gradient_against_float64(implementation):
  """d loss / d table of `mods.relative_bias(table)` ([N, 17], read at clip(s - t) + 8),
  causal: the float64 gradient of the bias it adds, summed per table entry."""
  B, T, S, N, K, H = SHAPES["base"]
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  table = np.linspace(-1.0, 1.0, N * 17).reshape(N, 17).astype(np.float32)
  q, k, v, cot = _inputs("base", "bfloat16")
  kw = dict(is_causal=True, score_mod=mods.relative_bias(jnp.asarray(table)))
  ran = _skip_unless_cuda_takes(q, k, v, implementation, **kw)

  def loss(table):
    out = jattn.dot_product_attention(q, k, v, implementation=implementation, is_causal=True,
                                      score_mod=mods.relative_bias(table))
    return jnp.sum(out.astype(jnp.float32) * cot)

  with _interpreting():
    got = jax.jit(jax.grad(loss))(jnp.asarray(table))
  index = np.clip(s - t, -8, 8) + 8  # [T, S]
  bias = np.broadcast_to(table.astype(np.float64)[:, index], (B, N, T, S))
  *_, d_bias = reference_vjp(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), cot, bias, is_causal=True)
  want = np.zeros((N, 17))
  np.add.at(want, (slice(None), index), np.einsum("bnts->nts", d_bias))
  err = _relative_error(got, want)
  assert err <= TOLERANCE["bfloat16"], f"relative error {err:.2e} ({ran})"
