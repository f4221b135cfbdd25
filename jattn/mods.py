"""Ready-made mask and score functions for `dot_product_attention(mask_mod=, score_mod=)`.

A mask mod is called for one entry, `mask_mod(b, n, t, s) -> bool` (True = may
attend), a score mod as `score_mod(score, b, n, t, s) -> float`: b batch, n
query head, t query position, s key position (int32 scalars, global
positions). jattn vectorises them with `jax.vmap`.

Each ready-made mod is a small frozen object that carries its parameters
(so other code can recognise it, e.g. to lower it onto a kernel with the same
mask built in) and is called like the plain function it stands for. Array
parameters may be NumPy or JAX arrays, traced or not; a score mod's arrays
receive gradients. They must fit the call, or it raises a ValueError naming
the argument and the shapes before any work: per batch row ([B] or [B, T]; a
leading 1 is one row for all), per query head ([N]), and segment ids at least
T and S long.
"""

# The machinery lives in jattn._src.masks.mods, below the kernels that recognise
# these objects; this public module re-exports it.
from jattn._src.masks.mods import (Alibi, And, Causal, Chunked, Document, Or, PrefixLM,
                                   RelativeBias, SlidingWindow, SoftCap, alibi, alibi_slopes,
                                   and_masks, causal, chunked, document, or_masks, prefix_lm,
                                   relative_bias, sliding_window, soft_cap)

__all__ = ["Alibi", "And", "Causal", "Chunked", "Document", "Or", "PrefixLM",
           "RelativeBias", "SlidingWindow", "SoftCap", "alibi", "alibi_slopes",
           "and_masks", "causal", "chunked", "document", "or_masks", "prefix_lm",
           "relative_bias", "sliding_window", "soft_cap"]
