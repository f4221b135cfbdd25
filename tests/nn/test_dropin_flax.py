"""jattn's modules against flax.nnx.MultiHeadAttention and
flax.linen.MultiHeadDotProductAttention, argument by argument, same inputs and weights."""

import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jattn
from tests.helpers import raises

B, T, S, F, F_KV = 2, 5, 4, 16, 12
TOL = dict(rtol=1e-5, atol=2e-6)


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _float_mask():
  """flax's helper, float32 [B, 1, T, S]: row b sees its first 2 + b keys."""
  return nnx.make_attention_mask(jnp.ones((B, T)), jnp.array([[1, 1, 0, 0], [1, 1, 1, 0.]]))


# (flax's defaults are compared in test_nnx.py)
FLAX_NNX_ARGS = [
    dict(in_kv_features=F_KV, normalize_qk=True, precision="highest", keep_rngs=False,
         out_kernel_init=nnx.initializers.normal(0.5), out_bias_init=nnx.initializers.ones_init(),
         bias_init=nnx.initializers.normal(0.1), kernel_init=nnx.initializers.xavier_uniform()),
    dict(use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32, broadcast_dropout=True,
         deterministic=True, dropout_rate=0.2, qkv_promote_dtype=nnx.nn.dtypes.promote_dtype,
         out_promote_dtype=nnx.nn.dtypes.promote_dtype,
         ln_promote_dtype=nnx.nn.dtypes.promote_dtype,
         kernel_metadata={"note": "k"}, out_kernel_metadata={"note": "o"},
         bias_metadata={}, out_bias_metadata={}, query_ln_scale_metadata={},
         key_ln_scale_metadata={}),
]


def _nnx_pair(*args, **kw):
  theirs = nnx.MultiHeadAttention(*args, decode=False, rngs=nnx.Rngs(0), **kw)
  ours = jattn.nnx.MultiHeadAttention(*args, decode=False, rngs=nnx.Rngs(1), **kw)
  return ours, theirs


