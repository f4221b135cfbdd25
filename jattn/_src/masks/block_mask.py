"""Block sparsity of a mask_mod: each (query block, key block) pair empty, partial or full.

`create_block_mask` evaluates mask_mod one query block at a time, and within
it a bounded group of key blocks at a time, inside jit: memory grows
linearly with T and S (never a [T, S] grid), and there is no host round trip.
The blockwise path skips EMPTY blocks and calls no mask_mod on FULL ones.
In the style of splash attention's MaskInfo, but traced, and per batch and head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.core.block_sizes import BlockSizes
from jattn._src.masks.closed_form_blocks import is_closed_form
from jattn._src.masks.programmable import build_mods, grid_index, on_grid

EMPTY, PARTIAL, FULL = 0, 1, 2
# Entries of mask_mod evaluated at once: bounds create_block_mask's working
# memory (a few bytes each) independently of T and S.
_ENTRIES_PER_STEP = 1 << 20


class _SameText:
  """A mask_mod's jaxpr as a BlockMask's static part, equal to another of the same text.

  A jaxpr compares by identity, and each `create_block_mask` traces its mask_mod
  anew: a jit taking a block mask made per batch would compile again every batch.
  The printed jaxpr names every equation, parameter and captured array's shape
  (the arrays themselves are the leaves `mask_consts`), so equal text computes the
  same mask."""

  def __init__(self, jaxpr):
    self.jaxpr = jaxpr
    self.text = None if jaxpr is None else str(jaxpr)

  def __eq__(self, other):
    return isinstance(other, _SameText) and self.text == other.text

  def __hash__(self):
    return hash(self.text)


# create_block_mask's default, the same on every platform (see its docstring).
BLOCK_MASK_SIZES = BlockSizes(q=128, kv=128)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
  """The block classes of a mask_mod, for reuse across calls and layers (a pytree).

  Made by `jattn.create_block_mask`; pass it as `block_mask=` to
  `jattn.dot_product_attention` (or a module's call) in every layer.

  Attributes:
    classes: int8 [B|1, N|1, ceil(T / q), ceil(S / kv)], EMPTY (0), PARTIAL (1)
      or FULL (2) per (batch, head, query block, key block); B or N is 1 when
      the mask_mod was declared independent of it (B or N None).
    block_sizes: the (clipped) `BlockSizes` it was made with; a call uses them.
    B, N (int or None), T, S: the sizes it was made for.
    mask_jaxpr, mask_consts: the mask_mod it classifies, traced, with the
      arrays it captured as leaves (so a block mask made inside jit can leave
      it); a call that passes no mask_mod uses it.

  Examples:
    >>> import jattn
    >>> bm = jattn.create_block_mask(jattn.mods.causal(), None, None, 256, 256)
    >>> bm.classes.shape   # [1, 1, T / q, S / kv], default blocks of 128 x 128
    (1, 1, 2, 2)
  """

  classes: jax.Array
  block_sizes: BlockSizes
  B: int | None
  N: int | None
  T: int
  S: int
  mask_jaxpr: object = None
  mask_consts: tuple = ()

  @functools.cached_property
  def _static_jaxpr(self) -> _SameText:  # printed once per block mask, not per jit call
    return _SameText(self.mask_jaxpr)

  def tree_flatten(self):
    return ((self.classes, self.mask_consts),
            (self.block_sizes, self.B, self.N, self.T, self.S, self._static_jaxpr))

  @classmethod
  def tree_unflatten(cls, aux, children):
    mask = cls(children[0], *aux[:5], aux[5].jaxpr, children[1])
    mask.__dict__["_static_jaxpr"] = aux[5]  # the same key: its text is not printed again
    return mask

  def sparsity(self) -> jax.Array:
    """The fraction of EMPTY blocks (float32)."""
    return jnp.mean((self.classes == EMPTY).astype(jnp.float32))

  def __repr__(self):
    return (f"BlockMask(B={self.B}, N={self.N}, T={self.T}, S={self.S}, "
            f"block_sizes={self.block_sizes}, classes {tuple(self.classes.shape)})")


def create_block_mask(mask_mod, B, N, T: int, S: int, *,
                      block_sizes: BlockSizes | None = None) -> BlockMask:
  """Classifies every (query block, key block) of mask_mod(b, n, t, s) as empty, partial, full.

  B, N: batch size and query heads, or None when mask_mod does not depend on
  that index (then it is called with 0 there and the classes have size 1).
  block_sizes: those of the blockwise call that will use it, clipped to T and
  S; `BLOCK_MASK_SIZES` (128 x 128, a TPU/GPU tile) when None, on every
  platform: a block mask is data, made before anyone knows where the program
  will be lowered. On CPU, `jattn.BlockSizes(q=512, kv=256)` is faster
  (`default_block_sizes("cpu")`). Runs under jit, in memory linear in
  T and S.

  Raises:
    ValueError: non-positive sizes, a mask_mod that does not return a bool
      scalar for one entry, B or N None for a mask_mod that reads b or n, or a
      ready-made mask whose arrays do not fit B, T, S; TypeError: a mask_mod that
      is not callable.

  Examples:
    >>> import jax.numpy as jnp, jattn
    >>> ids = jnp.repeat(jnp.arange(4), 256)[None]                # [B, T]: 4 documents
    >>> bm = jattn.create_block_mask(jattn.mods.document(ids), 1, None, 1024, 1024,
    ...                              block_sizes=jattn.BlockSizes(q=256, kv=256))
    >>> bm.classes[0, 0].tolist()                                 # 2 = full, 0 = empty
    [[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 2]]
  """
  for name, size in (("B", B), ("N", N)):
    if size is not None and (not isinstance(size, int) or size < 1):
      raise ValueError(f"create_block_mask: {name} must be a positive int or None, got {size!r}")
  for name, size in (("T", T), ("S", S)):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"create_block_mask: {name} must be a positive int, got {size!r}")
  if block_sizes is None:
    block_sizes = BLOCK_MASK_SIZES
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a jattn.BlockSizes(q=..., kv=...), got {block_sizes!r}")
  # checks arity, result and that a ready-made mask's arrays fit B, T, S (no mask reads N)
  mods = build_mods(mask_mod, None, None, None, N=N or 1, B=B, T=T, S=S)
  for name, size, index, letter in (("B", B, 0, "b"), ("N", N, 1, "n")):
    if size is None and _reads_index(mask_mod, mods, index):
      raise ValueError(f"create_block_mask: {name} is None, but mask_mod reads its index "
                       f"{letter}: pass {name} (the classes of {letter} = 0 alone would "
                       f"skip blocks another {letter} sees)")
  block_sizes = block_sizes.clipped(T, S)
  classes = classify(mods, B or 1, N or 1, T, S, block_sizes.q, block_sizes.kv)
  return BlockMask(classes, block_sizes, B, N, T, S, mods.mask_jaxpr, mods.mask_consts)


def _reads_index(mask_mod, mods, index: int) -> bool:
  """Whether mask_mod depends on its argument `index` (0 b, 1 n). A ready-made mask reads
  b only through arrays per batch row (a leading 1 broadcasts) and never reads n; another
  function, wherever its jaxpr reads the argument."""
  if is_closed_form(mask_mod):
    return index == 0 and any(jnp.ndim(x) and jnp.shape(x)[0] > 1
                              for x in jax.tree.leaves(mask_mod))
  return mods.mask_uses(index)


def classify(mods, B: int, N: int, T: int, S: int, bq: int, bk: int, q_offset=0,
             kv_offset=0):
  """int8 [B, N, nq, nk]: mask_mod evaluated on one [B, N, bq, c * bk] slab at a time.

  T queries from global position q_offset, S keys from kv_offset (a ring's ranges).
  """
  nq, nk = -(-T // bq), -(-S // bk)
  B_all, N_all = B, N
  B, N = (B if mods.mask_uses(0) else 1), (N if mods.mask_uses(1) else 1)
  c = max(1, min(nk, _ENTRIES_PER_STEP // (B * N * bq * bk)))  # key blocks per step
  groups = -(-nk // c)
  entry = lambda i: mods.mask(i["B"], i["N"], i["T"], i["S"])

  def row(i):
    t = i * bq + jnp.arange(bq, dtype=jnp.int32)

    def group(g):
      s = (g * c) * bk + jnp.arange(c * bk, dtype=jnp.int32)
      index = grid_index("BN", dict(B=B, N=N))
      # Padding positions are clipped to real ones for the call, and ignored.
      index.update(T=q_offset + jnp.minimum(t, T - 1), S=kv_offset + jnp.minimum(s, S - 1))
      keep = on_grid(entry, "BNTS", index)  # [B, N, bq, c * bk]
      valid = (t < T)[:, None] & (s < S)[None, :]  # [bq, c * bk]
      keep = keep.reshape(B, N, bq, c, bk)
      valid = valid.reshape(bq, c, bk)
      some = jnp.any(keep & valid, axis=(2, 4))  # [B, N, c]
      every = jnp.all(keep | ~valid, axis=(2, 4))
      return jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)

    per_group = lax.map(group, jnp.arange(groups, dtype=jnp.int32))  # [groups, B, N, c]
    return jnp.moveaxis(per_group, 0, 2).reshape(B, N, groups * c)[..., :nk]

  per_row = lax.map(row, jnp.arange(nq, dtype=jnp.int32))  # [nq, B, N, nk]
  classes = jnp.moveaxis(per_row, 0, 2)
  return jnp.broadcast_to(classes, (B_all, N_all) + classes.shape[2:])


def check_block_mask(block_mask, *, B: int, N: int, T: int, S: int,
                     block_sizes: BlockSizes | None, has_batch: bool) -> BlockSizes:
  """A call's block_mask must be made for its sizes; returns the block sizes it carries."""
  if not isinstance(block_mask, BlockMask):
    raise TypeError(f"block_mask must be a jattn.BlockMask from jattn.create_block_mask, "
                    f"got {type(block_mask).__name__}")
  made, call = (block_mask.B, block_mask.N, block_mask.T, block_mask.S), (B, N, T, S)
  fits = (block_mask.T == T and block_mask.S == S
          and block_mask.N in (None, N)
          and block_mask.B in ((None, B) if has_batch else (None, 1)))
  if not fits:
    raise ValueError(f"block_mask was made for (B, N, T, S) = {made}, but this call has "
                     f"(B, N, T, S) = {call}")
  if block_sizes is not None and block_sizes.clipped(T, S) != block_mask.block_sizes:
    raise ValueError(f"block_sizes {block_sizes.clipped(T, S)} differ from the "
                     f"block_mask's {block_mask.block_sizes}; leave block_sizes out "
                     f"to use the block_mask's")
  return block_mask.block_sizes
