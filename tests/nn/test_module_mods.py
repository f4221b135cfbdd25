"""The modules with mask_mod, score_mod and learned sinks: against the functional call
with the same weights, default parameters unchanged, and decoding equal to the full
pass with every mod. Letters: B T S N K G H D F."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.linen
import jattn.nnx
from jattn import mods
from tests.decode.test_decode import B, F, L, MAX, _columns, _decode, _decode_transformer

N = 4
SLOPES = jnp.asarray([0.5, -0.25, 0.125, 1.0], jnp.float32)
# A mod of each kind that depends on the query position, so a wrong position shows.
MOD_CASES = {
    "window_alibi_softcap": dict(
        mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(3)),
        score_mod=lambda x, b, n, t, s: mods.soft_cap(2.0)(mods.alibi(SLOPES)(x, b, n, t, s),
                                                          b, n, t, s)),
    "chunked_relative_bias": dict(
        mask_mod=mods.and_masks(mods.causal(), mods.chunked(3)),
        score_mod=mods.relative_bias(jnp.linspace(-1, 1, N * 7).reshape(N, 7))),
}


def _sinks_params():
  return jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)


def test_use_sinks_adds_a_zero_parameter_and_defaults_stay_flax_compatible():
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  ref = nnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0))
  keys = lambda mod: sorted(str(p) for p, _ in nnx.to_flat_state(nnx.state(mod, nnx.Param)))
  assert keys(m) == keys(ref)
  with_sinks = jattn.nnx.MultiHeadAttention(N, F, use_sinks=True, rngs=nnx.Rngs(0))
  assert set(keys(with_sinks)) - set(keys(m)) == {"('sinks',)"}
  np.testing.assert_array_equal(with_sinks.sinks[...], np.zeros(N))
  lin = jattn.linen.MultiHeadAttention(N, use_sinks=True)
  params = lin.init(jax.random.key(0), jnp.zeros((1, 3, F)))["params"]
  np.testing.assert_array_equal(params["sinks"], np.zeros(N))
  plain = jattn.linen.MultiHeadAttention(N).init(jax.random.key(0), jnp.zeros((1, 3, F)))
  assert "sinks" not in plain["params"]


@pytest.mark.parametrize("name", ["window_alibi_softcap", pytest.param(
    "chunked_relative_bias", marks=pytest.mark.thorough)])
def test_nnx_decoding_equals_full_pass_with_mods_and_sinks(name):
  x = jax.random.normal(jax.random.key(0), (B, L, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(N, F, num_kv_heads=2, use_sinks=True, rngs=nnx.Rngs(0))
  m.sinks[...] = _sinks_params()
  kw = MOD_CASES[name]
  full = m(x, is_causal=True, **kw)
  m.init_cache(B, MAX)
  got = _decode(lambda inp, lengths: m(inp, is_causal=True, decode=True, lengths=lengths, **kw),
                "rows", x)
  np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)
  # and the mods did something: the plain causal pass differs
  assert float(jnp.abs(full - m(x, is_causal=True)).max()) > 1e-3


@pytest.mark.thorough
def test_linen_decoding_equals_full_pass_with_mods_and_sinks():
  x = jax.random.normal(jax.random.key(0), (B, L, F), jnp.float32)
  m = jattn.linen.MultiHeadAttention(N, num_kv_heads=1, use_sinks=True, layout="columns")
  kw = MOD_CASES["window_alibi_softcap"]
  variables = m.init(jax.random.key(1), _columns("columns", jnp.zeros((B, MAX, F))),
                     is_causal=True, decode=True)
  params = {"params": variables["params"] | {"sinks": _sinks_params()}}
  cache = {"cache": variables["cache"]}
  full = _columns("columns", m.apply(params, _columns("columns", x), is_causal=True, **kw))

  def call(inp, lengths):
    nonlocal cache
    out, cache = m.apply(params | cache, inp, is_causal=True, decode=True, lengths=lengths,
                         mutable=["cache"], **kw)
    return out
  np.testing.assert_allclose(_decode(call, "columns", x), full, rtol=1e-5, atol=1e-5)


def test_module_equals_the_function_with_its_weights():
  """nnx module with mods and sinks == project, dot_product_attention, project back."""
  x = jax.random.normal(jax.random.key(2), (2, 7, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(N, F, use_sinks=True, rngs=nnx.Rngs(1))
  m.sinks[...] = _sinks_params()
  kw = MOD_CASES["chunked_relative_bias"]
  got = m(x, **kw)
  p = lambda proj: (proj.kernel[...], proj.bias[...])
  q = jnp.einsum("BTF,FNH->BTNH", x, p(m.query)[0]) + p(m.query)[1]
  k = jnp.einsum("BTF,FNH->BTNH", x, p(m.key)[0]) + p(m.key)[1]
  v = jnp.einsum("BTF,FNH->BTNH", x, p(m.value)[0]) + p(m.value)[1]
  out = jattn.dot_product_attention(q, k, v, implementation="xla", sinks=_sinks_params(), **kw)
  want = jnp.einsum("BTNH,NHF->BTF", out, p(m.out)[0]) + p(m.out)[1]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sinks_parameter_gets_a_gradient():
  x = jax.random.normal(jax.random.key(3), (2, 7, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(N, F, use_sinks=True, rngs=nnx.Rngs(1))
  grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(m)
  assert float(jnp.abs(grads.sinks[...]).max()) > 0


@pytest.mark.thorough  # in CI: tests/decode/test_decode.py's config test (jitted, vs float64 too)
def test_transformer_gemma2_style_config_decodes_like_its_full_pass():
  """logit_soft_cap, sinks and alternating sliding-window/global layers: the layers
  differ (window 2 vs global), and decoding equals the full pass."""
  from jattn.transformer import Transformer, TransformerConfig
  config = TransformerConfig(vocab_size=32, max_len=MAX, num_layers=2, features=F,
                             num_heads=N, num_kv_heads=2, mlp_features=32,
                             logit_soft_cap=1.5, sinks=True, attention_pattern=(2, None))
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, 32)
  model = Transformer(config, rngs=nnx.Rngs(0))
  for block in model.blocks:
    block.attention.sinks[...] = _sinks_params()
  assert [b.window for b in model.blocks] == [2, None]
  full = model(tokens)
  plain = Transformer(TransformerConfig(**{**config.__dict__, "attention_pattern": (),
                                           "logit_soft_cap": None, "sinks": False}),
                      rngs=nnx.Rngs(0))
  assert float(jnp.abs(plain(tokens) - full).max()) > 1e-3
  np.testing.assert_allclose(_decode_transformer(model, tokens), full, rtol=1e-5, atol=1e-5)