@pytest.mark.parametrize("kw", FLAX_NNX_ARGS)
def test_nnx_takes_every_flax_constructor_argument(kw):
  # num_heads, in_features, qkv_features, out_features, num_kv_heads positionally, as flax
  ours, theirs = _nnx_pair(4, F, 8, 10, 2, **kw)
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  assert shapes(ours) == shapes(theirs)
  # same initialisers and seed: same initial weights (flax consumes the rngs in this order)
  ours0 = jattn.nnx.MultiHeadAttention(4, F, 8, 10, 2, decode=False, rngs=nnx.Rngs(0), **kw)
  for a, b in zip(jax.tree.leaves(nnx.state(ours0, nnx.Param)),
                  jax.tree.leaves(nnx.state(theirs, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  if "note" in kw.get("kernel_metadata", {}):
    assert ours.query.kernel.get_metadata()["note"] == "k"
    assert ours.out.kernel.get_metadata()["note"] == "o"
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  kv_features = kw.get("in_kv_features", F)
  q, k, v = _x((B, T, F), 1), _x((B, S, kv_features), 2), _x((B, S, kv_features), 3)
  np.testing.assert_allclose(ours(q, k, v, mask=_float_mask()),
                             theirs(q, k, v, mask=_float_mask()), **TOL)


def test_nnx_call_arguments_as_flax():
  ours, theirs = _nnx_pair(4, F)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  q, kv = _x((B, T, F), 1), _x((B, S, F), 2)
  want = theirs(q, kv)
  with pytest.warns(DeprecationWarning, match="The inputs_kv arg will be deprecated soon."):
    got_kv = ours(q, inputs_kv=kv)  # flax's words, as flax.linen says them
  for got in (ours(q, kv), ours(q, kv, kv), ours(q, inputs_k=kv), got_kv):
    np.testing.assert_allclose(got, want, **TOL)
  # sow_weights: the same weights in the same place
  weights = lambda m: jax.tree.leaves(nnx.capture(m, nnx.Intermediate)(
      q, kv, mask=_float_mask(), sow_weights=True)[1])
  (w,), (want_w,) = weights(ours), weights(theirs)
  assert w.shape == (B, 4, T, S)
  np.testing.assert_allclose(w, want_w, **TOL)
  with raises(ValueError, "`inputs_k` cannot be None if `inputs_v` is not None"):
    ours(q, inputs_v=kv)


def test_nnx_rngs_in_the_call_and_keep_rngs():
  m = jattn.nnx.MultiHeadAttention(4, F, dropout_rate=0.5, keep_rngs=False, rngs=nnx.Rngs(0))
  x = _x((B, T, F), 1)
  a = m(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
  b = m(x, deterministic=False, rngs=nnx.Rngs(dropout=3).dropout)
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, m(x, deterministic=True))
  with raises(ValueError, "rngs: with keep_rngs=False"):
    m(x, deterministic=False)


def test_nnx_attention_fn_is_called_as_flax_calls_it():
  ours, theirs = _nnx_pair(4, F, attention_fn=nnx.dot_product_attention)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = _x((B, T, F), 1)
  causal = nnx.make_causal_mask(jnp.ones((B, T)))  # float32, as flax makes it
  np.testing.assert_allclose(ours(x, mask=causal), theirs(x, mask=causal), **TOL)
  with raises(ValueError, "attention_fn.*layout='rows'", "columns"):
    jattn.nnx.MultiHeadAttention(4, F, attention_fn=nnx.dot_product_attention,
                                 layout="columns", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["qkv_dot_general", "out_dot_general",
                                  "qkv_dot_general_cls", "out_dot_general_cls"])
def test_nnx_deprecated_dot_general_hooks_say_why(name):
  with raises(ValueError, f"{name}: jattn projects with its own einsums"):
    jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0), **{name: jax.lax.dot_general})


def test_bad_precision_is_named():
  with raises(ValueError, "precision must be"):
    jattn.nnx.MultiHeadAttention(4, F, precision="sloppy", rngs=nnx.Rngs(0))
  with raises(ValueError, "precision: .* the same one twice"):
    jattn.nnx.MultiHeadAttention(4, F, precision=("high", "highest"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_nnx_flax_decoding_protocol_matches_flax_and_the_full_pass(layout):
  theirs = nnx.MultiHeadAttention(4, F, decode=True, rngs=nnx.Rngs(0))
  ours = jattn.nnx.MultiHeadAttention(4, F, decode=True, layout=layout, rngs=nnx.Rngs(0))
  x = _x((B, T, F), 1)
  cols = (lambda a: a) if layout == "rows" else (lambda a: jnp.swapaxes(a, 1, 2))
  theirs.init_cache(x.shape)
  ours.init_cache(cols(x).shape, jnp.float32)  # flax's form: (input_shape, dtype)
  assert ours.cache_index[...].shape == ()  # one position for the batch, as flax
  steps = [(cols(ours(cols(x[:, t:t + 1]))), theirs(x[:, t:t + 1])) for t in range(T)]
  got, want = (jnp.concatenate(s, axis=1) for s in zip(*steps))
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(got, cols(ours(cols(x), is_causal=True, decode=False)), **TOL)
  with raises(ValueError, "lengths: a cache made by flax's init_cache"):
    ours(cols(x[:, :1]), lengths=jnp.ones((B,), jnp.int32))


CHUNKS = (3, 1, 2, 1)  # tokens per decoding call: a chunk first, then single tokens


def _chunks(x, axis):
  """x cut along `axis` into CHUNKS."""
  ends = np.cumsum((0,) + CHUNKS)
  return [jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in zip(ends[:-1], ends[1:])]


@pytest.mark.parametrize("module, layout", [
    ("nnx", "rows"), ("linen", "columns"),
    pytest.param("nnx", "columns", marks=pytest.mark.thorough),
    pytest.param("linen", "rows", marks=pytest.mark.thorough)])
def test_flax_protocol_decoding_in_chunks_equals_flax_full_causal_pass(module, layout):
  """flax's cache (one position for the batch) fed 3 tokens, then 1, 2, 1: each call
  advances the position by its length. Against flax's own module, full causal pass."""
  L, MAX = sum(CHUNKS), sum(CHUNKS) + 2  # the cache is longer than what is written
  x = _x((B, L, F), 1)
  cols = (lambda a: a) if layout == "rows" else (lambda a: jnp.swapaxes(a, 1, 2))
  axis = 1 if layout == "rows" else 2
  causal = nn.make_causal_mask(jnp.ones((B, L)))
  if module == "nnx":
    theirs = nnx.MultiHeadAttention(4, F, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    ours = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=2, decode=True, layout=layout,
                                        rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    want = theirs(x, mask=causal)
    ours.init_cache(cols(jnp.zeros((B, MAX, F))).shape)
    got = [ours(chunk) for chunk in _chunks(cols(x), axis)]
    index = ours.cache_index[...]
  else:
    theirs = nn.MultiHeadDotProductAttention(4)
    params = theirs.init(jax.random.key(0), x)["params"]
    want = theirs.apply({"params": params}, x, mask=causal)
    ours = jattn.linen.MultiHeadAttention(4, decode=True, layout=layout)
    cache = ours.init(jax.random.key(1), cols(jnp.zeros((B, MAX, F))))["cache"]
    got = []
    for chunk in _chunks(cols(x), axis):  # a flax generation loop, tokens in chunks
      y, mutated = ours.apply({"params": params, "cache": cache}, chunk, mutable=["cache"])
      cache = mutated["cache"]
      got.append(y)
    index = cache["cache_index"]
  np.testing.assert_allclose(cols(jnp.concatenate(got, axis=axis)), want, **TOL)
  assert index.shape == () and int(index) == L


def test_nnx_set_view_makes_a_flax_cache():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  m.set_view(decode=True, batch_size=B, max_length=T)
  x = _x((B, T, F), 1)
  got = jnp.concatenate([m(x[:, t:t + 1]) for t in range(T)], axis=1)
  np.testing.assert_allclose(got, m(x, is_causal=True, decode=False), **TOL)
  with raises(TypeError, "batch_size' and 'max_length'"):
    jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0)).set_view(decode=True)


LINEN_ARGS = [
    dict(qkv_features=8, out_features=10, normalize_qk=True, precision="highest",
         out_kernel_init=nn.initializers.normal(0.5), out_bias_init=nn.initializers.ones_init(),
         force_fp32_for_softmax=True),
    dict(use_bias=False, broadcast_dropout=True, dropout_rate=0.3, deterministic=True,
         kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(0.1),
         dtype=jnp.float32, param_dtype=jnp.float32, decode=False),
]


@pytest.mark.parametrize("kw", LINEN_ARGS)
def test_linen_takes_every_flax_attribute_and_call_argument(kw):
  theirs, ours = nn.MultiHeadDotProductAttention(4, **kw), jattn.linen.MultiHeadAttention(4, **kw)
  q, k, v = _x((B, T, F), 1), _x((B, S, F_KV), 2), _x((B, S, F_KV), 3)
  params = theirs.init(jax.random.key(0), q, k, v)
  ours_params = ours.init(jax.random.key(0), q, k, v)
  assert jax.tree.map(jnp.shape, ours_params) == jax.tree.map(jnp.shape, params)
  want = theirs.apply(params, q, k, v, mask=_float_mask())
  got = [ours.apply(params, q, k, v, mask=_float_mask()),
         ours.apply(params, q, inputs_k=k, inputs_v=v, mask=_float_mask(),
                    dropout_rng=jax.random.key(1))]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    want_kv = theirs.apply(params, q, inputs_kv=k, mask=_float_mask())
    got_kv = ours.apply(params, q, inputs_kv=k, mask=_float_mask())
  for g in got:
    np.testing.assert_allclose(g, want, **TOL)
  np.testing.assert_allclose(got_kv, want_kv, **TOL)
  _, theirs_w = theirs.apply(params, q, k, v, sow_weights=True, mutable=["intermediates"])
  _, ours_w = ours.apply(params, q, k, v, sow_weights=True, mutable=["intermediates"])
  np.testing.assert_allclose(ours_w["intermediates"]["attention_weights"][0],
                             theirs_w["intermediates"]["attention_weights"][0], **TOL)


def test_linen_dropout_rng_in_the_call():
  m = jattn.linen.MultiHeadAttention(4, dropout_rate=0.5)
  x = _x((B, T, F), 1)
  params = m.init(jax.random.key(0), x, deterministic=True)
  drop = lambda seed: m.apply(params, x, deterministic=False, dropout_rng=jax.random.key(seed))
  a = drop(3)  # no `dropout` rng collection needed
  np.testing.assert_array_equal(a, drop(3))
  assert not np.allclose(a, drop(4))
  assert not np.allclose(a, m.apply(params, x, deterministic=True))


def test_linen_attention_fn_and_bad_hooks():
  x = _x((B, T, F), 1)
  theirs = nn.MultiHeadDotProductAttention(4)
  ours = jattn.linen.MultiHeadAttention(4, attention_fn=nn.dot_product_attention)
  params = theirs.init(jax.random.key(0), x)
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  np.testing.assert_allclose(ours.apply(params, x, mask=causal),
                             theirs.apply(params, x, mask=causal), **TOL)
  for name in ["qkv_dot_general", "out_dot_general", "qk_attn_weights_einsum_cls",
               "attn_weights_value_einsum_cls"]:
    with raises(ValueError, f"{name}: jattn projects"):
      jattn.linen.MultiHeadAttention(4, **{name: jax.lax.dot_general}).init(jax.random.key(0), x)
  with raises(TypeError, "force_fp32_for_softmax must be a bool"):
    jattn.linen.MultiHeadAttention(4, force_fp32_for_softmax="yes").init(jax.random.key(0), x)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_linen_flax_decoding_protocol_matches_flax_and_the_full_pass(layout):
  x = _x((B, T, F), 1)
  cols = (lambda a: a) if layout == "rows" else (lambda a: jnp.swapaxes(a, 1, 2))
  theirs = nn.MultiHeadDotProductAttention(4, decode=True)
  ours = jattn.linen.MultiHeadAttention(4, decode=True, layout=layout)
  variables = theirs.init(jax.random.key(0), x)  # full-length inputs size the cache
  params = variables["params"]
  ours_cache = ours.init(jax.random.key(0), cols(x))["cache"]
  assert ours_cache["cache_index"].shape == ()

  def generate(module, cache, x, axis):
    outs = []
    for t in range(T):  # a flax generation loop, unchanged
      token = jax.lax.slice_in_dim(x, t, t + 1, axis=axis)
      y, mutated = module.apply({"params": params, "cache": cache}, token, mutable=["cache"])
      cache = mutated["cache"]
      outs.append(y)
    return jnp.concatenate(outs, axis=axis)

  want = generate(theirs, variables["cache"], x, 1)
  got = cols(generate(ours, ours_cache, cols(x), 1 if layout == "rows" else 2))
  np.testing.assert_allclose(got, want, **TOL)
  full = jattn.linen.MultiHeadAttention(4, layout=layout).apply(
      {"params": params}, cols(x), is_causal=True)
  np.testing.assert_allclose(got, cols(full), **TOL)


def test_bad_new_arguments_name_themselves():
  with raises(ValueError, "attention_fn must be callable"):
    jattn.nnx.MultiHeadAttention(4, F, attention_fn="flash", rngs=nnx.Rngs(0))
  m = jattn.nnx.MultiHeadAttention(4, F, in_kv_features=F_KV, rngs=nnx.Rngs(0))
  with raises(ValueError, "inputs_k: expected features F = in_features = 12", "(2, 4, 16)"):
    m(_x((B, T, F), 1), _x((B, S, F), 2))
  with raises(ValueError, "init_cache: flax's form takes the inputs' shape"):
    m.init_cache((B,), jnp.float32)
  with raises(ValueError, "init_cache\\(batch_size, max_length\\) needs max_length"):
    m.init_cache(B)
  with raises(ValueError, "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
              "be None"):
    m(_x((B, T, F), 1), _x((B, S, F_KV), 2), inputs_kv=_x((B, S, F_KV), 2))


def test_any_number_of_batch_axes_as_flax():
  ours, theirs = _nnx_pair(4, F)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = _x((3, B, T, F), 1)
  mask = nnx.make_causal_mask(jnp.ones((3, B, T)))  # [3, B, 1, T, T], float32
  np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), **TOL)
  np.testing.assert_allclose(ours(x[0, 0]), theirs(x[0, 0]), **TOL)  # no batch axis
  lin, params = jattn.linen.MultiHeadAttention(4), None
  theirs_lin = nn.MultiHeadDotProductAttention(4)
  params = theirs_lin.init(jax.random.key(0), x)
  np.testing.assert_allclose(lin.apply(params, x, mask=mask),
                             theirs_lin.apply(params, x, mask=mask), **TOL)
  # flax's decoding with two batch axes
  theirs = nnx.MultiHeadAttention(4, F, decode=True, rngs=nnx.Rngs(0))
  ours = jattn.nnx.MultiHeadAttention(4, F, decode=True, rngs=nnx.Rngs(0))
  theirs.init_cache(x.shape)
  ours.init_cache(x.shape)
  for t in range(2):
    np.testing.assert_allclose(ours(x[:, :, t:t + 1]), theirs(x[:, :, t:t + 1]), **TOL)


