"""`Transformer.generate`: a ragged batch of prompts, sampled over a paged KV cache.

    prefill: every row's prompt (its own length) in one call -> the first new token
    step:    each row's last token appended -> the next one; finished rows append nothing

Both are pure functions of the model's state (nnx.split into the caches and
the rest), jitted once per shape with the graph definition static and the
caches donated (updated in place, not copied per token); the loop over steps
is Python, so a progress bar can follow it, and each step is dispatched
without waiting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Steps between checks that every row has finished (a host round trip each).
_DONE_EVERY = 16
# A generation this long shows a progress bar by default.
_PROGRESS_FROM = 256


def _sample(logits, rng, temperature):
  """logits [B, V] -> int32 [B]: greedy at temperature 0, else softmax(logits / temperature)."""
  greedy = jnp.argmax(logits, axis=-1)
  hot = jax.random.categorical(rng, logits / jnp.maximum(temperature, 1e-6), axis=-1)
  return jnp.where(temperature > 0, hot, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _prefill(graphdef, caches, params, prompts, prompt_lengths, rng, temperature, eos):
  model = nnx.merge(graphdef, caches, params)
  logits = model(prompts, decode=True, lengths=prompt_lengths, deterministic=True)  # [B, T, V]
  last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
  tokens = _sample(last, rng, temperature)
  return nnx.state(model, nnx.Cache), tokens, tokens == eos


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _step(graphdef, caches, params, tokens, done, rng, temperature, eos):
  model = nnx.merge(graphdef, caches, params)
  new = jnp.where(done, 0, 1).astype(jnp.int32)  # a finished row appends nothing
  logits = model(tokens[:, None], decode=True, lengths=new, deterministic=True)[:, 0]
  sampled = jnp.where(done, eos, _sample(logits, rng, temperature))
  return nnx.state(model, nnx.Cache), sampled, done | (sampled == eos)


def _progress_bar(total: int, progress: bool | None):
  if progress is False or (progress is None and total < _PROGRESS_FROM):
    return None
  try:
    from tqdm.auto import tqdm
  except ImportError:
    if progress:
      raise ImportError("progress=True needs tqdm (pip install tqdm)") from None
    return None
  return tqdm(total=total, desc="generate", unit="tok")


def generate(model, prompts, prompt_lengths, max_new_tokens: int, rng, *, temperature,
             eos_id, page_size, num_pages, progress, cache_dtype=None):
  """See `Transformer.generate`."""
  prompts = jnp.asarray(prompts)
  if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
    raise ValueError(f"prompts: expected int [B, T], got {prompts.dtype} with shape "
                     f"{prompts.shape}")
  B, T = prompts.shape
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"prompt_lengths: expected int [B] = ({B},), got {lengths.dtype} with "
                     f"shape {lengths.shape}")
  if (lengths < 1).any() or (lengths > T).any():
    raise ValueError(f"prompt_lengths {lengths.tolist()} must be in [1, T = {T}] (prompts "
                     f"{prompts.shape})")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  if num_pages is None:  # each row's prompt and new tokens, in whole pages
    num_pages = int(np.sum(-(-(lengths + max_new_tokens) // page_size)))
  model.init_cache(B, T + max_new_tokens, paged=True, page_size=page_size, num_pages=num_pages,
                   cache_dtype=cache_dtype)
  graphdef, caches, params = nnx.split(model, nnx.Cache, ...)
  eos = jnp.int32(-1 if eos_id is None else eos_id)
  temperature = jnp.float32(temperature)
  rngs = jax.random.split(rng, max_new_tokens)
  caches, tokens, done = _prefill(graphdef, caches, params, prompts.astype(jnp.int32),
                                  jnp.asarray(lengths, jnp.int32), rngs[0], temperature, eos)
  out = [tokens]
  bar = _progress_bar(max_new_tokens, progress)
  for i in range(1, max_new_tokens):
    if eos_id is not None and i % _DONE_EVERY == 0 and bool(done.all()):
      out.extend([jnp.full((B,), eos)] * (max_new_tokens - i))
      break
    caches, tokens, done = _step(graphdef, caches, params, tokens, done, rngs[i], temperature,
                                 eos)
    out.append(tokens)
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  nnx.update(model, caches)
  tokens = jnp.stack(out, axis=1)  # [B, max_new_tokens]
  if eos_id is None:
    return tokens, jnp.full((B,), max_new_tokens, jnp.int32)
  # a row's length: up to and including its first eos_id
  first = jnp.argmax(tokens == eos, axis=1)
  ended = jnp.any(tokens == eos, axis=1)
  return tokens, jnp.where(ended, first + 1, max_new_tokens).astype(jnp.int32)
