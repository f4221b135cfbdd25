"""The "flex_mgpu" kernel: flash attention on Pallas's Mosaic GPU backend (Hopper,
sm_90: TMA copies and `wgmma`), with the user's mask_mod and score_mod evaluated
inside the kernel on each tile, as "flex_gpu" does on Pallas's Triton backend (which
jax deprecates from 0.11).

`plan(...)` looks only at static facts of a call and returns a hashable `Plan`, or a
reason in words for what the kernel cannot take. `flex_mgpu_call.run(plan, ...)` has the
contract of `blockwise_attention`: -> (out, None, lse float32 [B, N, T], max logits
float32 [B, N, T] or None: each row's running max, written when the plan asks).

The same design as "flex_gpu" (its docstring): grid (T / 64, N, B), a program per
64-row query tile, looping over the 64-column kv tiles of kv head n // G that are not
EMPTY (per-row lists from the shared block classes), FULL tiles without the mask
functions; the mods evaluated on tiles by the shared `tile_mods`; backward by a dq
kernel and a dk/dv kernel (grid S / 64, K, B, the G query heads summed in registers)
under jattn's kernel VJP. What Mosaic GPU changes is in `flex_mgpu_kernels`: one
warpgroup per program, every operand and side input in shared memory by TMA, products
by `wgmma`. Heads are zero-padded to E = max(H, D) rounded up to 64 (the wgmma
operands' 128-byte rows). Gradients into score_mod's captured float arrays come from
jattn's blockwise backward (exact, deterministic), not from the kernels.
Sinks join after the kernel, as in "blockwise".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import kernel_plan, tile_mods

# wgmma takes 16-bit operands here (float32 would be TF32 on the tensor cores)
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# A wgmma accumulator has a multiple of 64 rows (one warpgroup); 64 columns keep the
# probability tile and both kv slots in SMEM at E = 256. NOT MEASURED on a GPU.
_TILE = 64
# A Hopper SM's shared memory per block (sm_90: 227 KiB).
SMEM_BYTES = 227 * 1024
# A TMA box has at most 256 entries along each axis: per-token rows stacked per side.
_MAX_ROWS = 256
# Scalars (lengths, captured arrays read one element at a time), per dtype, in SMEM.
_MAX_SCALARS = 4096


@dataclasses.dataclass(frozen=True)
class Plan(kernel_plan.TilePlan):
  """Everything static the kernels are built from (hashable): the shared fields of
  `kernel_plan.TilePlan`, then these."""

  skip: bool = False  # EMPTY tiles skipped, FULL ones unmasked (from the block classes)
  q_lengths: bool = False
  kv_lengths: bool = False
  segments: bool = False
  mask_rows: tuple = ()  # ((const index, "t" or "s"), ...): mask_mod's per-token arrays
  score_reads: tuple = ()  # score_mod's float reads: gradients by the blockwise backward
  score_tables: tuple = ()  # always () (refused: Mosaic GPU has no gather)
  offsets: bool = False  # global positions from a ring step's offsets: not wired
  max_logits: bool = False  # the forward also writes each row's running max m
  fast: bool = False  # "flex_mgpu_ws": the warp-specialised forward (flex_mgpu_ws.py)
  fast_dq: bool = False  # ... and its warp-specialised dq kernel (`ws_dq`)
  fast_dkv: bool = False  # ... and its warp-specialised dk/dv kernel (`ws_dkv`)
  dkv_rows: int = 64  # ... whose query tiles have this many rows (`_ws_dkv_rows`)
  exp2_fma: int = 0  # the fast forward's kv-tile columns whose exp2 is fma_exp2's

  @property
  def H_padded(self) -> int:  # E: both heads, so the output tile reuses the query's SMEM
    return kernel_plan.round_up(max(self.H, self.D), _TILE)

  @property
  def D_padded(self) -> int:
    return self.H_padded


def smem_bytes(E: int, itemsize: int, sizes=(0, 0, 0, 0)) -> int:
  """The most SMEM a program of the three kernels asks for (bytes), at head width E;
  sizes: (int32 scalars, float32 scalars, query-side rows, key-side rows)."""
  t = _TILE * E * itemsize  # one [64, E] tile
  sq = _TILE * _TILE * itemsize  # one [64, 64] probability tile
  ints, floats, q_rows, kv_rows = sizes
  side = 4 * (ints + floats + 64 + _TILE * 2 * (q_rows + kv_rows))  # table row, rows x 3
  forward = t + 4 * t + sq + 8 * _TILE  # lse and max logits rows
  dq = 2 * t + 4 * t + sq + 8 * _TILE
  dkv = 2 * t + 4 * t + 2 * sq + 16 * _TILE
  return max(forward, dq, dkv) + side + 1024  # barriers


def plan(*, B: int, T: int, S: int, N: int, K: int, H: int, D: int, dtype,
         modifiers: Modifiers, return_weights: bool = False,
         return_max_logits: bool = False,
         block_q: int | None = None, block_kv: int | None = None,
         interpret: bool = False, fast: bool = False) -> Plan | str:
  """A `Plan` for this call, or the reason (a sentence) the kernel cannot take it.

  modifiers: the call's `Modifiers` (its arrays may be tracers or ShapeDtypeStructs:
  only shapes, dtypes and the mods' jaxprs are read). block_q, block_kv: a
  block_mask's tiles, unused (the tiles are 64 x 64; the classes are recomputed).
  interpret: run the kernels in the Mosaic GPU interpreter (any backend, for tests).
  return_max_logits: the forward also returns each row's largest visible logit.
  fast: plan "flex_mgpu_ws", the warp-specialised forward (Hopper only; interpreted with
  its register operands through SMEM; its backward is this kernel's unless ws_dq / ws_dkv).
  """
  del block_q, block_kv
  m = modifiers
  if fast:
    reason = compat.missing("pallas_mosaic_gpu") or compat.missing("pallas_mosaic_gpu_ws")
    if reason:
      return reason
  reason = compat.missing("pallas_mosaic_gpu") or (
      interpret and compat.missing("mosaic_gpu_interpret")) or kernel_plan.common_refusal(
          B=B, T=T, S=S, N=N, K=K, H=H, D=D, dtype=dtype, dtypes=_DTYPES, modifiers=m,
          return_weights=return_weights, platform="GPU")
  if reason:
    if np.dtype(dtype) == np.float32 and reason.startswith("dtype"):
      reason += " (wgmma would round float32 to TF32; flex_gpu takes float32)"
    return reason
  capability = gpu_capability()
  if capability is not None and capability < (9, 0):
    return (f"this GPU has compute capability {capability[0]}.{capability[1]}: TMA and "
            "wgmma need 9.0 (Hopper) or newer; flex_gpu runs there")
  if fast and capability is not None and capability[0] != 9:
    return (f"this GPU has compute capability {capability[0]}.{capability[1]}: the "
            "warp-specialised forward is written for Hopper's wgmma and setmaxnreg (9.x)")
  st = m.structure
  if (st.q_segment_ids is None) != (st.kv_segment_ids is None):
    return "segment ids for one side only"
  facts = kernel_plan.mods_facts(m.mods, smem=False)
  if isinstance(facts, str):
    return facts
  if facts.score_tables:
    return ("score_mod reads a table at positions (a relative bias): Mosaic GPU has no "
            "gather load; flex_gpu takes it")
  window = None if st.local_window is None else tuple(int(w) for w in st.local_window)
  # the fast forward's program spans two 64-row consumer tiles
  E = kernel_plan.round_up(max(H, D), _TILE)
  bq, bk = (2 * _TILE, _ws_kv_tile(E)) if fast else (_TILE, _TILE)
  p = Plan(B, T, S, N, K, H, D, bq, bk, float(m.scale), bool(st.is_causal), window,
           facts.has_mask, facts.has_score, bool(interpret),
           skip=facts.has_mask or bool(st.is_causal) or window is not None,
           q_lengths=st.q_lengths is not None, kv_lengths=st.kv_lengths is not None,
           segments=st.q_segment_ids is not None, mask_rows=facts.mask_rows,
           score_reads=facts.score_reads, max_logits=bool(return_max_logits), fast=fast,
           # the fast backward kernels' tiles fit SMEM up to E = 128
           fast_dq=fast and E <= 128 and bool(_WS_DQ.get()),
           fast_dkv=fast and E <= 128 and bool(_WS_DKV.get()),
           dkv_rows=_ws_dkv_rows(m.mods, facts) if fast else 64,
           exp2_fma=min(_WS_EXP2_FMA.get(), bk) if fast else 0)
  return _side_refusal(p, m, np.dtype(dtype).itemsize) or p


# "flex_mgpu_ws"'s kv tile when set (`ws_kv_tile`): for timing both on a card
_WS_KV_TILE = contextvars.ContextVar("flex_mgpu_ws_kv_tile", default=None)


def _ws_kv_tile(E: int) -> int:
  """The fast forward's kv tile: 128 keys up to E = 128 (K and V slots 128 KiB of SMEM,
  S 64 registers per consumer thread), else 64. NOT MEASURED on a GPU."""
  return _WS_KV_TILE.get() or (128 if E <= 128 else 64)


# "flex_mgpu_ws" with its warp-specialised dq kernel when set (`ws_dq`): NOT YET RUN on a GPU
_WS_DQ = contextvars.ContextVar("flex_mgpu_ws_dq", default=False)


@contextlib.contextmanager
def _set(setting: contextvars.ContextVar, value):
  """`setting` is `value` for the calls planned in this block."""
  token = setting.set(value)
  try:
    yield
  finally:
    setting.reset(token)


def ws_dq():
  """"flex_mgpu_ws" calls planned in this block take their dq from the warp-specialised
  dq kernel (compiled deviceless; until a card checks it, off by default)."""
  return _set(_WS_DQ, True)


_WS_DKV = contextvars.ContextVar("flex_mgpu_ws_dkv", default=False)


def ws_dkv():
  """"flex_mgpu_ws" calls planned in this block take dk, dv from the warp-specialised
  dk/dv kernel (compiled deviceless; until a card checks it, off by default)."""
  return _set(_WS_DKV, True)


# the warp-specialised dk/dv kernel's query tile when set (`ws_dkv_rows`): for timing both
_WS_DKV_ROWS = contextvars.ContextVar("flex_mgpu_ws_dkv_rows", default=None)


def _ws_dkv_rows(mods, facts) -> int:
  """The warp-specialised dk/dv kernel's query tile: 64 rows, or 32 where the mods' work
  on a tile is heavy, a score_mod or a mask_mod that divides (a floor division's or a
  remainder's sign fix-ups). Its consumers carry two [64, E] float32 accumulators; with
  64-row tiles those calls spilled 8 to 112 bytes a thread over the 240 registers
  (the compile tier, H100: soft-cap, ALiBi, chunked, and/or, a hand-written pair) and
  none with 32. 32 costs more instructions per query (+7% soft-cap, +19% causal in the
  inner loop's SASS), so the light cases keep 64. NOT MEASURED on a GPU."""
  if forced := _WS_DKV_ROWS.get():
    return forced
  divides = mods is not None and mods.has_mask and bool(
      {"div", "rem", "floor"} & tile_mods.primitives(mods.traced().mask_jaxpr))
  return 32 if facts.has_score or divides else 64


def ws_dkv_rows(rows: int):
  """"flex_mgpu_ws" calls planned in this block give the warp-specialised dk/dv kernel
  query tiles of `rows` (32 or 64) whatever their mods."""
  if rows not in (32, 64):
    raise ValueError(f"rows must be 32 or 64, got {rows}")
  return _set(_WS_DKV_ROWS, rows)


# the fast forward's columns of each kv tile whose exp2 runs on the FMA pipe (`ws_exp2_fma`)
_WS_EXP2_FMA = contextvars.ContextVar("flex_mgpu_ws_exp2_fma", default=0)


def ws_exp2_fma(columns: int):
  """"flex_mgpu_ws" calls planned in this block compute the softmax's exp2 of the last
  `columns` of each kv tile (a multiple of 16 from 0 to 128; at most the tile) by
  `fma_exp2` on the FP32 pipe, the rest by the special-function unit, which soft-cap's
  tanh also needs (docs/gpu_kernel.md). The forward only. NOT MEASURED on a GPU: off
  (0) by default until a card times it."""
  if isinstance(columns, bool) or not isinstance(columns, int) or not (
      0 <= columns <= 128 and columns % 16 == 0):
    raise ValueError(f"columns must be a multiple of 16 from 0 to 128, got {columns!r}")
  return _set(_WS_EXP2_FMA, columns)


def ws_kv_tile(block_kv: int):
  """"flex_mgpu_ws" calls planned in this block use kv tiles of `block_kv` (64 or 128)."""
  if block_kv not in (64, 128):
    raise ValueError(f"block_kv must be 64 or 128, got {block_kv}")
  return _set(_WS_KV_TILE, block_kv)


@functools.lru_cache(maxsize=None)
def gpu_capability() -> tuple[int, int] | None:
  """The compute capability of the GPU this process sees, or None (no GPU: an export from
  a CPU host, where the lowering cannot tell the target's generation)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  capability = getattr(devices[0], "compute_capability", None) if devices else None
  if not capability:
    return None
  return tuple(int(x) for x in str(capability).split(".")[:2])


def side_sizes(p: Plan, mods) -> tuple[int, int, int, int]:
  """(int32 scalars, float32 scalars, query-side rows, key-side rows) the kernels hold in
  SMEM for this call, from shapes alone (mods: traced `Mods` or None)."""
  ints = (p.B if p.q_lengths else 0) + (p.B if p.kv_lengths else 0)
  floats, rows = 0, {"t": p.B if p.segments else 0, "s": p.B if p.segments else 0}
  row_of = {ci for ci, _ in p.mask_rows}
  consts = [] if mods is None or mods.mask_jaxpr is None else [
      c for ci, c in enumerate(mods.mask_consts) if ci not in row_of]
  consts += [] if mods is None or mods.score_jaxpr is None else list(mods.score_consts)
  for c in consts:
    if jnp.issubdtype(np.dtype(c.dtype), jnp.floating):
      floats += int(np.prod(np.shape(c), dtype=np.int64))
    else:
      ints += int(np.prod(np.shape(c), dtype=np.int64))
  for ci, letter in p.mask_rows:
    shape = np.shape(mods.mask_consts[ci])
    rows[letter] += shape[0] if len(shape) == 2 else 1
  return ints, floats, rows["t"], rows["s"]


def _side_refusal(p: Plan, m: Modifiers, itemsize: int) -> str | None:
  """Why the side inputs do not fit SMEM or a TMA box, or None."""
  mods = None if m.mods is None else m.mods.traced()
  for ci, _ in p.mask_rows:
    dtype = np.dtype(mods.mask_consts[ci].dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
      return ("mask_mod reads a float per-token array (x[t] or x[s]): the kernel takes "
              "int and bool ones")
  sizes = side_sizes(p, mods)
  if max(sizes[:2]) > _MAX_SCALARS:
    return (f"{max(sizes[:2])} scalars (lengths, captured arrays) of one dtype: the kernel "
            f"holds up to {_MAX_SCALARS} in shared memory")
  if max(sizes[2:]) > _MAX_ROWS:
    return (f"{max(sizes[2:])} per-token rows (segment ids, mask_mod's x[t], x[s]) on one "
            f"side: a TMA copy takes up to {_MAX_ROWS}")
  need = smem_bytes(p.H_padded, itemsize, sizes)
  if p.fast:  # its forward's SMEM, beside the reference backward's
    ws = (itemsize * p.H_padded * (2 * _TILE + 4 * p.block_kv)
          + 4 * (sizes[0] + sizes[1] + 64 + 2 * _TILE * sizes[2] + 2 * p.block_kv * sizes[3])
          + 4 * 4 * _TILE + 1024)
    need = max(need, ws)
  if need > SMEM_BYTES:
    return (f"its tiles need {need // 1024} KiB of shared memory at head width "
            f"{p.H_padded}, over a Hopper SM's {SMEM_BYTES // 1024} KiB")
  return None