def test_linen_flax_class_name_keeps_auto_named_parameter_paths():
  class Parent(nn.Module):
    attention: type

    @nn.compact
    def __call__(self, x):
      return self.attention(num_heads=4)(x)  # auto-named after its class

  x = _x((B, T, F), 1)
  theirs = Parent(nn.MultiHeadDotProductAttention)
  ours = Parent(jattn.linen.MultiHeadDotProductAttention)
  params = theirs.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(
      jnp.shape, params)
  np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), **TOL)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_precision_reaches_every_matmul(impl):
  import re
  x = _x((B, T, F), 1)
  precisions = lambda f: set(re.findall(r"precision = \[(\w+), (\w+)\]",
                                        jax.jit(f).lower(x).as_text()))
  m = jattn.nnx.MultiHeadAttention(4, F, precision="high", implementation=impl,
                                   rngs=nnx.Rngs(0))
  flax_m = nnx.MultiHeadAttention(4, F, precision="high", decode=False, rngs=nnx.Rngs(0))
  assert precisions(lambda x: m(x)) == {("HIGH", "HIGH")}
  # flax's projections take it too; its jax.nn attention path runs at the global default
  assert ("HIGH", "HIGH") in precisions(lambda x: flax_m(x))
  lin = jattn.linen.MultiHeadAttention(4, precision=jax.lax.Precision.HIGH, implementation=impl)
  params = lin.init(jax.random.key(0), x)
  assert precisions(lambda x: lin.apply(params, x)) == {("HIGH", "HIGH")}
  fn = lambda x: jattn.flax_attention_fn(x.reshape(B, T, 4, 4), x.reshape(B, T, 4, 4),
                                         x.reshape(B, T, 4, 4), precision="high",
                                         implementation=impl)
  assert precisions(fn) == {("HIGH", "HIGH")}


