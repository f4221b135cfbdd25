"""Every implementation of `dot_product_attention`, and each platform's order of preference.

An `Implementation` answers one question before any work, `plan(call,
platform)`: either a static, hashable plan (what it will compute: block sizes,
a kernel's mask expression, ...) or a reason in words why it cannot take the
call. `run(plan, query, key, value, modifiers, layout)` then computes it and
returns (out, weights or None, lse float32 [B, N, T] or None, max logits float32
[B, N, T] or None).

`implementation=None` walks `preference(call, platform)` and takes the first
implementation that plans (`jattn/_src/dispatch.py`), once per platform the
program may be lowered for; the registry is a plain dict, so adding a kernel
is one entry here and one name in `preference`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jattn._src import compat
from jattn._src.impl import cudnn, fused, kernel_plans, no_work
from jattn._src.core.block_sizes import BlockSizes, default_block_sizes
from jattn._src.impl.blockwise import blockwise_attention
from jattn._src.impl.vmap import vmapped_attention
from jattn._src.impl.xla import xla_attention
from jattn._src.kernels import (flex_gpu, flex_gpu_call, flex_mgpu, flex_mgpu_call, flex_tpu,
                                flex_tpu_call)

# The platforms a program is lowered for, as jax.lax.platform_dependent names
# them. "rocm" stands for every accelerator without a kernel of its own here.
PLATFORMS = ("cpu", "tpu", "cuda", "rocm")
_PLATFORM_NAMES = {"cpu": "CPU", "tpu": "TPU", "cuda": "NVIDIA GPU (CUDA)", "rocm": "ROCm GPU"}

# On CPU, blockwise beats the dense einsum from this many logits per head
# (T * S) on: measured with both laid out for XLA:CPU's matmuls, float32 and
# bfloat16, forward and forward+backward, causal or not, at T = S in 64..4096
# (docs/implementations.md, benchmarks/crossover.py). At 64 they tie.
CPU_BLOCKWISE_FROM = 128 * 128

# On TPU and GPU, calls the fused kernels cannot take run "xla" while its
# float32 logits [B, N, T, S] stay under this many bytes, else "blockwise"
# (linear memory). NOT MEASURED: no TPU or GPU was available; the rule rests
# only on the expectation that fused kernels beat the blockwise lax loop and
# that XLA's dense einsum beats it while the logits fit comfortably in memory
# (256 MiB: far below a TPU v4/v5 core's 16-95 GiB or any datacentre GPU's).
ACCELERATOR_XLA_LOGITS_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to compute attention.

  platforms: where it runs ("cpu", "tpu", "cuda", "rocm"); None = everywhere.
  interpretable: a Pallas kernel that runs anywhere inside `pallas_interpret()`.
  forward_mode: its passes have forward-mode derivatives, so `jax.jvp` of `jax.grad` (a
    Hessian-vector product) and `jax.hessian` pass through it; jax's own kernels have none
    (a Pallas call or cuDNN's custom call has no JVP rule).
  vmaps_over_explicit_axes: jax can batch it under a vmap whose mapped axis is sharded
    over Explicit mesh axes (jax's batching rules of Pallas calls and of loops nested
    in loops refuse that axis: NotImplementedError, "Resource axis ... not found").
  plan(call, platform) -> a hashable plan, or a str: the reason it cannot.
  run(plan, query, key, value, modifiers, layout) -> (out, weights | None, lse | None,
    max_logits | None).
  """

  name: str
  plan: Callable
  run: Callable
  platforms: tuple[str, ...] | None = None
  interpretable: bool = False
  forward_mode: bool = True
  vmaps_over_explicit_axes: bool = False

  def plan_for(self, call, platform: str):
    """The plan on `platform`, or the reason in words (the platform's, the vmap's or the
    plan's)."""
    if not (self.platforms is None or platform in self.platforms
            or (self.interpretable and call.interpret)):
      needs = " or ".join(_PLATFORM_NAMES[p] for p in self.platforms)
      return f"it needs a {needs}, the program is lowered for {platform!r}"
    mapped = compat.vmapped_mesh_axes()
    if mapped and not self.vmaps_over_explicit_axes:
      return (f"the call is under a jax.vmap whose mapped axis is sharded over the "
              f"Explicit mesh axes {sorted(mapped)}, over which jax batches only the dense "
              f"paths (its batching of Pallas calls and of nested loops refuses such an "
              f"axis); implementation='xla' can, or fold that axis into the batch B, or "
              f"make those mesh axes Auto")
    return self.plan(call, platform)


@dataclasses.dataclass(frozen=True)
class DensePlan:
  """"xla" and "vmap" take every call: the [B, N, T, S] logits are formed."""


@dataclasses.dataclass(frozen=True)
class BlockwisePlan:
  block_sizes: BlockSizes


def _dense_plan(call, platform):
  return DensePlan()


