"""Sharding rules for jattn's modules and Transformer on a ("data", "model", "seq") mesh.

Parameters: the heads of every attention layer are split over "model" (its
query/key/value kernels [F, N|K, H] on N|K, its out kernel [N, H, F] on N), and
so are the MLP's hidden units E (Megatron-style: w_in [F, E] on E, w_out
[E, F] on E), so each device holds 1/model of those weights and the two
matmuls of a block need no gather between them. Everything else (embeddings,
norms, LM head) is replicated.

Activations: tokens [B, T] are split over "data" (B) and "seq" (T); attention
with implementation="context_parallel" then shards the sequence over "seq" by the
strategy chosen per call (ring, all-gather or Ulysses; see
`jattn.context_parallel_attention`), implementation="ring" as a ring.

Rules match the end of a parameter's path, so they apply as well to optimizer
states that mirror the parameters (Adam's mu and nu).
"""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model", "seq")

# (regular expression on the "/"-joined path, partition of the array's axes)
PARAMETER_RULES = (
    (r"attention/(query|key|value)/kernel$", P(None, "model", None)),  # [F, N|K, H]
    (r"attention/(query|key|value)/bias$", P("model", None)),  # [N|K, H]
    (r"attention/out/kernel$", P("model", None, None)),  # [N, H, F]
    (r"mlp/w_in$", P(None, "model")),  # [F, E]
    (r"mlp/b_in$", P("model")),  # [E]
    (r"mlp/w_out$", P("model", None)),  # [E, F]
)
TOKENS = P("data", "seq")  # [B, T]
PER_EXAMPLE = P("data")  # [B, ...]


def path_name(path) -> str:
  """"params/blocks/0/attention/query/kernel" for a pytree key path.

  Examples:
    >>> import jax, jattn
    >>> path, _ = jax.tree_util.tree_flatten_with_path({"blocks": [{"w_in": 0}]})[0][0]
    >>> jattn.sharding.path_name(path)
    'blocks/0/w_in'
  """
  parts = []
  for key in path:
    part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
    parts.append(str(part))
  if parts and parts[-1] == "value":  # the array inside an nnx.Variable
    parts.pop()
  return "/".join(parts)


def partition_spec(name: str, ndim: int) -> P:
  """The partition of the parameter (or its optimizer state) called `name`.

  Args:
    name: its path, as `path_name` spells it; the rules match its end.
    ndim: its rank; a rule applies only to arrays of its rank.

  Returns:
    A PartitionSpec over ("data", "model", "seq"); P() (replicated) when no
    rule matches.

  Examples:
    >>> import jattn
    >>> jattn.sharding.partition_spec("blocks/0/attention/query/kernel", 3)
    P(None, 'model', None)
  """
  for pattern, spec in PARAMETER_RULES:
    if re.search(pattern, name) and len(spec) == ndim:
      return spec
  return P()


def _on_mesh(spec: P, mesh: Mesh) -> P:
  """Drops the axes the mesh does not have (replicated along them)."""
  return P(*(axis if axis in mesh.axis_names else None for axis in spec))


def state_shardings(tree, mesh: Mesh):
  """A NamedSharding for every array leaf of `tree` (parameters, optimizer state).

  Axes the mesh lacks are replicated. Use as jit's in/out shardings of the
  train state (see docs/scaling.md).

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
    >>> params = {"mlp": {"w_in": jnp.ones((16, 64))}}               # [F, E]
    >>> jattn.sharding.state_shardings(params, mesh)["mlp"]["w_in"].spec
    P(None, 'model')
  """
  def sharding(path, leaf):
    spec = partition_spec(path_name(path), getattr(leaf, "ndim", 0))
    return NamedSharding(mesh, _on_mesh(spec, mesh))
  return jax.tree_util.tree_map_with_path(sharding, tree)


def batch_shardings(batch, mesh: Mesh):
  """tokens [B, T] over ("data", "seq"); any other [B, ...] array over "data".

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> jattn.sharding.batch_shardings({"tokens": jnp.ones((2, 8), int)}, mesh)["tokens"].spec
    P('data', None)
  """
  def sharding(path, leaf):
    spec = TOKENS if path_name(path).endswith("tokens") else PER_EXAMPLE
    return NamedSharding(mesh, _on_mesh(P(*spec[:leaf.ndim]), mesh))
  return jax.tree_util.tree_map_with_path(sharding, batch)
