"""return_max_logits: each query row's largest visible logit (what Muon's QK-clip reads),
after scale, bias and score_mod, against a float64 NumPy reference.

Every implementation that runs on this CPU: "xla", "vmap", "blockwise", and jattn's
kernels interpreted ("flex_tpu", "flex_gpu"; "flex_mgpu" on jax >= 0.11). Each call
holds causal, a window, a bias (dense, or read by score_mod in the kernels, which take
no dense bias), a soft-cap, rows that see no key (they get the lse's empty-row
constant, not a sink), grouped heads and several blocks per row; then the gradient of
the output with the max logits asked for, and the refusals of jax's kernels, which
keep their running max inside. Letters as everywhere: B T S N K G H D.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src import compat
from jattn._src.impl.interpret import pallas_interpret
from tests.helpers import TRITON, exported_text, from_layout, raises, to_layout
from tests.reference import reference_max_logits
from tests.reference_grads import reference_mods_vjp

EMPTY_ROW = np.float32(-0.7 * np.finfo(np.float32).max)  # the documented lse of no key
CAP = 1.0  # below most rows' largest raw logit: a max taken before the cap shows

# ---------------------------------------------------------------- dense implementations

B, T, S, N, K, H = 2, 11, 13, 4, 2, 8  # G = 2
t_, s_, b_ = np.arange(T)[:, None], np.arange(S)[None, :], np.arange(B)[:, None, None]
# causal and a window of 3 to the left; rows t < 2 + b see no key (mask_mod)
VISIBLE = ((s_ <= t_) & (s_ >= t_ - 3))[None] & (t_ >= 2 + b_)  # [B, T, S]
EMPTY = ~VISIBLE.any(-1)  # [B, T]: 5 rows
DENSE_KW = dict(is_causal=True, local_window_size=(3, 0), mask_mod=lambda b, n, t, s: t >= 2 + b,
                score_mod=mods.soft_cap(CAP))


def _dense_inputs():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in "kv")
  bias = 2.0 * rng.standard_normal((B, N, T, S)).astype(np.float32)
  return q, k, v, bias


def _dense_expected(q, k, bias):
  """float32 [B, T, N]: the reference, the empty rows at the lse's constant."""
  want = reference_max_logits(q, k, allowed=VISIBLE[:, None], bias=bias,
                              score=lambda x: CAP * np.tanh(x / CAP))
  want = np.einsum("BNT->BTN", want)
  return np.where(np.isfinite(want), want, EMPTY_ROW)


@pytest.mark.parametrize("implementation, layout", [
    ("xla", "BTNH"), ("vmap", "BNHT"), ("blockwise", "BNTH")])
