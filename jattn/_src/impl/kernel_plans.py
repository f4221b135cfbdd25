"""Which calls jax's fused Pallas kernels can take, as static, hashable plans.

`splash_plan` and `pallas_plan` look at a checked `Call` (its static facts and
the user's raw mods) before any work and return a plan when the kernel
computes exactly this call, else the reason in words. The ready-made `jattn.mods` objects
are recognised with `isinstance`; anything else (a hand-written mod, a
score_mod other than soft_cap with a Python-number cap, bias, a dense mask,
dropout, return_weights, return_max_logits) gets a reason, so implementation=None falls back and
an explicit implementation raises it: never a wrong answer.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jattn._src.masks import mods as M
from jattn._src import compat

# splash's kernels tile T and S by blocks of a multiple of 128 (TPU lanes).
SPLASH_TILE = 128
# the GPU mha kernel's default blocks (jax's BlockSizes.get_default()).
PALLAS_BLOCK = 128
# Triton's dot needs each side of its operands >= 16: below, mha's blocks and head sizes
# gave wrong values (not an error) on an H200 with jax 0.11.2.
PALLAS_MIN = 16
# The widest head (padded to a power of 2) whose blocks fit a Hopper SM's 227 KiB of
# shared memory, by bytes per element: on an H200, bfloat16 ran at 128 and failed at
# 256; float32 ran at 32 and failed at 64 ("Shared memory size limit exceeded").
PALLAS_MAX_HEAD = {2: 128, 4: 32}


class _Cannot(Exception):
  pass


def _check_api(*apis: str) -> None:
  """The jax APIs the kernel is called through: _Cannot when this jax lacks one."""
  for api in apis:
    reason = compat.missing(api)
    if reason is not None:
      raise _Cannot(reason)


@dataclasses.dataclass(frozen=True)
class SplashPlan:
  """What the splash kernel is asked to compute; hashable (a jit static)."""
  mask: tuple  # nested ("and"|"or", *parts) of ("causal",) ("local", l, r) ("chunk", n) ("full",)
  soft_cap: float | None
  segments: bool  # segment ids (the user's, or a mods.document's) in the data
  document: bool  # the segment ids are a mods.document mask_mod's (`find_document`)
  q_lengths: bool
  kv_lengths: bool
  sinks: bool
  guard_empty_rows: bool  # a row may see no key: zero it (found from the kernel's lse)
  interpret: bool


@dataclasses.dataclass(frozen=True)
class PallasPlan:
  """What jax's GPU flash kernel (pallas.ops.gpu.attention.mha) is asked to compute."""
  causal: bool
  segments: bool  # one id array for queries and keys (T == S, the same array)
  document: bool  # ... a mods.document mask_mod's (`find_document`)
  scale: float | None  # the user's Python number; None: traced, folded into q
  interpret: bool


def _mask_expr(mod, top: bool):
  """(static expression, Document or None) for a ready-made mask mod; _Cannot otherwise."""
  if isinstance(mod, M.Causal):
    return ("causal",), None
  if isinstance(mod, M.SlidingWindow):
    if not all(isinstance(w, int) and w >= 0 for w in (mod.left, mod.right)):
      raise _Cannot(f"mask_mod sliding_window needs non-negative Python ints, got {mod}")
    return ("local", mod.left, mod.right), None
  if isinstance(mod, M.Chunked):
    if not (isinstance(mod.size, int) and mod.size >= 1):
      raise _Cannot(f"mask_mod chunked needs a positive Python int size, got {mod}")
    return ("chunk", mod.size), None
  if isinstance(mod, M.Document):
    if not top:
      raise _Cannot("a mods.document mask under or_masks (segment ids can only be ANDed)")
    return ("full",), mod
  if isinstance(mod, (M.And, M.Or)):
    is_and = isinstance(mod, M.And)
    parts, docs = [], []
    for m in mod.mask_mods:
      expr, doc = _mask_expr(m, top and is_and)
      parts.append(expr)
      docs += [doc] if doc is not None else []
    if len(docs) > 1:
      raise _Cannot("more than one mods.document mask")
    return ("and" if is_and else "or", *parts), (docs[0] if docs else None)
  raise _Cannot(f"mask_mod {type(mod).__name__} is not a ready-made jattn.mods mask it "
                f"can lower (hand-written functions and the batch-dependent prefix_lm are not)")


