"""Compile for an NVIDIA H100 or H200 from a host with no GPU: compile-only CUDA devices.

Recipe (Python 3.12, `pip install "jax[cuda13]"`, `JAX_PLATFORMS=cpu`, no GPU needed):

    import jax, jax.numpy as jnp
    from jattn._src import deviceless_cuda
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    compiled = deviceless_cuda.compile_for("h100", f, x)     # or "h200"; jax's Compiled
    compiled.as_text()                                       # the optimized HLO

By hand, what `compile_for` does:

    devices = deviceless_cuda.cuda_devices("h100")           # one compile-only device
    mesh = jax.sharding.Mesh(devices, ("x",))
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16,
                             sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    lowered = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    compiled = lowered.compile()
    # Pallas Triton kernels also need the card named to their lowering: lower inside
    # `jattn.lowering_for("cuda", device_kind=devices[0].device_kind)`.

The compile runs XLA's GPU compiler for the card: cuDNN's graph build, Triton and
Mosaic GPU to PTX, and ptxas to SASS, with the card's shared memory and register
limits (a kernel over them fails here as on the card). It does not run anything.

What a compile needs installed (tried in a bare venv, jax 0.12.0.1): jax-cuda13-plugin and
jax-cuda13-pjrt without their nvidia extras, and nvidia-cudnn-cu13 (cuDNN's graph build;
without it jattn's cudnn plan refuses); XLA's PTX compiler and libdevice are inside the
plugin. `benchmarks/gpu_static.py` also runs ptxas (nvidia-cuda-nvcc) and nvdisasm
(nvidia-cuda-nvdisasm) itself.

Set `JAX_PLATFORMS=cpu` (or let this module set `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`
before jax first initializes its backends): otherwise the CUDA plugin, finding no GPU
driver, refuses to register and no CUDA topology exists in the process.

Where the card's description comes from: the CUDA plugin (`xla_cuda_plugin.so`) embeds
XLA's `GpuTargetConfigProto` text files (XLA's `xla/backends/gpu/target_config/`), one
per card; `target_config(target)` reads the one whose `device_description_str` names
the card from the installed plugin, so the description matches the compiler in use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import mmap
import os
import pathlib
import re

import jax

from jattn._src import lowering

# target -> the device_description_str of the plugin's embedded description
TARGETS = {
    "h100": "NVIDIA H100 80GB HBM3",      # H100 SXM5, 80 GB
    "h200": "NVIDIA H200 141GB HBM3e",
}

# the CUDA plugin packages jax ships, newest first
_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
CONFIGS_FOLDER = "JATTN_CUDA_TARGET_CONFIGS"  # a folder of <target>.txtpb, read first


@functools.cache
def plugin_path() -> pathlib.Path | None:
  """The installed CUDA PJRT plugin's shared library, or None."""
  for name in _PLUGINS:
    try:
      spec = importlib.util.find_spec(name)
    except ImportError:  # no jax_plugins namespace at all
      return None
    if spec is not None and spec.submodule_search_locations:
      for folder in spec.submodule_search_locations:
        library = pathlib.Path(folder) / "xla_cuda_plugin.so"
        if library.exists():
          return library
  return None


def missing() -> str | None:
  """Why a deviceless CUDA compile cannot run in this process (a sentence), or None."""
  if plugin_path() is None:
    return ("the CUDA plugin is not installed (pip install 'jax[cuda13]'; "
            f"none of {', '.join(_PLUGINS)} found)")
  from jax._src import xla_bridge
  if getattr(xla_bridge, "_plugins_registered", False) and (
      "cuda" not in getattr(xla_bridge, "_topology_factories", {})):
    return (f"jax initialized its backends without the CUDA plugin (with no GPU driver it "
            f"refuses to register unless {_SKIP_CHECK}=1 or JAX_PLATFORMS=cpu is set "
            f"before jax starts)")
  return None


def _descriptions(library: pathlib.Path) -> dict[str, str]:
  """device_description_str -> the GpuTargetConfigProto text embedded in `library`."""
  found = {}
  with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    at = m.find(b"gpu_device_info {")
    while at >= 0:
      # each embedded file is one NUL-terminated string
      start, end = m.rfind(b"\0", 0, at) + 1, m.find(b"\0", at)
      text = m[start:end].decode("utf-8", "replace")
      name = re.search(r'^device_description_str: "([^"]*)"', text, re.M)
      if name:
        found.setdefault(name.group(1), text)
      at = m.find(b"gpu_device_info {", end)
  return found