def test_lengths_reach_a_user_attention_fn_as_a_mask():
  """lengths= with flax's own attention as attention_fn equals jattn's attention with
  lengths (the same module weights): padded keys are masked for the user's function too."""
  x = np.random.default_rng(3).standard_normal((B, T, F)).astype(np.float32)
  lengths = jnp.array([2, T], jnp.int32)
  make = lambda fn: jattn.nnx.MultiHeadAttention(4, F, attention_fn=fn, rngs=nnx.Rngs(0))
  expected = make(None)(x, lengths=lengths)
  np.testing.assert_allclose(make(nnx.dot_product_attention)(x, lengths=lengths), expected,
                             rtol=1e-5, atol=1e-5)
  module = jattn.linen.MultiHeadAttention(4, attention_fn=nn.dot_product_attention)
  params = module.init(jax.random.key(0), x)
  ours = jattn.linen.MultiHeadAttention(4).apply(params, x, lengths=lengths)
  np.testing.assert_allclose(module.apply(params, x, lengths=lengths), ours,
                             rtol=1e-5, atol=1e-5)


# ------------------------------------------------- flax's own attention tests' calls

def test_linen_key_and_value_inputs_as_flax():
  """Keys and values of different feature sizes each get their own kernel (flax sizes
  the value kernel from inputs_v); an input that does not fit a kernel already made
  raises flax's ScopeParamShapeError; inputs_kv warns in flax's words; a square
  inputs_v (a mask passed positionally) warns as flax does, then fails as flax."""
  q, k, v = _x((B, T, F), 1), _x((B, S, F_KV), 2), _x((B, S, 10), 3)
  theirs, ours = nn.MultiHeadDotProductAttention(4), jattn.linen.MultiHeadAttention(4)
  params = theirs.init(jax.random.key(0), q, k, v)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), q, k, v)) == jax.tree.map(
      jnp.shape, params)
  np.testing.assert_allclose(ours.apply(params, q, k, v), theirs.apply(params, q, k, v), **TOL)
  for args in ((q, v, v), (q, k, k)):  # keys of 10 features, then values of 12
    with pytest.raises(flax.errors.ScopeParamShapeError):
      theirs.apply(params, *args)
    with pytest.raises(flax.errors.ScopeParamShapeError):
      ours.apply(params, *args)
  params_kv = theirs.init(jax.random.key(0), q, k)
  with pytest.warns(DeprecationWarning, match="The inputs_kv arg will be deprecated soon."):
    got = ours.apply(params_kv, q, inputs_kv=k)
  with pytest.warns(DeprecationWarning, match="The inputs_kv arg will be deprecated soon."):
    np.testing.assert_allclose(got, theirs.apply(params_kv, q, inputs_kv=k), **TOL)
  x = _x((1, 10, 1), 4)  # flax's test_multihead_mask_warning
  one = jattn.linen.MultiHeadAttention(1)
  variables = one.init(jax.random.key(0), x, x)
  causal = nn.make_causal_mask(jnp.ones((1, 10)))
  with pytest.warns(DeprecationWarning, match="the function signature of "
                    "MultiHeadDotProductAttention's `__call__` method has changed"):
    with pytest.raises(flax.errors.ScopeParamShapeError):
      one.apply(variables, x, x, causal)