def find_document(mod):
  """The mods.document inside a ready-made mask_mod (at the top or under and_masks)."""
  if isinstance(mod, M.Document):
    return mod
  if isinstance(mod, M.And):
    return next(filter(None, map(find_document, mod.mask_mods)), None)
  return None


def _check_document(doc, dims) -> None:
  want = ((dims.B, dims.T), (dims.B, dims.S))
  got = (np.shape(doc.q_segment_ids), np.shape(doc.kv_segment_ids))
  if got != want:
    raise _Cannot(f"its mods.document ids must be [B, T] and [B, S] = {want}, got {got}")


def _common(call):
  if call.has_bias:
    raise _Cannot("it takes no bias")
  if call.has_mask:
    raise _Cannot("it takes no dense mask (use is_causal, local_window_size, lengths, "
                  "segment ids or jattn.mods masks)")
  if call.dropout_rate > 0.0:
    raise _Cannot(f"it has no dropout, got dropout_rate={call.dropout_rate}")
  if call.return_weights:
    raise _Cannot("it does not form the weights (return_weights=True)")
  if call.return_residual:
    raise _Cannot("its lse output is not differentiable, so return_residual=True is refused")
  if call.return_max_logits:
    raise _Cannot("return_max_logits: jax's kernel returns no max logits (its running max "
                  "stays inside the kernel); jattn's flex kernels return them")
  if call.has_block_mask and call.mask_mod is None:
    raise _Cannot("a block_mask without its mask_mod cannot be lowered (pass mask_mod too)")


def splash_plan(call, platform: str):
  """A `SplashPlan` when jax's splash kernel computes `call` exactly, else the reason."""
  try:
    _check_api("splash_kernel", "splash_mask", "splash_computable_mask")
    _common(call)
    if str(call.dtype) not in ("float32", "bfloat16"):
      raise _Cannot(f"it takes float32 or bfloat16, got query dtype {call.dtype}")
    dims, structure = call.dims, call.structure
    T, S, H, D = dims.T, dims.S, dims.H, dims.D
    if H != D:
      raise _Cannot(f"it needs value's head size D equal to H, got H={H}, D={D}")
    if T % SPLASH_TILE or S % SPLASH_TILE:
      raise _Cannot(f"it needs T and S multiples of {SPLASH_TILE}, got T={T}, S={S}")
    parts, doc = [], None
    if call.is_causal:
      parts.append(("causal",))
    if call.window is not None:
      parts.append(("local", *call.window))
    if call.mask_mod is not None:
      expr, doc = _mask_expr(call.mask_mod, top=True)
      parts.append(expr)
    segments = structure.q_segment_ids is not None
    if doc is not None and segments:
      raise _Cannot("both segment ids and a mods.document mask")
    cap = None
    if call.score_mod is not None:
      score_mod = call.score_mod
      if not (isinstance(score_mod, M.SoftCap) and isinstance(score_mod.cap, (int, float))):
        raise _Cannot(f"score_mod {type(score_mod).__name__} is not mods.soft_cap with a "
                      f"Python-number cap")
      cap = float(score_mod.cap)
    same_ids = call.same_segment_ids
    if doc is not None:
      _check_document(doc, dims)
      segments, same_ids = True, doc.q_segment_ids is doc.kv_segment_ids
    # Every lowered mask keeps the diagonal, so a row can only lose all its keys
    # to kv lengths, to segment ids that differ between queries and keys, or when T > S.
    kv_lengths = structure.kv_lengths is not None
    guard = kv_lengths or T > S or (segments and not (same_ids and T == S))
    return SplashPlan(mask=("and", *parts), soft_cap=cap, segments=segments,
                      document=doc is not None,
                      q_lengths=structure.q_lengths is not None, kv_lengths=kv_lengths,
                      sinks=call.has_sinks, guard_empty_rows=guard,
                      interpret=call.interpret)
  except _Cannot as e:
    return str(e)


