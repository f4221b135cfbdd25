"""The "flex_gpu" kernel: flash attention in Pallas for NVIDIA GPUs (the Triton
lowering: Ampere and Hopper), with the user's mask_mod and score_mod evaluated
inside the kernel on each tile, as "flex_tpu" does on TPUs.

`plan(...)` looks only at static facts of a call and returns a hashable `Plan`, or a
reason in words for what the kernel cannot take. `flex_gpu_call.run(plan, ...)` has the
contract of `blockwise_attention`: -> (out, None, lse float32 [B, N, T], max logits
float32 [B, N, T] or None: each row's running max, written when the plan asks).

Grid (B, N, T / block_q): each program holds one query tile of head n and loops
(in the kernel) over the kv tiles of kv head n // G that are not EMPTY, in
ascending order, from a per-row list made from the block classes (closed forms
for causal, windows and jattn.mods masks, a block_mask, else mask_mod block by
block: the tables "flex_tpu" uses); a FULL tile runs without the mask functions.
The mods are evaluated on [block_q, block_kv] tiles of positions by
`tile_mods` (the TPU kernel's evaluator): captured arrays are whole-array
inputs, read with ordinary loads (a relative-bias table with a gather). Unlike
jax's Pallas `mha`, the kernel also takes windows, sequence lengths, segment ids
that differ between queries and keys, and T != S. Sinks are applied to
(out, lse) after the kernel, as "blockwise" does.

Backward: a custom VJP with a dq kernel (grid B, N, T / block_q) and a dk/dv
kernel (grid B, K, S / block_kv, looping over the G query heads of the kv head
and their non-EMPTY query tiles, summed in registers: no atomics), recomputing
the weights from out and lse. Gradients into score_mod's captured float arrays
read one element at a time (ALiBi slopes, a [B, N] table, a traced cap): the dq
kernel writes, per program, each read's gradient and its flat index, and XLA sums
them by a one-hot contraction (no atomics: the same bits every run). A table read
at positions (a relative bias) likewise: each dq program writes a gradient row of
the table's width and the table row it read (`table_grads`).
The kernels are in `flex_gpu_kernels`; docs/gpu_kernel.md has the design.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax.numpy as jnp
import numpy as np

from jattn._src import compat
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import kernel_plan

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Tiles and launch parameters. NOT MEASURED on a GPU (none was available): 64 x 64
# tiles and 4 warps are the usual FlashAttention-2 choice for head sizes <= 128.
_BLOCK = 64
_MIN_BLOCK = 16  # Triton's dot takes operands of at least 16 x 16
# The widest table read at positions: the dq kernel holds a row of its gradient per read
# in registers (1024 float32 over 128 threads: 8 each). Not measured on a GPU.
_MAX_TABLE = 1024
# The widest padded head whose tiles fit a Hopper SM's 227 KiB of shared memory, by bytes
# per element: on an H200 (jax 0.11.2, causal, forward and backward), float32 ran at
# 128 and failed at 256 ("Shared memory size limit exceeded"); 16-bit floats ran at 256.
_MAX_HEAD = {2: 256, 4: 128}


@dataclasses.dataclass(frozen=True)
class Plan(kernel_plan.TilePlan):
  """Everything static the kernels are built from (hashable): the shared
  fields of `kernel_plan.TilePlan`, then these."""

  # EMPTY tiles skipped, FULL ones unmasked (from the block classes)
  skip: bool = False
  q_lengths: bool = False
  kv_lengths: bool = False
  segments: bool = False
  # ((const index, "t" or "s"), ...): mask_mod's per-token arrays, read as rows
  mask_rows: tuple = ()
  # const index of each read of a float array captured by score_mod, in the order the
  # tile evaluation reads them: the dq kernel returns one gradient per read
  score_reads: tuple = ()
  # (const index, ...): score_mod's tables read at positions (a relative bias), by a
  # gather load
  score_tables: tuple = ()
  num_warps: int = 4
  num_stages: int = 2
  # positions are global from traced offsets (a ring step's): not wired on GPU yet
  offsets: bool = False
  # const index of each read of a float table at positions, in evaluation order: the
  # dq kernel returns one gradient row per read and query tile (`table_grads`)
  table_reads: tuple = ()
  # the forward also writes each row's running max m (return_max_logits)
  max_logits: bool = False

  @property
  def reads_padded(self) -> int:  # the dq kernel's vector of read gradients
    return max(_MIN_BLOCK, _next_power_of_two(len(self.score_reads)))

  @property
  def table_reads_padded(self) -> int:  # the dq kernel's vector of the table rows read
    return max(_MIN_BLOCK, _next_power_of_two(len(self.table_reads)))

  @property
  def H_padded(self) -> int:  # Triton's tiles have power-of-two sides
    return max(_MIN_BLOCK, _next_power_of_two(self.H))

  @property
  def D_padded(self) -> int:
    return max(_MIN_BLOCK, _next_power_of_two(self.D))


def _next_power_of_two(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _tile(length: int, asked: int | None) -> int:
  """A power-of-two tile between 16 and 64 (or the block_mask's), no longer than needed."""
  if asked is not None and asked >= _MIN_BLOCK and asked == _next_power_of_two(asked):
    return asked
  return max(_MIN_BLOCK, min(_BLOCK, _next_power_of_two(length)))


def plan(*, B: int, T: int, S: int, N: int, K: int, H: int, D: int, dtype,
         modifiers: Modifiers, return_weights: bool = False,
         return_max_logits: bool = False,
         block_q: int | None = None, block_kv: int | None = None,
         interpret: bool = False) -> Plan | str:
  """A `Plan` for this call, or the reason (a sentence) the kernel cannot take it.

  modifiers: the call's `Modifiers` (its arrays may be tracers or
  ShapeDtypeStructs: only shapes, dtypes and the mods' jaxprs are read).
  block_q, block_kv: a block_mask's tiles, taken when they are powers of two >= 16.
  interpret: run the Pallas kernels in interpret mode (any backend, for tests).
  return_max_logits: the forward also returns each row's largest visible logit.
  """
  m = modifiers
  reason = compat.missing("pallas_triton") or kernel_plan.common_refusal(
      B=B, T=T, S=S, N=N, K=K, H=H, D=D, dtype=dtype, dtypes=_DTYPES, modifiers=m,
      return_weights=return_weights, platform="GPU")
  if reason:
    return reason
  widest = _MAX_HEAD[np.dtype(dtype).itemsize]
  if max(H, D) > widest:
    return (f"head sizes H = {H}, D = {D}: its {8 * np.dtype(dtype).itemsize}-bit tiles "
            f"take heads of up to {widest} (GPU shared memory)")
  st = m.structure
  if (st.q_segment_ids is None) != (st.kv_segment_ids is None):
    return "segment ids for one side only"
  facts = kernel_plan.mods_facts(m.mods, smem=False)
  if isinstance(facts, str):
    return facts
  if facts.table_width > _MAX_TABLE:
    return (f"score_mod: a table of width {facts.table_width} read at positions; the dq "
            f"kernel sums its gradient in a row of at most {_MAX_TABLE} entries")
  window = None if st.local_window is None else tuple(int(w) for w in st.local_window)
  plan = Plan(B, T, S, N, K, H, D, _tile(T, block_q), _tile(S, block_kv), float(m.scale),
              bool(st.is_causal), window, facts.has_mask, facts.has_score, bool(interpret),
              skip=facts.has_mask or bool(st.is_causal) or window is not None,
              q_lengths=st.q_lengths is not None, kv_lengths=st.kv_lengths is not None,
              segments=st.q_segment_ids is not None, mask_rows=facts.mask_rows,
              score_reads=facts.score_reads, score_tables=facts.score_tables,
              table_reads=facts.table_reads,
              max_logits=bool(return_max_logits))
  return dataclasses.replace(plan, **(_LAUNCH.get() or {}))


# The tile sweep of benchmarks/gpu_kernels.py sets the launch parameters of the calls
# planned inside `launch_parameters(...)`; they enter the Plan, so the jit cache keys on them.
_LAUNCH = contextvars.ContextVar("jattn_flex_gpu_launch", default=None)


@contextlib.contextmanager
def launch_parameters(*, block_q: int, block_kv: int, num_warps: int, num_stages: int):
  """Calls planned in this block use these tiles (powers of two >= 16) and launch sizes."""
  for name, tile in (("block_q", block_q), ("block_kv", block_kv)):
    if tile < _MIN_BLOCK or tile != _next_power_of_two(tile):
      raise ValueError(f"{name} must be a power of two >= {_MIN_BLOCK}, got {tile}")
  token = _LAUNCH.set(dict(block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                           num_stages=num_stages))
  try:
    yield
  finally:
    _LAUNCH.reset(token)
