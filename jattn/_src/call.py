"""One `dot_product_attention` call, checked once: its static facts and its traced value.

`make_call` runs every argument check before any work (messages name the
argument and the shapes) and returns a `Call`: the sizes, dtype, layout and
flags every implementation's plan reads (static, hashable), the user's raw
mask/score mods (so kernels can recognise the ready-made `jattn.mods` objects),
and the `Modifiers` value that carries the arrays into the computation.
`dot_product_attention`, `ring_attention` and `jattn.explain` all start here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn._src.core import checks
from jattn._src.core.attend import default_scale
from jattn._src.core.layout import Layout, parse_layout
from jattn._src.core.softmax import logits_dtype
from jattn._src.masks.modifiers import Modifiers
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.core.dropout import Dropout
from jattn._src.masks.block_mask import check_block_mask
from jattn._src.masks.programmable import build_mods
from jattn._src.masks.structural import MaskSpec


@dataclasses.dataclass(frozen=True)
class Dims:
  """The sizes of one call (legend in jattn/__init__.py); B is 1 without a batch axis."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  D: int
  has_batch: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """A checked call. Plans read the static fields; implementations run on `modifiers`.

  query, key, value: the arrays in `layout`, with a batch axis (added if absent).
  scale: the user's Python number, or a traced array; `modifiers.scale` is
    always an array, so a new number compiles nothing new for most kernels.
  mask_mod, score_mod: the user's raw functions (None when absent).
  same_segment_ids: q_segment_ids and kv_segment_ids are one array object.
  block_sizes: the user's or the block mask's, else None (each platform's default).
  interpret: inside `pallas_interpret()`: Pallas kernels run interpreted anywhere.
  """

  query: jax.Array
  key: jax.Array
  value: jax.Array
  modifiers: Modifiers
  dims: Dims
  dtype: jnp.dtype
  layout: Layout
  is_causal: bool
  window: tuple[int, int] | None
  dropout_rate: float
  return_weights: bool
  return_residual: bool
  return_max_logits: bool
  scale: float | jax.Array
  mask_mod: object
  score_mod: object
  same_segment_ids: bool
  block_sizes: BlockSizes | None
  interpret: bool

  @property
  def structure(self) -> MaskSpec:
    return self.modifiers.structure

  @property
  def has_bias(self) -> bool:
    return self.modifiers.bias is not None

  @property
  def has_mask(self) -> bool:
    return self.modifiers.mask is not None

  @property
  def has_sinks(self) -> bool:
    return self.modifiers.sinks is not None

  @property
  def has_block_mask(self) -> bool:
    return self.modifiers.mods is not None and self.modifiers.mods.block_mask is not None

  @property
  def has_mods(self) -> bool:
    return self.modifiers.mods is not None


