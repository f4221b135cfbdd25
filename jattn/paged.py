"""The paged, ragged KV cache of `jattn.decode_attention`: a pure pytree and its functions.

    cache = jattn.paged.init_cache(B, max_length, num_kv_heads=K, head_dim=H,
                                   page_size=16, num_pages=P)
    cache = jattn.paged.append(cache, key [B, T, K, H], value [B, T, K, D], new_tokens [B])
    out = jattn.decode_attention(query [B, T, N, H], cache, ...)
    cache = jattn.paged.free(cache, finished [B])       # pages back to the pool

Every function is pure and jit-friendly (fixed shapes, no loop over rows).
"""

from jattn._src.decode.paged_cache import (NO_PAGE, PagedKVCache, allocate, append, check,
                                           free, init_cache, pages_held)

__all__ = ["NO_PAGE", "PagedKVCache", "allocate", "append", "check", "free", "init_cache",
           "pages_held"]
