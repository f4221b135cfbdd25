"""Which optional jax APIs this jax has, and if one is missing, why.

jattn's fused kernels stand on jax APIs that are experimental (splash, Pallas'
GPU `mha`, the Pallas Triton and TPU backends) or private (cuDNN detection,
splash's `_ComputableMask`); they move between jax releases. Each is imported
here on first use, never at `import jattn`. `missing(api)` is None when this jax
has it, else the reason in words: the implementation that needs it refuses its
plan with that reason, so implementation=None falls back and `jattn.explain`
says why. `load(api)` gives the module or object itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import warnings

import jax
import numpy as np


def _module(module: str, *names: str):
  """A loader: imports `module`, checks that it has every name in `names`, returns it."""
  def load():
    found = importlib.import_module(module)
    for name in names:
      getattr(found, name)
    return found
  load.module, load.names, load.what = module, names, f"{module} ({', '.join(names)})"
  return load


def _attribute(module: str, name: str):
  """A loader of one attribute (maybe private) of `module`."""
  def load():
    return getattr(importlib.import_module(module), name)
  load.module, load.names, load.what = module, (name,), f"{module}.{name}"
  return load


_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention"

# api -> (loader, what needs it)
APIS = {
    "splash_kernel": (_module(f"{_SPLASH}.splash_attention_kernel", "make_splash_mha",
                              "make_splash_mqa", "BlockSizes", "SegmentIds"),
                      "the 'splash' implementation"),
    "splash_mask": (_module(f"{_SPLASH}.splash_attention_mask", "MultiHeadMask"),
                    "the 'splash' implementation"),
    # private: splash's base class of masks computed in the kernel
    "splash_computable_mask": (_attribute(f"{_SPLASH}.splash_attention_mask",
                                          "_ComputableMask"), "the 'splash' implementation"),
    "pallas_mha": (_module("jax.experimental.pallas.ops.gpu.attention", "mha", "BlockSizes"),
                   "the 'pallas' implementation"),
    "pallas_triton": (_module("jax.experimental.pallas.triton", "CompilerParams"),
                      "the 'flex_gpu' kernel"),
    # Pallas on Mosaic GPU (Hopper): what the "flex_mgpu" kernels are written with
    "pallas_mosaic_gpu": (_module("jax.experimental.pallas.mosaic_gpu", "kernel", "wgmma", "ACC",
                                  "SMEM", "Barrier", "Layout", "TilingTransform",
                                  "SwizzleTransform", "copy_gmem_to_smem", "copy_smem_to_gmem",
                                  "barrier_wait", "commit_smem", "wait_smem_to_gmem",
                                  "broadcasted_iota", "layout_cast", "load"),
                          "the 'flex_mgpu' kernel"),
    # what the warp-specialised forward ("flex_mgpu_ws") adds: warpgroups, setmaxnreg
    "pallas_mosaic_gpu_ws": (_module("jax.experimental.pallas.mosaic_gpu", "set_max_registers",
                                     "barrier_arrive", "CompilerParams"),
                             "the 'flex_mgpu_ws' kernel"),
    # the GPU interpreter (jax >= 0.11): runs Mosaic GPU kernels on a CPU, with race detection
    "mosaic_gpu_interpret": (_module("jax.experimental.pallas.mosaic_gpu", "InterpretGPUParams"),
                             "the 'flex_mgpu' kernel in interpret mode"),
    "pallas_tpu": (_module("jax.experimental.pallas.tpu", "PrefetchScalarGridSpec", "VMEM",
                           "CompilerParams"), "the 'flex_tpu' kernel"),
    # private: jax.nn's own test of whether cuDNN can be called
    "cudnn_check": (_attribute("jax._src.cudnn.fused_attention_stablehlo",
                               "check_cudnn_version"), "the 'cudnn' implementation"),
}

# Importing these modules warns that they are deprecated (jax >= 0.11.1 for the
# GPU `mha`). That is jattn's business, not its users': a CPU user's default
# call traces the CUDA branch, and the warning would reach them for nothing.
_DEPRECATED_ON_IMPORT = ("pallas_mha",)


@functools.lru_cache(maxsize=None)
def _loaded(api: str):
  """(the loaded object, None) or (None, the reason it is missing)."""
  loader, _ = APIS[api]
  try:
    with warnings.catch_warnings():
      if api in _DEPRECATED_ON_IMPORT:
        warnings.simplefilter("ignore", DeprecationWarning)
      return loader(), None
  except (ImportError, AttributeError) as e:
    return None, (f"it needs {loader.what}, which jax {jax.__version__} lacks "
                  f"({type(e).__name__}: {e})")


def missing(api: str) -> str | None:
  """None when this jax has `api` (a key of `APIS`), else why not, in words."""
  return _loaded(api)[1]


def load(api: str):
  """The module (or object) of `api`; a RuntimeError with the reason if it is missing.

  Plans ask `missing` first, so a run never gets here without its API."""
  found, reason = _loaded(api)
  if reason is not None:
    raise RuntimeError(f"{APIS[api][1]}: {reason}")
  return found


# cache_clear of each answer read from these (`derived`): forgotten with them
_DERIVED: list = []


def derived(fn):
  """Decorates an answer read from this module's (fn takes no arguments): cached once, and
  forgotten by `refresh` with the answers it was read from."""
  cached = functools.lru_cache(maxsize=1)(fn)
  _DERIVED.append(cached.cache_clear)
  return cached


def refresh() -> None:
  """Forgets every answer and every `derived` one (tests that take an API away and put it
  back)."""
  _loaded.cache_clear()
  for forget in _DERIVED:
    forget()


def open_jaxpr(closed):
  """(jaxpr, consts) of what `jax.make_jaxpr` returns: the equations, whose
  `constvars` stand for the captured arrays, and those arrays apart (pytree leaves).

  From jax 0.11 a Jaxpr carries its consts (ClosedJaxpr merged into Jaxpr): kept
  static (a pytree's aux data, a jit cache key) it would keep the captured arrays,
  or a trace's tracers, alive. There the constvars get shape-only stand-ins;
  `jax.core.eval_jaxpr(jaxpr, consts, ...)` reads the values from `consts`."""
  consts = tuple(closed.consts)
  jaxpr = closed.jaxpr
  if consts and getattr(jaxpr, "consts", None):  # jax >= 0.11
    jaxpr = jaxpr.with_consts([jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts])
  return jaxpr, consts


def vmapped_mesh_axes() -> frozenset:
  """The Explicit mesh axes an enclosing `jax.vmap` maps away: those its mapped array
  axis is sharded over. Inside such a vmap they are not the body's to name (the
  arrays' types no longer show them): `jax.shard_map` refuses them in its axis_names,
  and subtracts them itself, reading jax's private axis environment, as this does.
  Empty outside such a vmap (or where this jax keeps no such record)."""
  from jax._src import core  # private: no public API says it
  return frozenset(getattr(core.get_axis_env(), "explicit_mesh_axis_names", ()))


@contextlib.contextmanager
def host_eval():
  """A context in which eager ops run on the host even where `jax.set_mesh` set a mesh
  of compile-only devices (deviceless compiles for a TPU slice or a GPU node), whose
  devices can hold no data: eager work there fails ("'Executable' object has no
  attribute 'local_devices'"). No mesh is in context inside, abstract or concrete,
  inside `jax.jit` too, where `jax.set_mesh(None)` is refused. jax keeps the concrete
  mesh in a private config state (`device_context`; jax.set_mesh swaps it the same way).
  """
  from jax._src import config, mesh as mesh_lib, sharding_impls  # private: no public API
  devices = getattr(config, "device_context", None) or getattr(
      sharding_impls, "device_context", None)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    if devices is None:  # a jax without it: the abstract mesh alone, as before
      yield
      return
    before = devices.swap_local(mesh_lib.empty_concrete_mesh)
    try:
      yield
    finally:
      devices.set_local(before)


def mgpu_load(ref, layout):
  """`plgpu.load(ref, layout=layout)`, the whole ref: jax 0.10 asks for an index
  argument (`()`: all of it) that later versions dropped."""
  plgpu = load("pallas_mosaic_gpu")
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)