def pallas_plan(call, platform: str):
  """A `PallasPlan` when jax's Pallas GPU flash kernel computes `call`, else the reason."""
  try:
    _check_api("pallas_mha")
    _common(call)
    # its running max and sum are float32: a float64 call cannot even be traced
    if str(call.dtype) not in ("float16", "bfloat16", "float32"):
      raise _Cannot(f"it takes float16, bfloat16 or float32, got query dtype {call.dtype}")
    structure = call.structure
    for name, x in (("local_window_size", call.window),
                    ("query_seq_lengths", structure.q_lengths),
                    ("key_value_seq_lengths", structure.kv_lengths),
                    ("score_mod", call.score_mod), ("sinks", call.modifiers.sinks)):
      if x is not None:
        raise _Cannot(f"it cannot honour {name}")
    dims = call.dims
    _check_pallas_shapes(dims.T, dims.S, dims.H, dims.D, np.dtype(call.dtype).itemsize)
    T, S = dims.T, dims.S
    causal, doc = call.is_causal, None
    segments, same_ids = structure.q_segment_ids is not None, call.same_segment_ids
    if call.mask_mod is not None:
      if isinstance(call.mask_mod, M.Causal):
        causal = True
      elif isinstance(call.mask_mod, M.Document):
        doc = call.mask_mod
      else:
        raise _Cannot(f"it lowers only mods.causal and mods.document, got mask_mod "
                      f"{type(call.mask_mod).__name__}")
      if doc is not None and segments:
        raise _Cannot("both segment ids and a mods.document mask")
    if doc is not None:
      _check_document(doc, dims)
      segments, same_ids = True, doc.q_segment_ids is doc.kv_segment_ids
    if (causal or segments) and T != S:
      raise _Cannot(f"its causal and segment masks need T == S, got T={T}, S={S}")
    if segments and not same_ids:
      raise _Cannot("it takes one segment-id array for queries and keys: pass the same "
                    "array as q_segment_ids and kv_segment_ids")
    if (causal or segments) and jax.config.jax_enable_x64:
      raise _Cannot("under jax_enable_x64 its causal and segment masks cannot be traced "
                    "(they divide an int32 block index by a Python int, which x64 makes "
                    "int64)")
    scale = float(call.scale) if isinstance(call.scale, (int, float)) else None
    return PallasPlan(causal=bool(causal), segments=segments, document=doc is not None,
                      scale=scale, interpret=call.interpret)
  except _Cannot as e:
    return str(e)


def pallas_blocks(T: int, S: int) -> tuple[int, int]:
  """The blocks (of T, of S) jattn gives mha, forward and backward alike."""
  return min(PALLAS_BLOCK, T), min(PALLAS_BLOCK, S)


def _check_pallas_shapes(T: int, S: int, H: int, D: int, itemsize: int) -> None:
  """mha's own rules, forward and backward (jax/experimental/pallas/ops/gpu/attention.py:
  `mha`, `_mha_backward`), and what its Triton lowering and launch take; _Cannot if not."""
  if H != D:  # mha: q, k and v share one head size
    raise _Cannot(f"it needs value's head size D equal to H, got H={H}, D={D}")
  bq, bk = pallas_blocks(T, S)
  if T % bq or S % bk:  # mha: the blocks divide the lengths
    raise _Cannot(f"it needs T and S multiples of {PALLAS_BLOCK} (or smaller), "
                  f"got T={T}, S={S}")
  if bq & (bq - 1) or bk & (bk - 1):  # the Triton lowering's _check_tensor_size
    raise _Cannot(f"Triton takes blocks whose sizes are powers of 2, got blocks of "
                  f"{bq} x {bk} (T={T}, S={S}, blocks of up to {PALLAS_BLOCK})")
  padded = 1 << (H - 1).bit_length()  # mha pads the head to a power of 2
  if min(bq, bk, padded) < PALLAS_MIN:
    raise _Cannot(f"Triton's dot needs blocks and head size of at least {PALLAS_MIN}, "
                  f"got blocks of {bq} x {bk} and H={H}")
  if T // bq != S // bk:  # _mha_backward: one program per query block and key block
    raise _Cannot(f"its backward needs T and S in the same number of blocks, got "
                  f"T={T} in {T // bq} and S={S} in {S // bk} (blocks of up to "
                  f"{PALLAS_BLOCK})")
  widest = PALLAS_MAX_HEAD.get(itemsize, 0)
  if padded > widest:
    raise _Cannot(f"its blocks hold heads of up to {widest} in {8 * itemsize}-bit floats "
                  f"(GPU shared memory), got H={H}")
