"""The attention programs the compile tier hands the TPU compiler, and what it checks.

A `Case` names a call (sizes, dtype, masks, mods); `compile_case` builds its arrays as
ShapeDtypeStructs, compiles the forward (or forward and gradient) for a TPU generation
from this CPU (`jattn._src.deviceless`) and checks the compiled program against what
`jattn.explain` says the TPU runs: that kernel's Mosaic calls and no other (none for
"xla" and "blockwise"), and, for the linear-memory paths, no [T, S] buffer in the
program's temporary memory. Letters: B T S N K G H D.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import jattn
from jattn import mods
from jattn._src import deviceless

GENERATIONS = ("v5e", "v6e", "v5p", "tpu7x")
IMPLEMENTATIONS = ("splash", "flex_tpu", "xla", "blockwise", None)
BUILT_IN_MASKS = ("causal", "window", "lengths", "segments")
MASK_MODS = ("causal", "window", "chunked", "prefix_lm", "document", "and", "or", "hand")
SCORE_MODS = ("soft_cap", "alibi", "relative_bias", "hand")

# The Mosaic kernels of each TPU implementation: their name prefixes (splash names its
# grouped-head kernels splash_mqa_*), then the forward's and the backward's kernels.
FAMILIES = {"flex_tpu": ("jattn_flex_tpu_",), "splash": ("splash_mha_", "splash_mqa_")}
KERNELS = {"flex_tpu": (("fwd",), ("dq", "dkv")), "splash": (("fwd",), ("dq", "dkv"))}
# the paths whose memory is linear in T and S: no [T, S] temporary
LINEAR = ("flex_tpu", "splash", "blockwise")


@dataclasses.dataclass(frozen=True)
class Case:
  """One call: sizes, dtype, built-in masks, mods (names as above), sinks."""

  T: int = 1024
  S: int | None = None   # None: T
  N: int = 4
  K: int | None = None   # None: N
  H: int = 128
  D: int | None = None   # value's head size; None: H
  dtype: str = "bfloat16"
  B: int = 1
  masks: tuple[str, ...] = ()
  mask_mod: str | None = None
  score_mod: str | None = None
  sinks: bool = False

  @property
  def sizes(self):
    S, K = self.T if self.S is None else self.S, self.N if self.K is None else self.K
    return self.T, S, self.N, K

  def __str__(self):
    T, S, N, K = self.sizes
    heads = f"H{self.H}" if self.D in (None, self.H) else f"H{self.H}D{self.D}"
    parts = [f"T{T}", f"S{S}", f"N{N}K{K}", heads, self.dtype, *self.masks,
             *(f"mask_mod={self.mask_mod}",) * bool(self.mask_mod),
             *(f"score_mod={self.score_mod}",) * bool(self.score_mod), *("sinks",) * self.sinks]
    return "-".join(parts)


def shapes(case: Case) -> dict:
  """The call's arrays as ShapeDtypeStructs: q, k, v, and what the masks and mods read."""
  T, S, N, K = case.sizes
  B, H, dtype = case.B, case.H, jnp.dtype(case.dtype)
  sds = jax.ShapeDtypeStruct
  out = {"q": sds((B, T, N, H), dtype), "k": sds((B, S, K, H), dtype),
         "v": sds((B, S, K, H if case.D is None else case.D), dtype)}
  if "lengths" in case.masks:
    out["q_lengths"], out["kv_lengths"] = sds((B,), jnp.int32), sds((B,), jnp.int32)
  if "segments" in case.masks or case.mask_mod in ("document", "and"):
    out["q_ids"], out["kv_ids"] = sds((B, T), jnp.int32), sds((B, S), jnp.int32)
  if case.mask_mod == "prefix_lm":
    out["prefix"] = sds((B,), jnp.int32)
  if case.score_mod == "alibi":
    out["slopes"] = sds((N,), jnp.float32)
  if case.score_mod == "relative_bias":
    out["table"] = sds((N, 33), jnp.float32)
  if case.sinks:
    out["sinks"] = sds((N,), jnp.float32)
  return out


