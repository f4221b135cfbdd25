"""jattn: scaled dot-product attention for JAX, built from small pure functions.

    o_i = sum_j softmax_j(q_i . k_j / sqrt(H)) v_j

The vector version (`attend`, one query) becomes the matrix version
(`attention`, one head) under `jax.vmap`, and multi-head, grouped and batched
(`dot_product_attention`) under three more. Both layouts are first-class:
tokens as rows, softmax(Q K^T / sqrt(H)) V, and tokens as columns,
V softmax(K^T Q / sqrt(H)) with the softmax over axis 0.

Letters used in every shape and einsum string:
  B batch · T query length · S key/value length · N query heads ·
  K key/value heads (N % K == 0, G = N // K query heads per kv head) ·
  H query/key depth per head · D value depth per head · F model features.
"""

from jattn._src.core.attend import attend
from jattn._src.core.attention import attention, project_qkv
from jattn._src.masks.block_mask import BlockMask, create_block_mask
from jattn._src.core.block_sizes import BlockSizes
from jattn._src.dot_product_attention import dot_product_attention
from jattn._src.dispatch import Explanation, explain_calls
from jattn._src.decode.decode_attention import decode_attention, explain_decode
from jattn._src.explain import explain
from jattn._src.lowering import lowering_for
from jattn._src.nn.flax_attention_fn import flax_attention_fn
from jattn._src.masks.structural import (causal_mask, combine_masks, local_mask, padding_mask,
                                         segment_mask)
from jattn._src.parallel.ring import ring_attention
from jattn._src.parallel.balance import ChunkOrder
from jattn._src.parallel.context_parallel import (context_parallel_attention,
                                                  context_parallel_plan)
from jattn._src.parallel.plan import ContextParallelPlan

__all__ = [
    "BlockMask",
    "BlockSizes",
    "ChunkOrder",
    "ContextParallelPlan",
    "attend",
    "attention",
    "causal_mask",
    "combine_masks",
    "context_parallel_attention",
    "context_parallel_plan",
    "create_block_mask",
    "decode_attention",
    "dot_product_attention",
    "explain",
    "explain_calls",
    "explain_decode",
    "Explanation",
    "flax_attention_fn",
    "local_mask",
    "lowering_for",
    "padding_mask",
    "project_qkv",
    "ring_attention",
    "segment_mask",
]
__version__ = "0.1.0"

# The ready-made mods, positions and sharding rules: plain JAX, imported with the core.
from jattn import mods, paged, rope, sharding  # noqa: E402

# The Flax modules and the Transformer import flax: loaded on first use
# (`jattn.nnx`, `from jattn import linen`, `import jattn.transformer` all work).
_LAZY = ("linen", "nnx", "transformer")


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return importlib.import_module(f"jattn.{name}")
  raise AttributeError(f"module 'jattn' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
