"""jattn.nnx.MultiHeadAttention: a flax.nnx shell around jattn.dot_product_attention.

Its parameters have the names and shapes of flax.nnx.MultiHeadAttention
(query/key/value kernel [F, N, H] (key/value [F, K, H]) and bias [N, H];
out kernel [N, H, F] and bias [F]), so weights move between the two unchanged.
Inputs are [B, T, F] (layout="rows") or [B, F, T] (layout="columns").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import _heads, _kv_cache
from jattn._dot_product_attention import dot_product_attention

default_kernel_init = nnx.initializers.lecun_normal()


class _Projection(nnx.Module):
  """kernel [*in_shape, *out_shape] and bias [*out_shape], as nnx.LinearGeneral's."""

  def __init__(self, in_shape, out_shape, *, use_bias, param_dtype, kernel_init,
               bias_init, rngs: nnx.Rngs):
    # initialised flat [prod(in), prod(out)], as LinearGeneral does, for the same fan-in
    flat = (math.prod(in_shape), math.prod(out_shape))
    kernel = kernel_init(rngs.params(), flat, param_dtype).reshape(in_shape + out_shape)
    self.kernel = nnx.Param(kernel)
    self.bias = (nnx.Param(bias_init(rngs.params(), out_shape, param_dtype))
                 if use_bias else nnx.data(None))

  def arrays(self):
    return self.kernel[...], (None if self.bias is None else self.bias[...])