def test_complex_inputs_are_refused_by_name():
  """flax computes complex64 attention; jattn's softmax takes real float32 logits, so
  it refuses them, naming the argument (docs/modules.md lists the difference)."""
  x = jnp.ones((B, T, F), jnp.complex64)
  with raises(TypeError, "inputs_q: complex inputs are not supported", "complex64"):
    jattn.linen.MultiHeadAttention(4).init(jax.random.key(0), x)
  with raises(TypeError, "inputs_k: complex inputs are not supported", "complex64"):
    jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))(_x((B, T, F), 1), x)


@pytest.mark.parametrize("module", ["nnx", pytest.param("linen", marks=pytest.mark.thorough)])
def test_decoding_with_inputs_k_and_inputs_v_as_flax(module):
  """decode with inputs_k and inputs_v: the new keys and values come from them and are
  written to the cache. flax's protocol, token by token, against flax's own module
  decoding the same; jattn's (a position per row, a 2-token prompt, then tokens)
  against flax's full causal pass with those keys and values."""
  L = 5
  x, xk, xv = _x((B, L, F), 1), _x((B, L, F), 2), _x((B, L, F), 3)
  causal = nn.make_causal_mask(jnp.ones((B, L)))
  tokens = lambda t0, t1: (x[:, t0:t1], xk[:, t0:t1], xv[:, t0:t1])
  if module == "nnx":
    theirs = nnx.MultiHeadAttention(4, F, decode=True, rngs=nnx.Rngs(0))
    ours = jattn.nnx.MultiHeadAttention(4, F, decode=True, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    theirs.init_cache(x.shape)
    ours.init_cache(x.shape)
    want = jnp.concatenate([theirs(*tokens(t, t + 1)) for t in range(L)], axis=1)
    got = jnp.concatenate([ours(*tokens(t, t + 1)) for t in range(L)], axis=1)
    full = theirs(x, xk, xv, mask=causal, decode=False)
    ours.init_cache(B, L + 1)  # jattn's protocol
    per_row = jnp.concatenate(
        [ours(*tokens(0, 2), is_causal=True, decode=True)]
        + [ours(*tokens(t, t + 1), is_causal=True, decode=True) for t in range(2, L)], axis=1)
  else:
    theirs = nn.MultiHeadDotProductAttention(4, decode=True)
    ours = jattn.linen.MultiHeadAttention(4, decode=True)
    variables = theirs.init(jax.random.key(0), x, xk, xv)  # full-length inputs: the cache
    params = {"params": variables["params"]}

    def generate(module, cache):
      outs = []
      for t in range(L):
        y, mutated = module.apply(params | {"cache": cache}, *tokens(t, t + 1),
                                  mutable=["cache"])
        cache = mutated["cache"]
        outs.append(y)
      return jnp.concatenate(outs, axis=1)

    want = generate(theirs, variables["cache"])
    got = generate(ours, ours.init(jax.random.key(1), x, xk, xv)["cache"])
    full = nn.MultiHeadDotProductAttention(4).apply(params, x, xk, xv, mask=causal)
    rows = jattn.linen.MultiHeadAttention(4)  # jattn's protocol: decode=True in the call
    cache = rows.init(jax.random.key(1), jnp.zeros((B, L + 1, F)), is_causal=True,
                      decode=True)["cache"]
    outs = []
    for t0, t1 in [(0, 2)] + [(t, t + 1) for t in range(2, L)]:
      y, mutated = rows.apply(params | {"cache": cache}, *tokens(t0, t1), is_causal=True,
                              decode=True, mutable=["cache"])
      cache = mutated["cache"]
      outs.append(y)
    per_row = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(got, full, **TOL)
  np.testing.assert_allclose(per_row, full, **TOL)
