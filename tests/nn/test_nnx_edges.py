"""jattn.nnx.MultiHeadAttention at the edges of its arguments, against flax.nnx's own
module where flax has the behaviour (parameter metadata, held rngs, its cache, the
attention_fn protocol, unbatched decoding), against a mask flax's module takes where
jattn adds an argument (lengths), and against the documented rule elsewhere (the
dropout-rate bounds, jattn's cache dtype, set_view, error messages).

Written from the mutation run of jattn/nnx.py (docs/testing.md): each test kills a
mutant that the module's other tests let live.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
from tests.helpers import raises

B, T, F, N = 2, 5, 16, 4
TOL = dict(rtol=1e-5, atol=2e-6)


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _pair(**kw):
  """(jattn's, flax's) with flax's weights in both."""
  theirs = nnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0), **kw)
  ours = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return ours, theirs


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_rate_outside_zero_one_is_refused(rate):
  with raises(ValueError, r"dropout_rate must be in \[0, 1\)", repr(rate)):
    jattn.nnx.MultiHeadAttention(N, F, dropout_rate=rate, rngs=nnx.Rngs(0))


def test_dropout_rate_zero_and_just_below_one_are_taken():
  for rate in (0.0, 0.99):
    jattn.nnx.MultiHeadAttention(N, F, dropout_rate=rate, rngs=nnx.Rngs(0))


