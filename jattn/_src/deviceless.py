"""Compiling for an accelerator this host does not have: compile-only devices of a target.

`jax.export` stops at StableHLO; the TPU compiler (Mosaic included), Triton and
ptxas run only at `.compile()`, where VMEM, shared memory and register limits are
met. jax's compile-only topologies give devices of a named TPU generation (from
libtpu, `pip install "jax[tpu]"`) or GPU (from the CUDA plugin,
`jattn/_src/deviceless_cuda.py`) on a CPU host; a function traced on
ShapeDtypeStructs sharded over them and lowered for their platform compiles as it
would on the chip, and is never run. The platform comes from the target's name,
never from `jax.devices()`.

    target   "v5e", "v6e", "v5p", "tpu7x" (one chip), "v5e=2x2", "v5p=2x2x1" (a slice),
             "h100", "h200"
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import re

import jax
import numpy as np

from jattn._src import lowering

# One chip of each TPU generation, as libtpu's topology names spell it.
TPU_TARGETS = {"v5e": "v5e=1x1", "v6e": "v6e=1x1", "v5p": "v5p=1x1x1", "tpu7x": "tpu7x=1x1x1"}
CUDA_TARGETS = ("h100", "h200")
TARGETS = tuple(TPU_TARGETS) + CUDA_TARGETS

# Custom-call targets that are kernels (Mosaic TPU, Triton, Mosaic GPU, cuDNN).
_KERNEL_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")
_CUSTOM_CALL = re.compile(
    r"%([\w.\-]+) = .*? custom-call\(.*?custom_call_target=\"([^\"]+)\"")


def platform_of(target: str) -> str:
  """"tpu" or "cuda": the platform a target's programs are lowered for."""
  name = _check_target(target)
  return "cuda" if name in CUDA_TARGETS else "tpu"


def devices(target: str) -> tuple:
  """The compile-only devices of `target` ("v5e", "v5e=2x2", "h100", ...), in id order."""
  name = _check_target(target)
  if name in CUDA_TARGETS:
    return tuple(_cuda_devices(name))
  return _tpu_devices(TPU_TARGETS.get(target, target))