class MultiHeadAttention(nnx.Module):
  """Multi-head (and grouped-query) attention with optional KV-cache decoding.

  Args:
    num_heads: query heads N.
    in_features: input features F.
    qkv_features: N * H (default in_features); must be divisible by num_heads.
    out_features: output features (default in_features).
    num_kv_heads: key/value heads K (default N); N % K == 0.
    dropout_rate: dropout on the attention weights, drawn independently for
      every batch element and head from the module's `dropout` rng stream.
    layout: "rows" (inputs [B, T, F]) or "columns" (inputs [B, F, T]).
    implementation: passed to jattn.dot_product_attention.
    deterministic: default for the call's `deterministic` (no dropout).
    use_sinks: a learned attention sink per query head, the parameter
      `sinks` [N] (zeros at init); see `dot_product_attention(sinks=)`.
  """

  def __init__(self, num_heads: int, in_features: int, *, qkv_features=None,
               out_features=None, num_kv_heads=None, dropout_rate: float = 0.0,
               layout: str = "rows", implementation=None, use_bias: bool = True,
               dtype=None, param_dtype=jnp.float32, deterministic=None,
               kernel_init=default_kernel_init,
               bias_init=nnx.initializers.zeros_init(), use_sinks: bool = False,
               rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = in_features if qkv_features is None else qkv_features
    self.out_features = in_features if out_features is None else out_features
    self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    self.head_dim = _heads.check_heads(num_heads, self.qkv_features, self.num_kv_heads)
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    self.dropout_rate = dropout_rate
    self.layout = _heads.check_layout(layout)
    self.implementation = implementation
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.deterministic = deterministic

    N, K, H, F = num_heads, self.num_kv_heads, self.head_dim, in_features
    proj = dict(use_bias=use_bias, param_dtype=param_dtype, kernel_init=kernel_init,
                bias_init=bias_init, rngs=rngs)
    self.query = _Projection((F,), (N, H), **proj)
    self.key = _Projection((F,), (K, H), **proj)
    self.value = _Projection((F,), (K, H), **proj)
    self.out = _Projection((N, H), (self.out_features,), **proj)
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else nnx.data(None)
    self.sinks = nnx.Param(jnp.zeros((N,), param_dtype)) if use_sinks else nnx.data(None)

    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_index = nnx.data(None)

  def init_cache(self, batch_size: int, max_length: int, dtype=None) -> None:
    """Empty caches for `decode=True`: keys/values [B, S, K, H] (rows) or
    [B, K, H, S] (columns) with S = max_length, and a position per batch element."""
    B, S, K, H = batch_size, max_length, self.num_kv_heads, self.head_dim
    shape = (B, S, K, H) if self.layout == "rows" else (B, K, H, S)
    dtype = dtype or self.dtype or self.param_dtype
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.zeros((B,), jnp.int32))

  def __call__(self, inputs_q, inputs_kv=None, *, mask=None, is_causal: bool = False,
               deterministic=None, decode: bool = False, lengths=None,
               sow_weights: bool = False, mask_mod=None, score_mod=None):
    """inputs [B, T, F] (rows) or [B, F, T] (columns) -> the same with out_features.

    mask: bool, broadcastable to [B, N, T, S]. lengths: int [B], tokens past
    lengths[b] are padding (their keys are masked out and, with decode=True,
    they are not written to the cache). decode=True: self-attention over the
    cache (call `init_cache` first): a prompt of any length, then one token at a
    time; each batch element continues from its own position. Decoding is
    causal, so it needs is_causal=True. sow_weights=True stores the attention
    weights [B, N, T, S] as nnx.Intermediate 'attention_weights' (as flax's;
    read them with nnx.capture). mask_mod / score_mod: as
    `dot_product_attention`'s; with decode=True they see each query's
    position in the cache.
    """
    layout = self.layout
    inputs_q = _heads.check_inputs("inputs_q", inputs_q, self.in_features, layout)
    self_attention = inputs_kv is None
    if self_attention:
      inputs_kv = inputs_q
    else:
      inputs_kv = _heads.check_inputs("inputs_kv", inputs_kv, self.in_features, layout)
    proj = dict(layout=layout, dtype=self.dtype)
    query = _heads.project_in(inputs_q, *self.query.arrays(), **proj)  # [B, T, N, H] | [B, N, H, T]
    key = _heads.project_in(inputs_kv, *self.key.arrays(), **proj)  # [B, S, K, H] | [B, K, H, S]
    value = _heads.project_in(inputs_kv, *self.value.arrays(), **proj)
    B, T = inputs_q.shape[0], inputs_q.shape[_heads.token_axis(layout)]
    S = inputs_kv.shape[_heads.token_axis(layout)]
    start = (self.cache_index[...] if decode and self.cache_index is not None
             else jnp.zeros((B,), jnp.int32))  # [B]: position of each row's first token
    query, key = self.encode_positions(query, key, start[:, None] + jnp.arange(T),
                                       start[:, None] + jnp.arange(S))
    kv_lengths = lengths
    if decode:
      key, value, mask = self._decode(self_attention, key, value, mask,
                                      is_causal, _kv_cache.check_lengths(lengths, B, T))
      is_causal, kv_lengths = False, None
      mask_mod, score_mod = _kv_cache.mods_from_positions(start, mask_mod, score_mod)
    dropout_rng = self._dropout_rng(deterministic)
    out = dot_product_attention(
        query, key, value, mask=mask, is_causal=is_causal,
        key_value_seq_lengths=kv_lengths, layout=_heads.HEADS_LAYOUT[layout],
        implementation=self.implementation,
        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng, return_weights=sow_weights, mask_mod=mask_mod,
        score_mod=score_mod, sinks=None if self.sinks is None else self.sinks[...])
    if sow_weights:
      out, weights = out
      self.sow(nnx.Intermediate, "attention_weights", weights)
    return _heads.project_out(out, *self.out.arrays(), **proj)

  def encode_positions(self, query, key, query_positions, key_positions):
    """A hook for subclasses (e.g. rotary embeddings): the per-head query
    [B, T, N, H] | [B, N, H, T] and key [B, S, K, H] | [B, K, H, S] with their
    positions int [B, T] and [B, S] (with decode=True, each row continues from
    its cache position) -> (query, key). Here the identity, as in flax."""
    del query_positions, key_positions
    return query, key

  def _decode(self, self_attention, key, value, mask, is_causal, lengths):
    if self.cache_index is None:
      raise ValueError("decode=True needs a cache: call init_cache(batch_size, "
                       "max_length) first")
    _kv_cache.check_call(self_attention, is_causal)
    axis = _heads.heads_token_axis(self.layout)
    if key.shape[0] != self.cached_key.shape[0]:
      raise ValueError(f"decode: inputs batch B = {key.shape[0]} does not match the "
                       f"cache, shape {self.cached_key.shape}")
    k, v, index, decode_mask = _kv_cache.step(
        self.cached_key[...], self.cached_value[...], self.cache_index[...],
        key, value, lengths, token_axis=axis)
    self.cached_key[...] = k
    self.cached_value[...] = v
    self.cache_index[...] = index
    mask = decode_mask if mask is None else jnp.logical_and(mask, decode_mask)
    return k, v, mask

  def _dropout_rng(self, deterministic) -> jax.Array | None:
    if self.dropout_rate == 0.0:
      return None
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError("dropout_rate > 0 needs `deterministic` (True: no dropout), "
                       "given to the call or the constructor")
    return None if deterministic else self.rngs()
