"""The Transformer's forward pass against a plain NumPy float64 model written here,
reading the same weights: every option (learned or rotary positions, the
previous-token embedding, grouped-query heads, rows or columns, lengths, the
implementation), so a wrong token, position or head fails a comparison with an
independent computation, not with the model itself. Letters: B T S N K G H D F E V.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jattn.transformer import Transformer, TransformerConfig

B, T, V, F, E = 2, 9, 11, 16, 24


def _a(x):
  return np.asarray(x[...], np.float64)


def _layer_norm(x, norm, eps=1e-6):
  """Over the last axis (flax's default epsilon)."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * _a(norm.scale) + _a(norm.bias)


def _gelu(x):  # jax.nn.gelu's default, the tanh approximation
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rope(x, base):
  """x [B, T, heads, H]: rotate the pairs (i, i + H/2) of token t by t * base^(-2i/H)."""
  H = x.shape[-1]
  angle = np.arange(x.shape[1])[:, None] * base ** (-2 * np.arange(H // 2) / H)  # [T, H/2]
  cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
  x1, x2 = x[..., :H // 2], x[..., H // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(x, attn, config, lengths, window=None, weights=None):
  """Causal multi-head attention of x [B, T, F] with K kv heads, loops over heads;
  window w: keys t - w <= s <= t only; logits capped at cap * tanh(logit / cap);
  sinks: p = exp(l) / (exp(sink[n]) + sum_s exp(l)). Appends p [B, N, T, S] to
  `weights` if given."""
  q = np.einsum("btf,fnh->btnh", x, _a(attn.query.kernel)) + _a(attn.query.bias)
  k = np.einsum("btf,fkh->btkh", x, _a(attn.key.kernel)) + _a(attn.key.bias)
  v = np.einsum("btf,fkh->btkh", x, _a(attn.value.kernel)) + _a(attn.value.bias)
  if config.position_encoding == "rope":
    q, k = _rope(q, config.rope_base), _rope(k, config.rope_base)
  N, K, H = q.shape[2], k.shape[2], q.shape[3]
  out, probabilities = np.zeros(q.shape), np.zeros((B, N, T, T))
  for b in range(B):
    for n in range(N):
      kv = n // (N // K)  # the kv head shared by this query head
      logits = q[b, :, n] @ k[b, :, kv].T / np.sqrt(H)  # [T, S]
      if config.logit_soft_cap is not None:
        logits = config.logit_soft_cap * np.tanh(logits / config.logit_soft_cap)
      allowed = np.tril(np.ones((T, T), bool)) & (np.arange(T) < lengths[b])[None, :]
      if window is not None:
        allowed &= np.arange(T)[None, :] >= np.arange(T)[:, None] - window
      sink = _a(attn.sinks)[n] if config.sinks else -np.inf
      logits = np.where(allowed, logits, -np.inf)
      m = np.maximum(logits.max(-1, keepdims=True), sink)
      m = np.where(np.isfinite(m), m, 0)
      w = np.where(allowed, np.exp(logits - m), 0)
      w = w / np.maximum(w.sum(-1, keepdims=True) + np.exp(sink - m), 1e-300)
      out[b, :, n], probabilities[b, n] = w @ v[b, :, kv], w
  if weights is not None:
    weights.append(probabilities)
  return np.einsum("btnh,nhf->btf", out, _a(attn.out.kernel)) + _a(attn.out.bias)


def reference_logits(model, config, tokens, lengths, weights=None, hidden=False):
  """The model's logits [B, T, V], written out in float64 from its weights (with
  hidden=True the normalised last residual stream [B, T, F] instead); each layer's
  attention weights appended to `weights` if given."""
  tokens = np.asarray(tokens)
  x = _a(model.token_embed.embedding)[tokens]  # [B, T, F]
  if config.previous_token_embedding:
    previous = _a(model.previous_embed.embedding)[np.roll(tokens, 1, axis=1)]
    previous[:, 0] = 0.0  # the first token has no predecessor
    x = x + previous
  if config.position_encoding == "learned":
    x = x + _a(model.position_embed)[:T][None]
  pattern = config.attention_pattern
  for i, block in enumerate(model.blocks):
    window = pattern[i % len(pattern)] if pattern else None
    x = x + _attention(_layer_norm(x, block.attention_norm), block.attention, config,
                       lengths, window, weights)
    h = _layer_norm(x, block.mlp_norm)
    h = _gelu(h @ _a(block.mlp.w_in) + _a(block.mlp.b_in))
    x = x + h @ _a(block.mlp.w_out) + _a(block.mlp.b_out)
  x = _layer_norm(x, model.final_norm)
  return x if hidden else x @ _a(model.head)


CONFIGS = {
    "learned_rows": dict(),
    "rope_columns_gqa_previous": dict(position_encoding="rope", layout="columns",
                                      num_kv_heads=2, previous_token_embedding=True),
    "learned_previous_mqa_blockwise": dict(num_kv_heads=1, previous_token_embedding=True,
                                           implementation="blockwise"),
    # no positions at all (NoPE) but a window of 1 key back in layer 0; embeddings std 1
    "none_rows_window": dict(position_encoding="none", attention_pattern=(1, None),
                             embed_init_std=1.0),
    # layer 0 a window of 2 keys back, layer 1 global; capped logits; sinks
    "rope_rows_gqa_window_softcap_sinks": dict(
        position_encoding="rope", num_kv_heads=2, rope_base=100.0,
        attention_pattern=(2, None), logit_soft_cap=1.5, sinks=True),
}


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_plain_float64_model(name, with_lengths):
  config = TransformerConfig(vocab_size=V, max_len=T + 3, num_layers=2, features=F,
                             num_heads=4, mlp_features=E, **CONFIGS[name])
  model = Transformer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  for block in model.blocks:  # non-zero biases, norms and sinks, so each one is read
    params = [block.attention.query.bias, block.attention.value.bias,
              block.attention.out.bias, block.attention_norm.bias, block.mlp.b_in,
              block.mlp.b_out]
    for param in params + ([block.attention.sinks] if config.sinks else []):
      param[...] = 0.1 * jnp.asarray(rng.standard_normal(param.shape), param[...].dtype)
    block.mlp_norm.scale[...] = block.mlp_norm.scale[...] * 1.5
  model.final_norm.bias[...] = 0.1 * jnp.asarray(rng.standard_normal(F), jnp.float32)
  tokens = np.random.default_rng(2).integers(0, V, (B, T)).astype(np.int32)
  lengths = np.array([T, 5] if with_lengths else [T, T], np.int32)
  got = model(jnp.asarray(tokens), lengths=jnp.asarray(lengths) if with_lengths else None)
  np.testing.assert_allclose(got, reference_logits(model, config, tokens, lengths),
                             rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_sown_weights_and_taken_positions_match_the_plain_model(layout):
  """sow_weights=True stores each layer's weights [B, N, T, S]; take(hidden, positions)
  picks the rows [B, P, F] (columns [B, F, P]) the training example's loss reads."""
  config = TransformerConfig(vocab_size=V, max_len=T, num_layers=2, features=F, num_heads=2,
                             mlp_features=E, layout=layout)
  model = Transformer(config, rngs=nnx.Rngs(3))
  tokens = np.random.default_rng(4).integers(0, V, (B, T)).astype(np.int32)
  weights = []
  hidden = reference_logits(model, config, tokens, [T, T], weights, hidden=True)
  forward = nnx.capture(lambda m, t: m.hidden(t, sow_weights=True), nnx.Intermediate)
  got_hidden, sown = forward(model, jnp.asarray(tokens))
  for block, want in zip(nnx.to_pure_dict(sown)["blocks"].values(), weights, strict=True):
    np.testing.assert_allclose(block["attention"]["attention_weights"][0], want,
                               rtol=2e-4, atol=2e-5)
  positions = np.array([[0, 4, 8], [7, 7, 2]], np.int32)  # [B, P]
  want = np.stack([hidden[b, positions[b]] for b in range(B)])  # [B, P, F]
  got = model.take(got_hidden, jnp.asarray(positions))
  np.testing.assert_allclose(got if layout == "rows" else np.swapaxes(got, 1, 2), want,
                             rtol=2e-4, atol=2e-4)


@pytest.mark.thorough  # ~10 s (dropout's compilation); tools/mutation/run.py runs it
def test_deterministic_call_drops_nothing():
  """dropout_rate > 0: deterministic=True gives the plain model's logits, False does not."""
  config = TransformerConfig(vocab_size=V, max_len=T, num_layers=1, features=F, num_heads=2,
                             mlp_features=E, dropout_rate=0.5)
  model = Transformer(config, rngs=nnx.Rngs(5))
  tokens = np.random.default_rng(6).integers(0, V, (B, T)).astype(np.int32)
  got = model(jnp.asarray(tokens), deterministic=True)
  np.testing.assert_allclose(got, reference_logits(model, config, tokens, [T, T]),
                             rtol=2e-4, atol=2e-4)
  assert not np.allclose(model(jnp.asarray(tokens), deterministic=False), got, atol=1e-3)
