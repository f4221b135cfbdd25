"""`flax_attention_fn`: jattn's attention as the `attention_fn` of flax's own modules."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jattn._src.dot_product_attention import dot_product_attention
from jattn._src.nn.precision import matmul_precision

# Products flax lets a caller swap (AQT quantisation); jattn computes its own.
_EINSUM_HOOKS = ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")


def flax_attention_fn(query, key, value, bias=None, mask=None, *,
                      broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
                      deterministic=False, dtype=None, precision=None, module=None,
                      promote_dtype=None, is_causal=False, force_fp32_for_softmax=False,
                      einsum_dot_general=None, qk_attn_weights_einsum=None,
                      attn_weights_value_einsum=None, **kwargs):
  """flax's `dot_product_attention` computed by `jattn.dot_product_attention`.

  Pass it as `flax.nnx.MultiHeadAttention(attention_fn=...)` or
  `flax.linen.MultiHeadDotProductAttention(attention_fn=...)`; with
  `functools.partial` any keyword of `jattn.dot_product_attention` rides
  along, e.g. `partial(jattn.flax_attention_fn, implementation="blockwise")`
  for memory linear in T and S.

  query [batch..., T, N, H], key [batch..., S, K, H], value [batch..., S, K, D]
  (K divides N), as flax passes them; bias/mask broadcastable to
  [batch..., N, T, S]. The arguments mean what they mean to flax:
  mask: bool or numeric, nonzero = may attend (flax's float masks work);
  dropout with dropout_rate > 0 and not deterministic, one draw shared by the
  batch and heads when broadcast_dropout (flax's default); dtype: q, k, v are
  promoted to it with `promote_dtype` (flax.nnx's by default); precision: every
  matmul of the call runs at it; module: the attention weights [batch..., N,
  T, S] are sown into it as flax does ("attention_weights"), which forms them;
  force_fp32_for_softmax: jattn's softmax is always float32.

  A row that may attend to no key returns zeros (flax's averages the values).
  return_residual / return_max_logits (keywords of `jattn.dot_product_attention`)
  return (out, lse and/or max logits [batch..., T, N]), not flax's single array.
  The einsum hooks (`einsum_dot_general`, `qk_attn_weights_einsum`,
  `attn_weights_value_einsum`) raise a ValueError: jattn does its own products.

  Shapes are flax's: query [B, T, N, H], key [B, S, K, H], value [B, S, K, D],
  mask broadcastable to [B, N, T, S] (bool, or float with nonzero = may
  attend) -> [B, T, N, D].

  Raises:
    ValueError: one of the hooks above, or any check of
      `jattn.dot_product_attention` (naming the argument and shapes).

  Examples:
    >>> import functools, jax, jattn
    >>> from flax import nnx
    >>> attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0),
    ...     attention_fn=functools.partial(jattn.flax_attention_fn, implementation="blockwise"))
    >>> attn(jax.numpy.ones((2, 16, 32))).shape
    (2, 16, 32)
  """
  for name, given in zip(_EINSUM_HOOKS, (einsum_dot_general, qk_attn_weights_einsum,
                                         attn_weights_value_einsum)):
    if given is not None:
      raise ValueError(f"{name}: jattn computes the attention products itself and "
                       f"cannot use a replacement einsum, got {given!r}")
  if "layout" in kwargs:
    raise ValueError(f"layout: flax passes [batch..., T, N, H], so flax_attention_fn "
                     f"takes no layout, got {kwargs['layout']!r}")
  if not isinstance(force_fp32_for_softmax, bool):
    raise TypeError(f"force_fp32_for_softmax must be a bool, got {force_fp32_for_softmax!r}")
  from flax import linen, nnx  # here: `import jattn` does not import flax

  promote = nnx.nn.dtypes.promote_dtype if promote_dtype is None else promote_dtype
  query, key, value = promote((query, key, value), dtype=dtype)
  if mask is not None:
    mask = jnp.asarray(mask)
    mask = mask if mask.dtype == jnp.bool_ else mask != 0  # flax: nonzero = may attend
  batch = query.shape[:-3]
  if len(batch) > 1:  # several batch axes: flattened into one, as flax does
    flat = lambda x, tail: jnp.reshape(x, (math.prod(batch),) + x.shape[-tail:])
    query, key, value = (flat(x, 3) for x in (query, key, value))
    full = lambda x: None if x is None else flat(
        jnp.broadcast_to(x, batch + jnp.shape(x)[-3:]) if jnp.ndim(x) > 3 else x, 3)
    bias, mask = full(bias), full(mask)
  dropout = dropout_rate if (dropout_rate > 0.0 and not deterministic) else 0.0
  with matmul_precision(precision):
    out = dot_product_attention(
        query, key, value, bias, mask, is_causal=is_causal, dropout_rate=dropout,
        dropout_rng=dropout_rng if dropout else None, broadcast_dropout=broadcast_dropout,
        return_weights=module is not None, **kwargs)
  # out, then what was asked: the weights (module), lse (return_residual), max logits
  out, *extras = out if isinstance(out, tuple) else (out,)
  if module is not None:
    weights = extras.pop(0)
    weights = jnp.reshape(weights, batch + weights.shape[-3:])
    if isinstance(module, nnx.Module):
      module.sow(nnx.Intermediate, "attention_weights", weights)
    elif isinstance(module, linen.Module):
      module.sow("intermediates", "attention_weights", weights)
    else:
      raise TypeError(f"module must be a flax nnx or linen Module, got {type(module).__name__}")
  out = jnp.reshape(out, batch + out.shape[-3:])
  if not extras:
    return out
  # lse / max logits [batch..., T, N], like out without D
  return (out, *(jnp.reshape(x, batch + x.shape[-2:]) for x in extras))