def _blockwise_plan(call, platform):
  if call.return_weights:
    return ("return_weights=True needs the [B, N, T, S] weights, which "
            "implementation='blockwise' never forms; use implementation='xla'")
  return BlockwisePlan(call.block_sizes or default_block_sizes(platform))


def _flex_plan(kernel, **options):
  """plan(call, platform) of jattn's own kernels (flex_tpu, flex_gpu): the call's static
  facts (and `options`) handed to the kernel's `plan`."""
  def plan(call, platform):
    if not isinstance(call.scale, (int, float)):
      return "a traced scale: the kernel takes a Python number"
    has_block_mask = call.has_mods and call.modifiers.mods.block_mask is not None
    block = call.block_sizes if has_block_mask else None  # the block_mask's tiles
    d = call.dims
    # the kernel reads the scale as a constant, and the ready-made mask mods traced
    modifiers = call.modifiers.replace(scale=float(call.scale))
    return kernel.plan(B=d.B, T=d.T, S=d.S, N=d.N, K=d.K, H=d.H, D=d.D, dtype=call.dtype,
                       modifiers=modifiers, return_weights=call.return_weights,
                       return_max_logits=call.return_max_logits,
                       block_q=None if block is None else block.q,
                       block_kv=None if block is None else block.kv,
                       interpret=call.interpret, **options)
  return plan


IMPLEMENTATIONS = {
    "xla": Implementation(
        "xla", _dense_plan, lambda plan, *args: xla_attention(*args),
        vmaps_over_explicit_axes=True),
    "vmap": Implementation(
        "vmap", _dense_plan, lambda plan, *args: vmapped_attention(*args),
        vmaps_over_explicit_axes=True),
    "blockwise": Implementation(
        "blockwise", _blockwise_plan,
        lambda plan, *args: blockwise_attention(*args, block_sizes=plan.block_sizes)),
    "cudnn": Implementation(
        "cudnn", cudnn.plan, cudnn.run, platforms=("cuda",), forward_mode=False),
    "splash": Implementation(
        "splash", kernel_plans.splash_plan, fused.splash_implementation,
        platforms=("tpu",), interpretable=True, forward_mode=False),
    "pallas": Implementation(
        "pallas", kernel_plans.pallas_plan, fused.pallas_implementation,
        platforms=("cuda",), interpretable=True, forward_mode=False),
    "flex_tpu": Implementation(  # jattn's own TPU kernel: any mask_mod / score_mod
        "flex_tpu", _flex_plan(flex_tpu), flex_tpu_call.run, platforms=("tpu",), interpretable=True),
    "flex_gpu": Implementation(  # jattn's own GPU kernel (Triton): any mask_mod / score_mod
        "flex_gpu", _flex_plan(flex_gpu), flex_gpu_call.run, platforms=("cuda",), interpretable=True),
    "flex_mgpu": Implementation(  # jattn's own GPU kernel on Mosaic GPU (Hopper): the same mods
        "flex_mgpu", _flex_plan(flex_mgpu), flex_mgpu_call.run, platforms=("cuda",),
        interpretable=True),
    # its warp-specialised forward (FlashAttention-3's design): implementation=None takes
    # it on a Hopper GPU within what the H100 run checked (`hopper_fast_path`)
    "flex_mgpu_ws": Implementation(
        "flex_mgpu_ws", _flex_plan(flex_mgpu, fast=True), flex_mgpu_call.run_ws,
        platforms=("cuda",), interpretable=True),
}
# A call with B, T or S of 0 computes nothing, in every implementation (no_work.py).
IMPLEMENTATIONS = {name: no_work.taking_empty_calls(implementation)
                   for name, implementation in IMPLEMENTATIONS.items()}
# "ring" and "context_parallel" are no entries: each is a shard_map over the context mesh
# around the blockwise loop (jattn/_src/parallel/ring.py), chosen only by name.
NAMES = tuple(IMPLEMENTATIONS) + ("ring", "context_parallel")


def preference(call, platform: str) -> tuple[str, ...]:
  """The implementations `implementation=None` tries on `platform`, best first."""
  d = call.dims
  if platform == "cpu":
    small = d.T * d.S < CPU_BLOCKWISE_FROM
    return ("xla", "blockwise") if small else ("blockwise", "xla")
  fits = 4 * d.B * d.N * d.T * d.S <= ACCELERATOR_XLA_LOGITS_BYTES
  generic = ("xla", "blockwise") if fits else ("blockwise", "xla")
  # TPU: flex_tpu first for every mask, splash where flex_tpu refuses. By the TPU
  # compiler's schedule (benchmarks/tpu_schedule.py, docs/tpu_kernel.md; estimates, no
  # TPU has run it) flex_tpu is at 0.88x to 0.99x of splash's time with no mask, causal
  # and a window, and 0.15x to 0.43x with documents (splash skips no tile between them).
  # CUDA, measured on an H200 (benchmarks/results/gpu_h200_bench.json, bfloat16, H = 128,
  # T = 4k and 16k): cuDNN fastest wherever it applies; flex_gpu before jax's Pallas mha,
  # which is 1.6x (causal) to 2x (no mask) slower forward + backward and, with document
  # ids, 4.5x (forward) and 8.7x (forward + backward) slower, as it skips no block.
  # flex_mgpu (Mosaic GPU) after flex_gpu: on an H100 (gpu_h100_bench*.json) within 10% of
  # flex_gpu either way; it takes over where flex_gpu cannot (a jax without Pallas Triton).
  # flex_mgpu_ws, its warp-specialised forward, before flex_gpu where `hopper_fast_path`
  # says so (the GPU the process sees is a Hopper, the call what the H100 run checked).
  if platform == "tpu":
    kernels = ("flex_tpu", "splash")
  elif platform == "cuda":
    fast = ("flex_mgpu_ws",) if hopper_fast_path(call) else ()
    kernels = ("cudnn", *fast, "flex_gpu", "flex_mgpu", "pallas")
  else:
    kernels = ()
  return kernels + generic


