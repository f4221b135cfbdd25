"""The pure functions behind both Flax modules: projections into and out of heads.

rows:    x [B, T, F] -> 'BTF,FNH->BTNH' -> attention in layout "BTNH" -> 'BTNH,NHF->BTF'
columns: x [B, F, T] -> 'BFT,FNH->BNHT' -> attention in layout "BNHT" -> 'BNHT,NHF->BFT'

The kernels are [F, N, H] (in) and [N, H, F] (out) in both layouts, as in
flax.nnx.MultiHeadAttention, so weights move between the modules unchanged.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jattn._src.core.explicit_axes import explicit_sharding

LAYOUTS = ("rows", "columns")
# the dot_product_attention layout of the per-head arrays, per module layout
HEADS_LAYOUT = {"rows": "BTNH", "columns": "BNHT"}
_IN = {"rows": "BTF,FNH->BTNH", "columns": "BFT,FNH->BNHT"}
_OUT = {"rows": "BTNH,NHF->BTF", "columns": "BNHT,NHF->BFT"}


def check_layout(layout) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  return layout


def feature_axis(layout: str) -> int:
  """Axis of F in the module's inputs: [B, T, F] (rows) or [B, F, T] (columns)."""
  return -1 if layout == "rows" else -2


def token_axis(layout: str) -> int:
  """Axis of T in the module's inputs [B, T, F] / [B, F, T]."""
  return -2 if layout == "rows" else -1


def heads_token_axis(layout: str) -> int:
  """Axis of T (S) in the per-head arrays [B, T, N, H] (rows) / [B, N, H, T] (columns)."""
  return 1 if layout == "rows" else 3


def check_rank(name: str, x, layout: str):
  """x is rank 3, [B, T, F] (rows) or [B, F, T] (columns)."""
  if jnp.ndim(x) != 3:
    legend = "[B, T, F]" if layout == "rows" else "[B, F, T]"
    raise ValueError(f"{name}: expected rank 3 {legend} for layout {layout!r} (or any "
                     f"number of batch axes before the last two), got shape "
                     f"{jnp.shape(x)}")
  return x


def check_inputs(name: str, x, in_features: int, layout: str) -> jax.Array:
  """x is [B, T, F] (rows) or [B, F, T] (columns) with F == in_features."""
  x = jnp.asarray(check_rank(name, x, layout))
  legend = "[B, T, F]" if layout == "rows" else "[B, F, T]"
  if jnp.iscomplexobj(x):
    raise TypeError(f"{name}: complex inputs are not supported (jattn's softmax takes "
                    f"real float32 logits), got dtype {x.dtype} with shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype} "
                    f"with shape {x.shape}")
  F = x.shape[feature_axis(layout)]
  if F != in_features:
    raise ValueError(f"{name}: expected features F = in_features = {in_features} "
                     f"on axis {feature_axis(layout)} of {legend}, got shape {x.shape}")
  return x


def compute_dtype(dtype, *arrays):
  """`dtype` if given, else the promoted dtype of the inputs and parameters (as flax)."""
  return dtype if dtype is not None else jnp.result_type(*arrays)


def project_in(x, kernel, bias, *, layout: str, dtype=None, out_sharding=None) -> jax.Array:
  """x [B, T, F] or [B, F, T], kernel [F, N, H], bias [N, H] | None
  -> [B, T, N, H] (rows) or [B, N, H, T] (columns), sharded as out_sharding."""
  dtype = compute_dtype(dtype, x, kernel, *(() if bias is None else (bias,)))
  y = jnp.einsum(_IN[layout], x.astype(dtype), kernel.astype(dtype),
                 out_sharding=out_sharding)
  if bias is not None:
    bias = bias.astype(dtype)
    y = y + (bias if layout == "rows" else bias[:, :, None])  # [N, H] or [N, H, 1]
  return y


def project_out(y, kernel, bias, *, layout: str, dtype=None, out_sharding=None) -> jax.Array:
  """y [B, T, N, H] or [B, N, H, T], kernel [N, H, F], bias [F] | None
  -> [B, T, F] (rows) or [B, F, T] (columns), sharded as out_sharding."""
  dtype = compute_dtype(dtype, y, kernel, *(() if bias is None else (bias,)))
  out = jnp.einsum(_OUT[layout], y.astype(dtype), kernel.astype(dtype),
                   out_sharding=out_sharding)
  if bias is not None:
    bias = bias.astype(dtype)
    out = out + (bias if layout == "rows" else bias[:, None])  # [F] or [F, 1]
  return out


