"""jattn.linen.MultiHeadAttention at the edges of its arguments, against
flax.linen.MultiHeadDotProductAttention where flax has the behaviour (initialisers,
normalize_qk, the attention_fn protocol, its warnings), against a mask flax's module
takes where jattn adds an argument (lengths), and against the documented rule
elsewhere (the dropout-rate bounds, error messages).

Written from the mutation run of jattn/linen.py (docs/testing.md): each test kills a
mutant that the module's other tests let live.
"""

import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import jattn
from tests.helpers import raises

B, T, F, N = 2, 5, 16, 4
TOL = dict(rtol=1e-5, atol=2e-6)


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_rate_outside_zero_one_is_refused(rate):
  with raises(ValueError, r"dropout_rate must be in \[0, 1\)", repr(rate)):
    jattn.linen.MultiHeadAttention(N, dropout_rate=rate).init(jax.random.key(0),
                                                             jnp.ones((B, T, F)))


def test_normalize_qk_in_columns_normalises_each_head_over_h():
  """Columns keep H on axis -2 of [B, N, H, T]: flax's rows result, transposed, with
  flax's parameters (the LayerNorm scales set far from one)."""
  theirs = nn.MultiHeadDotProductAttention(N, normalize_qk=True)
  x = _x((B, T, F), 1)
  params = theirs.init(jax.random.key(0), x)
  H = F // N
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: jnp.linspace(0.4, 2.0, H) if "query_ln" in str(path) else
      jnp.linspace(2.5, 0.5, H) if "key_ln" in str(path) else p, params)
  ours = jattn.linen.MultiHeadAttention(N, normalize_qk=True, layout="columns")
  got = jnp.swapaxes(ours.apply(params, jnp.swapaxes(x, 1, 2)), 1, 2)
  np.testing.assert_allclose(got, theirs.apply(params, x), **TOL)


def test_initial_parameters_as_flax_with_only_out_initialisers_given():
  """out_kernel_init / out_bias_init reach the out projection alone (and the others
  keep the defaults): the same key gives flax's parameters."""
  kw = dict(out_kernel_init=nn.initializers.normal(0.5), out_bias_init=nn.initializers.ones_init())
  x = _x((B, T, F), 1)
  want = nn.MultiHeadDotProductAttention(N, **kw).init(jax.random.key(0), x)
  got = jattn.linen.MultiHeadAttention(N, **kw).init(jax.random.key(0), x)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("deterministic", [False, True])
def test_attention_fn_gets_flax_deterministic_flag(deterministic):
  """With flax's own attention function and dropout: on or off as flax's module does
  it, with the same draws from the `dropout` collection."""
  kw = dict(dropout_rate=0.5, attention_fn=nn.dot_product_attention, broadcast_dropout=True)
  x = _x((B, T, F), 1)
  theirs = nn.MultiHeadDotProductAttention(N, **kw)
  params = theirs.init(jax.random.key(0), x, deterministic=True)
  rngs = {"dropout": jax.random.key(7)}
  want = theirs.apply(params, x, deterministic=deterministic, rngs=rngs)
  got = jattn.linen.MultiHeadAttention(N, **kw).apply(params, x, deterministic=deterministic,
                                                     rngs=rngs)
  np.testing.assert_allclose(got, want, **TOL)


def test_attention_fn_sows_weights_only_when_asked():
  theirs = nn.MultiHeadDotProductAttention(N, attention_fn=nn.dot_product_attention)
  ours = jattn.linen.MultiHeadAttention(N, attention_fn=nn.dot_product_attention)
  x = _x((B, T, F), 1)
  params = theirs.init(jax.random.key(0), x)
  sown = lambda m, **kw: m.apply(params, x, mutable=["intermediates"], **kw)[1]
  want = sown(theirs, sow_weights=True)["intermediates"]["attention_weights"]
  got = sown(ours, sow_weights=True)["intermediates"]["attention_weights"]
  np.testing.assert_allclose(got[0], want[0], **TOL)
  assert sown(ours) == {} and sown(theirs) == {}