def make_call(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              q_segment_ids=None, kv_segment_ids=None, layout="BTNH", dropout_rate=0.0,
              dropout_rng=None, broadcast_dropout=False, return_weights=False,
              block_sizes=None, return_residual=False, return_max_logits=False,
              mask_mod=None, score_mod=None, sinks=None, block_mask=None,
              interpret=False) -> Call:
  """Checks every argument of `dot_product_attention` (before any work) -> a `Call`."""
  query = checks.float_array("query", query)
  key = checks.float_array("key", key)
  value = checks.float_array("value", value)
  lay = parse_layout(layout, query.shape)
  dims = check_arrays(query, key, value, lay)
  B, T, S, N = dims.B, dims.T, dims.S, dims.N
  target = (B, N, T, S) if lay.has_batch else (N, T, S)
  legend = "[B, N, T, S]" if lay.has_batch else "[N, T, S]"
  mask = checks.broadcastable("mask", mask, target, legend, "bool")
  bias = checks.broadcastable("bias", bias, target, legend, "float")
  q_lengths = lengths("query_seq_lengths", query_seq_lengths, B, lay.has_batch)
  kv_lengths = lengths("key_value_seq_lengths", key_value_seq_lengths, B, lay.has_batch)
  q_ids, kv_ids = segment_ids(q_segment_ids, kv_segment_ids, B, T, S, lay.has_batch)
  window = local_window(local_window_size)
  if scale is None:
    scale = default_scale(dims.H)
  scale = checks.scale(scale)
  check_dropout(dropout_rate, dropout_rng)
  for name, flag in (("is_causal", is_causal), ("return_weights", return_weights),
                     ("return_residual", return_residual),
                     ("return_max_logits", return_max_logits),
                     ("broadcast_dropout", broadcast_dropout)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a jattn.BlockSizes(q=..., kv=...), "
                    f"got {block_sizes!r}")
  mods = build_mods(mask_mod, score_mod, sinks, block_mask, N=N, B=B, T=T, S=S,
                    defer_ready_made=True, logits_dtype=logits_dtype(query.dtype))
  if mods is not None and mods.block_mask is not None:
    block_sizes = check_block_mask(mods.block_mask, B=B, N=N, T=T, S=S,
                                   block_sizes=block_sizes, has_batch=lay.has_batch)

  if not lay.has_batch:
    query, key, value = (x[None] for x in (query, key, value))
    lay = Layout("B" + lay.query)
  mask = None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)
  bias = None if bias is None else jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)
  structure = MaskSpec(is_causal=is_causal, local_window=window, q_lengths=q_lengths,
                       kv_lengths=kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  dropout = (Dropout(float(dropout_rate), dropout_rng, broadcast_dropout)
             if dropout_rate > 0.0 else None)
  # traced: a new scale compiles nothing new (cuDNN and Pallas GPU take
  # `Call.scale`, the Python number, in their plans)
  traced_scale = jnp.asarray(scale) if isinstance(scale, (int, float)) else scale
  modifiers = Modifiers(bias=bias, mask=mask, structure=structure, mods=mods,
                        dropout=dropout, scale=traced_scale)
  return Call(query=query, key=key, value=value, modifiers=modifiers, dims=dims,
              dtype=query.dtype, layout=lay, is_causal=is_causal, window=window,
              dropout_rate=float(dropout_rate), return_weights=return_weights,
              return_residual=return_residual, return_max_logits=return_max_logits,
              scale=scale, mask_mod=mask_mod,
              score_mod=score_mod,
              same_segment_ids=q_segment_ids is not None and q_segment_ids is kv_segment_ids,
              block_sizes=block_sizes, interpret=bool(interpret))


def check_arrays(query, key, value, lay: Layout) -> Dims:
  """Ranks, shared batch/length/depth, N % K and dtypes; returns the sizes."""
  for name, x, sub in (("key", key, lay.key), ("value", value, lay.value)):
    if x.ndim != len(sub):
      raise ValueError(f"{name}: expected rank {len(sub)} [{', '.join(sub)}] for layout "
                       f"{lay.query!r}, got shape {x.shape} (query has shape {query.shape})")
  ax = lay.axis
  checks.equal_dim("length S", "key", key.shape, ax("S"), "value", value.shape, ax("S"))
  checks.equal_dim("kv heads K", "key", key.shape, ax("K"), "value", value.shape, ax("K"))
  checks.equal_dim("depth H", "query", query.shape, ax("H"), "key", key.shape, ax("H"))
  if lay.has_batch:
    checks.equal_dim("batch B", "query", query.shape, ax("B"), "key", key.shape, ax("B"))
    checks.equal_dim("batch B", "key", key.shape, ax("B"), "value", value.shape, ax("B"))
  checks.some_depth("query", query.shape, "key", key.shape, query.shape[ax("H")])
  N, K = query.shape[ax("N")], key.shape[ax("K")]
  if K == 0 or N % K != 0:
    raise ValueError(f"num heads N of query must be a multiple of kv heads K of key "
                     f"(N % K == 0): query has shape {query.shape} (N={N}), key has "
                     f"shape {key.shape} (K={K})")
  checks.same_dtype(query, key, value)
  return Dims(B=query.shape[ax("B")] if lay.has_batch else 1, T=query.shape[ax("T")],
              S=key.shape[ax("S")], N=N, K=K, H=query.shape[ax("H")],
              D=value.shape[ax("D")], has_batch=lay.has_batch)


def int_array(name: str, x, expected: tuple[int, ...], legend: str) -> jax.Array:
  x = checks.as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} "
                    f"with shape {x.shape}")
  if x.shape != expected:
    raise ValueError(f"{name}: expected shape {legend} = {expected}, got shape {x.shape}")
  return x


def lengths(name, x, B, has_batch):
  """query_seq_lengths / key_value_seq_lengths: int [B] (int [] without a batch axis)."""
  if x is None:
    return None
  if not has_batch:
    return int_array(name, x, (), "[] (no batch axis)")[None]
  return int_array(name, x, (B,), "[B]")


def segment_ids(q_ids, kv_ids, B, T, S, has_batch):
  """q_segment_ids int [B, T], kv_segment_ids int [B, S], given together (or neither)."""
  if (q_ids is None) != (kv_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together, got "
                     f"q_segment_ids={None if q_ids is None else 'array'}, "
                     f"kv_segment_ids={None if kv_ids is None else 'array'}")
  if q_ids is None:
    return None, None
  if not has_batch:
    return (int_array("q_segment_ids", q_ids, (T,), "[T]")[None],
            int_array("kv_segment_ids", kv_ids, (S,), "[S]")[None])
  return (int_array("q_segment_ids", q_ids, (B, T), "[B, T]"),
          int_array("kv_segment_ids", kv_ids, (B, S), "[B, S]"))


def local_window(window) -> tuple[int, int] | None:
  """local_window_size: an int w (w, w) or a pair (left, right) of non-negative ints."""
  if window is None:
    return None
  pair = (window, window) if isinstance(window, int) else window
  if (not isinstance(pair, (tuple, list)) or len(pair) != 2
      or not all(isinstance(w, int) and not isinstance(w, bool) for w in pair)):
    raise TypeError(f"local_window_size must be an int or a pair of ints "
                    f"(left, right), got {window!r}")
  if min(pair) < 0:
    raise ValueError(f"local_window_size must be non-negative, got {window!r}")
  return (int(pair[0]), int(pair[1]))


def check_dropout(rate, rng) -> None:
  if not isinstance(rate, (int, float)) or isinstance(rate, bool):
    raise TypeError(f"dropout_rate must be a float in [0, 1), got {rate!r}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
  if rate > 0.0 and rng is None:
    raise ValueError(f"dropout_rng is required when dropout_rate > 0 "
                     f"(dropout_rate={rate!r}, dropout_rng=None)")
