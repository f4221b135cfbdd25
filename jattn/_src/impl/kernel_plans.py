"""Which calls jax's fused Pallas kernels can take, as static, hashable plans.

`splash_plan` and `pallas_plan` look at the user's raw arguments at dispatch
time (before any work) and return (plan, None) when the kernel computes
exactly this call, else (None, reason). The ready-made `jattn.mods` objects
are recognised with `isinstance`; anything else (a hand-written mod, a
score_mod other than soft_cap with a Python-number cap, bias, a dense mask,
dropout, return_weights) gets a reason, so implementation=None falls back and
an explicit implementation raises it: never a wrong answer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jattn import mods as M

# splash's kernels tile T and S by blocks of a multiple of 128 (TPU lanes).
SPLASH_TILE = 128
# the GPU mha kernel's default blocks (jax's BlockSizes.get_default()).
PALLAS_BLOCK = 128


class _Cannot(Exception):
  pass


@dataclasses.dataclass(frozen=True)
class SplashPlan:
  """What the splash kernel is asked to compute; hashable (a jit static)."""
  mask: tuple  # nested ("and"|"or", *parts) of ("causal",) ("local", l, r) ("chunk", n) ("full",)
  soft_cap: float | None
  segments: bool  # segment ids (the user's, or a mods.document's) in the data
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
  scale: float
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


def _check_document(doc, dims) -> None:
  want = ((dims["B"], dims["T"]), (dims["B"], dims["S"]))
  got = (np.shape(doc.q_segment_ids), np.shape(doc.kv_segment_ids))
  if got != want:
    raise _Cannot(f"its mods.document ids must be [B, T] and [B, S] = {want}, got {got}")


def _common(*, bias, mask, dropout_rate, return_weights, return_residual, block_mask,
            mask_mod):
  if bias is not None:
    raise _Cannot("it takes no bias")
  if mask is not None:
    raise _Cannot("it takes no dense mask (use is_causal, local_window_size, lengths, "
                  "segment ids or jattn.mods masks)")
  if dropout_rate > 0.0:
    raise _Cannot(f"it has no dropout, got dropout_rate={dropout_rate}")
  if return_weights:
    raise _Cannot("it does not form the weights (return_weights=True)")
  if return_residual:
    raise _Cannot("its lse output is not differentiable, so return_residual=True is refused")
  if block_mask is not None and mask_mod is None:
    raise _Cannot("a block_mask without its mask_mod cannot be lowered (pass mask_mod too)")


def splash_plan(*, platform, interpret, dims, dtype, is_causal, window, q_lengths,
                kv_lengths, q_segment_ids, kv_segment_ids, bias, mask, dropout_rate,
                return_weights, return_residual, mask_mod, score_mod, sinks, block_mask):
  """(SplashPlan, None, document or None) when splash computes this call, else (None, reason, None)."""
  try:
    if platform != "tpu" and not interpret:
      raise _Cannot(f"it needs a TPU, the platform is {platform!r}")
    _common(bias=bias, mask=mask, dropout_rate=dropout_rate, return_weights=return_weights,
            return_residual=return_residual, block_mask=block_mask, mask_mod=mask_mod)
    if str(dtype) not in ("float32", "bfloat16"):
      raise _Cannot(f"it takes float32 or bfloat16, got query dtype {dtype}")
    T, S, H, D = dims["T"], dims["S"], dims["H"], dims["D"]
    if H != D:
      raise _Cannot(f"it needs value's head size D equal to H, got H={H}, D={D}")
    if T % SPLASH_TILE or S % SPLASH_TILE:
      raise _Cannot(f"it needs T and S multiples of {SPLASH_TILE}, got T={T}, S={S}")
    parts, doc = [], None
    if is_causal:
      parts.append(("causal",))
    if window is not None:
      parts.append(("local", *window))
    if mask_mod is not None:
      expr, doc = _mask_expr(mask_mod, top=True)
      parts.append(expr)
    if doc is not None and q_segment_ids is not None:
      raise _Cannot("both segment ids and a mods.document mask")
    cap = None
    if score_mod is not None:
      if not (isinstance(score_mod, M.SoftCap) and isinstance(score_mod.cap, (int, float))):
        raise _Cannot(f"score_mod {type(score_mod).__name__} is not mods.soft_cap with a "
                      f"Python-number cap")
      cap = float(score_mod.cap)
    if doc is not None:
      _check_document(doc, dims)
      q_segment_ids, kv_segment_ids = doc.q_segment_ids, doc.kv_segment_ids
    segments = q_segment_ids is not None
    # Every lowered mask keeps the diagonal, so a row can only lose all its keys
    # to kv lengths, to segment ids that differ between queries and keys, or when T > S.
    guard = (kv_lengths is not None or T > S
             or (segments and not (q_segment_ids is kv_segment_ids and T == S)))
    plan = SplashPlan(mask=("and", *parts), soft_cap=cap, segments=segments,
                      q_lengths=q_lengths is not None, kv_lengths=kv_lengths is not None,
                      sinks=sinks is not None, guard_empty_rows=guard,
                      interpret=bool(interpret))
    return plan, None, doc
  except _Cannot as e:
    return None, str(e), None


def pallas_plan(*, platform, interpret, dims, dtype, is_causal, window, q_lengths,
                kv_lengths, q_segment_ids, kv_segment_ids, bias, mask, dropout_rate,
                return_weights, return_residual, mask_mod, score_mod, sinks, block_mask,
                scale):
  """(PallasPlan, None, document or None) when the GPU mha kernel computes this call, else
  (None, reason, None)."""
  try:
    if platform != "gpu" and not interpret:
      raise _Cannot(f"it needs a GPU, the platform is {platform!r}")
    _common(bias=bias, mask=mask, dropout_rate=dropout_rate, return_weights=return_weights,
            return_residual=return_residual, block_mask=block_mask, mask_mod=mask_mod)
    for name, x in (("local_window_size", window), ("query_seq_lengths", q_lengths),
                    ("key_value_seq_lengths", kv_lengths), ("score_mod", score_mod),
                    ("sinks", sinks)):
      if x is not None:
        raise _Cannot(f"it cannot honour {name}")
    if not isinstance(scale, (int, float)):
      raise _Cannot(f"it takes a Python number as scale, got {type(scale).__name__}")
    T, S, H, D = dims["T"], dims["S"], dims["H"], dims["D"]
    if H != D:
      raise _Cannot(f"it needs value's head size D equal to H, got H={H}, D={D}")
    if T % min(PALLAS_BLOCK, T) or S % min(PALLAS_BLOCK, S):
      raise _Cannot(f"it needs T and S multiples of {PALLAS_BLOCK} (or smaller), "
                    f"got T={T}, S={S}")
    causal, doc = is_causal, None
    if mask_mod is not None:
      if isinstance(mask_mod, M.Causal):
        causal = True
      elif isinstance(mask_mod, M.Document):
        doc = mask_mod
      else:
        raise _Cannot(f"it lowers only mods.causal and mods.document, got mask_mod "
                      f"{type(mask_mod).__name__}")
      if doc is not None and q_segment_ids is not None:
        raise _Cannot("both segment ids and a mods.document mask")
    if doc is not None:
      _check_document(doc, dims)
      q_segment_ids, kv_segment_ids = doc.q_segment_ids, doc.kv_segment_ids
    segments = q_segment_ids is not None
    if (causal or segments) and T != S:
      raise _Cannot(f"its causal and segment masks need T == S, got T={T}, S={S}")
    if segments and q_segment_ids is not kv_segment_ids:
      raise _Cannot("it takes one segment-id array for queries and keys: pass the same "
                    "array as q_segment_ids and kv_segment_ids")
    plan = PallasPlan(causal=bool(causal), segments=segments, scale=float(scale),
                      interpret=bool(interpret))
    return plan, None, doc
  except _Cannot as e:
    return None, str(e), None
