"""`lowering_for(platform)`: the context a host without that accelerator needs to lower for it;
`lowered_on`: a function lowered for a platform on given (compile-only) devices.

From jax 0.11, lowering a Pallas Triton kernel with no GPU present asks for an
abstract GPU device (jax 0.10 assumed compute capability 9.0 by itself). Inside
`lowering_for("cuda")`, `jax.export(..., platforms=["cuda"])` works the same on
every supported jax: the block names a Hopper device kind when jax sees no GPU,
and does nothing where it sees one (the real device decides) or for other platforms.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

# The device kind named when no GPU is present: Hopper, the generation jax's
# Triton lowering assumed before 0.11 (compute capability 9.0).
ABSTRACT_GPU_KIND = "NVIDIA H100"


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:  # no GPU backend in this jaxlib
    return False


@contextlib.contextmanager
def lowering_for(platform: str, device_kind: str = ABSTRACT_GPU_KIND):
  """A context in which programs can be lowered (`jax.export`) for `platform` from this host.

  For "cuda" on a host with no GPU, an abstract GPU device of `device_kind` (the
  Pallas Triton lowering reads its compute capability); otherwise nothing.

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> from jax import export
    >>> soft_cap = jattn.mods.soft_cap(30.0)  # no cuDNN call takes it: jattn's Triton kernel
    >>> f = jax.jit(lambda q: jattn.dot_product_attention(q, q, q, score_mod=soft_cap))
    >>> q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    >>> triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    >>> with jattn.lowering_for("cuda"):
    ...   text = export.export(f, platforms=["cuda"], disabled_checks=[triton])(q).mlir_module()
    >>> "__gpu$xla.gpu.triton" in text
    True
  """
  if platform != "cuda" or _has_gpu():
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                       platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                abstract_device=device)):
    yield


def lowered_on(platform: str, devices_, fn, args, mesh: jax.sharding.Mesh | None):
  """jax.jit(fn) traced on `args` and lowered for `platform`: a ShapeDtypeStruct with a
  sharding keeps it, every other leaf is replicated over `mesh`, else the first of
  `devices_`; `mesh`, when given, is set while tracing."""
  mesh_ = jax.sharding.Mesh(devices_[:1], ("x",)) if mesh is None else mesh
  replicated = jax.sharding.NamedSharding(mesh_, jax.sharding.PartitionSpec())

  def shaped(x):
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated)

  args = jax.tree.map(shaped, args)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    traced = jax.jit(fn).trace(*args)
  return traced.lower(lowering_platforms=(platform,))