def test_max_logits_against_the_reference(implementation, layout):
  q, k, v, bias = _dense_inputs()
  blocks = jattn.BlockSizes(q=4, kv=3) if implementation == "blockwise" else None
  out, lse, got = jattn.dot_product_attention(
      *(to_layout(x, layout) for x in (q, k, v)), bias, layout=layout,
      implementation=implementation, block_sizes=blocks, return_residual=True,
      return_max_logits=True, **DENSE_KW)
  rows = layout.replace("H", "")  # shaped like the residual: the query without H
  assert got.shape == lse.shape == tuple(dict(zip("BTN", (B, T, N)))[c] for c in rows)
  assert got.dtype == jnp.float32
  got, lse = from_layout(got, rows, "BTN"), from_layout(lse, rows, "BTN")
  np.testing.assert_allclose(got, _dense_expected(q, k, bias), rtol=1e-5, atol=1e-5)
  # a row that sees no key: the same value as its lse (issue 37), exactly
  assert EMPTY.sum() == 5
  np.testing.assert_array_equal(got[EMPTY], lse[EMPTY])
  np.testing.assert_array_equal(got[EMPTY], EMPTY_ROW)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_sinks_are_no_logit_of_a_key(implementation):
  """With sinks an empty row's lse is the sink's logit; its max logit stays the constant
  (a clip of W_q, W_k cannot lower a sink), and the other rows are as without sinks."""
  q, k, v, bias = _dense_inputs()
  sinks = np.asarray([3.0, -1.0, 0.5, 2.0], np.float32)
  _, lse, got = jattn.dot_product_attention(
      q, k, v, bias, implementation=implementation, sinks=sinks, return_residual=True,
      return_max_logits=True, **DENSE_KW)
  np.testing.assert_allclose(got, _dense_expected(q, k, bias), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse)[EMPTY], np.broadcast_to(sinks, (5, N)))


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_gradients_with_the_max_asked_for_are_the_outputs_alone(implementation):
  """The loss adds the max logits: no gradient flows from them (stopped), and the
  output's is the float64 VJP's."""
  q, k, v, bias = _dense_inputs()
  cot = np.random.default_rng(1).standard_normal((B, T, N, H)).astype(np.float32)

  def loss(q, k, v):
    out, max_logits = jattn.dot_product_attention(
        q, k, v, bias, implementation=implementation, return_max_logits=True, **DENSE_KW)
    return jnp.sum(out * cot) + jnp.sum(max_logits)

  got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  capped = lambda x: np.tanh((x + bias) / CAP)  # the bias folded into the score
  want = reference_mods_vjp(q, k, v, cot, allowed=VISIBLE[:, None],
                            score=lambda x: CAP * capped(x),
                            d_score=lambda x: 1.0 - capped(x) ** 2)[1:]
  for name, g, w in zip(("d_query", "d_key", "d_value"), got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_without_a_batch_axis():
  q, k, v, bias = _dense_inputs()
  _, got = jattn.dot_product_attention(q[0], k[0], v[0], bias[0], implementation="xla",
                                       return_max_logits=True, **DENSE_KW)
  assert got.shape == (T, N)  # mask_mod sees b = 0
  np.testing.assert_allclose(got, _dense_expected(q, k, bias)[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- jattn's kernels

KT = 136  # T = S: three 64-tiles (flex_gpu, flex_mgpu), two 128-tiles of keys (flex_tpu)
SLOPES = np.asarray([0.9, 0.05, 0.6, 0.2], np.float32)  # per query head: G = 2 apart
kt_, ks_ = np.arange(KT)[:, None], np.arange(KT)[None, :]
# causal, a window of 40 (rows near 128 see keys of two tiles); rows t < 2 + b see none
K_VISIBLE = ((ks_ <= kt_) & (ks_ >= kt_ - 40))[None] & (kt_ >= 2 + b_)  # [B, T, S]


def _capped_alibi(x, b, n, t, s):
  """A bias read by score_mod (the kernels take no dense one), then a soft-cap."""
  return CAP * jnp.tanh((x + jnp.asarray(SLOPES)[n] * (s - t).astype(jnp.float32)) / CAP)


def _kernel_call(implementation, dtype):
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((B, KT, N, 16)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, KT, K, 16)), dtype) for _ in "kv")
  empty = lambda b, n, t, s: t >= 2 + b
  block_mask = jattn.create_block_mask(empty, B, None, KT, KT,
                                       block_sizes=jattn.BlockSizes(q=64, kv=128))
  kw = dict(is_causal=True, local_window_size=(40, 0), mask_mod=empty, block_mask=block_mask,
            score_mod=_capped_alibi, implementation=implementation)
  return (q, k, v), kw


needs_mgpu_interpreter = pytest.mark.skipif(
    compat.missing("mosaic_gpu_interpret") is not None,
    reason=f"no Mosaic GPU interpreter: {compat.missing('mosaic_gpu_interpret')}")


@pytest.mark.interpret
@pytest.mark.parametrize("implementation, dtype", [
    ("flex_tpu", jnp.float32), ("flex_gpu", jnp.float32),
    pytest.param("flex_mgpu", jnp.bfloat16, marks=needs_mgpu_interpreter)])
