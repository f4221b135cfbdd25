"""A small decoder-only Transformer built from jattn.nnx.MultiHeadAttention.

tokens int [B, T] -> token embeddings (+ learned position embeddings, or
rotary embeddings of q and k in every attention layer; optionally + an embedding
of the previous token, a width-2 causal convolution over the tokens like the
short convolutions of H3/Based, so one attention layer can match a query to
the token after its earlier occurrence) -> num_layers pre-norm blocks
(x + attention(norm(x)), x + mlp(norm(x))) -> norm -> LM head -> logits [B, T, V]. The residual stream is [B, T, F] (layout="rows") or [B, F, T]
(layout="columns"); E is the MLP's hidden width, V the vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jattn.nnx
from jattn import mods
from jattn._src.core.explicit_axes import explicit_sharding, laid_out_as, whole_along
from jattn.rope import DEFAULT_BASE, rope_heads

POSITION_ENCODINGS = ("learned", "rope", "none")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The Transformer's sizes and options (F features, N heads, K kv heads, E MLP width).

  Fields are commented where they are declared; `examples/training.py` checks a
  config before a run and names a bad field.
  """

  vocab_size: int
  max_len: int
  num_layers: int = 2
  features: int = 64        # F
  num_heads: int = 4        # N
  num_kv_heads: int | None = None  # K (None: N)
  mlp_features: int = 256   # E
  layout: str = "rows"
  implementation: str | None = None
  dropout_rate: float = 0.0
  dtype: jnp.dtype | None = None
  # "learned" (added to the embeddings), "rope", or "none" (NoPE: only the causal
  # mask and any windows tell positions apart)
  position_encoding: str = "learned"
  rope_base: float = DEFAULT_BASE
  previous_token_embedding: bool = False  # add an embedding of token t-1 at t
  embed_init_std: float = 0.02  # token (and previous-token) embeddings at initialisation
  logit_soft_cap: float | None = None  # cap * tanh(logit / cap) in every layer (Gemma 2)
  sinks: bool = False  # a learned attention sink per head in every layer (gpt-oss)
  # Per layer, cycled over the layers: None for global causal attention, an int w
  # for a causal sliding window of w keys back; e.g. (4096, None) alternates
  # sliding-window and global layers as Gemma 2 does.
  attention_pattern: tuple[int | None, ...] = ()


class RotaryMultiHeadAttention(jattn.nnx.MultiHeadAttention):
  """jattn.nnx.MultiHeadAttention with rotary embeddings on the per-head query
  and key (the parameters are the same; the cache holds rotated keys).

  Takes the arguments of `jattn.nnx.MultiHeadAttention` (x [B, T, F] for layout
  "rows", [B, F, T] for "columns" -> the same shape) and raises what it raises;
  `rope_base` is the rotary base (`jattn.rope.rope`).

  Examples:
    >>> import jax.numpy as jnp, jattn.transformer as tr
    >>> from flax import nnx
    >>> layer = tr.RotaryMultiHeadAttention(2, 16, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 8, 16)), is_causal=True).shape               # [B, T, F]
    (1, 8, 16)
  """

  def __init__(self, *args, rope_base: float = DEFAULT_BASE, **kwargs):
    super().__init__(*args, **kwargs)
    self.rope_base = rope_base

  def encode_positions(self, query, key, query_positions, key_positions):
    rotate = dict(layout=self.layout, base=self.rope_base)
    return (rope_heads(query, query_positions, **rotate),
            rope_heads(key, key_positions, **rotate))