def default_out_sharding(x, layout: str):
  """The output's sharding when the caller names none: on Explicit axes that of the
  module's input x with its feature axis unsharded (the output projection contracts N,
  which the heads' sharding splits, and jax cannot infer the result's sharding from
  that); None elsewhere, where jax infers it."""
  sharding = explicit_sharding(x)
  if sharding is None:
    return None
  spec = list(sharding.spec)
  spec[feature_axis(layout)] = None  # out_features need not divide as in_features do
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def kv_cache_sharding(key_kernel, rank: int, heads_axis: int):
  """A KV cache's sharding on Explicit axes: its kv-head axis (heads_axis of its rank)
  split as the key kernel's [F, K, H] K, so each device caches the heads it projects
  (and holds only their part of the cache); None where that K is on no Explicit axis."""
  sharding = explicit_sharding(key_kernel)
  heads = None if sharding is None else sharding.spec[1]
  if heads is None:
    return None
  placed = getattr(key_kernel, "sharding", None) if not isinstance(
      key_kernel, jax.core.Tracer) else None
  mesh = placed.mesh if isinstance(placed, NamedSharding) else sharding.mesh  # eager: placed
  spec = [None] * rank
  spec[heads_axis] = heads
  return NamedSharding(mesh, PartitionSpec(*spec))


def check_heads(num_heads: int, qkv_features: int, num_kv_heads: int) -> int:
  """Returns the depth per head H = qkv_features // num_heads."""
  for name, v in (("num_heads", num_heads), ("qkv_features", qkv_features),
                  ("num_kv_heads", num_kv_heads)):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if qkv_features % num_heads != 0:
    raise ValueError(f"qkv_features ({qkv_features}) must be divisible by "
                     f"num_heads ({num_heads})")
  if num_heads % num_kv_heads != 0:
    raise ValueError(f"num_heads ({num_heads}) must be divisible by "
                     f"num_kv_heads ({num_kv_heads})")
  return qkv_features // num_heads


def float_mask(mask):
  """flax's masks: bool, or numeric with nonzero = may attend (flax's helpers
  make float32 ones) -> bool, or None."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def check_deprecated(**given) -> None:
  """flax's deprecated dot_general hooks: jattn's projections are einsums."""
  for name, value in given.items():
    if value is not None:
      raise ValueError(f"{name}: jattn projects with its own einsums and cannot use a "
                       f"replacement dot_general (deprecated in flax too), got {value!r}")


def refuse_mods_with_attention_fn(*, mask_mod, score_mod, use_sinks: bool) -> None:
  """A user attention_fn is called as flax calls it, which has no place for mods."""
  given = [name for name, present in (("mask_mod", mask_mod is not None),
                                      ("score_mod", score_mod is not None),
                                      ("use_sinks", use_sinks)) if present]
  if given:
    raise ValueError(f"{', '.join(given)}: an attention_fn is called as flax calls it, "
                     f"with no mask_mod, score_mod or sinks; drop attention_fn (jattn's "
                     f"own attention takes them) or bind them into it with "
                     f"functools.partial(jattn.flax_attention_fn, ...)")


def key_value_inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
  """flax's rules: inputs_k defaults to inputs_q, inputs_v to inputs_k;
  inputs_kv (older flax) sets both, with flax's DeprecationWarning. The errors and
  the warning start with flax's words, so code that matches them keeps working.
  Returns (inputs_k, inputs_v, self_attention)."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
                       "be None: inputs_kv sets both keys and values, so pass either "
                       "inputs_kv or inputs_k/inputs_v")
    warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v "
                  "instead (flax's deprecation; jattn follows it).", DeprecationWarning,
                  stacklevel=3)
    inputs_k = inputs_v = inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None: pass the same "
                       "array as inputs_k and leave inputs_v None for keys and values "
                       "from one input")
    return inputs_q, inputs_q, True
  return inputs_k, (inputs_k if inputs_v is None else inputs_v), False


def merge_batch(x, batch: tuple[int, ...]):
  """[batch..., a, b] -> [prod(batch), a, b] (flax takes any number of batch axes)."""
  if x is None or len(batch) == 1 or jnp.ndim(x) < 2:
    return x  # (check_inputs names a rank below 2)
  x = jnp.asarray(x)
  return x.reshape((math.prod(batch),) + x.shape[-2:])


def merge_mask_batch(mask, batch: tuple[int, ...]):
  """A mask broadcastable to [batch..., N, T, S] -> one batch axis."""
  if mask is None or len(batch) == 1 or jnp.ndim(mask) <= 3:
    return mask  # with no batch axes of its own it broadcasts as it is
  mask = jnp.asarray(mask)
  full = jnp.broadcast_to(mask, batch + mask.shape[-3:])
  return full.reshape((math.prod(batch),) + mask.shape[-3:])


def split_batch(y, batch: tuple[int, ...]):
  """The inverse of merge_batch on the output."""
  return y if len(batch) == 1 else y.reshape(batch + y.shape[1:])