def test_kernels_return_their_running_max(implementation, dtype):
  (q, k, v), kw = _kernel_call(implementation, dtype)
  with pallas_interpret():
    _, lse, got = jattn.dot_product_attention(q, k, v, return_residual=True,
                                              return_max_logits=True, **kw)
  want = reference_max_logits(
      np.asarray(q, np.float64), np.asarray(k, np.float64), allowed=K_VISIBLE[:, None],
      score=lambda x: CAP * np.tanh((x + SLOPES[None, :, None, None] * (ks_ - kt_)) / CAP))
  want = np.einsum("BNT->BTN", want)
  empty = ~K_VISIBLE.any(-1)
  assert got.dtype == jnp.float32 and empty.sum() == 5
  np.testing.assert_allclose(np.asarray(got)[~empty], want[~empty], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got)[empty], EMPTY_ROW)
  # the lse is in value's dtype (bfloat16 for flex_mgpu): equal once rounded to it
  np.testing.assert_array_equal(np.asarray(got.astype(lse.dtype))[empty], np.asarray(lse)[empty])


@pytest.mark.interpret
def test_a_kernel_gradient_with_the_max_logits_asked_for():
  (q, k, v), kw = _kernel_call("flex_gpu", jnp.float32)
  cot = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)

  def loss(q):
    out, max_logits = jattn.dot_product_attention(q, k, v, return_max_logits=True, **kw)
    return jnp.sum(out * cot) + jnp.sum(max_logits)  # no gradient from the max

  with pallas_interpret():
    got = jax.grad(loss)(q)
  alibi = lambda x: (x + SLOPES[None, :, None, None] * (ks_ - kt_)) / CAP
  want = reference_mods_vjp(q, k, v, cot, allowed=K_VISIBLE[:, None],
                            score=lambda x: CAP * np.tanh(alibi(x)),
                            d_score=lambda x: 1.0 - np.tanh(alibi(x)) ** 2)[1]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- plans, export, errors

EB, ET, EN, EH = 1, 256, 2, 64


def _abstract():
  q = jax.ShapeDtypeStruct((EB, ET, EN, EH), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((EB, ET, 1, EH), jnp.bfloat16)
  return q, kv, kv


def test_jax_kernels_refuse_and_jattn_kernels_take_the_call():
  report = jattn.explain(*_abstract(), is_causal=True, return_max_logits=True)
  assert report.implementation("tpu") == "flex_tpu", str(report)
  assert report.implementation("cuda") == "flex_gpu", str(report)
  assert "return_max_logits" in report.reasons("cuda")["cudnn"]
  plain = jattn.explain(*_abstract(), is_causal=True)  # unasked: no kernel refuses for it
  assert "return_max_logits" not in str(plain), str(plain)
  # (jax 0.12.1 removed its GPU mha: test_compat checks that refusal)
  jax_kernels = (("splash", "tpu"),) + (
      (("pallas", "cuda"),) if compat.missing("pallas_mha") is None else ())
  for name, platform in jax_kernels:
    explicit = jattn.explain(*_abstract(), is_causal=True, return_max_logits=True,
                             implementation=name)
    assert "return_max_logits" in explicit.choices[platform].error


@pytest.mark.parametrize("platform, kernel", [("tpu", "tpu_custom_call"), ("cuda", TRITON)])
def test_export_with_max_logits_carries_the_fused_kernel(platform, kernel):
  """Forward and gradient of the output, the max logits asked for, exported from this CPU:
  the fused kernel, forward and backward, and no [T, S] tensor."""
  fwd = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                    return_max_logits=True)
  loss = lambda q, k, v: jnp.sum(fwd(q, k, v)[0].astype(jnp.float32) ** 2)
  for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
    text = exported_text(fn, platform, *_abstract())
    assert text.count(kernel) >= (1 if fn is fwd else 3), (platform, fn)
    assert not re.search(rf"tensor<(\d+x)*{ET}x{ET}x", text), platform