def test_lengths_with_two_batch_axes_or_none():
  """lengths has the inputs' batch shape ([b1, b2], or [] for one unbatched sequence):
  keys past lengths[...] are padding. Against flax's module with that padding as a mask."""
  theirs, ours = nn.MultiHeadDotProductAttention(N), jattn.linen.MultiHeadAttention(N)
  x = _x((3, B, T, F), 1)
  params = theirs.init(jax.random.key(0), x)
  lengths = jnp.array([[1, 5], [3, 2], [4, 1]], jnp.int32)  # [3, B]
  keys = (jnp.arange(T) < lengths[..., None]).astype(jnp.float32)  # [3, B, S]
  mask = nn.make_attention_mask(jnp.ones((3, B, T)), keys)  # [3, B, 1, T, S]
  np.testing.assert_allclose(ours.apply(params, x, lengths=lengths),
                             theirs.apply(params, x, mask=mask), **TOL)
  np.testing.assert_allclose(ours.apply(params, x[1, 0], lengths=jnp.array(3)),
                             theirs.apply(params, x[1, 0], mask=mask[1, 0]), **TOL)


def test_square_inputs_v_warns_as_flax_and_other_values_do_not():
  """flax warns when inputs_v's last two axes are equal (a mask passed positionally,
  before flax 0.7.4); an unbatched [S, F] with S == F warns too, values of another
  shape do not, nor does inputs_kv beside its own warning."""
  m = jattn.linen.MultiHeadAttention(N)
  q, v_square = _x((3, F), 1), _x((F, F), 2)
  with warnings.catch_warnings():  # flax's own warning for the same call
    warnings.simplefilter("ignore", DeprecationWarning)
    params = nn.MultiHeadDotProductAttention(N).init(jax.random.key(0), q, v_square, v_square)
  with pytest.warns(DeprecationWarning, match="intended to pass it to the `mask` arg"):
    m.apply(params, q, v_square, v_square)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    m.apply(params, q, _x((T, F), 3), _x((T, F), 4))
  with pytest.warns(DeprecationWarning) as record:
    m.apply(params, q, inputs_kv=v_square)
  assert [str(w.message)[:31] for w in record] == ["The inputs_kv arg will be depre"]


def test_decoding_a_batch_the_cache_was_not_made_for_names_both():
  m = jattn.linen.MultiHeadAttention(N)
  for per_row in (True, False):  # jattn's cache, then flax's (the decode attribute)
    module = m if per_row else m.clone(decode=True)
    call = dict(is_causal=True, decode=True) if per_row else {}
    variables = module.init(jax.random.key(0), jnp.zeros((B, T, F)), **call)
    with raises(ValueError, "decode: inputs batch B = 3 does not match the cache",
                "(2, 5, 4, 4)"):
      module.apply(variables, _x((3, 1, F), 1), mutable=["cache"], **call)


def test_an_input_of_rank_two_meets_its_kernel_before_its_rank_check_as_flax():
  """Against parameters made for 12 key features, keys [S, 10] without a batch axis
  raise flax's ScopeParamShapeError, as flax's module does (the kernel comes first),
  and keys of rank one a ValueError that names their rank;
  square values [S, S] without a batch axis warn as flax does, then are refused."""
  q = _x((B, T, F), 1)
  theirs = nn.MultiHeadDotProductAttention(N)
  params = theirs.init(jax.random.key(0), q, _x((B, T, 12), 2))
  ours = jattn.linen.MultiHeadAttention(N)
  for module in (theirs, ours):
    with pytest.raises(flax.errors.ScopeParamShapeError):
      module.apply(params, q, _x((T, 10), 3))
  # below rank 2 there is no [S, F] to read F from: jattn names the rank first
  with raises(ValueError, "inputs_k: expected rank 3", "(10,)"):
    ours.apply(params, q, _x((10,), 3))
  with pytest.warns(DeprecationWarning, match="intended to pass it to the `mask` arg"):
    with raises(ValueError, "inputs_v: expected rank 3", "(16, 16)"):
      ours.init(jax.random.key(0), q, q, _x((F, F), 4))
  with raises(ValueError, "inputs_v: expected rank 3", "(16,)"):  # no last two axes to compare
    ours.init(jax.random.key(0), q, q, _x((F,), 4))


