"""The ready-made mask and score mods behind the public `jattn.mods` (see its docstring).

They live here, in masks/, so that the kernels and plans below the public API can
recognise them without importing `jattn`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------- mask mods


@dataclasses.dataclass(frozen=True)
class Causal:
  """s <= t: query t sees keys up to its own position (is_causal=True)."""

  def __call__(self, b, n, t, s):
    return s <= t


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
  """t - left <= s <= t + right (local_window_size=(left, right))."""

  left: int
  right: int = 0

  def __call__(self, b, n, t, s):
    return (s >= t - self.left) & (s <= t + self.right)


@dataclasses.dataclass(frozen=True)
class Chunked:
  """t // size == s // size: attention within fixed chunks of `size` tokens (Llama 4).

  Combine with causal() for causal chunked attention.
  """

  size: int

  def __call__(self, b, n, t, s):
    return t // self.size == s // self.size


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixLM:
  """s <= t or s < prefix_lengths[b]: bidirectional over a prefix, causal after it."""

  prefix_lengths: object  # int [B]

  def __call__(self, b, n, t, s):
    return (s <= t) | (s < jnp.asarray(self.prefix_lengths)[b])


@dataclasses.dataclass(frozen=True, eq=False)
class Document:
  """q_segment_ids[b, t] == kv_segment_ids[b, s]: packed documents see only themselves."""

  q_segment_ids: object  # int [B, T]
  kv_segment_ids: object  # int [B, S]

  def __call__(self, b, n, t, s):
    return jnp.asarray(self.q_segment_ids)[b, t] == jnp.asarray(self.kv_segment_ids)[b, s]


@dataclasses.dataclass(frozen=True, eq=False)
class Lengths:
  """t < q_lengths[b] and s < kv_lengths[b]: query_seq_lengths and key_value_seq_lengths
  as a mask mod (either may be None), for the kernels that take lengths as a mask
  (`structure_mods`); not in the public jattn.mods, whose callers pass the lengths."""

  q_lengths: object  # int [B] or None
  kv_lengths: object  # int [B] or None

  def __call__(self, b, n, t, s):
    keep = jnp.bool_(True)
    if self.q_lengths is not None:
      keep = keep & (t < jnp.asarray(self.q_lengths)[b])
    if self.kv_lengths is not None:
      keep = keep & (s < jnp.asarray(self.kv_lengths)[b])
    return keep


@dataclasses.dataclass(frozen=True)
class And:
  """mask_mods[0](b, n, t, s) & mask_mods[1](...) & ..."""

  mask_mods: tuple[Callable, ...]

  def __call__(self, b, n, t, s):
    out = jnp.bool_(True)
    for mod in self.mask_mods:
      out = out & mod(b, n, t, s)
    return out


@dataclasses.dataclass(frozen=True)
class Or:
  """mask_mods[0](b, n, t, s) | mask_mods[1](...) | ..."""

  mask_mods: tuple[Callable, ...]

  def __call__(self, b, n, t, s):
    out = jnp.bool_(False)
    for mod in self.mask_mods:
      out = out | mod(b, n, t, s)
    return out


def causal() -> Causal:
  """The causal mask mod, s <= t: as `is_causal=True`.

  A mask mod is called on one entry (b, n, t, s) of the [B, N, T, S] grid
  (int scalars) and returns a bool scalar, True = may attend.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.causal()(0, 0, jnp.int32(2), jnp.int32(3))
    Array(False, dtype=bool)
  """
  return Causal()


def sliding_window(left: int, right: int = 0) -> SlidingWindow:
  """The mask mod t - left <= s <= t + right: as `local_window_size=(left, right)`.

  Args:
    left: keys before the query it may see.
    right: keys after it (0: none).

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.sliding_window(2)(0, 0, jnp.int32(5), jnp.int32(3))
    Array(True, dtype=bool)
  """
  return SlidingWindow(int(left), int(right))


def chunked(size: int) -> Chunked:
  """The mask mod t // size == s // size: attention within chunks of `size` tokens.

  Raises:
    ValueError: size < 1.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.chunked(4)(0, 0, jnp.int32(3), jnp.int32(4))
    Array(False, dtype=bool)
  """
  if int(size) < 1:
    raise ValueError(f"chunked: size must be a positive int, got {size!r}")
  return Chunked(int(size))


def prefix_lm(prefix_lengths) -> PrefixLM:
  """The mask mod s <= t or s < prefix_lengths[b]: bidirectional over a prefix.

  Args:
    prefix_lengths: int [B], each batch element's prefix length.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.prefix_lm(jnp.array([4]))(0, 0, jnp.int32(1), jnp.int32(3))
    Array(True, dtype=bool)
  """
  return PrefixLM(prefix_lengths)


def document(q_segment_ids, kv_segment_ids=None) -> Document:
  """The mask mod q_segment_ids[b, t] == kv_segment_ids[b, s]: packed documents.

  Args:
    q_segment_ids: int [B, T].
    kv_segment_ids: int [B, S]; defaults to q_segment_ids (self-attention).

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.document(jnp.array([[0, 0, 1]]))(0, 0, jnp.int32(1), jnp.int32(2))
    Array(False, dtype=bool)
  """
  return Document(q_segment_ids, q_segment_ids if kv_segment_ids is None else kv_segment_ids)


def and_masks(*mask_mods) -> And:
  """A mask mod that is True where every one of mask_mods is.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.sliding_window(1))(0, 0, jnp.int32(5), jnp.int32(3))
    Array(False, dtype=bool)
  """
  return And(tuple(mask_mods))


def or_masks(*mask_mods) -> Or:
  """A mask mod that is True where any one of mask_mods is.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.or_masks(jattn.mods.causal(), jattn.mods.chunked(4))(0, 0, jnp.int32(0), jnp.int32(3))
    Array(True, dtype=bool)
  """
  return Or(tuple(mask_mods))


# ---------------------------------------------------------------- score mods


@dataclasses.dataclass(frozen=True, eq=False)
class SoftCap:
  """cap * tanh(score / cap): logits bounded by +-cap (Gemma 2)."""

  cap: object  # float, or a float array (learnable)

  def __call__(self, score, b, n, t, s):
    cap = jnp.asarray(self.cap, score.dtype)
    return cap * jnp.tanh(score / cap)


@dataclasses.dataclass(frozen=True, eq=False)
class Alibi:
  """score + slopes[n] * (s - t): a linear distance penalty per head (ALiBi)."""

  slopes: object  # float [N]

  def __call__(self, score, b, n, t, s):
    slopes = jnp.asarray(self.slopes)
    return score + slopes[n].astype(score.dtype) * (s - t).astype(score.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RelativeBias:
  """score + table[n, clip(s - t, -M, M) + M] with table [N, 2M + 1] (T5-style, unbucketed)."""

  table: object  # float [N, 2M + 1]

  def __call__(self, score, b, n, t, s):
    table = jnp.asarray(self.table)
    M = (table.shape[-1] - 1) // 2
    return score + table[n, jnp.clip(s - t, -M, M) + M].astype(score.dtype)


def soft_cap(cap) -> SoftCap:
  """The score mod cap * tanh(score / cap): logits bounded by +-cap (Gemma 2).

  A score mod is called as score_mod(score, b, n, t, s) on one scaled logit and
  returns the new logit.

  Args:
    cap: a positive float, or a float array (its gradient is exact).

  Raises:
    ValueError: a number cap that is not positive.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.soft_cap(2.0)(jnp.float32(100.0), 0, 0, 0, 0)
    Array(2., dtype=float32)
  """
  if isinstance(cap, (int, float)) and not cap > 0:
    raise ValueError(f"soft_cap: cap must be positive, got {cap!r}")
  return SoftCap(cap)


def alibi(slopes) -> Alibi:
  """The score mod score + slopes[n] * (s - t): ALiBi's distance penalty.

  Args:
    slopes: float [N], one per query head (`alibi_slopes(N)` for ALiBi's).

  Raises:
    ValueError: slopes that are not one-dimensional.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.alibi(jnp.array([0.5]))(jnp.float32(1.0), 0, 0, jnp.int32(4), jnp.int32(2))
    Array(0., dtype=float32)
  """
  if jnp.ndim(slopes) != 1:
    raise ValueError(f"alibi: slopes must be [N], got shape {jnp.shape(slopes)}")
  return Alibi(slopes)


def alibi_slopes(num_heads: int) -> jnp.ndarray:
  """float32 [N]: ALiBi's geometric slopes 2^(-8 (n + 1) / N).

  Positive: with alibi(), a key s < t is penalised by slopes[n] * (t - s).

  Examples:
    >>> import jattn
    >>> jattn.mods.alibi_slopes(2).tolist()
    [0.0625, 0.00390625]
  """
  n = jnp.arange(1, num_heads + 1, dtype=jnp.float32)
  return jnp.exp2(-8.0 * n / num_heads)


def relative_bias(table) -> RelativeBias:
  """The score mod score + table[n, clip(s - t, -M, M) + M]: T5-style bias.

  Args:
    table: float [N, 2M + 1], a learned bias per head and clipped distance.

  Raises:
    ValueError: a table that is not [N, 2M + 1] with an odd width.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> jattn.mods.relative_bias(jnp.array([[1.0, 2.0, 3.0]]))(jnp.float32(0.0), 0, 0, jnp.int32(0), jnp.int32(5))
    Array(3., dtype=float32)
  """
  shape = jnp.shape(table)
  if len(shape) != 2 or shape[1] % 2 != 1:
    raise ValueError(f"relative_bias: table must be [N, 2M + 1] (odd width), got shape {shape}")
  return RelativeBias(table)


# ---------------------------------------------------------------- fitting a call


def check_fit(mod, argument: str, *, B: int | None, N: int | None, T: int | None = None,
              S: int | None = None) -> None:
  """Raises a ValueError, naming `argument` and the shapes, where an array of a ready-made
  mod does not fit a call of sizes B, N, T, S; other functions pass unchecked.

  A gather past an array's end is clamped, so an unfit array would silently give rows,
  heads or positions another one's entry. A leading size of 1 broadcasts over B (as the
  closed-form block classes read it); segment ids may run past T and S (never read
  there). None: that size unchecked (decode's positions run to the cache's capacity;
  create_block_mask's B or N of None).
  """
  def fits(name, x, axes):
    """axes: (letter, the call's size or None) per axis of x."""
    shape = jnp.shape(x)
    rule = {"B": lambda got, size: got in (1, size), "T": int.__ge__, "S": int.__ge__,
            "N": int.__eq__}
    if len(shape) == len(axes) and all(
        size is None or rule.get(letter, lambda *_: True)(got, size)
        for got, (letter, size) in zip(shape, axes)):
      return
    want = ", ".join(letter if size is None else f"{letter} = {size}" for letter, size in axes)
    notes = ["a leading 1 broadcasts over B"] * any(letter == "B" for letter, _ in axes) + [
        "ids past the sequence are not read"] * any(letter in "TS" for letter, _ in axes)
    raise ValueError(f"{argument}: mods.{type(mod).__name__}'s {name} must be [{want}]"
                     f"{' (' + '; '.join(notes) + ')' if notes else ''}, got shape {shape}")

  if isinstance(mod, (And, Or)):
    for part in mod.mask_mods:
      check_fit(part, argument, B=B, N=N, T=T, S=S)
  elif isinstance(mod, PrefixLM):
    fits("prefix_lengths", mod.prefix_lengths, (("B", B),))
  elif isinstance(mod, Document):
    fits("q_segment_ids", mod.q_segment_ids, (("B", B), ("T", T)))
    fits("kv_segment_ids", mod.kv_segment_ids, (("B", B), ("S", S)))
  elif isinstance(mod, Alibi):
    fits("slopes", mod.slopes, (("N", N),))
  elif isinstance(mod, RelativeBias):
    fits("table", mod.table, (("N", N), ("2M + 1", None)))


# Pytrees: array parameters are leaves (they may be traced, and jattn keeps the
# object itself inside a call's jit), ints are static; And/Or hold their parts.
for _cls, _arrays, _static in (
    (Causal, [], []), (SlidingWindow, [], ["left", "right"]), (Chunked, [], ["size"]),
    (PrefixLM, ["prefix_lengths"], []), (Document, ["q_segment_ids", "kv_segment_ids"], []),
    (Lengths, ["q_lengths", "kv_lengths"], []),
    (And, ["mask_mods"], []), (Or, ["mask_mods"], []), (SoftCap, ["cap"], []),
    (Alibi, ["slopes"], []), (RelativeBias, ["table"], [])):
  jax.tree_util.register_dataclass(_cls, data_fields=_arrays, meta_fields=_static)
del _cls, _arrays, _static

__all__ = ["Alibi", "And", "Causal", "Chunked", "Document", "Or", "PrefixLM",
           "RelativeBias", "SlidingWindow", "SoftCap", "alibi", "alibi_slopes",
           "and_masks", "causal", "chunked", "document", "or_masks", "prefix_lm",
           "relative_bias", "sliding_window", "soft_cap"]