def jattn_attention(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The attention layer `config` asks for: `jattn.nnx.MultiHeadAttention`, or
  `RotaryMultiHeadAttention` when position_encoding == "rope"; with `use_sinks`
  when config.sinks. The default `attention` factory of `Transformer` and `Block`.

  Examples:
    >>> import jattn.transformer as tr
    >>> from flax import nnx
    >>> config = tr.TransformerConfig(vocab_size=16, max_len=8, num_layers=1, features=16,
    ...                               num_heads=2, mlp_features=32)
    >>> type(tr.jattn_attention(config, nnx.Rngs(0))).__name__
    'MultiHeadAttention'
  """
  kwargs = dict(num_kv_heads=config.num_kv_heads, dropout_rate=config.dropout_rate,
                layout=config.layout, implementation=config.implementation,
                dtype=config.dtype, rngs=rngs)
  if config.sinks:
    kwargs["use_sinks"] = True
  if config.position_encoding == "rope":
    return RotaryMultiHeadAttention(config.num_heads, config.features,
                                    rope_base=config.rope_base, **kwargs)
  return jattn.nnx.MultiHeadAttention(config.num_heads, config.features, **kwargs)


_MLP_IN = {"rows": "BTF,FE->BTE", "columns": "BFT,FE->BET"}
_MLP_OUT = {"rows": "BTE,EF->BTF", "columns": "BET,EF->BFT"}
_HEAD = {"rows": "BTF,FV->BTV", "columns": "BFT,FV->BTV"}


class MLP(nnx.Module):
  """x -> gelu(x W_in + b_in) W_out + b_out along the feature axis of either layout.

  x [B, T, F] ("rows") or [B, F, T] ("columns") -> the same shape; W_in [F, E],
  W_out [E, F] with F = config.features, E = config.mlp_features.

  Examples:
    >>> import jax.numpy as jnp, jattn.transformer as tr
    >>> from flax import nnx
    >>> config = tr.TransformerConfig(vocab_size=16, max_len=8, num_layers=1, features=16,
    ...                               num_heads=2, mlp_features=32)
    >>> tr.MLP(config, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 16))).shape      # [B, T, F]
    (2, 8, 16)
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    F, E = config.features, config.mlp_features
    init = nnx.initializers.lecun_normal()
    self.w_in = nnx.Param(init(rngs.params(), (F, E)))  # [F, E]
    self.b_in = nnx.Param(jnp.zeros((E,)))
    self.w_out = nnx.Param(init(rngs.params(), (E, F)))  # [E, F]
    self.b_out = nnx.Param(jnp.zeros((F,)))
    self.layout = config.layout

  def __call__(self, x):
    bias = (lambda b: b) if self.layout == "rows" else (lambda b: b[:, None])
    h = jax.nn.gelu(jnp.einsum(_MLP_IN[self.layout], x, self.w_in[...]) + bias(self.b_in[...]))
    # on Explicit axes with E sharded (jattn.sharding) the contraction over E has no
    # sharding jax can infer: the output is laid out as x
    return (jnp.einsum(_MLP_OUT[self.layout], h, self.w_out[...],
                       out_sharding=explicit_sharding(x)) + bias(self.b_out[...]))


def _lookup(embed: nnx.Embed, ids):
  """ids int [B, T] -> embed's rows [B, T, F]. On Explicit axes the rows are laid out as
  the ids (jax cannot infer a gather's sharding from sharded indices)."""
  sharding = explicit_sharding(ids, new_axes=1)
  if sharding is None:
    return embed(ids)
  table = embed.embedding[...]  # [V, F]
  table = table if embed.dtype is None else table.astype(embed.dtype)
  return table.at[ids].get(mode="fill", out_sharding=sharding)  # as jnp.take, Embed's lookup