def test_normalize_qk_in_columns_normalises_each_head_over_h():
  """The columns layout keeps H on axis -2 of [B, N, H, T]: its LayerNorm must run
  there, giving flax's rows result transposed (flax's LayerNorm over H, same scales)."""
  ours, theirs = _pair(normalize_qk=True)
  ours_columns = jattn.nnx.MultiHeadAttention(N, F, normalize_qk=True, layout="columns",
                                              rngs=nnx.Rngs(2))
  # scales far from one, so each scale must meet its own H
  theirs.query_ln.scale[...] = jnp.linspace(0.5, 2.0, F // N)
  theirs.key_ln.scale[...] = jnp.linspace(2.0, 0.3, F // N)
  nnx.update(ours_columns, nnx.state(theirs, nnx.Param))
  x = _x((B, T, F), 1)
  want = theirs(x)
  np.testing.assert_allclose(jnp.swapaxes(ours_columns(jnp.swapaxes(x, 1, 2)), 1, 2), want,
                             **TOL)


def test_parameter_metadata_as_flax_when_only_the_inputs_are_given():
  """out_kernel_metadata / out_bias_metadata default to kernel_metadata / bias_metadata,
  as flax's."""
  kw = dict(kernel_metadata={"note": "kernel"}, bias_metadata={"note": "bias"})
  theirs = nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0), **kw)
  ours = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0), **kw)  # (nnx.update copies it)
  notes = lambda m: {path: p.get_metadata().get("note")
                     for path, p in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  assert notes(theirs)[("out", "bias")] == "bias"  # flax's rule, which jattn follows
  assert notes(ours) == notes(theirs)


@pytest.mark.parametrize("keep_rngs, rate", [(True, 0.0), (True, 0.3), (False, 0.3)])
def test_holds_a_dropout_rng_exactly_when_flax_does(keep_rngs, rate):
  make = lambda cls: cls(N, F, dropout_rate=rate, keep_rngs=keep_rngs, rngs=nnx.Rngs(0))
  paths = lambda m: sorted(path for path, _ in nnx.to_flat_state(nnx.state(m, nnx.RngState)))
  theirs = make(nnx.MultiHeadAttention)
  assert paths(make(jattn.nnx.MultiHeadAttention)) == paths(theirs)
  assert bool(paths(theirs)) == (keep_rngs and rate > 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_attention_fn_gets_flax_deterministic_flag(deterministic):
  """With flax's own attention function, dropout on or off as flax's module does it:
  the flag says whether a dropout rng is given (same rng stream, same draws)."""
  ours, theirs = _pair(dropout_rate=0.5, broadcast_dropout=True,
                       attention_fn=nnx.dot_product_attention)
  x = _x((B, T, F), 1)
  want = theirs(x, deterministic=deterministic, rngs=nnx.Rngs(dropout=7))
  got = ours(x, deterministic=deterministic, rngs=nnx.Rngs(dropout=7))
  np.testing.assert_allclose(got, want, **TOL)


def test_attention_fn_sows_weights_only_when_asked():
  ours, theirs = _pair(attention_fn=nnx.dot_product_attention)
  x = _x((B, T, F), 1)
  sown = lambda m, **kw: jax.tree.leaves(nnx.capture(m, nnx.Intermediate)(x, **kw)[1])
  (want,) = sown(theirs, sow_weights=True)
  (got,) = sown(ours, sow_weights=True)
  np.testing.assert_allclose(got, want, **TOL)
  assert sown(ours) == [] and sown(theirs) == []


def test_lengths_with_two_batch_axes_or_none():
  """lengths has the inputs' batch shape ([b1, b2], or [] for one unbatched sequence):
  keys past lengths[...] are padding. Against flax's module with that padding as a mask."""
  ours, theirs = _pair()
  x = _x((3, B, T, F), 1)
  lengths = jnp.array([[1, 5], [3, 2], [4, 1]], jnp.int32)  # [3, B]
  keys = (jnp.arange(T) < lengths[..., None]).astype(jnp.float32)  # [3, B, S]
  mask = nnx.make_attention_mask(jnp.ones((3, B, T)), keys)  # [3, B, 1, T, S]
  np.testing.assert_allclose(ours(x, lengths=lengths), theirs(x, mask=mask), **TOL)
  np.testing.assert_allclose(ours(x[1, 0], lengths=jnp.array(3)), theirs(x[1, 0], mask=mask[1, 0]),
                             **TOL)


# ---------------------------------------------------------------- the cache, flax's form

@pytest.mark.parametrize("args, kwargs, dtype", [
    ((), {}, jnp.float32),                       # flax's default
    ((jnp.bfloat16,), {}, jnp.bfloat16),         # dtype positionally, as flax's signature
    ((), {"dtype": jnp.bfloat16}, jnp.bfloat16)])
def test_flax_form_init_cache_shape_and_dtype_as_flax(args, kwargs, dtype):
  ours, theirs = _pair(num_kv_heads=2)
  theirs.init_cache((B, T, F), *args, **kwargs)
  ours.init_cache((B, T, F), *args, **kwargs)
  for name in ("cached_key", "cached_value"):
    ours_cache, theirs_cache = getattr(ours, name)[...], getattr(theirs, name)[...]
    assert (ours_cache.shape, ours_cache.dtype) == (theirs_cache.shape, theirs_cache.dtype)
    assert ours_cache.dtype == dtype
  assert ours.cache_index[...].shape == () == theirs.cache_index[...].shape


def test_flax_form_init_cache_refuses_a_dtype_given_twice_or_a_short_shape():
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  with raises(ValueError, "init_cache: flax's form takes the inputs' shape"):
    m.init_cache((B, T, F), jnp.bfloat16, jnp.float32)
  with raises(ValueError, "init_cache: flax's form takes the inputs' shape", "(16,)"):
    m.init_cache((F,))


def test_unbatched_flax_protocol_decoding_as_flax():
  """init_cache((T, F)): one sequence, no batch axis, decoded token by token."""
  theirs = nnx.MultiHeadAttention(N, F, decode=True, rngs=nnx.Rngs(0))
  ours = jattn.nnx.MultiHeadAttention(N, F, decode=True, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = _x((T, F), 1)
  theirs.init_cache(x.shape)
  ours.init_cache(x.shape)
  for t in range(3):
    np.testing.assert_allclose(ours(x[t:t + 1]), theirs(x[t:t + 1]), **TOL)


# ---------------------------------------------------------------- the cache, jattn's form

@pytest.mark.parametrize("module_kw, dtype, want", [
    ({}, None, jnp.float32),                                        # param_dtype
    ({"param_dtype": jnp.bfloat16}, None, jnp.bfloat16),             # param_dtype
    ({"dtype": jnp.bfloat16}, None, jnp.bfloat16),                   # dtype before it
    ({"dtype": jnp.bfloat16}, jnp.float16, jnp.float16)])            # the call's first
def test_jattn_form_init_cache_dtype(module_kw, dtype, want):
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0), **module_kw)
  m.init_cache(B, T, dtype)
  assert m.cached_key[...].dtype == want and m.cached_value[...].dtype == want
  assert m.cache_index[...].shape == (B,)


def test_decoding_a_batch_the_cache_was_not_made_for_names_both():
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  m.init_cache(B, T)
  with raises(ValueError, "decode: inputs batch B = 3 does not match the cache",
              "(2, 5, 4, 4)"):
    m(_x((3, 1, F), 1), is_causal=True, decode=True)


# ---------------------------------------------------------------- nnx.view / set_view

def test_view_sets_deterministic_and_leaves_it_when_not_given():
  m = jattn.nnx.MultiHeadAttention(N, F, dropout_rate=0.5, rngs=nnx.Rngs(0))
  x = _x((B, T, F), 1)
  clean = m(x, deterministic=True)
  np.testing.assert_array_equal(nnx.view(m, deterministic=True)(x), clean)
  dropped = nnx.view(m, deterministic=False)
  assert not np.allclose(dropped(x), clean)
  # decode alone leaves deterministic as the view before it set it
  decoding = nnx.view(dropped, decode=True, batch_size=B, max_length=T)
  assert decoding.deterministic is False and decoding.decode is True


@pytest.mark.parametrize("given", [dict(batch_size=B), dict(max_length=T)])
def test_view_without_cache_sizes_names_them(given):
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  with raises(TypeError, "'batch_size' and 'max_length' must be given"):
    m.set_view(decode=True, **given)


def test_view_makes_a_columns_cache_that_decodes_as_flax():
  theirs = nnx.MultiHeadAttention(N, F, decode=True, rngs=nnx.Rngs(0))
  ours = jattn.nnx.MultiHeadAttention(N, F, layout="columns", rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  ours.set_view(decode=True, batch_size=B, max_length=T)
  assert ours.cached_key[...].shape == (B, N, F // N, T)  # [B, K, H, S]
  x = _x((B, T, F), 1)
  theirs.init_cache(x.shape)
  for t in range(3):
    got = jnp.swapaxes(ours(jnp.swapaxes(x[:, t:t + 1], 1, 2)), 1, 2)
    np.testing.assert_allclose(got, theirs(x[:, t:t + 1]), **TOL)



def test_positions_given_to_encode_positions_with_and_without_decode():
  """The hook sees each row's positions: from its cache position while decoding, from 0
  in a call that does not decode, even when a cache is there."""
  seen = []

  class Recording(jattn.nnx.MultiHeadAttention):
    def encode_positions(self, query, key, query_positions, key_positions):
      seen.append((np.asarray(query_positions), np.asarray(key_positions)))
      return query, key

  m = Recording(N, F, rngs=nnx.Rngs(0))
  m.init_cache(B, 8)
  x = _x((B, 3, F), 1)
  m(x, is_causal=True, decode=True, lengths=jnp.array([3, 2]))
  m(x[:, :1], is_causal=True, decode=True)
  m(x, is_causal=True)  # no decoding: a full pass from position 0
  (q0, k0), (q1, k1), (q2, k2) = seen
  np.testing.assert_array_equal(q0, [[0, 1, 2]] * B)
  np.testing.assert_array_equal(q1, [[3], [2]])  # each row after its own prompt
  np.testing.assert_array_equal(k1, q1)
  np.testing.assert_array_equal(q2, [[0, 1, 2]] * B)
  np.testing.assert_array_equal(k2, q2)


# ------------------------------------------------ what both modules share (heads.py)

@pytest.mark.parametrize("name", ["num_heads", "qkv_features", "num_kv_heads"])
@pytest.mark.parametrize("bad", [0, -4, True, 2.0])
def test_head_counts_and_features_must_be_positive_ints(name, bad):
  kw = dict(num_heads=N, in_features=F) | {name: bad}
  with raises(ValueError, f"{name} must be a positive int", repr(bad)):
    jattn.nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))


def test_self_attention_with_other_key_value_features_is_refused_by_name():
  """flax fails inside dot_general; jattn says which argument is missing."""
  m = jattn.nnx.MultiHeadAttention(N, F, in_kv_features=12, rngs=nnx.Rngs(0))
  with raises(ValueError, "inputs_k: keys and values come from inputs_q", "(2, 5, 16)",
              "in_kv_features = 12"):
    m(_x((B, T, F), 1))


def test_output_dtype_without_bias_as_flax():
  """use_bias=False in bfloat16: no bias takes part in the promotion, so the output
  stays bfloat16, as flax's."""
  kw = dict(use_bias=False, param_dtype=jnp.bfloat16)
  ours, theirs = _pair(**kw)
  x = _x((B, T, F), 1).astype(jnp.bfloat16)
  with jax.numpy_dtype_promotion("standard"):  # flax's jax.nn path promotes implicitly
    want = theirs(x)
  assert ours(x).dtype == want.dtype == jnp.bfloat16


@pytest.mark.parametrize("layout, legend", [("rows", "[B, T, F]"), ("columns", "[B, F, T]")])
def test_a_rank_one_input_is_named_with_its_layout_and_shape(layout, legend):
  m = jattn.nnx.MultiHeadAttention(N, F, layout=layout, rngs=nnx.Rngs(0))
  with raises(ValueError, "inputs_q: expected rank 3", legend, f"for layout '{layout}'",
              "got shape (16,)"):
    m(_x((F,), 1))


def test_inputs_kv_warning_points_at_the_callers_line():
  m = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning, match="inputs_kv") as record:
    m(_x((B, T, F), 1), inputs_kv=_x((B, T, F), 2))
  assert record[0].filename == __file__


def test_a_rank_four_mask_with_two_batch_axes_broadcasts_over_the_first():
  """A mask [B, 1, T, S] against inputs [3, B, T, F] broadcasts as NumPy does (flax's
  own module refuses it): flax's result with the mask broadcast to [3, B, 1, T, S]."""
  ours, theirs = _pair()
  x = _x((3, B, T, F), 1)
  keys = (jnp.arange(T) < jnp.array([[2], [4]])).astype(jnp.float32)  # [B, S]
  mask = nnx.make_attention_mask(jnp.ones((B, T)), keys)  # [B, 1, T, S]
  want = theirs(x, mask=jnp.broadcast_to(mask, (3,) + mask.shape))
  np.testing.assert_allclose(ours(x, mask=mask), want, **TOL)
