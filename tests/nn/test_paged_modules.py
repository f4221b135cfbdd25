"""Paged decoding in jattn.nnx.MultiHeadAttention and the Transformer, and generate().

A ragged batch of prompts is prefilled, then decoded token by token or in
chunks; every output must equal the module's own full pass (the training
call) with the same mods, and the paged cache must give what today's dense
cache gives. generate() with temperature 0 must pick the full pass's argmax.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.nnx
import jattn.transformer as tr
from tests.helpers import raises

B, L, F = 3, 11, 16
PROMPTS = np.array([5, 1, 4])  # ragged, across the pages of 4 tokens


def _columns(layout, x):
  return x if layout == "rows" else jnp.swapaxes(x, 1, 2)


def _decode(call, x, *, chunk, layout="rows"):
  """[B, L, ...] from call(inputs [B, T, ...] in the layout, new int [B]): each row's prompt,
  then `chunk` tokens per call; rows past L append nothing."""
  pos, new, T = np.zeros(B, int), PROMPTS, int(PROMPTS.max())
  out = None
  while (pos < L).any():
    at = np.minimum(pos[:, None] + np.arange(T)[None, :], L - 1)  # [B, T]
    got = np.asarray(_columns(layout, call(_columns(layout, x[np.arange(B)[:, None], at]),
                                           jnp.asarray(new, jnp.int32))))
    if out is None:
      out = np.zeros((B, L) + got.shape[2:], np.float32)
    for b in range(B):
      out[b, pos[b]:pos[b] + new[b]] = got[b, :new[b]]
    pos = pos + new
    new, T = np.minimum(chunk, L - pos), chunk
  return out


_MODS = {
    "none": {},
    "window_alibi": dict(mask_mod=jattn.mods.sliding_window(3),
                         score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(4))),
    "chunked_soft_cap": dict(mask_mod=jattn.mods.and_masks(jattn.mods.causal(),
                                                          jattn.mods.chunked(4)),
                            score_mod=jattn.mods.soft_cap(2.0)),
}


# every mods case token by token and in chunks in rows; columns once in CI (the rest of
# the grid in the slow tier)
@pytest.mark.parametrize("layout,mods,chunk", [
    ("rows", m, c) for m in _MODS for c in (1, 3)] + [("columns", "window_alibi", 3)] + [
    pytest.param("columns", m, c, marks=pytest.mark.thorough)
    for m in _MODS for c in (1, 3) if (m, c) != ("window_alibi", 3)])
def test_nnx_paged_decoding_equals_the_full_pass(layout, mods, chunk):
  x = jax.random.normal(jax.random.key(0), (B, L, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=2, layout=layout, use_sinks=True,
                                   rngs=nnx.Rngs(0))
  m.sinks[...] = jnp.array([0.5, -1.0, 1.0, 0.0])
  kwargs = _MODS[mods]
  full = np.asarray(_columns(layout, m(_columns(layout, x), is_causal=True, **kwargs)))
  m.init_cache(B, 16, paged=True, page_size=4, num_pages=9)  # 3 + 3 + 3 pages of 4
  step = nnx.jit(lambda m, inputs, new: m(inputs, is_causal=True, decode=True, lengths=new,
                                          **kwargs))
  got = _decode(lambda inputs, new: step(m, inputs, new), x, chunk=chunk, layout=layout)
  np.testing.assert_allclose(got, full, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(m.paged_cache.get_value().lengths, [L] * B)


def test_paged_equals_the_dense_cache():
  x = jax.random.normal(jax.random.key(1), (B, L, F), jnp.float32)
  m = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=1, rngs=nnx.Rngs(1))
  kwargs = _MODS["window_alibi"]
  # in jit: called eagerly, the paged path's blockwise scan compiles afresh at every step
  # (a new closure each call), about 1.3 s a token here
  step = nnx.jit(lambda m, inputs, new: m(inputs, is_causal=True, decode=True, lengths=new,
                                          **kwargs))
  outs = {}
  for paged in (False, True):
    m.init_cache(B, 16, **(dict(paged=True, page_size=4) if paged else {}))
    outs[paged] = _decode(lambda inputs, new: step(m, inputs, new), x, chunk=2)
  np.testing.assert_allclose(outs[True], outs[False], rtol=2e-5, atol=2e-5)


_CONFIG = tr.TransformerConfig(
    vocab_size=32, max_len=16, num_layers=2, features=16, num_heads=4, num_kv_heads=2,
    mlp_features=32, position_encoding="rope", sinks=True, logit_soft_cap=5.0,
    attention_pattern=(3, None), previous_token_embedding=True)


def _model(config=_CONFIG, seed=0):
  model = tr.Transformer(config, rngs=nnx.Rngs(seed))
  for block in model.blocks:  # sinks away from their zero init, so they matter
    block.attention.sinks[...] = jnp.linspace(-1.0, 1.0, 4)
  return model


@pytest.mark.parametrize("chunk", [1, 4])
def test_transformer_paged_decoding_equals_the_full_pass(chunk):
  model = _model()
  tokens = jax.random.randint(jax.random.key(2), (B, L), 0, 32)
  full = np.asarray(model(tokens))  # [B, L, V]
  model.init_cache(B, paged=True, page_size=4, num_pages=12)
  step = nnx.jit(lambda model, t, new: model(t, decode=True, lengths=new))
  got = _decode(lambda t, new: step(model, t, new), np.asarray(tokens), chunk=chunk)
  np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_transformer_int8_pages_decode_near_the_full_pass():
  """cache_dtype=jnp.int8: every layer's pages int8 with scales; the logits within the
  quantization error of the full pass (not equal: the pages are int8)."""
  model = _model()
  tokens = jax.random.randint(jax.random.key(2), (B, L), 0, 32)
  full = np.asarray(model(tokens))  # [B, L, V]
  with raises(ValueError, "cache_dtype", "paged=True"):
    model.init_cache(B, cache_dtype=jnp.int8)
  model.init_cache(B, paged=True, page_size=4, num_pages=12, cache_dtype=jnp.int8)
  cache = model.blocks[0].attention.paged_cache.get_value()
  assert cache.key_pages.dtype == cache.value_pages.dtype == jnp.int8
  assert cache.key_scales.shape == cache.key_pages.shape[:2]
  step = nnx.jit(lambda model, t, new: model(t, decode=True, lengths=new))
  got = _decode(lambda t, new: step(model, t, new), np.asarray(tokens), chunk=1)
  err = np.abs(got - full).max()
  assert 0 < err < 0.05 * np.abs(full).max(), (err, np.abs(full).max())


def _greedy_full_pass(model, prompts, lengths, n):
  """The next n tokens of each row by argmax of the full pass, one row at a time."""
  # one padded length for every call (one compilation): the model is causal, so the
  # padding after a row's last token changes nothing at or before it
  width = prompts.shape[1] + n
  full = nnx.jit(lambda model, x: model(x))
  out = []
  for b in range(prompts.shape[0]):
    seq = list(np.asarray(prompts[b, :lengths[b]]))
    for _ in range(n):
      padded = jnp.array([seq + [0] * (width - len(seq))])
      seq.append(int(jnp.argmax(full(model, padded)[0, len(seq) - 1])))
    out.append(seq[lengths[b]:])
  return np.array(out)


def test_generate_greedy_equals_the_full_pass_and_compiles_once():
  from jattn._src.nn import generate
  model = _model(dataclasses.replace(_CONFIG, position_encoding="learned"), seed=3)
  prompts = jax.random.randint(jax.random.key(4), (B, 6), 0, 32)
  lengths = np.array([6, 2, 3])
  tokens, n = model.generate(prompts, lengths, 5, jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(tokens, _greedy_full_pass(model, prompts, lengths, 5))
  np.testing.assert_array_equal(n, [5, 5, 5])
  compiled = generate._step._cache_size()
  other = jax.random.randint(jax.random.key(5), (B, 6), 0, 32)
  model.generate(other, lengths, 5, jax.random.key(1), temperature=0.7)
  assert generate._step._cache_size() == compiled  # the same shapes: no new compilation


def test_generate_rows_stop_at_their_own_eos():
  model = _model(seed=6)
  prompts = jax.random.randint(jax.random.key(7), (B, 4), 0, 32)
  lengths = np.array([4, 1, 2])
  free_run = np.asarray(model.generate(prompts, lengths, 6, jax.random.key(0),
                                       temperature=0.0)[0])
  eos = int(free_run[1, 2])  # row 1's third token ends it
  tokens, n = model.generate(prompts, lengths, 6, jax.random.key(0), temperature=0.0,
                             eos_id=eos)
  tokens = np.asarray(tokens)
  for b in range(B):
    hits = np.flatnonzero(free_run[b] == eos)
    end = hits[0] + 1 if hits.size else 6
    assert n[b] == end
    np.testing.assert_array_equal(tokens[b, :end], free_run[b, :end])
    np.testing.assert_array_equal(tokens[b, end:], eos)
  assert n[1] == 3


def test_generate_shows_a_progress_bar(capsys):
  model = _model(seed=8)
  model.generate(jnp.ones((1, 2), jnp.int32), np.array([2]), 3, jax.random.key(0),
                 progress=True)
  assert "generate" in capsys.readouterr().err


def test_paged_decoding_errors_name_the_argument():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  x = jnp.ones((B, 2, F))
  with raises(ValueError, "init_cache", "paged=True"):
    m.init_cache((B, 16, F), paged=True)
  m.init_cache(B, 16, paged=True, page_size=4)
  with raises(ValueError, "mask", "mask_mod"):
    m(x, is_causal=True, decode=True, mask=jnp.ones((B, 1, 2, 2), bool))
  with raises(ValueError, "sow_weights"):
    m(x, is_causal=True, decode=True, sow_weights=True)
  with raises(ValueError, "batch", "(3, 4)"):
    m(jnp.ones((2, 2, F)), is_causal=True, decode=True)
  model = _model()
  with raises(ValueError, "prompt_lengths", "[0, 1, 1]"):
    model.generate(jnp.ones((B, 2), jnp.int32), np.array([0, 1, 1]), 2, jax.random.key(0))
  with raises(ValueError, "prompts", "(3,)"):
    model.generate(jnp.ones((B,), jnp.int32), np.array([1, 1, 1]), 2, jax.random.key(0))
