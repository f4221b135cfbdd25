"""implementation=None chooses per platform when the program is lowered: exported from
this CPU host for TPU and CUDA, the same jitted function carries the fused kernel
(Mosaic `tpu_custom_call`, Triton `__gpu$xla.gpu.triton`) forward and backward,
and no [T, S]-shaped tensor; where a kernel refuses, `jattn.explain` says why and
the export carries no kernel. Lowering only: nothing here runs on a TPU or GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jattn
from jattn import mods
from tests.helpers import TRITON, exported_text, raises
from tests.reference import reference_mods

# the CUDA kernels expected are those of a host without jax's CUDA plugin (conftest)
pytestmark = pytest.mark.usefixtures("host_without_cuda")

B, T, N, K, H = 2, 640, 4, 2, 128  # T: five 128-tiles, two of flex_tpu's 512 (its tile
# is no [T, S] tensor); no other axis is 640 long
KERNEL = {"tpu": "tpu_custom_call", "cuda": TRITON}
IDS = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [100, 200, 340], axis=1).astype(np.int32)

# name -> (kwargs, kv heads, {platform: the fused kernel expected, or None})
# issue 23's cases (jax's kernels), then issue 24's (jattn's own TPU kernel)
CASES = {
    "causal": (dict(is_causal=True), K, {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "window_segments": (dict(local_window_size=(64, 0), q_segment_ids=IDS,
                             kv_segment_ids=IDS), K, {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "grouped_heads": (dict(), 1, {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "soft_cap_sinks": (dict(is_causal=True, score_mod=mods.soft_cap(20.0),
                            sinks=jnp.linspace(-1.0, 1.0, N)), K, {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "alibi": (dict(is_causal=True, score_mod=mods.alibi(jnp.linspace(0.1, 0.4, N))), K,
              {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "prefix_lm": (dict(mask_mod=mods.prefix_lm(jnp.array([100, 7]))), K,
                  {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "hand_written_mask": (dict(mask_mod=lambda b, n, t, s: (s <= t) & ((t - s) % 3 != 1)), K,
                          {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    "relative_bias": (dict(is_causal=True, score_mod=mods.relative_bias(
        jnp.linspace(-1.0, 1.0, N * 33).reshape(N, 33))), K, {"tpu": "flex_tpu", "cuda": "flex_gpu"}),
    # a dense [T, S] bias: no fused kernel reads it
    "dense_bias": (dict(bias=np.zeros((1, 1, T, T), np.float32)), K, {"tpu": None, "cuda": None}),
}


def _functions(kw):
  fwd = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)
  loss = lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32) ** 2)
  return {"forward": fwd, "grad": jax.grad(loss, argnums=(0, 1, 2))}


def _exported(fn, platform, kv_heads, dtype=jnp.bfloat16):
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, T, kv_heads, H), dtype)
  return exported_text(fn, platform, q, kv, kv)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("case", list(CASES))
def test_export_carries_the_kernel_where_the_plan_takes_the_call(case, platform):
  kw, kv_heads, expected = CASES[case]
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, kv_heads, H), jnp.bfloat16)
  report = jattn.explain(q, kv, kv, **kw)
  kernel = expected[platform]
  if kernel is not None:
    assert report.implementation(platform) == kernel, str(report)
  else:  # every fused kernel refused, with a reason
    assert report.implementation(platform) in ("xla", "blockwise"), str(report)
    assert {"tpu": "splash", "cuda": "pallas"}[platform] in report.reasons(platform)
  for what, fn in _functions(kw).items():
    text = _exported(fn, platform, kv_heads)
    assert (KERNEL[platform] in text) == (kernel is not None), (what, platform)
    if kernel is not None:  # the logits never exist outside the kernel
      assert not re.search(rf"tensor<(\d+x)*{T}x{T}x", text), (what, platform)
    else:
      assert re.search(rf"tensor<(\d+x)*{T}x{T}x", text), (what, platform)


# ids not "tpu": conftest would skip a test with that keyword where jax sees no TPU
@pytest.mark.parametrize("platform", ["tpu", "cuda"], ids=["for_tpu", "for_cuda"])
def test_relative_bias_gradient_exports_the_three_kernels_and_no_loop(platform):
  """The gradient into a relative-bias table comes from the dq kernel: the export holds
  the forward, dq and dk/dv kernels and no loop of XLA's (the blockwise backward, which
  recomputes the attention, is a while loop). Grouped heads, T != S."""
  table = jnp.linspace(-1.0, 1.0, N * 33).reshape(N, 33)

  def loss(q, k, v, table):
    out = jattn.dot_product_attention(q, k, v, is_causal=True,
                                      score_mod=mods.relative_bias(table))
    return jnp.sum(out.astype(jnp.float32) ** 2)

  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, 512, K, H), jnp.bfloat16)
  assert jattn.explain(q, kv, kv, is_causal=True, score_mod=mods.relative_bias(
      table)).implementation(platform) == {"tpu": "flex_tpu", "cuda": "flex_gpu"}[platform]
  text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3)), platform, q, kv, kv,
                       jax.ShapeDtypeStruct(table.shape, table.dtype))
  prefix = {"tpu": "jattn_flex_tpu", "cuda": "jattn_flex_gpu"}[platform]
  assert set(re.findall(rf"{prefix}_(fwd|dq|dkv)\b", text)) == {"fwd", "dq", "dkv"}
  assert text.count(f"@{KERNEL[platform]}(") == 3
  assert "stablehlo.while" not in text


def test_the_cpu_result_of_the_same_function_is_unchanged():
  """The function whose TPU export holds splash computes, on this CPU, what the reference does."""
  kw, kv_heads, _ = CASES["soft_cap_sinks"]
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 256, N, 64)).astype(np.float32)
  k, v = (rng.standard_normal((1, 256, kv_heads, 64)).astype(np.float32) for _ in "kv")
  fn = jax.jit(_functions(kw)["forward"])
  assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(q, k, v).mlir_module()
  causal = np.tril(np.ones((256, 256), bool))
  want, _ = reference_mods(q, k, v, allowed=causal, score=lambda x: 20.0 * np.tanh(x / 20.0),
                           sinks=np.asarray(kw["sinks"]))
  np.testing.assert_allclose(fn(q, k, v), want, atol=2e-5, rtol=2e-5)


def test_an_explicit_kernel_names_the_platform_it_cannot_run_on():
  q = jnp.zeros((1, 128, 2, 64))
  f = jax.jit(lambda q: jattn.dot_product_attention(q, q, q, implementation="splash"))
  assert "tpu_custom_call" in export.export(f, platforms=["tpu"])(q).mlir_module()
  with raises(ValueError, "implementation='splash' cannot run this call on 'cpu': "
                          "it needs a TPU, the program is lowered for 'cpu'"):
    f(q)
  with raises(ValueError, "implementation='splash' cannot run this call on 'cuda'"):
    export.export(f, platforms=["cuda"])(q)


def test_one_platform_choice_builds_no_branch():
  """return_weights: "xla" everywhere, so the jaxpr has no platform_dependent switch."""
  q = jnp.zeros((1, 8, 2, 4))
  jaxpr = str(jax.make_jaxpr(lambda q: jattn.dot_product_attention(
      q, q, q, return_weights=True))(q))
  assert "platform_index" not in jaxpr
  jaxpr = str(jax.make_jaxpr(lambda q: jattn.dot_product_attention(q, q, q))(q))
  assert "platform_index" in jaxpr  # splash on TPU, pallas on CUDA, xla on CPU


def _branch_count(jaxpr) -> int:
  """Branches of the one platform_dependent switch (a cond) anywhere in the jaxpr."""
  def conds(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "cond":
        yield eqn
      elif "jaxpr" in eqn.params:  # the jit of the dispatch
        yield from conds(eqn.params["jaxpr"].jaxpr)
  [switch] = conds(jaxpr)
  return len(switch.params["branches"])


def test_equal_choices_are_traced_once():
  """Platforms that choose the same implementation and plan share one branch: explicit
  "blockwise" (one default block size everywhere) builds no switch, and None at
  T = 8192 (logits over the accelerators' dense limit) traces three programs
  (blockwise on CPU and ROCm, splash, pallas), not four."""
  q = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)
  blockwise = jax.make_jaxpr(lambda q: jattn.dot_product_attention(
      q, q, q, is_causal=True, implementation="blockwise"))(q)
  assert "platform_index" not in str(blockwise)
  default = jax.make_jaxpr(lambda q: jattn.dot_product_attention(q, q, q, is_causal=True))(q)
  assert _branch_count(default.jaxpr) == 3


def test_explain_reports_plans_and_reasons_for_every_platform():
  q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  report = jattn.explain(q, q, q, mask_mod=mods.and_masks(mods.causal(), mods.document(ids)))
  assert report.implementation("cpu") == "blockwise"
  assert report.choices["cpu"].plan.block_sizes == jattn.BlockSizes(q=512, kv=256)
  # documents on TPU: flex_tpu first (it skips the tiles between documents), and says why
  assert report.implementation("tpu") == "flex_tpu"
  assert "splash applies segment ids on every tile" in report.choices["tpu"].why
  assert report.choices["cpu"].why is None
  splash = jattn.explain(q, q, q, implementation="splash",
                         mask_mod=mods.and_masks(mods.causal(), mods.document(ids)))
  splash = splash.choices["tpu"].plan  # splash stays selectable
  assert splash.mask == ("and", ("and", ("causal",), ("full",))) and splash.document
  assert report.implementation("cuda") == "flex_gpu"
  assert report.reasons("cuda")["cudnn"].startswith("it cannot honour mask_mod")
  text = str(report)
  assert "tpu: flex_tpu" in text and "not cudnn: it cannot honour mask_mod" in text
  assert "why: flex_tpu before splash for segment ids and mods.document" in text
  # causal alone: flex_tpu too (one kernel for every mask), with the schedule's figures
  causal = jattn.explain(q, q, q, is_causal=True)
  assert causal.implementation("tpu") == "flex_tpu"
  assert causal.choices["tpu"].why.startswith("flex_tpu before splash: one kernel for every")
  assert causal.choices["cuda"].why is None
  # a local window on TPU: flex_tpu first (its grid runs only the window's tiles), says why
  window = jattn.explain(q, q, q, is_causal=True, local_window_size=(255, 0))
  assert window.implementation("tpu") == "flex_tpu"
  assert "runs only each row's tiles in the window" in window.choices["tpu"].why
  assert jattn.explain(q, q, q, is_causal=True, local_window_size=(255, 0),
                       implementation="splash").implementation("tpu") == "splash"
  # an explicit implementation that cannot run somewhere is reported, not raised
  report = jattn.explain(q, q, q, implementation="splash", bias=jnp.zeros(()))
  assert report.implementation("tpu") is None
  assert "it takes no bias" in report.choices["tpu"].error
