"""KV-cache decoding: a prompt, then one token at a time, equals the full causal pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.linen
import jattn.nnx

B, L, F, MAX = 3, 8, 16, 10
PROMPTS = np.array([2, 5, 1])  # a different prompt length per batch element


def _columns(layout, x):
  return x if layout == "rows" else jnp.swapaxes(x, 1, 2)


def _token(layout, x, t):
  """Token t of each batch element, t int [B]: [B, 1, F] (rows) or [B, F, 1] (columns)."""
  rows = jnp.take_along_axis(x, jnp.asarray(t)[:, None, None], axis=1)
  return _columns(layout, rows)


def _decode(call, layout, x):
  """Outputs [B, L, F] from decoding: prompts of PROMPTS[b] tokens, then single tokens."""
  out = np.zeros((B, L, F), np.float32)
  first = _columns(layout, call(_columns(layout, x[:, :PROMPTS.max()]),
                                jnp.asarray(PROMPTS, jnp.int32)))
  for b in range(B):
    out[b, :PROMPTS[b]] = first[b, :PROMPTS[b]]
  for j in range(L - PROMPTS.min()):
    t = np.minimum(PROMPTS + j, L - 1)  # elements already at the end repeat their last token
    step = _columns(layout, call(_token(layout, x, t), None))[:, 0]
    for b in range(B):
      if PROMPTS[b] + j < L:
        out[b, PROMPTS[b] + j] = step[b]
  return out


def _decode_transformer(model, tokens, call=None):
  """Logits [B, L, V] from decoding a Transformer: prompts of PROMPTS[b] tokens, then
  single tokens, each batch element from its own cache position. call(model, tokens,
  lengths) runs one decoding call (default: eagerly)."""
  if call is None:
    call = lambda m, t, lengths: m(t, decode=True, lengths=lengths)
  model.init_cache(B)
  first = call(model, tokens[:, :PROMPTS.max()], jnp.asarray(PROMPTS))
  got = np.zeros(first.shape[:1] + (L,) + first.shape[2:], np.float32)
  for b in range(B):
    got[b, :PROMPTS[b]] = first[b, :PROMPTS[b]]
  for j in range(L - PROMPTS.min()):
    t = np.minimum(PROMPTS + j, L - 1)  # elements already at the end repeat their last token
    step = call(model, jnp.asarray(tokens)[np.arange(B), t][:, None], None)[:, 0]
    for b in range(B):
      if PROMPTS[b] + j < L:
        got[b, PROMPTS[b] + j] = step[b]
  return got


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_nnx_decoding_equals_full_causal_pass(layout):
  x = jax.random.normal(jax.random.key(0), (B, L, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=2, layout=layout, rngs=nnx.Rngs(0))
  full = _columns(layout, m(_columns(layout, x), is_causal=True))  # [B, L, F]
  m.init_cache(B, MAX)
  got = _decode(lambda inp, lengths: m(inp, is_causal=True, decode=True, lengths=lengths),
                layout, x)
  np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(m.cache_index[...], PROMPTS + L - PROMPTS.min())


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_linen_decoding_equals_full_causal_pass(layout):
  x = jax.random.normal(jax.random.key(0), (B, L, F), jnp.float32)
  m = jattn.linen.MultiHeadAttention(4, num_kv_heads=1, layout=layout)
  blank = _columns(layout, jnp.zeros((B, MAX, F)))
  variables = m.init(jax.random.key(1), blank, is_causal=True, decode=True)
  params, cache = {"params": variables["params"]}, {"cache": variables["cache"]}
  full = _columns(layout, m.apply(params, _columns(layout, x), is_causal=True))

  def call(inp, lengths):
    nonlocal cache
    out, updated = m.apply(params | cache, inp, is_causal=True, decode=True,
                           lengths=lengths, mutable=["cache"])
    cache = updated
    return out

  np.testing.assert_allclose(_decode(call, layout, x), full, rtol=1e-5, atol=1e-5)


def test_decode_needs_causal_and_keys_of_the_same_tokens():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  m.init_cache(B, MAX)
  x = jnp.zeros((B, 1, F))
  with pytest.raises(ValueError, match="is_causal=True"):
    m(x, decode=True)
  with pytest.raises(ValueError, match="queries and keys must be the same new tokens, "
                     "got T = 1 queries and 2 keys"):
    m(x, jnp.zeros((B, 2, F)), is_causal=True, decode=True)
  with pytest.raises(ValueError, match=r"lengths: expected shape \[B\] = \(3,\), got shape \(2,\)"):
    m(x, is_causal=True, decode=True, lengths=jnp.array([1, 1]))


@pytest.mark.parametrize("position_encoding, previous_token_embedding",
                         [("learned", False), ("rope", False), ("rope", True)])
def test_transformer_decoding_equals_full_pass_and_layouts_agree(position_encoding,
                                                                 previous_token_embedding):
  from jattn.transformer import Transformer, TransformerConfig
  config = TransformerConfig(vocab_size=32, max_len=MAX, num_layers=2, features=F,
                             num_heads=4, num_kv_heads=2, mlp_features=32,
                             position_encoding=position_encoding,
                             previous_token_embedding=previous_token_embedding)
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, 32)
  model = Transformer(config, rngs=nnx.Rngs(0))
  full = model(tokens)  # [B, L, V]
  columns = Transformer(dataclasses.replace(config, layout="columns"), rngs=nnx.Rngs(0))
  np.testing.assert_allclose(columns(tokens), full, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_decode_transformer(model, tokens), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_padding_tokens_are_not_written_to_the_cache(layout):
  """API: tokens past lengths[b] are not written; the cache holds exactly the keys
  and values of the valid tokens, at positions [0, lengths[b]), zeros after."""
  m = jattn.nnx.MultiHeadAttention(2, F, layout=layout, rngs=nnx.Rngs(0))
  m.init_cache(B, MAX)
  x = jax.random.normal(jax.random.key(5), (B, 4, F))
  m(_columns(layout, x), is_causal=True, decode=True, lengths=jnp.array([2, 4, 0]))
  # the key projection of x, [B, T, K, H], written out independently of the cache code
  kernel, bias = m.key.kernel[...], m.key.bias[...]
  keys = np.einsum("btf,fkh->btkh", np.asarray(x), np.asarray(kernel)) + np.asarray(bias)
  cached = np.asarray(m.cached_key[...])
  if layout == "columns":  # [B, K, H, S] -> [B, S, K, H]
    cached = np.transpose(cached, (0, 3, 1, 2))
  for b, n in enumerate([2, 4, 0]):
    np.testing.assert_allclose(cached[b, :n], keys[b, :n], rtol=1e-5, atol=1e-5)
    assert not np.any(cached[b, n:]), (b, n)
  np.testing.assert_array_equal(m.cache_index[...], [2, 4, 0])


def test_transformer_row_that_skips_a_call_keeps_its_previous_token():
  """A decoding call with lengths[b] = 0 leaves row b's cache as it was: the token
  before its next one is still the last it was given, not the padding. Every call
  is jitted with one shape (2 tokens, lengths saying how many are real), so the
  test compiles the model twice, not once per eager op."""
  from jattn.transformer import Transformer, TransformerConfig
  config = TransformerConfig(vocab_size=32, max_len=MAX, num_layers=1, features=F,
                             num_heads=2, mlp_features=32, previous_token_embedding=True)
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 6), 1, 32))
  model = nnx.jit(lambda: Transformer(config, rngs=nnx.Rngs(0)))()
  full = nnx.jit(lambda m, tokens: m(tokens))(model, tokens)  # [2, 6, V]
  model.init_cache(2)
  step = nnx.jit(lambda m, tokens, lengths: m(tokens, decode=True, lengths=lengths))
  step(model, tokens[:, :2], jnp.array([2, 2]))
  # row 1 sits this call out: its two tokens are padding (0, never a real token here)
  step(model, np.array([tokens[0, 2:4], [0, 0]]), jnp.array([2, 0]))
  # one real token per row, then padding: the previous token is the real one
  third = step(model, np.array([[tokens[0, 4], 0], [tokens[1, 2], 0]]), jnp.array([1, 1]))
  fourth = step(model, np.array([[tokens[0, 5], 0], [tokens[1, 3], 0]]), jnp.array([1, 1]))
  np.testing.assert_allclose(third[:, 0], np.stack([full[0, 4], full[1, 2]]), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(fourth[:, 0], np.stack([full[0, 5], full[1, 3]]), rtol=1e-5,
                             atol=1e-5)


def test_gemma2_style_config_decodes_as_its_full_pass():
  """configs/mqar_gemma2_style.py, shrunk: alternating local and global layers, capped
  logits and sinks. Its full pass equals the plain float64 model (which reads the
  windows, cap and sinks from the config itself), and KV-cache decoding equals the full
  pass, so a window measured from the wrong cache position fails."""
  import sys
  import types
  sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
  import training  # noqa: E402
  from configs import mqar_gemma2_style
  from jattn.rope import DEFAULT_BASE
  from jattn.transformer import Transformer
  from tests.test_transformer_reference import B as RB, T as RT, reference_logits

  config = mqar_gemma2_style.get_config()
  assert any(w is None for w in config.attention_pattern)  # global layers
  assert any(w is not None for w in config.attention_pattern)  # and local ones
  # small sizes; a window of 2 keys back (shorter than the sequence, so it cuts) and
  # a cap of 1 (so it bends the logits of this small model)
  config.attention_pattern = tuple(None if w is None else 2 for w in config.attention_pattern)
  config.logit_soft_cap = 1.0
  config.vocab_size, config.seq_len, config.features, config.mlp_features = 32, MAX, F, 32
  config.num_heads, config.num_kv_heads = 4, 2
  model = Transformer(training.model_config(config), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)
  for block in model.blocks:  # non-zero sinks, so that they count
    block.attention.sinks[...] = jnp.asarray(rng.standard_normal(4), jnp.float32)

  spec = types.SimpleNamespace(**config.to_dict(), rope_base=DEFAULT_BASE)
  tokens = rng.integers(0, 32, (RB, RT)).astype(np.int32)
  forward = nnx.jit(lambda m, t: m(t))  # compiled: eager dispatch of the mods is slow
  np.testing.assert_allclose(forward(model, jnp.asarray(tokens)),
                             reference_logits(model, spec, tokens, [RT] * RB),
                             rtol=2e-4, atol=2e-4)

  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, 32)
  full = forward(model, tokens)  # [B, L, V]
  decode = nnx.jit(lambda m, t, lengths: m(t, decode=True, lengths=lengths))
  np.testing.assert_allclose(_decode_transformer(model, tokens, decode), full,
                             rtol=1e-5, atol=1e-5)