def _norm(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  axis = -1 if config.layout == "rows" else -2  # F of [B, T, F] or [B, F, T]
  return nnx.LayerNorm(config.features, reduction_axes=axis, feature_axes=axis, rngs=rngs)


def layer_mods(window: int | None, logit_soft_cap: float | None) -> dict:
  """A layer's mask_mod (a causal sliding window of `window` keys back) and score_mod.

  Returns the keyword arguments for `dot_product_attention` / the modules: none,
  `mask_mod=jattn.mods.sliding_window(window, 0)` and/or
  `score_mod=jattn.mods.soft_cap(logit_soft_cap)`.

  Examples:
    >>> import jattn.transformer as tr
    >>> sorted(tr.layer_mods(4, 50.0))
    ['mask_mod', 'score_mod']
    >>> tr.layer_mods(None, None)
    {}
  """
  out = {}
  if window is not None:
    out["mask_mod"] = mods.sliding_window(window, 0)
  if logit_soft_cap is not None:
    out["score_mod"] = mods.soft_cap(logit_soft_cap)
  return out


class Block(nnx.Module):
  """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)).

  x [B, T, F] ("rows") or [B, F, T] ("columns") -> the same shape. The attention
  is causal, with layer `layer`'s window from config.attention_pattern and
  config.logit_soft_cap (`layer_mods`); `attention(config, rngs)` builds it
  (`jattn_attention` in `Transformer`). Keyword arguments of a call go to it.

  Examples:
    >>> import jax.numpy as jnp, jattn.transformer as tr
    >>> from flax import nnx
    >>> config = tr.TransformerConfig(vocab_size=16, max_len=8, num_layers=1, features=16,
    ...                               num_heads=2, mlp_features=32)
    >>> block = tr.Block(config, tr.jattn_attention, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 8, 16))).shape                              # [B, T, F]
    (2, 8, 16)
  """

  def __init__(self, config: TransformerConfig, attention: Callable, *, rngs: nnx.Rngs,
               layer: int = 0):
    self.attention_norm = _norm(config, rngs)
    self.attention = attention(config, rngs)
    self.mlp_norm = _norm(config, rngs)
    self.mlp = MLP(config, rngs=rngs)
    pattern = config.attention_pattern
    self.window = pattern[layer % len(pattern)] if pattern else None
    self.logit_soft_cap = config.logit_soft_cap

  def __call__(self, x, **attention_kwargs):
    sharding = explicit_sharding(x)
    if sharding is not None:  # Explicit axes: the output projection contracts sharded N
      attention_kwargs.setdefault("out_sharding", sharding)
    attended = self.attention(self.attention_norm(x), is_causal=True,
                              **layer_mods(self.window, self.logit_soft_cap),
                              **attention_kwargs)
    # the residual stream keeps its dtype (attention may compute in config.dtype, e.g.
    # bfloat16, where strict dtype promotion would refuse float32 + bfloat16)
    x = x + attended.astype(x.dtype)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only language model. `attention(config, rngs)` builds each layer's
  attention module (default jattn.nnx.MultiHeadAttention; any module with the
  call signature of flax.nnx.MultiHeadAttention works, e.g. for comparisons).

  Call: tokens int [B, T] -> logits [B, T, V]; `init_cache(B)` then
  `model(tokens, decode=True)` decodes with a KV cache in every layer.

  Examples:
    >>> import jax.numpy as jnp, jattn.transformer as tr
    >>> from flax import nnx
    >>> config = tr.TransformerConfig(vocab_size=16, max_len=8, num_layers=1, features=16,
    ...                               num_heads=2, mlp_features=32)
    >>> model = tr.Transformer(config, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape                   # [B, T, V]
    (2, 8, 16)
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
               attention: Callable = jattn_attention):
    if config.position_encoding not in POSITION_ENCODINGS:
      raise ValueError(f"position_encoding must be one of {POSITION_ENCODINGS}, "
                       f"got {config.position_encoding!r}")
    self.config = config
    embed_init = nnx.initializers.normal(0.02)
    token_init = nnx.initializers.normal(config.embed_init_std)
    self.token_embed = nnx.Embed(config.vocab_size, config.features,
                                 embedding_init=token_init, rngs=rngs)
    self.previous_embed = (nnx.Embed(config.vocab_size, config.features,
                                     embedding_init=token_init, rngs=rngs)
                           if config.previous_token_embedding else nnx.data(None))
    self.last_token = nnx.data(None)
    self.position_embed = (
        nnx.Param(embed_init(rngs.params(), (config.max_len, config.features)))
        if config.position_encoding == "learned" else nnx.data(None))
    self.blocks = nnx.List([Block(config, attention, rngs=rngs, layer=layer)
                            for layer in range(config.num_layers)])
    if config.position_encoding == "rope" and not all(
        isinstance(b.attention, RotaryMultiHeadAttention) for b in self.blocks):
      raise ValueError("position_encoding='rope' needs attention modules that rotate "
                       "q and k (RotaryMultiHeadAttention); the model would have no "
                       "positions otherwise")
    self.final_norm = _norm(config, rngs)
    self.head = nnx.Param(nnx.initializers.lecun_normal()(
        rngs.params(), (config.features, config.vocab_size)))  # [F, V]

  def init_cache(self, batch_size: int, max_length: int | None = None, *, paged: bool = False,
                 page_size: int = 16, num_pages: int | None = None,
                 cache_dtype=None) -> None:
    """KV caches for decode=True (max_length defaults to config.max_len).

    paged=True: a paged cache per layer (`jattn.nnx.MultiHeadAttention.init_cache`),
    num_pages pages of page_size tokens each, shared by the rows; cache_dtype its
    pages' dtype (default the model's; jnp.int8: int8 pages with per-page scales,
    `jattn.paged.init_cache`).
    """
    if cache_dtype is not None and not paged:
      raise ValueError(f"cache_dtype={cache_dtype!r} is for paged=True caches only")
    paged_kwargs = dict(paged=True, page_size=page_size, num_pages=num_pages,
                        dtype=cache_dtype) if paged else {}
    for block in self.blocks:
      block.attention.init_cache(batch_size, max_length or self.config.max_len, **paged_kwargs)
    if self.previous_embed is not None:
      self.last_token = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))

  def __call__(self, tokens, *, decode: bool = False, lengths=None,
               deterministic: bool | None = None, sow_weights: bool = False):
    """tokens int [B, T] -> logits float32 [B, T, V].

    decode=True continues each batch element from its cache position (a prompt
    first, then single tokens); lengths int [B]: valid tokens per row.
    """
    return self.logits(self.hidden(tokens, decode=decode, lengths=lengths,
                                   deterministic=deterministic, sow_weights=sow_weights))

  def hidden(self, tokens, *, decode: bool = False, lengths=None,
             deterministic: bool | None = None, sow_weights: bool = False):
    """tokens int [B, T] -> the normalised last residual stream [B, T, F] (rows) or
    [B, F, T] (columns), before the LM head (`logits`)."""
    B, T = tokens.shape
    if decode:
      attention = self.blocks[0].attention
      start = (attention.decode_positions(B) if hasattr(attention, "decode_positions")
               else attention.cache_index[...])  # [B]; flax's modules have no paged cache
    else:
      start = jnp.zeros((B,), jnp.int32)
    x = _lookup(self.token_embed, tokens)  # [B, T, F]
    if self.previous_embed is not None:
      x = x + self._previous(tokens, start, decode, lengths)
    if self.position_embed is not None:  # learned; rope acts inside the attention
      positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
      x = x + jnp.take(self.position_embed[...], positions, axis=0, mode="clip")
    if self.config.layout == "columns":
      x = jnp.swapaxes(x, 1, 2)  # [B, F, T]: the residual stream as columns
    kwargs = {}
    if decode:
      kwargs["decode"] = True
    if lengths is not None:
      kwargs["lengths"] = lengths
    if deterministic is not None:
      kwargs["deterministic"] = deterministic
    if sow_weights:
      kwargs["sow_weights"] = True
    for block in self.blocks:
      x = block(x, **kwargs)
    return self.final_norm(x)

  def _previous(self, tokens, start, decode, lengths):
    """[B, T, F]: the embedding of each token's predecessor (zeros at position 0);
    with decode=True the first one is the last token cached for its row."""
    B, T = tokens.shape
    # on Explicit axes the (small) tokens whole along T, which a sequence split would
    # cut unevenly, and their rows sharded as the tokens' (the cached token is laid out
    # as the cache, and goes back so); the result laid out as the tokens again
    whole = whole_along(tokens, 1)
    first = (laid_out_as(self.last_token[...], whole[:, 0]) if decode
             else jnp.zeros_like(whole[:, 0]))  # [B]
    previous = jnp.concatenate([first[:, None], whole[:, :-1]], axis=1)  # [B, T]
    has_previous = (start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]) > 0  # [B, T]
    if decode:
      n = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
      n = laid_out_as(n, first)
      last = jnp.take_along_axis(whole, jnp.clip(n - 1, 0, T - 1)[:, None], axis=1)[:, 0]
      self.last_token[...] = laid_out_as(jnp.where(n > 0, last, first), self.last_token[...])
    previous = laid_out_as(previous, tokens)
    return jnp.where(has_previous[:, :, None], _lookup(self.previous_embed, previous), 0.0)

  def generate(self, prompts, prompt_lengths, max_new_tokens: int, rng, *,
               temperature: float = 1.0, eos_id: int | None = None, page_size: int = 16,
               num_pages: int | None = None, progress: bool | None = None,
               cache_dtype=None):
    """Samples max_new_tokens after each prompt, all rows in one batch, over a paged cache.

    prompts int [B, T] (row b's first prompt_lengths[b] tokens, the rest padding);
    rng a jax key; temperature 0 samples greedily. A row stops at its own end:
    after it samples eos_id, it appends nothing more and its later tokens are
    eos_id. The cache holds num_pages pages of page_size tokens (default: each
    row's prompt plus max_new_tokens, rounded up to pages) of cache_dtype (default
    the model's dtype; jnp.int8 for int8 pages). Prefill and step are
    jitted once per shape; progress (default: when max_new_tokens >= 256 and
    tqdm is installed) shows a progress bar. Leaves the model's caches filled.

    Returns (tokens int32 [B, max_new_tokens], lengths int32 [B]: the tokens each
    row generated, its eos_id included).
    """
    from jattn._src.nn import generate as _generate
    return _generate.generate(self, prompts, prompt_lengths, max_new_tokens, rng,
                              temperature=temperature, eos_id=eos_id, page_size=page_size,
                              num_pages=num_pages, progress=progress, cache_dtype=cache_dtype)

  def take(self, hidden, positions):
    """hidden [B, T, F] or [B, F, T], positions int [B, P] -> [B, P, F] or [B, F, P]."""
    rows = self.config.layout == "rows"
    sharding = explicit_sharding(positions, new_axes=1)  # [B, P, F] laid out as positions
    if sharding is None:
      if rows:
        return jnp.take_along_axis(hidden, positions[:, :, None], axis=1)
      return jnp.take_along_axis(hidden, positions[:, None, :], axis=2)
    # on Explicit axes jax cannot infer the sharding of a gather by sharded positions
    # (along a T that may be sharded too): the rows are laid out as the positions
    b = jnp.arange(positions.shape[0], dtype=jnp.int32)[:, None]  # [B, 1]
    at = (b, positions) if rows else (b, slice(None), positions)  # both give [B, P, F]
    taken = hidden.at[at].get(out_sharding=sharding)
    return taken if rows else jnp.swapaxes(taken, 1, 2)

  def logits(self, hidden):
    """hidden [B, T, F] or [B, F, T] -> logits float32 [B, T, V] (the LM head)."""
    return jnp.einsum(_HEAD[self.config.layout], hidden, self.head[...],
                      preferred_element_type=jnp.float32)
