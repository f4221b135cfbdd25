"""The traced mask and score functions kept as static data (a BlockMask's or Mods'
pytree aux data, hence jit cache keys) hold no captured array and no tracer.

From jax 0.11 a Jaxpr carries its consts (ClosedJaxpr merged into Jaxpr): kept as
it comes from `jax.make_jaxpr`, a block mask's treedef would keep the document ids
it was made from alive (`compat.open_jaxpr` gives the constvars shape-only stand-ins;
the arrays stay leaves). Values with the stand-ins: tests/masks/test_block_mask.py and the
mods tests.
"""

import gc
import weakref

import jax
import jax.numpy as jnp

import jattn
from jattn import mods
from jattn._src.masks.programmable import build_mods

L = 4096  # [1, L] document ids


def _static_consts(jaxpr):
  """What the static jaxpr itself holds as constant values (none before jax 0.11)."""
  return list(getattr(jaxpr, "consts", []))


def test_a_block_masks_treedef_keeps_no_captured_array_alive():
  ids = jnp.repeat(jnp.arange(16, dtype=jnp.int32), L // 16)[None]  # [B, T]
  alive = weakref.ref(ids)
  block_mask = jattn.create_block_mask(mods.document(ids), 1, None, L, L)
  leaves, treedef = jax.tree.flatten(block_mask)
  assert any(leaf is ids for leaf in leaves)  # the ids are a leaf (they cross jit)
  assert hash(treedef) == hash(jax.tree.structure(block_mask))
  assert treedef == jax.tree.structure(block_mask)
  assert all(isinstance(c, jax.ShapeDtypeStruct) for c in _static_consts(
      block_mask.mask_jaxpr))
  del block_mask, leaves, ids
  gc.collect()
  assert alive() is None, "the treedef (static data) keeps the document ids alive"


def test_mods_traced_inside_jit_keep_no_tracer_in_their_static_part():
  seen = {}

  @jax.jit
  def f(table, cap):  # table float [N], cap float: tracers here
    built = build_mods(lambda b, n, t, s: s <= t, lambda x, b, n, t, s: x + table[n] * cap,
                       None, None, N=2)
    seen["held"] = _static_consts(built.score_jaxpr)
    hash(jax.tree.structure(built))
    return built.score(jnp.float32(1.0), 0, 1, 0, 0)

  assert float(f(jnp.asarray([2.0, 3.0]), jnp.float32(0.5))) == 2.5  # 1 + 3 * 0.5
  assert not any(isinstance(c, jax.core.Tracer) for c in seen["held"]), seen["held"]
  assert all(isinstance(c, jax.ShapeDtypeStruct) for c in seen["held"])
