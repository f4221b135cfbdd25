"""jattn.linen.MultiHeadAttention: a flax.linen shell around jattn.dot_product_attention.

Its parameter tree equals that of flax.linen.MultiHeadDotProductAttention
({query, key, value}: kernel [F, N, H], bias [N, H]; out: kernel [N, H, F],
bias [F]; with num_kv_heads the key/value kernels are [F, K, H]), so params
from one apply to the other. Inputs are [B, T, F] (rows) or [B, F, T] (columns).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

from jattn import _heads, _kv_cache
from jattn._dot_product_attention import dot_product_attention


class _Projection(nn.Module):
  """kernel [*in_shape, *out_shape] and bias [*out_shape], as nn.DenseGeneral's."""

  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  use_bias: bool
  param_dtype: Any
  kernel_init: Callable
  bias_init: Callable

  def setup(self):
    def init_kernel(rng):
      flat = (math.prod(self.in_shape), math.prod(self.out_shape))
      return self.kernel_init(rng, flat, self.param_dtype).reshape(
          self.in_shape + self.out_shape)
    self.kernel = self.param("kernel", init_kernel)
    self.bias = (self.param("bias", self.bias_init, self.out_shape, self.param_dtype)
                 if self.use_bias else None)

  def __call__(self):
    return self.kernel, self.bias


class MultiHeadAttention(nn.Module):
  """Multi-head (and grouped-query) attention; see jattn.nnx.MultiHeadAttention.

  The features F are read from inputs_q. Dropout draws from the `dropout` rng
  collection, independently for every batch element and head. decode=True
  keeps the KV cache in the `cache` collection: its size is set by the inputs
  of `init` ([B, max_length, F] or [B, F, max_length]).
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  dropout_rate: float = 0.0
  layout: str = "rows"
  implementation: str | None = None
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  deterministic: bool | None = None
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  use_sinks: bool = False  # a learned `sinks` [N] parameter (zeros at init)

  @nn.compact
  def __call__(self, inputs_q, inputs_kv=None, *, mask=None, is_causal: bool = False,
               deterministic=None, decode: bool = False, lengths=None, mask_mod=None,
               score_mod=None):
    layout = _heads.check_layout(self.layout)
    F = jnp.shape(inputs_q)[_heads.feature_axis(layout)] if jnp.ndim(inputs_q) == 3 else -1
    inputs_q = _heads.check_inputs("inputs_q", inputs_q, F, layout)
    self_attention = inputs_kv is None
    inputs_kv = inputs_q if self_attention else _heads.check_inputs(
        "inputs_kv", inputs_kv, F, layout)
    qkv = self.qkv_features or F
    out_features = self.out_features or F
    kv_heads = self.num_kv_heads or self.num_heads
    H = _heads.check_heads(self.num_heads, qkv, kv_heads)
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
    proj = dict(use_bias=self.use_bias, param_dtype=self.param_dtype,
                kernel_init=self.kernel_init, bias_init=self.bias_init)
    N, K = self.num_heads, kv_heads
    heads = dict(layout=layout, dtype=self.dtype)
    # [B, T, N, H] (rows) or [B, N, H, T] (columns); key/value with S and K
    query = _heads.project_in(inputs_q, *_Projection((F,), (N, H), name="query", **proj)(), **heads)
    key = _heads.project_in(inputs_kv, *_Projection((F,), (K, H), name="key", **proj)(), **heads)
    value = _heads.project_in(inputs_kv, *_Projection((F,), (K, H), name="value", **proj)(), **heads)
    out_proj = _Projection((N, H), (out_features,), name="out", **proj)

    sinks = (self.param("sinks", nn.initializers.zeros_init(), (N,), self.param_dtype)
             if self.use_sinks else None)
    kv_lengths = lengths
    if decode:
      key, value, mask, is_causal, kv_lengths, start = self._decode(
          self_attention, key, value, mask, is_causal, lengths)
      mask_mod, score_mod = _kv_cache.mods_from_positions(start, mask_mod, score_mod)
    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic:
        dropout_rng = self.make_rng("dropout")
    out = dot_product_attention(
        query, key, value, mask=mask, is_causal=is_causal,
        key_value_seq_lengths=kv_lengths, layout=_heads.HEADS_LAYOUT[layout],
        implementation=self.implementation,
        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks)
    return _heads.project_out(out, *out_proj(), **heads)

  def _decode(self, self_attention, key, value, mask, is_causal, lengths):
    _kv_cache.check_call(self_attention, is_causal)
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", jnp.zeros, (key.shape[0],), jnp.int32)
    start = cache_index.value  # [B]: the position of each row's first query
    if not initialized:  # init: the inputs set the cache's shape; attend as a full pass
      return key, value, mask, is_causal, lengths, start
    axis = _heads.heads_token_axis(self.layout)
    T = key.shape[axis]
    k, v, index, decode_mask = _kv_cache.step(
        cached_key.value, cached_value.value, cache_index.value, key, value,
        _kv_cache.check_lengths(lengths, key.shape[0], T), token_axis=axis)
    cached_key.value, cached_value.value, cache_index.value = k, v, index
    mask = decode_mask if mask is None else jnp.logical_and(mask, decode_mask)
    return k, v, mask, False, None, start
