"""The unbatched single-head building blocks: attend, attention, project_qkv."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import EXPECTED, W_K, W_Q, W_V, X, randn, random_mask
from tests.reference import numerical_grad, reference_single

ATOL = RTOL = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _single_inputs(seed, T=4, S=6, H=8, D=3, with_mask=False, with_bias=False):
  rng = np.random.default_rng(seed)
  q = randn(rng, (T, H))
  k = randn(rng, (S, H))
  v = randn(rng, (S, D))
  mask = random_mask(rng, (T, S)) if with_mask else None
  if mask is not None:
    mask[:, 0] = True  # every query row keeps at least one key
  bias = randn(rng, (T, S)) if with_bias else None
  return q, k, v, mask, bias


# ---------------------------------------------------------------- attend

@pytest.mark.parametrize("with_mask,with_bias,scale,D", [
    (False, False, None, 8),
    (True, False, None, 3),
    (False, True, 0.5, 5),
    (True, True, 2.0, 3),
])
def test_attend_matches_reference(with_mask, with_bias, scale, D):
  q, k, v, mask, bias = _single_inputs(0, T=1, D=D, with_mask=with_mask,
                                       with_bias=with_bias)
  out = jattn.attend(q[0], k, v,
                     mask=None if mask is None else mask[0],
                     bias=None if bias is None else bias[0], scale=scale)
  want, _ = reference_single(q, k, v, mask=mask, bias=bias, scale=scale)
  assert out.shape == (D,)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want[0], atol=ATOL, rtol=RTOL)


def test_attend_fully_masked_is_zero_with_finite_grads():
  q, k, v, _, _ = _single_inputs(1, T=1, D=3)
  mask = np.zeros(k.shape[0], bool)
  out = jattn.attend(q[0], k, v, mask=mask)
  np.testing.assert_array_equal(out, np.zeros(3, np.float32))
  grads = jax.grad(lambda q, k, v: jattn.attend(q, k, v, mask=mask).sum(),
                   argnums=(0, 1, 2))(q[0], k, v)
  for g in grads:
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g, np.zeros_like(g))


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("with_mask,with_bias,scale", [
    (False, False, None), (True, True, None), (True, False, 0.3)])
def test_attention_rows_matches_reference(with_mask, with_bias, scale):
  q, k, v, mask, bias = _single_inputs(2, with_mask=with_mask,
                                       with_bias=with_bias)
  out, weights = jattn.attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 return_weights=True)
  want, want_w = reference_single(q, k, v, mask=mask, bias=bias, scale=scale)
  assert out.shape == (4, 3) and weights.shape == (4, 6)
  np.testing.assert_allclose(out, want, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, atol=1e-6)
  if mask is not None:
    assert np.all(np.asarray(weights)[~mask] == 0)


def test_attention_default_returns_only_output():
  q, k, v, _, _ = _single_inputs(3)
  out = jattn.attention(q, k, v)
  assert isinstance(out, jax.Array) and out.shape == (4, 3)
  np.testing.assert_allclose(out, reference_single(q, k, v)[0],
                             atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("with_mask,with_bias", [(False, False), (True, True)])
def test_vmap_of_attend_matches_reference(with_mask, with_bias):
  """API.md: attention (rows) equals vmap(attend) over the queries; attention rows
  is checked against the reference above, so here vmap(attend) is too (attention
  is built from attend, so comparing the two would test nothing)."""
  q, k, v, mask, bias = _single_inputs(4, with_mask=with_mask,
                                       with_bias=with_bias)

  def one(qi, mi, bi):
    return jattn.attend(qi, k, v, mask=mi, bias=bi)

  in_axes = (0, None if mask is None else 0, None if bias is None else 0)
  vmapped = jax.vmap(one, in_axes=in_axes)(q, mask, bias)
  want, _ = reference_single(q, k, v, mask=mask, bias=bias)
  np.testing.assert_allclose(vmapped, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("with_mask,with_bias,scale", [
    (False, False, None), (True, True, 0.7)])
def test_attention_columns_is_rows_transposed(with_mask, with_bias, scale):
  q, k, v, mask, bias = _single_inputs(5, with_mask=with_mask,
                                       with_bias=with_bias)
  cols, w_cols = jattn.attention(
      q.T, k.T, v.T, mask=None if mask is None else mask.T,
      bias=None if bias is None else bias.T, scale=scale, layout="columns",
      return_weights=True)
  want, want_w = reference_single(q, k, v, mask=mask, bias=bias, scale=scale)
  assert cols.shape == (3, 4) and w_cols.shape == (6, 4)
  np.testing.assert_allclose(cols, want.T, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(w_cols, want_w.T, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(np.sum(w_cols, axis=0), 1.0, atol=1e-6)
  rows, w_rows = jattn.attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 return_weights=True)
  np.testing.assert_allclose(cols, np.asarray(rows).T, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(w_cols, np.asarray(w_rows).T, atol=1e-6, rtol=1e-6)


def test_attention_fully_masked_row_is_zero():
  q, k, v, _, _ = _single_inputs(6)
  mask = np.ones((4, 6), bool)
  mask[2] = False
  out, w = jattn.attention(q, k, v, mask=mask, return_weights=True)
  np.testing.assert_array_equal(np.asarray(out)[2], 0)
  np.testing.assert_array_equal(np.asarray(w)[2], 0)
  want, _ = reference_single(q, k, v, mask=mask)
  np.testing.assert_allclose(out, want, atol=ATOL, rtol=RTOL)


def test_attention_jit_matches_reference():
  q, k, v, mask, bias = _single_inputs(7, with_mask=True, with_bias=True)
  f = jax.jit(jattn.attention, static_argnames=("layout", "return_weights"))
  out = f(q, k, v, mask=mask, bias=bias)
  np.testing.assert_allclose(out, reference_single(q, k, v, mask=mask,
                                                   bias=bias)[0],
                             atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=["bf16", "f16"])
def test_attention_half_precision_keeps_dtype_and_float32_logits(dtype):
  # logits ~5000 differing by < 1 (inputs exact in half precision)
  q = np.zeros((2, 4), np.float32)
  q[:, 0] = 100.0
  q[:, 1] = [1.0, -0.5]
  k = np.zeros((5, 4), np.float32)
  k[:, 0] = 100.0
  k[:, 1] = [-2.0, -1.0, 0.0, 1.0, 2.0]
  v = randn(np.random.default_rng(13), (5, 3))
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  out = jattn.attention(q, k, v)
  single = jattn.attend(q[0], k, v)
  assert out.dtype == dtype and single.dtype == dtype
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  want, _ = reference_single(f64(q), f64(k), f64(v))
  tol = 2e-2 if dtype == jnp.bfloat16 else 3e-3
  np.testing.assert_allclose(f64(out), want, atol=tol, rtol=0)
  np.testing.assert_allclose(f64(single), want[0], atol=tol, rtol=0)


def test_options_are_keyword_only():
  """API.md: arrays positional, options keyword-only (mask, bias, scale, layout)."""
  q, k, v, mask, _ = _single_inputs(14, with_mask=True)
  with pytest.raises(TypeError):
    jattn.attend(q[0], k, v, mask[0])
  with pytest.raises(TypeError):
    jattn.attention(q, k, v, mask)


# ---------------------------------------------------------------- gradients

def _check_grads_against_float64_differences(f, reference, args, cotangent):
  """jax.grad of sum(f(*args) * cotangent) (float32) against central differences
  of the same loss on the float64 NumPy reference."""
  grads = jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=tuple(range(len(args))))(
      *args)
  args64 = [np.ascontiguousarray(a, np.float64) for a in args]  # numerical_grad needs C order
  cot64 = np.asarray(cotangent, np.float64)
  for i, (g, a) in enumerate(zip(grads, args64)):
    def loss(x, i=i):
      return float(np.sum(reference(*args64[:i], x, *args64[i + 1:]) * cot64))
    np.testing.assert_allclose(g, numerical_grad(loss, a), atol=2e-5, rtol=1e-4,
                               err_msg=f"argument {i}")


def test_attend_grads():
  q, k, v, mask, bias = _single_inputs(8, T=1, S=5, H=4, D=3, with_mask=True,
                                       with_bias=True)
  f = lambda q, k, v, b: jattn.attend(q, k, v, mask=mask[0], bias=b)
  ref = lambda q, k, v, b: reference_single(q[None], k, v, mask=mask, bias=b[None])[0][0]
  cot = randn(np.random.default_rng(12), (3,))
  _check_grads_against_float64_differences(f, ref, (q[0], k, v, bias[0]), cot)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_attention_grads(layout):
  q, k, v, mask, bias = _single_inputs(9, T=3, S=4, H=4, D=2, with_mask=True,
                                       with_bias=True)
  ref = lambda q, k, v, b: reference_single(q, k, v, mask=mask, bias=b)[0]
  cot = randn(np.random.default_rng(13), (3, 2))
  args = (q, k, v, bias)
  if layout == "columns":  # the same numbers, transposed: the reference in rows
    args, cot = tuple(a.T for a in args), cot.T
    rows_ref = ref
    ref = lambda q, k, v, b: rows_ref(q.T, k.T, v.T, b.T).T
  m = mask if layout == "rows" else mask.T
  f = lambda q, k, v, b: jattn.attention(q, k, v, mask=m, bias=b, layout=layout)
  _check_grads_against_float64_differences(f, ref, args, cot)


def test_attention_grads_match_jnp_reimplementation():
  """Reverse-mode gradients against a plain jnp formula (float32)."""
  q, k, v, mask, bias = _single_inputs(10, with_mask=True, with_bias=True)
  cot = randn(np.random.default_rng(11), (4, 3))

  def plain(q, k, v, bias):
    logits = q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1])) + bias
    logits = jnp.where(mask, logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1) @ v

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a) * cot)

  ours = jax.grad(loss(lambda q, k, v, b: jattn.attention(q, k, v, mask=mask,
                                                          bias=b)),
                  argnums=(0, 1, 2, 3))(q, k, v, bias)
  want = jax.grad(loss(plain), argnums=(0, 1, 2, 3))(q, k, v, bias)
  for g, w in zip(ours, want):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- project_qkv

def test_project_qkv_rows_and_columns():
  rng = np.random.default_rng(12)
  x = randn(rng, (5, 6))           # [T, P]
  w_q, w_k, w_v = randn(rng, (6, 4)), randn(rng, (6, 4)), randn(rng, (6, 3))
  q, k, v = jattn.project_qkv(x, w_q, w_k, w_v)
  for got, w in zip((q, k, v), (w_q, w_k, w_v)):
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, atol=1e-5,
                               rtol=1e-5)
  qc, kc, vc = jattn.project_qkv(x.T, w_q.T, w_k.T, w_v.T, layout="columns")
  assert qc.shape == (4, 5) and vc.shape == (3, 5)
  for got, w in zip((qc, kc, vc), (w_q, w_k, w_v)):
    np.testing.assert_allclose(got, w.T.astype(np.float64) @ x.T, atol=1e-5,
                               rtol=1e-5)


def test_project_qkv_arrays_by_name_and_layout_keyword_only():
  x, w = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
  q, _, _ = jattn.project_qkv(x=x, w_q=w, w_k=w, w_v=w, layout="rows")
  np.testing.assert_array_equal(q, np.full((2, 2), 3.0))
  with pytest.raises(TypeError):
    jattn.project_qkv(x, w, w, w, "rows")


@pytest.mark.parametrize("layout, legend, shape", [("rows", "[T, S]", (4, 6)),
                                                   ("columns", "[S, T]", (6, 4))])
def test_attention_mask_error_names_the_layouts_axes(layout, legend, shape):
  # T = 4 queries, S = 6 keys; the message names the mask's axes in this layout
  q = np.ones((4, 8) if layout == "rows" else (8, 4), np.float32)
  k = np.ones((6, 8) if layout == "rows" else (8, 6), np.float32)
  v = np.ones((6, 3) if layout == "rows" else (3, 6), np.float32)
  with pytest.raises(ValueError, match=re.escape(f"{legend} = {shape}")):
    jattn.attention(q, k, v, mask=np.ones((5, 5), bool), layout=layout)


# ---------------------------------------------------------------- worked example

def test_worked_example_rows():
  q, k, v = jattn.project_qkv(X, W_Q, W_K, W_V)
  np.testing.assert_array_equal(q, X @ W_Q)
  np.testing.assert_allclose(jattn.attention(q, k, v), EXPECTED, atol=1e-4)


def test_worked_example_columns():
  q, k, v = jattn.project_qkv(X.T, W_Q.T, W_K.T, W_V.T, layout="columns")
  out = jattn.attention(q, k, v, layout="columns")
  assert out.shape == (3, 4)
  np.testing.assert_allclose(np.asarray(out).T, EXPECTED, atol=1e-4)


def test_worked_example_vmap_attend():
  q, k, v = jattn.project_qkv(X, W_Q, W_K, W_V)
  out = jax.vmap(jattn.attend, in_axes=(0, None, None))(q, k, v)
  np.testing.assert_allclose(out, EXPECTED, atol=1e-4)


def test_worked_example_script_prints_the_numbers():
  script = ROOT / "examples" / "worked_example.py"
  assert script.exists(), f"missing {script}"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  for value in EXPECTED.ravel():
    assert f"{value:.4f}" in result.stdout, (value, result.stdout)
  assert result.stdout.count("7.4482") >= 3, result.stdout
