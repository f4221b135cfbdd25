"""jattn.nnx.MultiHeadAttention: a flax.nnx shell around jattn.dot_product_attention.

Its parameters have the names and shapes of flax.nnx.MultiHeadAttention
(query/key/value kernel [F, N, H] (key/value [F, K, H]) and bias [N, H];
out kernel [N, H, F] and bias [F]; query_ln/key_ln scale [H] with
normalize_qk), so weights move between the two unchanged. It takes every
argument of flax's, constructor and call, with flax's meaning.
Inputs are [B, T, F] (layout="rows") or [B, F, T] (layout="columns").
"""

from __future__ import annotations

import math
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jattn._src.core.explicit_axes import zeros
from jattn._src.nn import heads as _heads
from jattn._src.decode import paged_cache as _paged
from jattn._src.nn import kv_cache as _kv_cache
from jattn._src.nn import paged_step as _paged_step
from jattn._src.dispatch import explain_calls
from jattn._src.nn.attend_step import attend, check_sow_max_logits
from jattn._src.nn.precision import matmul_precision

default_kernel_init = nnx.initializers.lecun_normal()
_NO_METADATA = MappingProxyType({})


class _Projection(nnx.Module):
  """kernel [*in_shape, *out_shape] and bias [*out_shape], as nnx.LinearGeneral's."""

  def __init__(self, in_shape, out_shape, *, use_bias, param_dtype, kernel_init,
               bias_init, promote_dtype=dtypes.promote_dtype,
               kernel_metadata=_NO_METADATA, bias_metadata=_NO_METADATA, rngs: nnx.Rngs):
    # initialised flat [prod(in), prod(out)], as LinearGeneral does, for the same fan-in
    flat = (math.prod(in_shape), math.prod(out_shape))
    kernel = kernel_init(rngs.params(), flat, param_dtype).reshape(in_shape + out_shape)
    self.kernel = nnx.Param(kernel, **kernel_metadata)
    self.bias = (nnx.Param(bias_init(rngs.params(), out_shape, param_dtype), **bias_metadata)
                 if use_bias else nnx.data(None))
    self.promote_dtype = promote_dtype

  def arrays(self, x, dtype):
    """(x, kernel, bias) promoted to one dtype, as LinearGeneral does."""
    bias = None if self.bias is None else self.bias[...]
    return self.promote_dtype((x, self.kernel[...], bias), dtype=dtype)