@functools.cache
def target_config(target: str) -> str:
  """The card's `xla.GpuTargetConfigProto` in text form: from the folder named by
  $JATTN_CUDA_TARGET_CONFIGS where set (`<target>.txtpb`, as `save_target_configs` writes
  it), else from the installed CUDA plugin.

  The folder is for a jax whose plugin embeds no descriptions (jax 0.11, the lent cards'
  version), which compiles for a card all the same when given one (tried: jax 0.11.2):
  save them from a jax 0.12 venv, then point the variable at the folder. Read once per
  target and process (cached), so set the variable before the first compile."""
  if target not in TARGETS:
    raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
  folder = os.environ.get(CONFIGS_FOLDER)
  if folder:
    path = pathlib.Path(folder) / f"{target}.txtpb"
    if not path.is_file():
      raise RuntimeError(f"${CONFIGS_FOLDER}={folder} has no {path.name} (write it with "
                         f"deviceless_cuda.save_target_configs under jax >= 0.12)")
    return path.read_text()
  library = plugin_path()
  if library is None:
    raise RuntimeError(f"cannot compile for {target}: {missing()}")
  descriptions = _descriptions(library)
  if TARGETS[target] not in descriptions:
    raise RuntimeError(f"the CUDA plugin {library} embeds no description of "
                       f"{TARGETS[target]!r} (it has {sorted(descriptions)}; a jax whose "
                       f"plugin embeds none reads them from ${CONFIGS_FOLDER})")
  return descriptions[TARGETS[target]]


def save_target_configs(folder) -> list[pathlib.Path]:
  """Writes every target's description from this process's plugin into `folder` as
  `<target>.txtpb` (for $JATTN_CUDA_TARGET_CONFIGS in an older jax's process)."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  written = []
  for target in TARGETS:
    path = folder / f"{target}.txtpb"
    path.write_text(target_config(target))
    written.append(path)
  return written


@functools.cache
def cuda_devices(target: str, count: int = 1) -> tuple:
  """Compile-only CUDA devices of `target` ("h100" or "h200"): `count` cards on one host
  (1 to 8, as in one NVLink node), for this host."""
  if not isinstance(count, int) or not 1 <= count <= 8:
    raise ValueError(f"count must be an int from 1 to 8 (the cards of one host), got {count!r}")
  text = target_config(target)
  from jax._src import xla_bridge
  if not getattr(xla_bridge, "_plugins_registered", False):
    # the plugin checks the CUDA driver's versions when it loads, and there is none
    os.environ.setdefault(_SKIP_CHECK, "1")
  reason = missing()
  if reason:
    raise RuntimeError(f"cannot compile for {target}: {reason}")
  from jax.experimental import topologies
  # topology: slices x hosts x devices per host
  return tuple(topologies.get_topology_desc("", "cuda", target_config=text,
                                            topology=f"1x1x{count}").devices)


def compile_for(target: str, fn, *args, options: dict | None = None,
                mesh: jax.sharding.Mesh | None = None):
  """`jax.jit(fn)` compiled for `target` on `args` (ShapeDtypeStructs or arrays, pytrees).

  options: XLA debug options for this compile only (e.g. {"xla_dump_to": DIR}).
  A ShapeDtypeStruct with a sharding keeps it (on `cuda_devices(target, count)`); every
  other argument is replicated over `mesh`, by default one card. mesh, when given, is
  also set (`jax.set_mesh`) while tracing, for calls that read the ambient mesh.
  Returns jax's `Compiled`: `.as_text()` is the optimized HLO (the kernels' custom
  calls), `.memory_analysis()` the buffers. Raises what the compiler raises.
  """
  with _abstract_card(target):
    lowered = lowering.lowered_on("cuda", cuda_devices(target), fn, args, mesh)
  return lowered.compile(compiler_options=options)


@contextlib.contextmanager
def _abstract_card(target: str):
  """Pallas Triton's lowering reads the card's compute capability from an abstract device
  when the process has no GPU (as `jattn.lowering_for`). Not `jax.default_device`: a
  constant made while tracing (splash's block tables, traced for every platform) would
  then be placed on the compile-only device, which cannot hold data."""
  device = jax.sharding.AbstractDevice(device_kind=cuda_devices(target)[0].device_kind,
                                       num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                abstract_device=device)):
    yield
