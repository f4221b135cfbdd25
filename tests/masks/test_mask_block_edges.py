"""Every ready-made mask with its edge on every position of a key block.

Prefix-LM, chunked, sliding window and document masks, with the parameter swept
over every residue modulo the block size (a prefix that ends on a block's last key,
on the next block's first, ...): the closed-form block classes against a brute-force
classification of the dense grid, and blockwise's output against the float64
reference. One compilation per mask: traced parameters (prefix lengths, segment ids)
under vmap, static ones (chunk size, window) in one jitted function.
Letters: B T S N K G H D.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.masks.closed_form_blocks import closed_form_classes
from tests.reference import reference_mods
from tests.masks.test_block_mask import dense_classes

B, T, S, N, H = 1, 16, 16, 2, 4
# Query blocks of 3 against key blocks of 4: a key block's last position meets a query
# block's first (the diagonal's edge), which blocks of one size from 0 never do.
BQ, BK = 3, 4
NQ, NK = -(-T // BQ), S // BK
t, s = np.arange(T)[:, None], np.arange(S)[None, :]


def _ids(boundary, length):
  """Three packed documents 0, 1, 2: the second starts at boundary, the third 7 later."""
  pos = np.arange(length)
  return ((pos >= boundary).astype(np.int32) + (pos >= boundary + 7)).reshape(1, length)


# name -> (parameters, parameter -> mask_mod, parameter -> allowed [T, S], traced)
CASES = {
    "prefix_lm": (list(range(S + 1)), lambda p: mods.prefix_lm(jnp.reshape(p, (1,))),
                  lambda p: (s <= t) | (s < p), True),
    # query and key documents alike, and the keys' boundary one later
    "document": ([(_ids(d, T), _ids(d + shift, S)) for d in range(1, S) for shift in (0, 1)],
                 lambda ids: mods.document(*ids),
                 lambda ids: ids[0][0][:, None] == ids[1][0][None, :], True),
    # sizes 2..6: every residue mod BK, a chunk of one block and one that straddles two
    "chunked": (list(range(2, 7)), mods.chunked, lambda c: t // c == s // c, False),
    # left and right each at every residue twice, wide enough for FULL blocks
    "sliding_window": ([(left, 11 - left) for left in range(4, 12)],
                       lambda w: mods.sliding_window(*w),
                       lambda w: (s >= t - w[0]) & (s <= t + w[1]), False),
}


def _qkv():
  r = np.random.default_rng(4)
  return tuple(r.standard_normal((B, L, N, H)).astype(np.float32) for L in (T, S, S))


def _blockwise(q, k, v, mask_mod):
  return jattn.dot_product_attention(q, k, v, mask_mod=mask_mod, implementation="blockwise",
                                     block_sizes=jattn.BlockSizes(q=BQ, kv=BK))


def _outputs(name, q, k, v):
  """Blockwise's output for every parameter of CASES[name], one compilation."""
  params, make, _, traced = CASES[name]
  if traced:
    stacked = jax.tree.map(lambda *x: jnp.stack([jnp.asarray(a) for a in x]), *params)
    return jax.jit(jax.vmap(lambda p: _blockwise(q, k, v, make(p))))(stacked)
  return jax.jit(lambda q, k, v: [_blockwise(q, k, v, make(p)) for p in params])(q, k, v)


@pytest.mark.parametrize("name", ["prefix_lm", "sliding_window",
                                  pytest.param("chunked", marks=pytest.mark.thorough),
                                  pytest.param("document", marks=pytest.mark.thorough)])
def test_block_classes_and_outputs_with_the_edge_at_every_residue(name):
  params, make, allowed_of, _ = CASES[name]
  q, k, v = _qkv()
  outputs = _outputs(name, q, k, v)
  for p, out in zip(params, outputs):
    allowed = np.broadcast_to(allowed_of(p), (B, 1, T, S))
    got = np.asarray(closed_form_classes(make(p), B, T, S, BQ, BK))
    np.testing.assert_array_equal(np.broadcast_to(got, (B, 1, NQ, NK)),
                                  dense_classes(allowed, BQ, BK), err_msg=f"classes, {p}")
    want, _ = reference_mods(q, k, v, allowed=allowed)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=f"output, {p}")