class MultiHeadAttention(nnx.Module):
  """Multi-head (and grouped-query) attention with optional KV-cache decoding.

  flax.nnx.MultiHeadAttention's arguments, with its meaning:
    num_heads, in_features, qkv_features (default in_features), out_features
      (default in_features), num_kv_heads (default num_heads), in_kv_features
      (features of inputs_k/inputs_v, default in_features), dtype, param_dtype,
      kernel_init / bias_init and out_kernel_init / out_bias_init (the output
      projection's, default the former), use_bias, the *_metadata of the
      parameters, normalize_qk (LayerNorm of each query and key head, params
      query_ln/key_ln), qkv_promote_dtype / out_promote_dtype /
      ln_promote_dtype, keep_rngs, rngs.
    dropout_rate, deterministic, broadcast_dropout: dropout on the attention
      weights from the `dropout` rng stream. broadcast_dropout=True shares one
      draw across batch and heads, as flax's default; jattn's default (False)
      draws each batch element and head independently.
    precision: every matmul of the call (projections and attention) runs at it.
    attention_fn: None for jattn.dot_product_attention; otherwise called as
      flax calls it (query [B, T, N, H], key, value, mask=..., dropout_rng=...,
      ..., module=..., is_causal=...), e.g. flax's own or
      `jattn.flax_attention_fn`; layout="rows" only.
    decode: default for the call's `decode` (see `init_cache`).
    qkv_dot_general, out_dot_general, qkv_dot_general_cls, out_dot_general_cls
      (deprecated in flax): a ValueError when given; the projections are einsums.
  jattn's own:
    layout: "rows" (inputs [B, T, F]) or "columns" (inputs [B, F, T]).
    implementation: passed to jattn.dot_product_attention.
    use_sinks: a learned attention sink per query head, the parameter
      `sinks` [N] (zeros at init); see `dot_product_attention(sinks=)`.
    sow_max_logits: default for the call's: each call sows each head's largest
      visible logit, float32 [N] (max over batch and query rows, after scale,
      mods and masks; `dot_product_attention(return_max_logits=)`), as
      nnx.Intermediate 'max_logits': what Muon's QK-clip reads (nnx.capture, or
      nnx.pop(model, nnx.Intermediate)).

  Raises:
    ValueError: num_heads not divisible by num_kv_heads, features not divisible
      by num_heads, an unknown layout, a deprecated hook, or (in the call)
      inputs whose shapes do not fit, named with the shapes.

  Examples:
    >>> import jax, jattn
    >>> from flax import nnx
    >>> mha = jattn.nnx.MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2,
    ...                                    rngs=nnx.Rngs(0))
    >>> x = jax.numpy.ones((2, 16, 32))                            # [B, T, F]
    >>> mha(x, is_causal=True).shape                               # [B, T, F]
    (2, 16, 32)
    >>> mha.init_cache(2, 16)                                      # KV-cache decoding
    >>> mha(x[:, :3], is_causal=True, decode=True).shape           # a prompt, then tokens
    (2, 3, 32)
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features=None,
               out_features=None, num_kv_heads=None, in_kv_features=None, *,
               dtype=None, param_dtype=jnp.float32, broadcast_dropout: bool = False,
               dropout_rate: float = 0.0, deterministic=None, precision=None,
               kernel_init=default_kernel_init, out_kernel_init=None,
               bias_init=nnx.initializers.zeros_init(), out_bias_init=None,
               use_bias: bool = True, attention_fn=None, decode=None,
               normalize_qk: bool = False,
               qkv_promote_dtype=dtypes.promote_dtype,
               out_promote_dtype=dtypes.promote_dtype,
               ln_promote_dtype=dtypes.promote_dtype,
               qkv_dot_general=None, out_dot_general=None,
               qkv_dot_general_cls=None, out_dot_general_cls=None,
               rngs: nnx.Rngs, keep_rngs: bool = True,
               kernel_metadata=_NO_METADATA, out_kernel_metadata=_NO_METADATA,
               bias_metadata=_NO_METADATA, out_bias_metadata=_NO_METADATA,
               query_ln_scale_metadata=_NO_METADATA, key_ln_scale_metadata=_NO_METADATA,
               layout: str = "rows", implementation=None, use_sinks: bool = False,
               sow_max_logits: bool = False):
    _heads.check_deprecated(qkv_dot_general=qkv_dot_general,
                            out_dot_general=out_dot_general,
                            qkv_dot_general_cls=qkv_dot_general_cls,
                            out_dot_general_cls=out_dot_general_cls)
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = in_features if qkv_features is None else qkv_features
    self.out_features = in_features if out_features is None else out_features
    self.in_kv_features = in_features if in_kv_features is None else in_kv_features
    self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    self.head_dim = _heads.check_heads(num_heads, self.qkv_features, self.num_kv_heads)
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    self.dropout_rate = dropout_rate
    self.broadcast_dropout = broadcast_dropout
    self.layout = _heads.check_layout(layout)
    if attention_fn is not None and not callable(attention_fn):
      raise ValueError(f"attention_fn must be callable or None, got {attention_fn!r}")
    if attention_fn is not None and layout != "rows":
      raise ValueError("attention_fn: flax's attention functions take [B, T, N, H], so "
                       f"they need layout='rows', got layout={layout!r}")
    matmul_precision(precision)  # a bad precision fails here, not at the first call
    self.precision = precision
    self.attention_fn = attention_fn
    self.implementation = implementation
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.deterministic = deterministic
    self.decode = decode
    self.normalize_qk = normalize_qk
    check_sow_max_logits(sow_max_logits, attention_fn)
    self.sow_max_logits = sow_max_logits

    N, K, H = num_heads, self.num_kv_heads, self.head_dim
    proj = dict(use_bias=use_bias, param_dtype=param_dtype, kernel_init=kernel_init,
                bias_init=bias_init, promote_dtype=qkv_promote_dtype,
                kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, rngs=rngs)
    self.query = _Projection((in_features,), (N, H), **proj)
    self.key = _Projection((self.in_kv_features,), (K, H), **proj)
    self.value = _Projection((self.in_kv_features,), (K, H), **proj)
    if normalize_qk:  # over each head's H axis: the last in rows, [B, N, H, T] in columns
      axis = -1 if layout == "rows" else -2
      norm = lambda metadata: nnx.LayerNorm(
          H, use_bias=False, dtype=dtype, param_dtype=param_dtype,
          promote_dtype=ln_promote_dtype, reduction_axes=axis, feature_axes=axis,
          scale_metadata=metadata, rngs=rngs)
      self.query_ln = norm(query_ln_scale_metadata)
      self.key_ln = norm(key_ln_scale_metadata)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = _Projection(
        (N, H), (self.out_features,), use_bias=use_bias, param_dtype=param_dtype,
        kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
        promote_dtype=out_promote_dtype,
        kernel_metadata=out_kernel_metadata or kernel_metadata,
        bias_metadata=out_bias_metadata or bias_metadata, rngs=rngs)
    self.rngs = (rngs.dropout.fork() if keep_rngs and dropout_rate > 0
                 else nnx.data(None))
    self.sinks = nnx.Param(jnp.zeros((N,), param_dtype)) if use_sinks else nnx.data(None)

    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_index = nnx.data(None)
    self.paged_cache = nnx.data(None)

  def init_cache(self, batch_size, max_length=None, dtype=None, *, paged: bool = False,
                 page_size: int = 16, num_pages: int | None = None) -> None:
    """Empty caches for decoding, by either protocol.

    jattn's: init_cache(batch_size, max_length): a cache position per batch
      element, so prompts of different lengths decode together (call with
      is_causal=True, decode=True, lengths=...).
    flax's: init_cache(input_shape, dtype=jnp.float32) with input_shape the
      inputs' shape at full length ([B, max_length, F] for rows, [B, F,
      max_length] for columns): one position for the batch, as flax.

    Keys/values are cached as [B, S, K, H] (rows) or [B, K, H, S] (columns).

    paged=True (jattn's form): a `jattn.paged.PagedKVCache` instead, rows of
      up to max_length tokens in a pool of num_pages pages of page_size tokens
      (default: enough for every row at max_length; fewer, about the sum of
      the lengths / page_size, hold only what rows use). Decoding calls append
      to it and attend with `jattn.decode_attention` (its default
      implementation): mask_mod and score_mod see global positions, is_causal
      is passed through as given, and a dense mask, attention_fn, sow_weights
      and dropout are refused. The cache is `self.paged_cache`.
    """
    self.paged_cache = nnx.data(None)
    if paged:
      if isinstance(batch_size, (tuple, list)) or max_length is None:
        raise ValueError(f"init_cache(paged=True) takes jattn's form (batch_size, "
                         f"max_length), got batch_size={batch_size!r}, "
                         f"max_length={max_length!r}")
      dtype = dtype or self.dtype or self.param_dtype
      self.paged_cache = nnx.Cache(_paged.init_cache(
          batch_size, max_length, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
          page_size=page_size, num_pages=num_pages, dtype=dtype,
          pool_sharding=_heads.kv_cache_sharding(self.key.kernel[...], 4, 1)))
      self.cached_key = self.cached_value = self.cache_index = nnx.data(None)
      return
    if isinstance(batch_size, (tuple, list)):  # flax's init_cache(input_shape, dtype)
      if max_length is not None and dtype is None:
        dtype, max_length = max_length, None
      if max_length is not None or len(batch_size) < 2:
        raise ValueError(f"init_cache: flax's form takes the inputs' shape [batch..., T, F] "
                         f"(or [batch..., F, T] for columns) and a dtype, got "
                         f"input_shape={batch_size!r}, then {max_length!r}")
      # the batch axes merged into one, as the call merges them
      B, S = math.prod(batch_size[:-2]), batch_size[_heads.token_axis(self.layout)]
      index = jnp.array(0, jnp.int32)
      dtype = dtype or jnp.float32
    else:
      if max_length is None:
        raise ValueError("init_cache(batch_size, max_length) needs max_length "
                         "(or flax's form, init_cache(input_shape))")
      B, S = batch_size, max_length
      index = jnp.zeros((B,), jnp.int32)
      dtype = dtype or self.dtype or self.param_dtype
    K, H = self.num_kv_heads, self.head_dim
    shape = (B, S, K, H) if self.layout == "rows" else (B, K, H, S)
    sharding = _heads.kv_cache_sharding(self.key.kernel[...], 4,
                                        2 if self.layout == "rows" else 1)
    self.cached_key = nnx.Cache(zeros(shape, dtype, sharding))
    self.cached_value = nnx.Cache(zeros(shape, dtype, sharding))
    self.cache_index = nnx.Cache(index)

  def set_view(self, deterministic=None, decode=None, batch_size=None, max_length=None):
    """For `nnx.view`, as flax's: sets deterministic and decode; with decode, an
    empty cache of flax's kind when none exists (batch_size and max_length)."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if self.cache_index is None and self.paged_cache is None:
        if batch_size is None or max_length is None:
          raise TypeError("set_view: 'batch_size' and 'max_length' must be given to "
                          "initialise the cache")
        F = self.in_features
        shape = (batch_size, max_length, F) if self.layout == "rows" else (
            batch_size, F, max_length)
        self.init_cache(shape, self.dtype)

  def explain(self, *args, **kwargs) -> list:
    """`jattn.explain` for this module's configuration: runs `self(*args, **kwargs)` and
    returns the `jattn.Explanation` of its attention call(s), each platform's
    implementation and the reasons kernels refused (a KV cache advances as in the call).

    Examples:
      >>> import jax, jattn
      >>> from flax import nnx
      >>> mha = jattn.nnx.MultiHeadAttention(2, 16, rngs=nnx.Rngs(0))
      >>> x = jax.numpy.ones((1, 256, 16))                               # [B, T, F]
      >>> [report] = mha.explain(x, mask_mod=jattn.mods.sliding_window(4, 0))
      >>> report.implementation("tpu")
      'splash'
    """
    with explain_calls() as reports:
      self(*args, **kwargs)
    return reports

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None,
               mask=None, is_causal: bool = False, deterministic=None, rngs=None,
               sow_weights: bool = False, decode=None, lengths=None,
               out_sharding=None, qkv_sharding=None, mask_mod=None, score_mod=None,
               sow_max_logits=None):
    """inputs [B, T, F] (rows) or [B, F, T] (columns) -> the same with out_features.

    inputs_k / inputs_v: keys and values come from inputs_q when both are None,
    values from inputs_k when only inputs_v is None, as flax's; inputs_kv sets
    both (older flax). mask: broadcastable to [B, N, T, S]; bool, or numeric
    with nonzero = may attend (flax's float32 masks). rngs: an nnx.Rngs or
    RngStream for dropout, instead of the module's. sow_weights=True stores the
    attention weights [B, N, T, S] as nnx.Intermediate 'attention_weights'
    (read them with nnx.capture). sow_max_logits (default: the constructor's)
    sows each head's largest visible logit, float32 [N], as nnx.Intermediate
    'max_logits'. out_sharding / qkv_sharding: the shardings
    of the output and of the projected q, k, v (in the module's layout); on Explicit
    mesh axes the output is by default sharded as inputs_q, its feature axis whole.

    decode (default: the constructor's): attention over the cache, after
    `init_cache`; the new tokens' keys and values (from inputs_q, or from
    inputs_k / inputs_v when given, as flax) are written to it. With jattn's
    cache (init_cache(batch_size, max_length)): a prompt of any length with
    is_causal=True, lengths int [B] (tokens past lengths[b] are padding, not
    cached), then one token at a time; each batch element continues from its
    own position. With flax's cache
    (init_cache(input_shape)): causal by construction, one position for the
    batch, as flax. lengths (without decode): keys past lengths[b] are padding.

    mask_mod / score_mod: as `dot_product_attention`'s; with decode they see
    each query's position in the cache.
    """
    layout = self.layout
    # any number of batch axes, as flax: merged into one here, split on the way out
    batch = jnp.shape(inputs_q)[:-2]
    inputs_q, inputs_k, inputs_v, inputs_kv = (
        _heads.merge_batch(x, batch) for x in (inputs_q, inputs_k, inputs_v, inputs_kv))
    mask = _heads.merge_mask_batch(mask, batch)
    if lengths is not None and len(batch) != 1:
      lengths = jnp.reshape(lengths, (-1,))
    inputs_k, inputs_v, self_attention = _heads.key_value_inputs(
        inputs_q, inputs_k, inputs_v, inputs_kv)
    inputs_q = _heads.check_inputs("inputs_q", inputs_q, self.in_features, layout)
    if not self_attention:
      inputs_k = _heads.check_inputs("inputs_k", inputs_k, self.in_kv_features, layout)
      inputs_v = _heads.check_inputs("inputs_v", inputs_v, self.in_kv_features, layout)
    elif self.in_kv_features != self.in_features:
      raise ValueError(f"inputs_k: keys and values come from inputs_q, shape "
                       f"{inputs_q.shape}, when inputs_k is None, but in_kv_features = "
                       f"{self.in_kv_features} differs from in_features = {self.in_features}: "
                       f"pass inputs_k (and inputs_v)")
    mask = _heads.float_mask(mask)
    if out_sharding is None:
      out_sharding = _heads.default_out_sharding(inputs_q, layout)
    decode = self.decode if decode is None else decode
    sow_max_logits = self.sow_max_logits if sow_max_logits is None else sow_max_logits
    B, T = inputs_q.shape[0], inputs_q.shape[_heads.token_axis(layout)]
    S = inputs_k.shape[_heads.token_axis(layout)]
    paged = decode and self.paged_cache is not None
    if paged:
      _paged_step.check_call(B=B, T=T, new_keys=S, cache=self.paged_cache.get_value(),
                             mask=mask, attention_fn=self.attention_fn,
                             sow_weights=sow_weights, sow_max_logits=sow_max_logits,
                             dropout=self._dropout_rng(deterministic, rngs) is not None)
    elif decode:
      self._check_decode(is_causal, lengths, B=B, T=T, S=S)
    with matmul_precision(self.precision):
      query, key, value = (
          _heads.project_in(*proj.arrays(x, self.dtype), layout=layout,
                            out_sharding=qkv_sharding)  # [B, T, N, H] | [B, N, H, T]
          for proj, x in ((self.query, inputs_q), (self.key, inputs_k),
                          (self.value, inputs_v)))
      if self.normalize_qk:
        query, key = self.query_ln(query), self.key_ln(key)
      start = self.decode_positions(B) if decode else jnp.zeros((B,), jnp.int32)
      t, s = (jnp.arange(L, dtype=jnp.int32) for L in (T, S))
      query, key = self.encode_positions(query, key, start[:, None] + t, start[:, None] + s)
      if paged:
        sinks = None if self.sinks is None else self.sinks[...]
        cache, out = _paged_step.step(
            self.paged_cache.get_value(), query, key, value, lengths, layout=layout,
            is_causal=is_causal, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks)
        self.paged_cache.set_value(cache)
        out = _heads.project_out(*self.out.arrays(out, self.dtype), layout=layout,
                                 out_sharding=out_sharding)
        return _heads.split_batch(out, batch)
      kv_lengths = lengths
      if decode:
        key, value, mask = self._decode(key, value, mask, lengths, T)
        is_causal, kv_lengths = False, None
        mask_mod, score_mod = _kv_cache.mods_from_positions(start, mask_mod, score_mod)
      dropout_rng = self._dropout_rng(deterministic, rngs)
      sinks = None if self.sinks is None else self.sinks[...]
      user_fn = None if self.attention_fn is None else (
          lambda q, k, v, mask, is_causal: self._flax_attention(q, k, v, mask, is_causal,
                                                                dropout_rng, sow_weights))
      out = attend(
          query, key, value, layout=layout, mask=mask, is_causal=is_causal,
          kv_lengths=kv_lengths, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks,
          dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
          broadcast_dropout=self.broadcast_dropout, implementation=self.implementation,
          sow_weights=sow_weights, sow_max_logits=sow_max_logits, attention_fn=user_fn,
          sow=lambda name, x: self.sow(nnx.Intermediate, name, x))
      out = _heads.project_out(*self.out.arrays(out, self.dtype), layout=layout,
                               out_sharding=out_sharding)
    return _heads.split_batch(out, batch)

  def _flax_attention(self, query, key, value, mask, is_causal, dropout_rng, sow_weights):
    """The user's attention_fn, called as flax.nnx.MultiHeadAttention calls it."""
    return self.attention_fn(
        query, key, value, mask=mask, dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
        deterministic=dropout_rng is None, dtype=self.dtype, precision=self.precision,
        module=self if sow_weights else None, is_causal=is_causal)

  def encode_positions(self, query, key, query_positions, key_positions):
    """A hook for subclasses (e.g. rotary embeddings): the per-head query
    [B, T, N, H] | [B, N, H, T] and key [B, S, K, H] | [B, K, H, S] with their
    positions int [B, T] and [B, S] (with decode=True, each row continues from
    its cache position) -> (query, key). Here the identity, as in flax."""
    del query_positions, key_positions
    return query, key

  def decode_positions(self, B: int) -> jax.Array:
    """int32 [B]: the position of each row's next token in the cache (its length)."""
    if self.paged_cache is not None:
      return self.paged_cache.get_value().lengths
    return jnp.broadcast_to(self.cache_index[...], (B,))

  def _check_decode(self, is_causal, lengths, *, B, T, S) -> None:
    """Before any work: a cache of this batch, and a call it can decode (T queries,
    their S = T new keys, is_causal with jattn's cache, lengths only with it)."""
    if self.cache_index is None:
      raise ValueError("decode=True needs a cache: call init_cache(batch_size, "
                       "max_length), or flax's init_cache(input_shape), first")
    _kv_cache.check_call(is_causal, T=T, new_keys=S, per_row=self.cache_index.ndim == 1,
                         lengths=lengths)
    _kv_cache.check_batch(B, self.cached_key.shape)

  def _decode(self, key, value, mask, lengths, T):
    """key/value: the new tokens' (from inputs_q, or inputs_k / inputs_v as flax),
    written to the cache; -> the whole cache and the decoding mask."""
    k, v, index, decode_mask = _kv_cache.step(
        self.cached_key[...], self.cached_value[...], self.cache_index[...],
        key, value, _kv_cache.check_lengths(lengths, key.shape[0], T),
        token_axis=_heads.heads_token_axis(self.layout))
    self.cached_key[...] = k
    self.cached_value[...] = v
    self.cache_index[...] = index
    mask = decode_mask if mask is None else jnp.logical_and(mask, decode_mask)
    return k, v, mask

  def _dropout_rng(self, deterministic, rngs) -> jax.Array | None:
    if self.dropout_rate == 0.0:
      return None
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError("dropout_rate > 0 needs `deterministic` (True: no dropout), "
                       "given to the call or the constructor")
    if deterministic:
      return None
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
    if stream is None:
      raise ValueError("rngs: with keep_rngs=False the module holds no dropout rng; "
                       "pass rngs= to the call")
    return stream()