@pytest.mark.parametrize("name", ["inputs_k", "inputs_v"])
@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int32])
def test_keys_and_values_of_a_type_jattn_cannot_attend_are_refused_by_name(name, dtype):
  q = _x((B, T, F), 1)
  kv = dict(inputs_k=_x((B, T, F), 2), inputs_v=_x((B, T, F), 3))
  kv[name] = kv[name].astype(dtype)
  with raises(TypeError, name, str(jnp.dtype(dtype))):
    jattn.linen.MultiHeadAttention(N).init(jax.random.key(0), q, **kv)


def test_attention_fn_receives_the_keywords_flax_passes():
  """A user attention_fn that names flax's keywords receives the values flax's module
  gives it, the defaults included (force_fp32_for_softmax=False, deterministic, ...)."""
  def recorder(record):
    def attention_fn(query, key, value, mask=None, dropout_rng=None, dropout_rate=0.0,
                     broadcast_dropout=True, deterministic=False, dtype=None,
                     precision=None, force_fp32_for_softmax=None):
      record.update(dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
                    deterministic=deterministic, dtype=dtype, precision=precision,
                    force_fp32_for_softmax=force_fp32_for_softmax,
                    dropout_rng=dropout_rng is None, mask=mask is None)
      return nn.dot_product_attention(query, key, value, mask=mask)
    return attention_fn

  x = _x((B, T, F), 1)
  theirs_record, ours_record = {}, {}
  kw = dict(broadcast_dropout=True)  # the one default jattn changes (documented)
  params = nn.MultiHeadDotProductAttention(N, attention_fn=recorder(theirs_record),
                                           **kw).init(jax.random.key(0), x)
  jattn.linen.MultiHeadAttention(N, attention_fn=recorder(ours_record), **kw).apply(params, x)
  assert ours_record == theirs_record
  assert theirs_record["force_fp32_for_softmax"] is False


def test_dropout_draws_each_batch_element_apart_by_default():
  """jattn's default broadcast_dropout=False (flax's is True): two equal batch rows get
  different dropout; with broadcast_dropout=True, as flax's default, the same."""
  x = jnp.broadcast_to(_x((1, T, F), 1), (B, T, F))
  for broadcast in (None, True):
    kw = {} if broadcast is None else dict(broadcast_dropout=broadcast)
    m = jattn.linen.MultiHeadAttention(N, dropout_rate=0.5, **kw)
    params = m.init(jax.random.key(0), x, deterministic=True)
    out = m.apply(params, x, deterministic=False, dropout_rng=jax.random.key(3))
    assert np.allclose(out[0], out[1]) == bool(broadcast)


def test_output_dtype_follows_every_parameter_as_flax():
  """The projections promote the inputs with the kernel and the bias, as flax's
  DenseGeneral: a float32 bias beside bfloat16 kernels and inputs gives float32; with
  no bias, bfloat16 stays."""
  x = _x((B, T, F), 1).astype(jnp.bfloat16)
  for use_bias in (True, False):
    theirs = nn.MultiHeadDotProductAttention(N, use_bias=use_bias, param_dtype=jnp.bfloat16)
    params = theirs.init(jax.random.key(0), x)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p.astype(jnp.float32) if "bias" in str(path) else p, params)
    # mixed parameter dtypes promote implicitly (a TypePromotionError under conftest's
    # strict promotion), in flax and in jattn alike
    with jax.numpy_dtype_promotion("standard"):
      want = theirs.apply(params, x)
      got = jattn.linen.MultiHeadAttention(N, use_bias=use_bias).apply(params, x)
    assert got.dtype == want.dtype == (jnp.float32 if use_bias else jnp.bfloat16)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                               rtol=0.05, atol=0.05)
