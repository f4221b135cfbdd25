"""jattn.flax_attention_fn inside flax's own modules, against flax's default attention."""

import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jattn
from tests.compile_flags import fast_compile_flags
from tests.helpers import raises

B, T, F = 2, 6, 16
TOL = dict(rtol=1e-5, atol=2e-6)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _nnx_pair(attention_fn, **kw):
  """flax.nnx.MultiHeadAttention with flax's attention and with `attention_fn`, same weights."""
  theirs = nnx.MultiHeadAttention(4, F, decode=False, rngs=nnx.Rngs(0), **kw)
  ours = nnx.MultiHeadAttention(4, F, decode=False, rngs=nnx.Rngs(0),
                                attention_fn=attention_fn, **kw)
  return ours, theirs


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_nnx_module_with_it_equals_flax_default(impl):
  ours, theirs = _nnx_pair(functools.partial(jattn.flax_attention_fn, implementation=impl),
                           num_kv_heads=2)
  x = _x((B, T, F), 1)
  causal = nnx.make_causal_mask(jnp.ones((B, T)))  # float32, flax's default dtype
  np.testing.assert_allclose(ours(x, mask=causal), theirs(x, mask=causal), **TOL)
  np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, is_causal=True), **TOL)
  # gradients with respect to the parameters, under jit
  grads = lambda m: nnx.jit(nnx.grad(lambda m: (m(x, mask=causal) ** 2).sum()))(m)
  for a, b in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(grads(theirs))):
    # float32's rounding grows with the leaf: against float64, flax's gradients and these
    # are both 1e-5 to 2e-5 off in leaves of up to 50 (jax 0.12.1), so the bound scales
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(10.0, np.abs(b).max()))


def test_linen_module_with_it_equals_flax_default():
  x = _x((B, T, F), 1)
  theirs = nn.MultiHeadDotProductAttention(4)
  params = theirs.init(jax.random.key(0), x)
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  # linen passes no is_causal: jattn's arguments ride along with functools.partial
  ours = nn.MultiHeadDotProductAttention(4, attention_fn=functools.partial(
      jattn.flax_attention_fn, is_causal=True, implementation="blockwise"))
  np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x, mask=causal), **TOL)
  plain = nn.MultiHeadDotProductAttention(4, attention_fn=jattn.flax_attention_fn)
  _, want = theirs.apply(params, x, mask=causal, sow_weights=True, mutable=["intermediates"])
  got_out, got = plain.apply(params, x, mask=causal, sow_weights=True, mutable=["intermediates"])
  np.testing.assert_allclose(got["intermediates"]["attention_weights"][0],
                             want["intermediates"]["attention_weights"][0], **TOL)
  np.testing.assert_allclose(got_out, theirs.apply(params, x, mask=causal), **TOL)


def test_nnx_sow_weights_and_dropout_through_it():
  ours, theirs = _nnx_pair(jattn.flax_attention_fn, dropout_rate=0.5)
  x = _x((B, T, F), 1)
  weights = lambda m: jax.tree.leaves(nnx.capture(m, nnx.Intermediate)(
      x, deterministic=True, sow_weights=True)[1])
  (w,), (want,) = weights(ours), weights(theirs)
  np.testing.assert_allclose(w, want, **TOL)
  np.testing.assert_allclose(ours(x, deterministic=True), theirs(x, deterministic=True), **TOL)
  dropped = ours(x, deterministic=False)
  assert not np.allclose(dropped, ours(x, deterministic=True))
  assert np.isfinite(np.asarray(dropped)).all()


def test_the_function_itself_matches_flax_with_extra_batch_axes_and_dtype():
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 3, T, 4, 8)).astype(np.float32) for _ in range(3))
  mask = (rng.random((2, 3, 1, T, T)) < 0.7).astype(np.float32)
  mask[..., 0] = 1.0  # every row sees a key (flax averages an empty row, jattn gives 0)
  bias = rng.standard_normal((1, 4, T, T)).astype(np.float32)
  want = nnx.dot_product_attention(q, k, v, bias, mask)
  got = jattn.flax_attention_fn(q, k, v, bias, mask, precision="highest")
  np.testing.assert_allclose(got, want, **TOL)
  half = jattn.flax_attention_fn(q, k, v, dtype=jnp.bfloat16)
  assert half.dtype == jnp.bfloat16 and half.shape == (2, 3, T, 4, 8)


def test_what_it_cannot_honour_says_why():
  q = np.zeros((1, 3, 2, 8), np.float32)
  for name in ["einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"]:
    with raises(ValueError, f"{name}: jattn computes the attention products itself"):
      jattn.flax_attention_fn(q, q, q, **{name: jnp.einsum})
  with raises(ValueError, "layout: flax passes"):
    jattn.flax_attention_fn(q, q, q, layout="BNTH")
  with raises(TypeError, "force_fp32_for_softmax must be a bool"):
    jattn.flax_attention_fn(q, q, q, force_fp32_for_softmax="yes")
  with raises(TypeError, "module must be a flax nnx or linen Module"):
    jattn.flax_attention_fn(q, q, q, module=object())


# Long sequences: a flax.nnx.MultiHeadAttention at T = 32768 in a child process,
# whose peak resident memory (VmHWM) is what the test reads. 4 heads of
# float32 [T, T] logits are 16 GiB; the blockwise kernel holds one block.
_LONG = textwrap.dedent("""
    import functools, resource, sys
    import jax, jax.numpy as jnp
    from flax import nnx
    import jattn
    T, F = 32768, 32
    if sys.argv[1] == "flax":  # fail fast instead of exhausting the shared machine
      resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
      fn = nnx.dot_product_attention
    else:
      fn = functools.partial(jattn.flax_attention_fn, implementation="blockwise")
    m = nnx.MultiHeadAttention(4, F, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, T, F), jnp.float32)
    y = nnx.jit(lambda m, x: m(x, is_causal=True))(m, x)
    y.block_until_ready()
    ok = bool(jnp.isfinite(y).all())
    # VmHWM: this process's own peak; ru_maxrss would carry over the parent's
    # (pytest's) peak through fork and exec
    status = open("/proc/self/status").read().split("VmHWM:")[1].split()
    print(f"finite={ok} peak_gib={int(status[0]) / 2**20:.2f}")
""")


def _run_long(which):
  # XLA's default optimisation, not the suite's fast-compile flags (tests/compile_flags.py):
  # one program over 32k tokens runs about 2.5x faster optimised (26 s -> 10.5 s of CPU here)
  flags = os.environ.get("XLA_FLAGS", "").replace(fast_compile_flags(), "").strip()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=flags)
  return subprocess.run([sys.executable, "-c", _LONG, which], env=env, capture_output=True,
                        text=True, timeout=900)


@pytest.mark.slow
def test_flax_module_runs_32k_tokens_in_linear_memory_where_flax_cannot():
  ours = _run_long("jattn")
  assert ours.returncode == 0, ours.stderr[-3000:]
  print(ours.stdout)
  fields = dict(f.split("=") for f in ours.stdout.split())
  assert fields["finite"] == "True"
  assert float(fields["peak_gib"]) < 2.0  # the logits alone would be 16 GiB
  theirs = _run_long("flax")
  assert theirs.returncode != 0
  assert "RESOURCE_EXHAUSTED" in theirs.stderr or "MemoryError" in theirs.stderr, (
      theirs.stderr[-3000:])