# The calls flex_mgpu_ws was checked on, on an H100: bfloat16, H = D = 128
# (tools/mgpu_fast_check.py, benchmarks/results/gpu_h100_mgpu_fast.json: 15 value checks
# against float64: causal, documents, a sliding window, chunked, prefix-LM, soft-cap,
# ALiBi, grouped heads, T != S, unaligned T, empty rows). Its backward there is
# flex_mgpu's kernels (checked over tests/kernels/test_gpu.py's cases on the same card;
# since 2026-11-28 they accumulate into carried accumulators, which no card has run yet:
# docs/gpu_kernel.md, "flex_mgpu's spills, fixed").
_HOPPER_CHECKED = (jnp.dtype(jnp.bfloat16), 128)


def hopper_fast_path(call) -> bool:
  """implementation=None tries flex_mgpu_ws before flex_gpu: the process sees a GPU of
  compute capability 9.x and the call is bfloat16 with H = D = 128 (as checked on the H100).

  On the H100 it took 0.49x to 0.75x of flex_gpu's forward time (causal, 16 documents,
  soft-cap; T = 4k and 16k) and 0.85x of the causal forward + backward. Where no GPU is
  seen (an export from a CPU host), the target's generation is unknown and the order
  stays portable (flex_gpu runs on Ampere too); an Ampere or Blackwell GPU never gets it.
  """
  capability = flex_mgpu.gpu_capability()
  if capability is None or capability[0] != 9:
    return False
  dtype, heads = _HOPPER_CHECKED
  return (jnp.dtype(call.dtype) == dtype and call.dims.H == heads and call.dims.D == heads)


def _window(call) -> bool:
  """The call has a local_window_size (flex_tpu runs only each row's tiles in the window)."""
  return call.structure.local_window is not None


def _documents(call) -> bool:
  """The call has segment ids, or its mask_mod holds a ready-made mods.document (each
  kernel reads the other as its own)."""
  return call.structure.q_segment_ids is not None or (
      call.mask_mod is not None and kernel_plans.find_document(call.mask_mod) is not None)


def why_first(call, platform: str, name: str) -> str | None:
  """Why `preference` puts `name` before a kernel that could also take the call, in words
  (`jattn.explain` shows it), or None where no other kernel competes for it."""
  if platform == "cuda" and name == "flex_mgpu_ws":
    return ("flex_mgpu_ws before flex_gpu on this Hopper GPU (bfloat16, H = D = 128, as "
            "checked against float64 on an H100): measured there (bfloat16, N = 16, H = 128, "
            "T = 4k and 16k), 0.49x to 0.75x of flex_gpu's forward time with causal, 16 "
            "documents and soft-cap, and 0.85x of its causal forward + backward (the "
            "backward is flex_mgpu's kernels)")
  if platform != "tpu" or name != "flex_tpu":
    return None
  estimate = "estimated from the TPU compiler's schedule (benchmarks/tpu_schedule.py), not "
  if _documents(call):
    return ("flex_tpu before splash for segment ids and mods.document masks: splash applies "
            "segment ids on every tile and skips none, flex_tpu skips the tiles between "
            "documents; "
            + estimate + "measured on a TPU: 0.15x to 0.43x of splash's time (v5e, v6e; 16 "
            "documents, H = 128 and 256, T = 4k and 16k)")
  if _window(call):
    return ("flex_tpu before splash for a local_window_size: its grid runs only each row's "
            "tiles in the window and a window's partial tile tests one bound; " + estimate
            + "measured on a TPU: 0.94x to 1.02x of splash's time, forward and forward + "
            "backward (v5e, v6e; causal, a 1024-token window, H = 128 and 256, T = 4k and "
            "16k)")
  return ("flex_tpu before splash: one kernel for every mask, splash where flex_tpu refuses; "
          + estimate + "measured on a TPU: 0.88x to 0.99x of splash's time with no mask or "
          "causal, forward, and 0.91x to 1.02x forward + backward (v5e, v6e; H = 128 and "
          "256; T = 4k and 16k)")
