"""jattn.rope against a plain NumPy rotary embedding, and its relative-position property."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.rope import rope, rope_heads


def _reference(x, positions, base=10_000.0):
  """x [T, H] float64: rotate (x[i], x[i + H/2]) by position * base**(-2i/H)."""
  x = np.asarray(x, np.float64)
  T, H = x.shape
  out = np.empty_like(x)
  for t in range(T):
    for i in range(H // 2):
      a = positions[t] * base ** (-2.0 * i / H)
      c, s = np.cos(a), np.sin(a)
      out[t, i] = x[t, i] * c - x[t, i + H // 2] * s
      out[t, i + H // 2] = x[t, i + H // 2] * c + x[t, i] * s
  return out


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("jit", [False, True])
def test_rope_matches_numpy(dtype, tol, jit):
  x = jax.random.normal(jax.random.key(0), (7, 8)).astype(dtype)
  positions = jnp.array([0, 1, 2, 5, 9, 100, 255])
  f = jax.jit(rope) if jit else rope
  got = f(x, positions)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             _reference(np.asarray(x, np.float64), np.asarray(positions)),
                             rtol=tol, atol=tol)


def test_rope_exact_case_and_logits_depend_on_offset_only():
  # position 0 is the identity; position 1 with H = 2 rotates by exactly 1 radian
  x = jnp.array([[1.0, 0.0], [1.0, 0.0]])
  got = rope(x, jnp.array([0, 1]))
  np.testing.assert_allclose(got, [[1.0, 0.0], [np.cos(1.0), np.sin(1.0)]], rtol=1e-6)
  q, k = jax.random.normal(jax.random.key(1), (2, 1, 16))
  dot = lambda t, s: float(rope(q, jnp.array([t]))[0] @ rope(k, jnp.array([s]))[0])
  np.testing.assert_allclose(dot(3, 1), dot(12, 10), rtol=1e-4)
  assert abs(dot(3, 1) - dot(3, 2)) > 1e-3


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_rope_heads_rotates_each_head_at_each_rows_positions(layout):
  B, T, N, H = 2, 5, 3, 4
  x = jax.random.normal(jax.random.key(2), (B, T, N, H))
  positions = np.array([np.arange(T), 7 + np.arange(T)])  # rows continue differently
  expected = np.stack([np.stack([_reference(x[b, :, n], positions[b]) for n in range(N)], 1)
                       for b in range(B)])  # [B, T, N, H]
  arg = x if layout == "rows" else jnp.transpose(x, (0, 2, 3, 1))  # [B, N, H, T]
  got = rope_heads(arg, jnp.asarray(positions), layout=layout)
  if layout == "columns":
    got = jnp.transpose(got, (0, 3, 1, 2))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_rope_shape_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"x: expected an even depth H"):
    rope(jnp.ones((4, 3)), jnp.arange(4))
  with pytest.raises(ValueError, match=r"positions: expected shape \[T\] = \(4,\), got shape \(5,\)"):
    rope(jnp.ones((4, 2)), jnp.arange(5))
  with pytest.raises(ValueError, match=r"x: expected rank 2 \[T, H\]"):
    rope(jnp.ones((1, 4, 2)), jnp.arange(4))


def test_rope_arrays_by_name_and_options_by_keyword_only():
  # the signatures: x and positions may be named, base and layout must be
  x, positions = jnp.ones((2, 4)), jnp.arange(2)
  np.testing.assert_allclose(rope(x=x, positions=positions, base=100.0),
                             _reference(np.ones((2, 4)), [0, 1], base=100.0), rtol=1e-5)
  with pytest.raises(TypeError):
    rope(x, positions, 100.0)
  heads, rows = jnp.ones((1, 2, 1, 4)), jnp.arange(2)[None]
  assert rope_heads(x=heads, positions=rows, layout="rows").shape == heads.shape
  with pytest.raises(TypeError):
    rope_heads(heads, rows, "rows")
