"""Bad inputs raise ValueError/TypeError naming the argument and its shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import raises

Q_SHAPE = (2, 8, 4, 16)  # B T N H


def _arrays(q_shape=Q_SHAPE, k_shape=None, v_shape=None, dtype=jnp.float32):
  k_shape = q_shape if k_shape is None else k_shape
  v_shape = k_shape if v_shape is None else v_shape
  return (jnp.ones(q_shape, dtype), jnp.ones(k_shape, dtype),
          jnp.ones(v_shape, dtype))


def s(shape):
  return str(tuple(shape))


dpa = jattn.dot_product_attention


# ------------------------------------------------------------ dot_product_attention

def test_dpa_query_wrong_rank():
  q, k, v = _arrays((8, 16), (8, 16))
  with raises(ValueError, "query", s((8, 16))):
    dpa(q, k, v)


def test_dpa_key_rank_differs_from_query():
  q, k, v = _arrays(Q_SHAPE, (8, 4, 16))
  with raises(ValueError, "key", s(Q_SHAPE), s((8, 4, 16))):
    dpa(q, k, v)


def test_dpa_value_wrong_rank():
  q, k, v = _arrays(Q_SHAPE, Q_SHAPE, (2, 8, 64))
  with raises(ValueError, "value", s((2, 8, 64))):
    dpa(q, k, v)


def test_dpa_head_depth_mismatch():
  q, k, v = _arrays(Q_SHAPE, (2, 8, 4, 8))
  with raises(ValueError, "key", s(Q_SHAPE), s((2, 8, 4, 8))):
    dpa(q, k, v)


def test_dpa_seq_length_mismatch_between_key_and_value():
  q, k, v = _arrays(Q_SHAPE, (2, 8, 4, 16), (2, 6, 4, 16))
  with raises(ValueError, "value", s((2, 8, 4, 16)), s((2, 6, 4, 16))):
    dpa(q, k, v)


def test_dpa_batch_mismatch():
  q, k, v = _arrays(Q_SHAPE, (3, 8, 4, 16))
  with raises(ValueError, "key", s(Q_SHAPE), s((3, 8, 4, 16))):
    dpa(q, k, v)


def test_dpa_kv_heads_mismatch_between_key_and_value():
  q, k, v = _arrays(Q_SHAPE, (2, 8, 4, 16), (2, 8, 2, 16))
  with raises(ValueError, "value", s((2, 8, 4, 16)), s((2, 8, 2, 16))):
    dpa(q, k, v)


def test_dpa_heads_not_divisible():
  q, k, v = _arrays(Q_SHAPE, (2, 8, 3, 16))
  with raises(ValueError, r"head|N % K", s(Q_SHAPE), s((2, 8, 3, 16))):
    dpa(q, k, v)


@pytest.mark.parametrize("layout", ["BTXH", "BTTH", "BTN", "BTNHX", "btnh"])
def test_dpa_bad_layout_letters(layout):
  q, k, v = _arrays()
  with raises(ValueError, "layout", layout):
    dpa(q, k, v, layout=layout)


def test_dpa_layout_rank_mismatch():
  q, k, v = _arrays()
  with raises(ValueError, "layout", "TNH", s(Q_SHAPE)):
    dpa(q, k, v, layout="TNH")


@pytest.mark.parametrize("mask_shape", [(2, 1, 8, 5), (3, 4, 8, 8), (8, 7),
                                        (2, 4, 8, 8, 1)])
def test_dpa_mask_not_broadcastable(mask_shape):
  q, k, v = _arrays()
  with raises(ValueError, "mask", s(mask_shape), s((2, 4, 8, 8))):
    dpa(q, k, v, mask=jnp.ones(mask_shape, bool))


def test_dpa_mask_wrong_dtype():
  q, k, v = _arrays()
  with raises((TypeError, ValueError), "mask"):
    dpa(q, k, v, mask=jnp.ones((8, 8), jnp.float32))


@pytest.mark.parametrize("bias_shape", [(3, 8, 8), (2, 4, 8, 9), (1, 1, 7, 8)])
def test_dpa_bias_not_broadcastable(bias_shape):
  q, k, v = _arrays()
  with raises(ValueError, "bias", s(bias_shape), s((2, 4, 8, 8))):
    dpa(q, k, v, bias=jnp.ones(bias_shape, jnp.float32))


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dpa_dropout_rate_out_of_range(rate):
  q, k, v = _arrays()
  with raises(ValueError, "dropout_rate", str(rate)):
    dpa(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(0))


def test_dpa_dropout_without_rng():
  q, k, v = _arrays()
  with raises(ValueError, "dropout_rng"):
    dpa(q, k, v, dropout_rate=0.5)


def test_dpa_no_depth():
  q, k, v = _arrays((2, 8, 4, 0), (2, 8, 4, 0), (2, 8, 4, 16))
  with raises(ValueError, "depth H", s((2, 8, 4, 0)), "H = 0"):
    dpa(q, k, v)


@pytest.mark.parametrize("implementation", ["ring", "context_parallel"])
@pytest.mark.parametrize("letter,q_shape,k_shape", [("T", (1, 0, 2, 8), (1, 4, 2, 8)),
                                                    ("S", (1, 4, 2, 8), (1, 0, 2, 8))])
def test_dpa_sequence_parallel_needs_a_sequence(implementation, letter, q_shape, k_shape):
  q, k, v = _arrays(q_shape, k_shape)
  with jax.set_mesh(jax.make_mesh((1,), ("seq",))):
    with raises(ValueError, f"length {letter}=0", "'seq'"):
      dpa(q, k, v, implementation=implementation)


@pytest.mark.parametrize("scale", ["x", True, jnp.ones(2), jnp.int32(2), np.bool_(True), 1j])
def test_dpa_scale_not_a_float_scalar(scale):
  q, k, v = _arrays()
  with raises(TypeError, "scale", type(scale).__name__):
    dpa(q, k, v, scale=scale)


def test_dpa_takes_a_scale_of_any_real_kind():
  q, k, v = _arrays()
  want = dpa(q, k, v, scale=0.5)
  for scale in (np.float32(0.5), jnp.float32(0.5), np.float64(0.5)):
    np.testing.assert_allclose(dpa(q, k, v, scale=scale), want, rtol=1e-6)
  np.testing.assert_allclose(dpa(q, k, v, scale=np.int64(1)), dpa(q, k, v, scale=1.0),
                             rtol=1e-6)


def test_dpa_unknown_implementation():
  q, k, v = _arrays()
  with raises(ValueError, "implementation", "foo", "xla", "vmap"):
    dpa(q, k, v, implementation="foo")


def test_dpa_query_key_dtype_mismatch():
  q, _, _ = _arrays()
  _, k, v = _arrays(dtype=jnp.bfloat16)
  with raises((TypeError, ValueError), "key", "float32", "bfloat16"):
    dpa(q, k, v)


def test_dpa_string_query():
  _, k, v = _arrays()
  with raises(TypeError, "query"):
    dpa("not an array", k, v)


def test_dpa_query_seq_lengths_wrong_shape():
  q, k, v = _arrays()
  with raises(ValueError, "query_seq_lengths", s((3,))):
    dpa(q, k, v, query_seq_lengths=jnp.array([8, 8, 8], jnp.int32))


def test_dpa_segment_ids_wrong_shape():
  q, k, v = _arrays()
  ids = jnp.zeros((2, 8), jnp.int32)
  with raises(ValueError, "q_segment_ids", s((2, 5))):
    dpa(q, k, v, q_segment_ids=jnp.zeros((2, 5), jnp.int32),
        kv_segment_ids=ids)
  with raises(ValueError, "kv_segment_ids", s((2, 7))):
    dpa(q, k, v, q_segment_ids=ids, kv_segment_ids=jnp.zeros((2, 7), jnp.int32))


def test_dpa_errors_raised_at_trace_time_under_jit():
  q, k, v = _arrays(Q_SHAPE, (2, 8, 4, 16), (2, 6, 4, 16))
  with raises(ValueError, "value", s((2, 6, 4, 16))):
    jax.jit(dpa)(q, k, v)


def test_dpa_errors_in_other_layouts_show_given_shapes():
  q, k, v = _arrays((2, 4, 8, 16), (2, 4, 8, 8))  # BNTH, H mismatch
  with raises(ValueError, "key", s((2, 4, 8, 16)), s((2, 4, 8, 8))):
    dpa(q, k, v, layout="BNTH")


# ------------------------------------------------------------ attention

def test_attention_wrong_rank():
  q, k, v = _arrays((2, 4, 8), (6, 8), (6, 3))
  with raises(ValueError, r"\bq\b|query", s((2, 4, 8))):
    jattn.attention(q, k, v)


def test_attention_head_depth_mismatch():
  q, k, v = _arrays((4, 8), (6, 4), (6, 3))
  with raises(ValueError, r"\bk\b|key", s((4, 8)), s((6, 4))):
    jattn.attention(q, k, v)


def test_attention_seq_length_mismatch():
  q, k, v = _arrays((4, 8), (6, 8), (5, 3))
  with raises(ValueError, r"\bv\b|value", s((6, 8)), s((5, 3))):
    jattn.attention(q, k, v)


def test_attention_columns_seq_length_mismatch():
  q, k, v = _arrays((8, 4), (8, 6), (3, 5))
  with raises(ValueError, r"\bv\b|value", s((8, 6)), s((3, 5))):
    jattn.attention(q, k, v, layout="columns")


def test_attention_mask_shape():
  q, k, v = _arrays((4, 8), (6, 8), (6, 3))
  with raises(ValueError, "mask", s((4, 5)), s((4, 6))):
    jattn.attention(q, k, v, mask=jnp.ones((4, 5), bool))


def test_attention_bias_shape():
  q, k, v = _arrays((4, 8), (6, 8), (6, 3))
  with raises(ValueError, "bias", s((6, 4)), s((4, 6))):
    jattn.attention(q, k, v, bias=jnp.ones((6, 4), jnp.float32))


def test_attention_unknown_layout():
  q, k, v = _arrays((4, 8), (6, 8), (6, 3))
  with raises(ValueError, "layout", "diagonal"):
    jattn.attention(q, k, v, layout="diagonal")


# ------------------------------------------------------------ attend

def test_attend_wrong_rank():
  q, k, v = _arrays((1, 8), (6, 8), (6, 3))
  with raises(ValueError, r"\bq\b|query", s((1, 8))):
    jattn.attend(q, k, v)


def test_attend_head_depth_mismatch():
  q, k, v = _arrays((8,), (6, 4), (6, 3))
  with raises(ValueError, r"\bk\b|key", s((8,)), s((6, 4))):
    jattn.attend(q, k, v)


def test_attend_seq_length_mismatch():
  q, k, v = _arrays((8,), (6, 8), (5, 3))
  with raises(ValueError, r"\bv\b|value", s((6, 8)), s((5, 3))):
    jattn.attend(q, k, v)


def test_attend_no_depth():
  with raises(ValueError, "depth H", "(0,)", "(4, 0)"):
    jattn.attend(jnp.ones(0), jnp.ones((4, 0)), jnp.ones((4, 2)))


def test_attention_and_attend_scale_not_a_float_scalar():
  with raises(TypeError, "scale", "str"):
    jattn.attention(jnp.ones((3, 4)), jnp.ones((5, 4)), jnp.ones((5, 2)), scale="x")
  with raises(TypeError, "scale", "ArrayImpl"):
    jattn.attend(jnp.ones(4), jnp.ones((5, 4)), jnp.ones((5, 2)), scale=jnp.ones(3))


def test_attend_mask_shape():
  q, k, v = _arrays((8,), (6, 8), (6, 3))
  with raises(ValueError, "mask", s((5,)), s((6,))):
    jattn.attend(q, k, v, mask=jnp.ones((5,), bool))


# ------------------------------------------------------------ project_qkv

def test_project_qkv_feature_mismatch():
  x = jnp.ones((5, 6), jnp.float32)
  w = jnp.ones((6, 4), jnp.float32)
  with raises(ValueError, r"w_k", s((5, 6)), s((7, 4))):
    jattn.project_qkv(x, w, jnp.ones((7, 4), jnp.float32), w)