def test_bad_requests_name_the_argument():
  q = np.zeros((1, 8, 2, 4), np.float32)
  with raises(TypeError, "return_max_logits", "'yes'"):
    jattn.dot_product_attention(q, q, q, return_max_logits="yes")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  with raises(TypeError, "return_max_logits", "'yes'"):  # the sequence-parallel call checks it
    jattn.ring_attention(q, q, q, mesh=mesh, return_max_logits="yes")
  with raises(ValueError, "return_max_logits", "splash"):
    jattn.dot_product_attention(q, q, q, implementation="splash", return_max_logits=True)


# ---------------------------------------------------------------- Flax modules

MF, MT = 16, 9  # features F and tokens T of the module tests; N = 4 heads, K = 2, H = 4


def _module_expected(x, params, causal):
  """float64 [N]: each head's largest visible logit from the module's own projections."""
  proj = lambda p: np.einsum("BTF,FNH->BTNH", np.float64(x), np.float64(p["kernel"])) + p["bias"]
  want = reference_max_logits(proj(params["query"]), proj(params["key"]),
                              allowed=causal[None, None])  # [B, N, T]
  return want.max(axis=(0, 2))


def test_nnx_module_sows_each_heads_max_logit():
  from flax import nnx
  x = np.random.default_rng(4).standard_normal((2, MT, MF)).astype(np.float32)
  module = jattn.nnx.MultiHeadAttention(N, MF, num_kv_heads=K, rngs=nnx.Rngs(0))
  capture = lambda **kw: jax.tree.leaves(
      nnx.capture(module, nnx.Intermediate)(x, is_causal=True, **kw)[1])
  assert capture() == []  # not asked: nothing sown
  (got,) = capture(sow_max_logits=True)
  params = {name: {"kernel": np.asarray(getattr(module, name).kernel[...]),
                   "bias": np.asarray(getattr(module, name).bias[...])}
            for name in ("query", "key")}
  assert got.shape == (N,) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, _module_expected(x, params, np.tri(MT, dtype=bool)),
                             rtol=1e-5, atol=1e-5)


def test_linen_module_sows_each_heads_max_logit_in_the_columns_layout():
  from flax import linen as nn
  x = np.random.default_rng(5).standard_normal((2, MT, MF)).astype(np.float32)
  module = jattn.linen.MultiHeadAttention(N, num_kv_heads=K, layout="columns",
                                          sow_max_logits=True)
  x_cols = np.swapaxes(x, 1, 2)  # [B, F, T]
  variables = module.init(jax.random.key(0), x_cols)
  _, state = module.apply(variables, x_cols, is_causal=True, mutable=["intermediates"])
  (got,) = state["intermediates"]["max_logits"]
  assert got.shape == (N,)
  np.testing.assert_allclose(got, _module_expected(x, variables["params"],
                                                   np.tri(MT, dtype=bool)),
                             rtol=1e-5, atol=1e-5)
  _, state = module.apply(variables, x_cols, sow_max_logits=False, mutable=["intermediates"])
  assert state == {}  # the call's flag overrides the attribute
  del nn


def test_modules_refuse_what_returns_no_max_logits():
  from flax import nnx
  with raises(TypeError, "sow_max_logits", "'yes'"):
    jattn.nnx.MultiHeadAttention(N, MF, sow_max_logits="yes", rngs=nnx.Rngs(0))
  with raises(ValueError, "sow_max_logits", "attention_fn"):
    jattn.nnx.MultiHeadAttention(N, MF, attention_fn=jattn.flax_attention_fn,
                                 sow_max_logits=True, rngs=nnx.Rngs(0))
  module = jattn.nnx.MultiHeadAttention(N, MF, rngs=nnx.Rngs(0))
  module.init_cache(1, 8, paged=True, page_size=4)
  with raises(ValueError, "sow_max_logits", "paged"):
    module(np.zeros((1, 2, MF), np.float32), is_causal=True, decode=True,
           sow_max_logits=True)