def mesh(target: str, axes: dict[str, int] | None = None) -> jax.sharding.Mesh:
  """A mesh over `target`'s devices: axes name -> size (their product the device
  count); None: one axis "x" over every device."""
  devs = devices(target)
  axes = {"x": len(devs)} if axes is None else dict(axes)
  if int(np.prod(list(axes.values()))) != len(devs):
    raise ValueError(f"mesh axes {axes} hold {int(np.prod(list(axes.values())))} devices; "
                     f"target {target!r} has {len(devs)}")
  return jax.sharding.Mesh(np.asarray(devs, dtype=object).reshape(tuple(axes.values())),
                           tuple(axes))


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What the compiler made of a program for one target.

  kernels: the kernels in the compiled program, by name ("jattn_flex_tpu_fwd",
    "splash_mha_fwd_no_residuals", ...), one entry per call site, in program order.
  custom_calls: (name, custom-call target) of every custom call, kernels included.
  memory: `compiled.memory_analysis()`'s device figures in bytes ("argument",
    "output", "temp", "alias", "generated_code"): temp is the scratch the program
    holds in HBM (a [T, S] logits buffer would be there).
  vmem_limits: for TPU kernels that set one, the scoped VMEM limit (bytes) each was
    compiled under; the compiler reports no VMEM use, so this is the bound it checked.
  """

  target: str
  platform: str
  kernels: tuple[str, ...]
  custom_calls: tuple[tuple[str, str], ...]
  memory: dict
  vmem_limits: dict

  def __str__(self) -> str:
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    kernels = ", ".join(dict.fromkeys(self.kernels)) or "none (XLA's own fusions only)"
    lines = [f"compiled for {self.target} ({self.platform}): kernels {kernels}",
             "    memory: " + ", ".join(f"{k} {mib(v)}" for k, v in self.memory.items())]
    if self.vmem_limits:
      lines.append("    VMEM limit: " + ", ".join(f"{k} {mib(v)}"
                                                  for k, v in self.vmem_limits.items()))
    return "\n".join(lines)


def compile_for(target: str, fn, *args, mesh: jax.sharding.Mesh | None = None):
  """fn(*args) jitted, lowered for `target`'s platform and compiled on its compile-only
  devices -> (compiled, `CompileReport`). Nothing runs.

  args: pytrees of arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are
  used). A ShapeDtypeStruct with a sharding keeps it (it must be on `devices(target)`);
  every other leaf is replicated over `mesh`, by default the target's first device
  (one core: a TPU7x chip is two devices, and a kernel is never split between them).
  `mesh`, when given, is also set (`jax.set_mesh`) while tracing, for calls that read
  the ambient mesh (`context_parallel_attention`, the Transformer's rules).
  """
  compiled = lowering.lowered_on(platform_of(target), devices(target), fn, args, mesh).compile()
  return compiled, report(target, compiled)


def report(target: str, compiled) -> CompileReport:
  """The `CompileReport` of a program compiled for `target`."""
  calls, limits = [], {}
  for line in compiled.as_text().splitlines():
    found = _CUSTOM_CALL.search(line)
    if found is None:
      continue
    name, call_target = re.sub(r"\.\d+$", "", found.group(1)), found.group(2)
    calls.append((name, call_target))
    limit = _vmem_limit(line) if call_target == "tpu_custom_call" else None
    if limit is not None:
      limits[name] = limit
  kernels = tuple(n for n, t in calls if t in _KERNEL_CALLS or t.startswith("__cudnn$"))
  stats = compiled.memory_analysis()
  memory = {k: int(getattr(stats, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "temp", "alias", "generated_code")}
  return CompileReport(target, platform_of(target), kernels, tuple(calls), memory, limits)


# The kernels of each implementation, by name prefix, as the compiled program names them.
KERNEL_PREFIXES = {"flex_tpu": ("jattn_flex_tpu_",), "splash": ("splash_mha_", "splash_mqa_")}


def check_kernels(report: CompileReport, implementation: str) -> None:
  """A RuntimeError unless the compiled program runs `implementation`'s kernels (and no
  other jattn or splash kernel): the plan and the compiled program must agree."""
  ours = tuple(p for ps in KERNEL_PREFIXES.values() for p in ps)
  found = [k for k in report.kernels if k.startswith(ours)]
  wanted = KERNEL_PREFIXES.get(implementation, ())
  stray = [k for k in found if not k.startswith(wanted)] if wanted else found
  if (wanted and not found) or stray:
    raise RuntimeError(
        f"the program compiled for {report.target} runs the kernels {list(report.kernels)}, "
        f"where jattn's plan chose {implementation!r}: a bug in jattn, please report it")


def _vmem_limit(line: str) -> int | None:
  """A Mosaic call's scoped VMEM limit from its backend config, if it sets one."""
  start = line.find("backend_config=")
  if start < 0:
    return None
  try:
    config, _ = json.JSONDecoder().raw_decode(line, start + len("backend_config="))
  except ValueError:
    return None
  limit = config.get("custom_call_config", {}).get("vmem_limit_bytes")
  return None if limit is None else int(limit)


def _check_target(target) -> str:
  """The generation's name of a target ("v5e=2x2" -> "v5e"); a ValueError for others."""
  if not isinstance(target, str):
    raise TypeError(f"target must be a str such as 'v5e' or 'h100', got {type(target).__name__}")
  name = target.split("=")[0].strip().lower()
  if name not in TARGETS or (name in CUDA_TARGETS and name != target):
    raise ValueError(f"target {target!r} is not one of {', '.join(TARGETS)} (or a TPU slice "
                     "such as 'v5e=2x2', 'v5p=2x2x1')")
  return name


def tpu_available() -> str | None:
  """None where the TPU compiler (libtpu) is installed, else why not, in words."""
  if importlib.util.find_spec("libtpu") is None:
    return ("compiling for a TPU from this host needs libtpu, which is not installed: "
            "pip install 'jax[tpu]' (the version matching jax)")
  return None


@functools.lru_cache(maxsize=None)
def _tpu_devices(topology: str) -> tuple:
  missing = tpu_available()
  if missing:
    raise RuntimeError(missing)
  from jax.experimental import topologies
  try:
    return tuple(topologies.get_topology_desc(topology, "tpu").devices)
  except Exception as error:  # libtpu's own message names the bad part
    if "lockfile" in str(error):
      raise RuntimeError(
          "libtpu is loaded by another process on this host and holds its lock; for "
          "compile-only devices set ALLOW_MULTIPLE_LIBTPU_LOAD=1 before jax loads libtpu "
          f"({error})") from error
    raise ValueError(f"libtpu gives no compile-only devices for {topology!r}: {error}") from error


def _cuda_devices(name: str):
  try:
    import jattn._src.deviceless_cuda as deviceless_cuda
  except ModuleNotFoundError as error:
    if error.name != "jattn._src.deviceless_cuda":
      raise
    raise RuntimeError(
        f"compiling for {name!r} needs jattn/_src/deviceless_cuda.py (the CUDA targets), "
        f"which this copy of jattn does not have: {error}") from error
  return deviceless_cuda.cuda_devices(name)