def keywords(case: Case, a: dict) -> dict:
  """dot_product_attention's keyword arguments of the case, from its arrays `a`."""
  kw = {}
  if "causal" in case.masks:
    kw["is_causal"] = True
  if "window" in case.masks:
    kw["local_window_size"] = (256, 0)
  if "lengths" in case.masks:
    kw["query_seq_lengths"], kw["key_value_seq_lengths"] = a["q_lengths"], a["kv_lengths"]
  if "segments" in case.masks:
    kw["q_segment_ids"], kw["kv_segment_ids"] = a["q_ids"], a["kv_ids"]
  mask_mods = {
      "causal": lambda: mods.causal(), "window": lambda: mods.sliding_window(256, 16),
      "chunked": lambda: mods.chunked(384), "prefix_lm": lambda: mods.prefix_lm(a["prefix"]),
      "document": lambda: mods.document(a["q_ids"], a["kv_ids"]),
      "and": lambda: mods.and_masks(mods.causal(), mods.document(a["q_ids"], a["kv_ids"])),
      "or": lambda: mods.or_masks(mods.chunked(128), mods.sliding_window(64)),
      "hand": lambda: lambda b, n, t, s: (t - s) % 3 != 1}
  score_mods = {
      "soft_cap": lambda: mods.soft_cap(30.0), "alibi": lambda: mods.alibi(a["slopes"]),
      "relative_bias": lambda: mods.relative_bias(a["table"]),
      "hand": lambda: lambda score, b, n, t, s: score * 0.5 + 0.01 * (s - t).astype(score.dtype)}
  if case.mask_mod:
    kw["mask_mod"] = mask_mods[case.mask_mod]()
  if case.score_mod:
    kw["score_mod"] = score_mods[case.score_mod]()
  if case.sinks:
    kw["sinks"] = a["sinks"]
  return kw


def program(case: Case, implementation, grad: bool):
  """fn(arrays): the output, or the loss and its gradient with respect to q, k, v."""
  def out(a, q, k, v):
    return jattn.dot_product_attention(q, k, v, implementation=implementation,
                                       **keywords(case, a))

  def fn(a):
    if not grad:
      return out(a, a["q"], a["k"], a["v"])
    loss = lambda q, k, v: jnp.sum(out(a, q, k, v).astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(a["q"], a["k"], a["v"])
  return fn


def explanation(case: Case, implementation):
  """jattn.explain of the case (small concrete arrays: explain reads only their shapes)."""
  a = {name: jnp.zeros(x.shape, x.dtype) for name, x in shapes(case).items()}
  return jattn.explain(a["q"], a["k"], a["v"], implementation=implementation,
                       **keywords(case, a))


def compile_case(case: Case, implementation, target: str, *, grad: bool = True):
  """Compiles the case for `target` and checks it -> (chosen implementation, report), or
  (None, the refusal) when the TPU plan refuses the call (nothing compiled)."""
  choice = explanation(case, implementation).choices["tpu"]
  if choice.implementation is None:
    assert choice.error, choice
    return None, choice.error
  _, report = deviceless.compile_for(target, program(case, implementation, grad), shapes(case))
  check_kernels(report, choice.implementation, grad)
  return choice.implementation, report


def check_kernels(report, chosen: str, grad: bool):
  """The compiled program runs the kernels of `chosen` (explain's choice) and no other."""
  every = tuple(p for family in FAMILIES.values() for p in family)
  found = [k for k in report.kernels if k.startswith(every)]
  family = FAMILIES.get(chosen, ())
  stray = [k for k in found if not family or not k.startswith(family)]
  assert not stray, (chosen, stray, report.kernels)
  forward, backward = KERNELS.get(chosen, ((), ()))
  parts = [k[len(p):] for k in found for p in family if k.startswith(p)]
  for part in forward + backward * grad:
    assert any(x.startswith(part) for x in parts), (chosen, part, report.kernels)


def ts_bytes(case: Case) -> int:
  """Bytes of one [T, S] float32 buffer of one head."""
  T, S, _, _ = case.sizes
  return 4 * T * S
