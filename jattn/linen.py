"""jattn.linen.MultiHeadAttention: a flax.linen shell around jattn.dot_product_attention.

Its parameter tree equals that of flax.linen.MultiHeadDotProductAttention
({query, key, value}: kernel [F, N, H], bias [N, H]; out: kernel [N, H, F],
bias [F]; query_ln/key_ln scale [H] with normalize_qk; with num_kv_heads the
key/value kernels are [F, K, H]), so params from one apply to the other. It
takes every attribute and call argument of flax's, with flax's meaning.
Inputs are [B, T, F] (rows) or [B, F, T] (columns).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

from jattn._src.nn import heads as _heads
from jattn._src.nn import kv_cache as _kv_cache
from jattn._src.dispatch import explain_calls
from jattn._src.nn.attend_step import attend
from jattn._src.nn.precision import matmul_precision


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

  flax.linen.MultiHeadDotProductAttention's attributes, with its meaning:
  num_heads, dtype, param_dtype, qkv_features, out_features, dropout_rate,
  deterministic, broadcast_dropout (jattn's default False draws every batch
  element and head independently; flax's True shares one draw), precision
  (every matmul of the call), kernel_init, out_kernel_init, bias_init,
  out_bias_init, use_bias, attention_fn (None: jattn.dot_product_attention;
  else called as flax calls it; rows only), decode (flax's protocol: `init`
  with full-length inputs makes the `cache` collection, each later call
  appends its tokens, one position for the batch), normalize_qk,
  force_fp32_for_softmax (jattn's softmax is always float32). The deprecated
  dot_general / einsum hooks raise a ValueError when given.

  jattn's own: num_kv_heads, layout, implementation, sow_max_logits (default
  for the call's: sow each head's largest visible logit, float32 [N], max over
  batch and query rows, into 'intermediates' as 'max_logits': what Muon's
  QK-clip reads; see `dot_product_attention(return_max_logits=)`);
  decode=True in the call
  (a cache position per batch element, `lengths`, is_causal=True). The
  features F are read from inputs_q. Dropout draws from the `dropout` rng
  collection unless the call gives `dropout_rng`.

  Raises:
    ValueError: as `jattn.nnx.MultiHeadAttention`.

  Examples:
    >>> import jax, jattn
    >>> mha = jattn.linen.MultiHeadAttention(num_heads=4, qkv_features=32)
    >>> x = jax.numpy.ones((2, 16, 32))                            # [B, T, F]
    >>> params = mha.init(jax.random.key(0), x)
    >>> mha.apply(params, x).shape
    (2, 16, 32)
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
  broadcast_dropout: bool = False
  precision: Any = None
  out_kernel_init: Callable | None = None
  out_bias_init: Callable | None = None
  attention_fn: Callable | None = None
  decode: bool = False
  normalize_qk: bool = False
  force_fp32_for_softmax: bool = False
  qkv_dot_general: Any = None
  out_dot_general: Any = None
  qkv_dot_general_cls: Any = None
  out_dot_general_cls: Any = None
  qk_attn_weights_einsum_cls: Any = None
  attn_weights_value_einsum_cls: Any = None
  use_sinks: bool = False  # a learned `sinks` [N] parameter (zeros at init)
  sow_max_logits: bool = False  # sow each head's largest visible logit [N]

  def explain(self, *args, **kwargs) -> list:
    """`jattn.explain` for this module's configuration, as a method for `apply`:
    `layer.apply(variables, x, method="explain")` runs the call and returns the
    `jattn.Explanation` of its attention call(s).

    Examples:
      >>> import jax, jattn.linen
      >>> layer = jattn.linen.MultiHeadAttention(num_heads=2, qkv_features=16)
      >>> x = jax.numpy.ones((1, 256, 16))
      >>> [report] = layer.apply(layer.init(jax.random.key(0), x), x, is_causal=True,
      ...                        method="explain")
      >>> report.implementation("tpu")
      'splash'
    """
    with explain_calls() as reports:
      self(*args, **kwargs)
    return reports

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None,
               mask=None, is_causal: bool = False, deterministic=None, dropout_rng=None,
               sow_weights: bool = False, decode: bool = False, lengths=None,
               mask_mod=None, score_mod=None, sow_max_logits=None):
    """inputs_k/inputs_v/inputs_kv as flax's (keys and values default to
    inputs_q; each projected by a kernel sized from its own features; with
    decode, the new tokens' keys and values come from them); mask bool or numeric,
    nonzero = may attend, broadcastable to [B, N, T, S]; dropout_rng overrides the
    `dropout` collection; sow_weights sows the weights [B, N, T, S] into
    'intermediates'; sow_max_logits (default the attribute's) sows each head's
    largest visible logit [N] there as 'max_logits'. lengths: int [B], keys past
    lengths[b] are padding. mask_mod / score_mod: as `dot_product_attention`'s; when
    decoding they see each query's position in the cache. On Explicit mesh axes the
    output is sharded as inputs_q, its feature axis whole."""
    self._check_attributes()
    layout = _heads.check_layout(self.layout)
    # any number of batch axes, as flax: merged into one here, split on the way out
    batch = jnp.shape(inputs_q)[:-2]
    inputs_q, inputs_k, inputs_v, inputs_kv = (
        _heads.merge_batch(x, batch) for x in (inputs_q, inputs_k, inputs_v, inputs_kv))
    mask = _heads.merge_mask_batch(mask, batch)
    if lengths is not None and len(batch) != 1:
      lengths = jnp.reshape(lengths, (-1,))
    if inputs_kv is None and inputs_v is not None and _square(inputs_v):
      warnings.warn(f"You are passing an array of shape {jnp.shape(inputs_v)} to the "
                    f"`inputs_v` arg, when you may have intended to pass it to the `mask` "
                    f"arg: as in flax since 0.7.4, the function signature of "
                    f"MultiHeadDotProductAttention's `__call__` method has changed to "
                    f"__call__(inputs_q, inputs_k=None, inputs_v=None, *, mask=None, ...). "
                    f"Use the keyword `mask`.", DeprecationWarning, stacklevel=2)
    inputs_k, inputs_v, self_attention = _heads.key_value_inputs(
        inputs_q, inputs_k, inputs_v, inputs_kv)
    # F of an input of rank >= 2 (its rank is checked after its kernel, as flax's order)
    features = lambda name, x: jnp.shape(x if jnp.ndim(x) >= 2 else _heads.check_rank(
        name, x, layout))[_heads.feature_axis(layout)]
    F = features("inputs_q", _heads.check_rank("inputs_q", inputs_q, layout))
    inputs_q = _heads.check_inputs("inputs_q", inputs_q, F, layout)
    qkv = self.qkv_features or F
    out_features = self.out_features or F
    kv_heads = self.num_kv_heads or self.num_heads
    H = _heads.check_heads(self.num_heads, qkv, kv_heads)
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
    mask = _heads.float_mask(mask)
    proj = dict(use_bias=self.use_bias, param_dtype=self.param_dtype,
                kernel_init=self.kernel_init, bias_init=self.bias_init)
    N, K = self.num_heads, kv_heads
    # Each kernel sized by its own input's features, as flax's: keys and values may
    # differ, and one that does not fit a kernel already made raises flax's
    # ScopeParamShapeError here, before any other check of that input.
    query_params = _Projection((F,), (N, H), name="query", **proj)()
    key_params = _Projection((features("inputs_k", inputs_k),), (K, H), name="key", **proj)()
    value_params = _Projection((features("inputs_v", inputs_v),), (K, H), name="value",
                               **proj)()
    if not self_attention:
      inputs_k = _heads.check_inputs("inputs_k", inputs_k, key_params[0].shape[0], layout)
      inputs_v = _heads.check_inputs("inputs_v", inputs_v, value_params[0].shape[0], layout)
    heads = dict(layout=layout, dtype=self.dtype)
    with matmul_precision(self.precision):
      # [B, T, N, H] (rows) or [B, N, H, T] (columns); key/value with S and K
      query = _heads.project_in(inputs_q, *query_params, **heads)
      key = _heads.project_in(inputs_k, *key_params, **heads)
      value = _heads.project_in(inputs_v, *value_params, **heads)
      if self.normalize_qk:  # over each head's H axis
        axis = -1 if layout == "rows" else -2
        norm = lambda name: nn.LayerNorm(name=name, use_bias=False, dtype=self.dtype,
                                         param_dtype=self.param_dtype,
                                         reduction_axes=axis, feature_axes=axis)
        query, key = norm("query_ln")(query), norm("key_ln")(key)
      out_proj = _Projection(
          (N, H), (out_features,), name="out", use_bias=self.use_bias,
          param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
          bias_init=self.out_bias_init or self.bias_init)

      sinks = (self.param("sinks", nn.initializers.zeros_init(), (N,), self.param_dtype)
               if self.use_sinks else None)
      kv_lengths = lengths
      if decode or self.decode:
        key, value, mask, is_causal, kv_lengths, start = self._decode(
            key, value, mask, is_causal, lengths, query.shape[_heads.heads_token_axis(layout)],
            per_row=decode)
        mask_mod, score_mod = _kv_cache.mods_from_positions(start, mask_mod, score_mod)
      if self.dropout_rate > 0.0:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if not deterministic and dropout_rng is None:
          dropout_rng = self.make_rng("dropout")
        if deterministic:
          dropout_rng = None
      else:
        dropout_rng = None
      user_fn = None if self.attention_fn is None else (
          lambda q, k, v, mask, is_causal: self._flax_attention(q, k, v, mask, dropout_rng,
                                                                sow_weights))
      out = attend(
          query, key, value, layout=layout, mask=mask, is_causal=is_causal,
          kv_lengths=kv_lengths, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks,
          dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
          broadcast_dropout=self.broadcast_dropout, implementation=self.implementation,
          sow_weights=sow_weights, attention_fn=user_fn,
          sow_max_logits=self.sow_max_logits if sow_max_logits is None else sow_max_logits,
          sow=lambda name, x: self.sow("intermediates", name, x))
      # on Explicit axes the projection contracts the sharded heads: the output is laid
      # out as inputs_q (as jattn.nnx's default; flax's linen module has no out_sharding)
      out = _heads.project_out(out, *out_proj(), **heads,
                               out_sharding=_heads.default_out_sharding(inputs_q, layout))
    return _heads.split_batch(out, batch)

  def _check_attributes(self):
    _heads.check_deprecated(
        qkv_dot_general=self.qkv_dot_general, out_dot_general=self.out_dot_general,
        qkv_dot_general_cls=self.qkv_dot_general_cls,
        out_dot_general_cls=self.out_dot_general_cls,
        qk_attn_weights_einsum_cls=self.qk_attn_weights_einsum_cls,
        attn_weights_value_einsum_cls=self.attn_weights_value_einsum_cls)
    if not isinstance(self.force_fp32_for_softmax, bool):
      raise TypeError(f"force_fp32_for_softmax must be a bool, got "
                      f"{self.force_fp32_for_softmax!r}")
    if self.attention_fn is not None and self.layout != "rows":
      raise ValueError("attention_fn: flax's attention functions take [B, T, N, H], so "
                       f"they need layout='rows', got layout={self.layout!r}")

  def _flax_attention(self, query, key, value, mask, dropout_rng, sow_weights):
    """The user's attention_fn, called as flax.linen calls it: only the keywords
    its signature names."""
    kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                  broadcast_dropout=self.broadcast_dropout,
                  deterministic=dropout_rng is None, dtype=self.dtype,
                  precision=self.precision,
                  force_fp32_for_softmax=self.force_fp32_for_softmax)
    named = inspect.signature(self.attention_fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in named}
    if sow_weights:
      kwargs["module"] = self
    return self.attention_fn(query, key, value, **kwargs)

  def _decode(self, key, value, mask, is_causal, lengths, T, *, per_row):
    """key/value: the T new tokens' (from inputs_q, or inputs_k / inputs_v as flax),
    written to the cache. per_row: jattn's protocol (decode=True in the call): a
    position per batch element. Otherwise flax's (the decode attribute): one scalar
    position."""
    axis = _heads.heads_token_axis(self.layout)
    _kv_cache.check_call(is_causal, T=T, new_keys=key.shape[axis], per_row=per_row,
                         lengths=lengths)
    initialized = self.has_variable("cache", "cached_key")
    if initialized:
      _kv_cache.check_batch(key.shape[0], self.get_variable("cache", "cached_key").shape)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable(
        "cache", "cache_index", jnp.zeros, (key.shape[0],) if per_row else (), jnp.int32)
    # [B]: the position of each row's first query (flax's cache keeps one for all)
    start = jnp.broadcast_to(cache_index.value, (key.shape[0],))
    if not initialized:  # init: the inputs set the cache's shape; attend as a full pass
      return key, value, mask, is_causal, lengths, start
    k, v, index, decode_mask = _kv_cache.step(
        cached_key.value, cached_value.value, cache_index.value, key, value,
        _kv_cache.check_lengths(lengths, key.shape[0], T), token_axis=axis)
    cached_key.value, cached_value.value, cache_index.value = k, v, index
    mask = decode_mask if mask is None else jnp.logical_and(mask, decode_mask)
    return k, v, mask, False, None, start


def _square(x) -> bool:
  """flax's sign of a mask passed positionally as inputs_v: its last two axes equal."""
  shape = jnp.shape(x)
  return len(shape) >= 2 and shape[-1] == shape[-2]


class MultiHeadDotProductAttention(MultiHeadAttention):
  """flax.linen's name for the same module, so that a parent's auto-named
  submodule ("MultiHeadDotProductAttention_0") keeps flax's parameter path.

  Arguments, shapes and errors are those of `jattn.linen.MultiHeadAttention`.

  Examples:
    >>> import jax, jax.numpy as jnp, jattn.linen
    >>> layer = jattn.linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    >>> x = jnp.ones((1, 8, 16))                                        # [B, T, F]
    >>> params = layer.init(jax.random.key(0), x)
    >>> layer.apply(params, x).shape
    (1, 8, 16)
  """
