"""implementation="splash" (TPU) and "pallas" (GPU), run in Pallas interpret mode on CPU.

Every argument the lowering claims (jattn._src.impl.kernel_plans) is checked against
implementation="xla" for values and gradients of q, k, v, in both layouts
("BTNH" and tokens as columns "BNHT") and with grouped heads; T <= 256
because interpret mode is slow. The default rule is checked per platform with
the platform faked. No TPU or GPU was used: nothing here measures speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.impl import cudnn
from jattn._src.impl.interpret import pallas_interpret
from tests.helpers import from_layout, make_qkv, needs_api, raises, to_layout
from tests.reference_grads import reference_vjp

pytestmark = pytest.mark.interpret

B, T, H = 2, 128, 16
IDS = np.repeat(np.array([[0, 1], [0, 2]]), [50, 78], axis=1).astype(np.int32)  # [B, T]
OTHER_IDS = np.repeat(np.array([[0, 1], [1, 0]]), [64, 64], axis=1).astype(np.int32)


def _arrays(N, K, layout, T=T, seed=0):
  q, k, v = make_qkv(np.random.default_rng(seed), B=B, T=T, S=T, N=N, K=K, H=H)
  return tuple(jnp.asarray(to_layout(x, layout)) for x in (q, k, v))


def _loss(impl, layout, kw):
  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation=impl, layout=layout, **kw)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(out * w), out
  return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def _check(impl, N, K, layout, kw, T=T):
  q, k, v = _arrays(N, K, layout, T=T)
  with pallas_interpret():
    (_, out), grads = _loss(impl, layout, kw)(q, k, v)
  (_, ref), ref_grads = _loss("xla", layout, kw)(q, k, v)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


# name -> (kwargs, T): every argument the splash lowering claims
SPLASH_CASES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(17, 3)),
    "lengths": dict(query_seq_lengths=jnp.array([128, 70]),
                    key_value_seq_lengths=jnp.array([100, 30])),
    "segments": dict(q_segment_ids=IDS, kv_segment_ids=OTHER_IDS),
    "window_lengths": dict(local_window_size=(17, 3), query_seq_lengths=jnp.array([128, 70]),
                           key_value_seq_lengths=jnp.array([100, 30])),
    "causal_mod": dict(mask_mod=mods.causal()),
    "sliding_window_mod": dict(mask_mod=mods.sliding_window(9, 2)),
    "chunked_or_window": dict(mask_mod=mods.or_masks(mods.chunked(32),
                                                      mods.sliding_window(4))),
    "document_and_causal": dict(mask_mod=mods.and_masks(mods.document(IDS), mods.causal())),
    "soft_cap_sinks": dict(score_mod=mods.soft_cap(2.0), sinks=jnp.array([0.5, -1.0, 2.0, 0.0])),
}
CI_SPLASH = {  # (case, layout, N, K): a few in the CI tier, covering both layouts and GQA
    ("causal", "BTNH", 4, 2), ("window_lengths", "BNHT", 4, 4),
    ("document_and_causal", "BNHT", 4, 1), ("soft_cap_sinks", "BTNH", 4, 2),
}


def _tier(ci: bool):
  return () if ci else (pytest.mark.thorough,)


@pytest.mark.parametrize("case, layout, N, K", [
    pytest.param(c, lay, n, k, marks=_tier((c, lay, n, k) in CI_SPLASH))
    for c in SPLASH_CASES for lay in ("BTNH", "BNHT") for n, k in ((4, 4), (4, 2), (4, 1))
])
def test_splash_matches_xla(case, layout, N, K):
  _check("splash", N, K, layout, SPLASH_CASES[case])


@pytest.mark.thorough
def test_splash_two_tiles_and_rows_without_keys():
  """T = 256 (two 128 tiles); T > S leaves queries past the window with no key."""
  q, k, v = _arrays(2, 1, "BTNH", T=256)
  k, v = k[:, :128], v[:, :128]
  kw = dict(local_window_size=(5, 5), layout="BTNH")
  with pallas_interpret():
    out = jattn.dot_product_attention(q, k, v, implementation="splash", **kw)
  ref = jattn.dot_product_attention(q, k, v, implementation="xla", **kw)
  np.testing.assert_allclose(out, ref, atol=2e-5)
  assert np.all(np.asarray(out)[:, 140:] == 0)


# Query ids 0, 1, 3 against key ids 0, 1: the 38 queries of document 3 see no key.
NO_KEY_IDS = np.repeat(np.array([[0, 1, 3]]), [50, 40, 38], axis=1).astype(np.int32)
CHUNK = 40  # chunk edges at 40, 80, 120: inside the kernel's one 128 x 128 tile


@pytest.mark.parametrize("case, layout", [("chunked", "BTNH"), ("segments_no_key", "BNHT")])
def test_splash_against_float64_reference(case, layout):
  """Out and d q/k/v of the splash kernel (interpreted) against the float64 reference:
  a chunked mask on its own; query segments that leave a query with no key (zeros)."""
  N, K = 2, 1  # one batch row: interpret mode is slow
  q, k, v = make_qkv(np.random.default_rng(7), B=1, T=T, S=T, N=N, K=K, H=H)
  if case == "chunked":
    kw = dict(mask_mod=mods.chunked(CHUNK))
    t = np.arange(T)
    masks = dict(mask=(t[:, None] // CHUNK == t[None, :] // CHUNK)[None, None])
  else:
    masks = kw = dict(q_segment_ids=NO_KEY_IDS, kv_segment_ids=OTHER_IDS[:1])
  arrays = [jnp.asarray(to_layout(x, layout)) for x in (q, k, v)]
  assert jattn.explain(*arrays, layout=layout, implementation="splash",
                       **kw).implementation("tpu") == "splash"  # splash takes the call
  with pallas_interpret():
    (_, out), grads = _loss("splash", layout, kw)(*arrays)
  d_out = np.cos(np.arange(out.size, dtype=np.float32).reshape(out.shape))
  want = reference_vjp(q, k, v, from_layout(d_out, layout), **masks)
  np.testing.assert_allclose(from_layout(out, layout), want[0], atol=2e-5, rtol=2e-5)
  for name, g, r in zip("qkv", grads, want[1:4]):
    np.testing.assert_allclose(from_layout(g, layout), r, atol=5e-5, rtol=5e-5,
                               err_msg=f"d{name}")
  if case == "segments_no_key":
    assert np.all(from_layout(out, layout)[:, 90:] == 0)


# jax's Pallas GPU mha (jax 0.12.1 removed it: tests/impl/test_compat.py checks the refusal)
PALLAS_MHA = needs_api("pallas_mha")

PALLAS_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "segments": dict(q_segment_ids=IDS, kv_segment_ids=IDS),
    "causal_segments": dict(is_causal=True, q_segment_ids=IDS, kv_segment_ids=IDS),
    "mods": dict(mask_mod=mods.document(IDS)),
}
CI_PALLAS = {("causal_segments", "BNHT", 4, 2)}


@PALLAS_MHA
@pytest.mark.parametrize("case, layout, N, K", [
    pytest.param(c, lay, n, k, marks=_tier((c, lay, n, k) in CI_PALLAS))
    for c in PALLAS_CASES for lay in ("BTNH", "BNHT") for n, k in ((4, 4), (4, 2))])
def test_pallas_matches_xla(case, layout, N, K):
  _check("pallas", N, K, layout, PALLAS_CASES[case])


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("impl, kw, name", [
    ("splash", dict(bias=np.zeros((1, 1, T, T), np.float32)), "bias"),
    ("splash", dict(return_residual=True), "return_residual"),
    ("splash", dict(score_mod=mods.alibi(np.ones(2, np.float32))), "score_mod"),
    ("splash", dict(mask_mod=mods.prefix_lm(np.array([3, 4]))), "mask_mod"),
    ("splash", dict(mask_mod=lambda b, n, t, s: s <= t), "mask_mod"),
    ("splash", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate"),
    pytest.param("pallas", dict(local_window_size=4), "local_window_size", marks=PALLAS_MHA),
    pytest.param("pallas", dict(query_seq_lengths=np.array([3, 4])), "query_seq_lengths",
                 marks=PALLAS_MHA),
    pytest.param("pallas", dict(q_segment_ids=IDS, kv_segment_ids=OTHER_IDS), "kv_segment_ids",
                 marks=PALLAS_MHA),
    pytest.param("pallas", dict(return_weights=True), "return_weights", marks=PALLAS_MHA),
])
def test_explicit_kernel_names_what_it_cannot_honour(impl, kw, name):
  q, k, v = _arrays(2, 2, "BTNH")
  with pallas_interpret(), raises(ValueError, f"implementation='{impl}'.*{name}"):
    jattn.dot_product_attention(q, k, v, implementation=impl, **kw)


def test_splash_without_interpret_on_cpu_names_the_platform():
  q, k, v = _arrays(2, 2, "BTNH")
  with raises(ValueError, "implementation='splash'.*TPU.*'cpu'"):
    jattn.dot_product_attention(q, k, v, implementation="splash")


# ---------------------------------------------------------------- the default rule


@pytest.mark.parametrize("platform, dtype, kw, expected", [
    # flex_tpu first for every mask (the TPU compiler's schedule: registry.preference)
    ("tpu", jnp.float32, dict(is_causal=True), "flex_tpu"),
    ("tpu", jnp.bfloat16, dict(mask_mod=mods.sliding_window(8)), "flex_tpu"),
    ("tpu", jnp.bfloat16, dict(q_segment_ids=IDS, kv_segment_ids=IDS), "flex_tpu"),
    # a traced scale: flex_tpu takes a Python number, splash folds it into the query
    ("tpu", jnp.float32, dict(is_causal=True, scale=jnp.float32(0.3)), "splash"),
    ("tpu", jnp.float32, dict(bias=np.zeros((1, 1, T, T), np.float32)), "xla"),
    ("tpu", jnp.float32, dict(return_weights=True), "xla"),
    ("cuda", jnp.bfloat16, dict(is_causal=True), "cudnn"),
    # flex_gpu before Pallas mha (measured on an H200: registry.preference)
    ("cuda", jnp.float32, dict(is_causal=True), "flex_gpu"),
    ("cuda", jnp.bfloat16, dict(q_segment_ids=IDS, kv_segment_ids=IDS), "flex_gpu"),
    # a traced scale: flex_gpu takes a Python number, mha folds it into the query
    pytest.param("cuda", jnp.float32, dict(is_causal=True, scale=jnp.float32(0.3)), "pallas",
                 marks=PALLAS_MHA),
    ("cuda", jnp.float32, dict(local_window_size=3), "flex_gpu"),
    ("cuda", jnp.float32, dict(bias=np.zeros((1, 1, T, T), np.float32)), "xla"),
    ("cpu", jnp.float32, dict(is_causal=True), "blockwise"),
])
def test_default_picks_what_the_rule_says(monkeypatch, platform, dtype, kw, expected):
  monkeypatch.setattr(cudnn, "cudnn_missing", lambda: None)  # a CUDA build host
  q, k, v = (x.astype(dtype) for x in _arrays(2, 2, "BTNH"))
  assert jattn.explain(q, k, v, **kw).implementation(platform) == expected


def test_without_cudnn_on_the_host_cuda_takes_jattns_kernel(host_without_cuda):
  q, k, v = (x.astype(jnp.bfloat16) for x in _arrays(2, 2, "BTNH"))
  report = jattn.explain(q, k, v, is_causal=True)
  assert report.implementation("cuda") == "flex_gpu"
  assert "cuDNN is not detected" in report.reasons("cuda")["cudnn"]


def test_default_on_accelerators_switches_to_blockwise_when_logits_are_large():
  big = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
  small = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.float32)
  window = dict(local_window_size=3, bias=jnp.zeros(()))  # no fused kernel takes a bias
  assert jattn.explain(big, big, big, **window).implementation("tpu") == "blockwise"
  assert jattn.explain(big, big, big, **window).implementation("cuda") == "blockwise"
  assert jattn.explain(small, small, small, **window).implementation("tpu") == "xla"


def test_splash_bfloat16_values_and_gradients_through_the_default_precision_wrapper():
  """bfloat16 splash runs inside a custom VJP that traces its kernels at the default matmul
  precision (Mosaic compiles no "highest" dot of bfloat16 operands, the compile tier
  found; this suite runs at "highest"): out and d q/k/v, with segment ids (integer inputs
  of the VJP) and sinks, grouped heads, against "xla" on the float32 upcast."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _arrays(4, 2, "BTNH"))
  kw = dict(q_segment_ids=IDS, kv_segment_ids=IDS, sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))

  def loss(impl):
    def fn(q, k, v):
      out = jattn.dot_product_attention(q, k, v, implementation=impl, **kw)
      w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
      return jnp.sum(out.astype(jnp.float32) * w), out
    return jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)
  with pallas_interpret():
    (_, out), grads = loss("splash")(q, k, v)
  (_, ref), ref_grads = loss("xla")(*(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    assert g.dtype == jnp.bfloat16, name
    r = np.asarray(r)
    np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=3e-2,
                               atol=3e-2 * np.abs(r).max(), err_msg=name)
