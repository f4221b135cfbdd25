"""implementation="blockwise": equal to "xla" (values and gradients) on every argument,
linear memory, skipped blocks, dropout, errors, and the raw primitives' contract.

Shapes are small and odd (T=13/37, S=11/29 against blocks of 8) so every case
has padded remainders; letters as everywhere: B T S N K G H D.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.kernels import blockwise_loop as _blockwise
from jattn._src.core.block_sizes import default_block_sizes
from jattn._src.impl.registry import CPU_BLOCKWISE_FROM
from jattn._src.core.layout import Layout
from jattn._src.masks.structural import MaskSpec
from jattn._src.masks.modifiers import Modifiers

BS = jattn.BlockSizes(q=8, kv=8)
B, T, S, N, K, H = 2, 37, 29, 4, 2, 8
TOL = dict(rtol=2e-5, atol=2e-5)


def _arrays(layout="BTNH", B=B, T=T, S=S, N=N, K=K, H=H, seed=0):
  """query/key/value in `layout` (S for T, K for N in key/value)."""
  rng = np.random.default_rng(seed)
  sizes = dict(B=B, T=T, N=N, H=H)
  shape = lambda sub: tuple(sizes[c] for c in sub)
  kv_sizes = dict(B=B, T=S, N=K, H=H)
  kv_shape = lambda sub: tuple(kv_sizes[c] for c in sub)
  q = jnp.asarray(rng.standard_normal(shape(layout)), jnp.float32)
  k = jnp.asarray(rng.standard_normal(kv_shape(layout)), jnp.float32)
  v = jnp.asarray(rng.standard_normal(kv_shape(layout)), jnp.float32)
  return q, k, v


def _loss_and_grads(impl, q, k, v, bias, layout, kwargs, block_sizes=BS):
  """Output and d/d(q, k, v, bias) of sum(out * cos(out)) (a non-trivial cotangent)."""
  def loss(q, k, v, bias):
    out = jattn.dot_product_attention(
        q, k, v, bias, layout=layout, implementation=impl,
        block_sizes=block_sizes if impl == "blockwise" else None, **kwargs)
    return jnp.sum(out * jnp.cos(out)), out
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, bias)
  return out, grads


def _compare(q, k, v, bias=None, layout="BTNH", block_sizes=BS, **kwargs):
  out_x, grads_x = _loss_and_grads("xla", q, k, v, bias, layout, kwargs)
  out_b, grads_b = _loss_and_grads("blockwise", q, k, v, bias, layout, kwargs, block_sizes)
  np.testing.assert_allclose(out_b, out_x, **TOL)
  for name, gb, gx in zip(("d_query", "d_key", "d_value", "d_bias"), grads_b, grads_x):
    assert bool(jnp.all(jnp.isfinite(gb))), name
    np.testing.assert_allclose(gb, gx, **TOL, err_msg=name)
  return out_b, grads_b


def _sorted_ids(rng, shape, high):
  return jnp.asarray(np.sort(rng.integers(0, high, shape), axis=-1), jnp.int32)


_rng = np.random.default_rng(1)
# Each case adds arguments to the call; together they cover every argument.
CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(3, 9)),
    "causal_window": dict(is_causal=True, local_window_size=5),
    "lengths": dict(query_seq_lengths=jnp.array([30, 0]),
                    key_value_seq_lengths=jnp.array([17, 3])),
    "segments": dict(q_segment_ids=_sorted_ids(_rng, (B, T), 3),
                     kv_segment_ids=_sorted_ids(_rng, (B, S), 3)),
    "unsorted_segments": dict(q_segment_ids=jnp.asarray(_rng.integers(0, 2, (B, T))),
                              kv_segment_ids=jnp.asarray(_rng.integers(0, 2, (B, S)))),
    "mask": dict(mask=jnp.asarray(_rng.random((B, 1, T, S)) > 0.4)),
    "mask_per_head_causal": dict(mask=jnp.asarray(_rng.random((1, N, T, S)) > 0.2),
                                 is_causal=True),
    "scale_causal_lengths": dict(scale=0.3, is_causal=True,
                                 key_value_seq_lengths=jnp.array([29, 11])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_xla(case):
  _compare(*_arrays(), **CASES[case])


@pytest.mark.parametrize("bias_shape", [(B, N, T, S), (1, N, 1, S), (1, 1, T, S), (B, 1, T, 1)])
def test_bias_matches_xla(bias_shape):
  bias = jnp.asarray(np.random.default_rng(2).standard_normal(bias_shape), jnp.float32)
  _compare(*_arrays(), bias=bias, is_causal=bias_shape[0] == 1)


def test_bias_per_head_with_one_kv_head():
  """A per-head bias broadcast over queries, [1, N, 1, S], with K = 1: every head
  of the group reads its own bias row (a block that kept the first head's passed
  with K > 1)."""
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, N, 1, S)), jnp.float32)
  _compare(*_arrays(K=1), bias=bias, is_causal=True)


def test_bias_of_two_queries_and_two_keys_one_block_each():
  """T = S = 2 with one query and one key per block: the bias gradient of block
  (i, j) lands in the bias's row i and column j (one written at row 0 passed when
  T != 2, one written at column 0 when S != 2)."""
  bias = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, 2, 2)), jnp.float32)
  _compare(*_arrays(T=2, S=2), bias=bias, block_sizes=jattn.BlockSizes(q=1, kv=1))


@pytest.mark.parametrize("layout,case", [
    ("BNTH", "causal"), ("BNHT", "segments"), ("HBTN", "window"), ("TNH", "plain"),
    ("NHT", "causal")])
def test_layouts_match_xla(layout, case):
  q, k, v = _arrays(layout if "B" in layout else "B" + layout)
  kwargs = dict(CASES[case])
  if "B" not in layout:  # unbatched: drop the batch axis of arrays and ids
    q, k, v = q[0], k[0], v[0]
    kwargs = {name: x[0] for name, x in kwargs.items()} if case == "segments" else kwargs
  _compare(q, k, v, layout=layout, **kwargs)


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_grouped_query_heads_match_xla(num_kv_heads):
  _compare(*_arrays(K=num_kv_heads), is_causal=True,
           query_seq_lengths=jnp.array([37, 20]))


def test_matches_float64_numpy_reference():
  """An independent reference: the formula in NumPy float64, causal, one block size."""
  q, k, v = _arrays(T=13, S=13)
  out = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise",
                                    block_sizes=jattn.BlockSizes(q=4, kv=3))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  kn, vn = np.repeat(kn, N // K, axis=2), np.repeat(vn, N // K, axis=2)
  logits = np.einsum("BTNH,BSNH->BNTS", qn, kn) / np.sqrt(H)
  logits = np.where(np.tril(np.ones((13, 13), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("BNTS,BSNH->BTNH", w, vn), rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
  q, k, v = _arrays()
  mask = jnp.ones((B, 1, T, S), bool).at[:, :, 5:20].set(False)  # rows 5..19 see nothing
  out, grads = _compare(q, k, v, mask=mask, query_seq_lengths=jnp.array([37, 30]))
  assert float(jnp.abs(out[:, 5:20]).max()) == 0.0
  assert float(jnp.abs(out[1, 30:]).max()) == 0.0
  assert float(jnp.abs(grads[0][:, 5:20]).max()) == 0.0  # d_query of those rows


def test_block_sizes_do_not_change_the_result():
  q, k, v = _arrays()
  base = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")
  for sizes in ((1, 1), (16, 5), (64, 64), (37, 29)):
    out = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise",
                                      block_sizes=jattn.BlockSizes(*sizes))
    np.testing.assert_allclose(out, base, **TOL)


def test_block_sizes_are_honoured():
  """The logits block has the requested shape [B, K, R, bk], R = G * bq rows per matmul."""
  q, k, v = _arrays()
  text = jax.jit(lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="blockwise", block_sizes=jattn.BlockSizes(q=16, kv=8))
  ).lower(q, k, v).as_text()
  G = N // K
  assert f"tensor<{B}x{K}x{G * 16}x8xf32>" in text
  assert f"tensor<{B}x{K}x{G * 8}x8xf32>" not in text


def test_default_block_sizes_are_the_cpu_measured_ones_everywhere():
  for platform in ("cpu", "tpu", "cuda", "rocm"):
    assert default_block_sizes(platform) == jattn.BlockSizes(q=512, kv=256)


# ----------------------------------------------------------------- skipped blocks

def _count(T, S, spec, block, q_offset=0, kv_offset=0):
  q, k, v = _arrays(T=T, S=S)
  _, _, count = _blockwise.forward_with_count(
      q, k, v, Modifiers(structure=spec, scale=0.5), Layout("BTNH"), q_offset, kv_offset,
      jattn.BlockSizes(q=block, kv=block))
  return int(count)


def test_blocks_ruled_out_are_skipped():
  full = 8 * 8  # T = S = 64 in blocks of 8
  assert _count(64, 64, MaskSpec(), 8) == full
  assert _count(64, 64, MaskSpec(is_causal=True), 8) == 8 * 9 // 2
  # window (8, 0): each q block needs its own kv block and the one before
  assert _count(64, 64, MaskSpec(local_window=(8, 0)), 8) == 8 + 7
  # only the first 2 kv blocks have keys; only q blocks before row 40 have queries
  lengths = MaskSpec(kv_lengths=jnp.array([9, 16]), q_lengths=jnp.array([40, 3]))
  assert _count(64, 64, lengths, 8) == 5 * 2
  # packed segments of 16: block-diagonal pairs of blocks
  ids = jnp.repeat(jnp.arange(4), 16)[None].repeat(B, 0)
  assert _count(64, 64, MaskSpec(q_segment_ids=ids, kv_segment_ids=ids), 8) == 4 * 4
  # a kv range that lies after every query of this range sees nothing (causal ring)
  assert _count(64, 64, MaskSpec(is_causal=True), 8, q_offset=0, kv_offset=64) == 0


# ----------------------------------------------------------------- dropout

def _dropout_out(rng, rate=0.3, block_sizes=BS):
  q, k, v = _arrays()
  return jattn.dot_product_attention(q, k, v, implementation="blockwise", is_causal=True,
                                     dropout_rate=rate, dropout_rng=rng,
                                     block_sizes=block_sizes)


def test_dropout_is_reproducible_from_the_rng():
  a = _dropout_out(jax.random.key(0))
  np.testing.assert_array_equal(a, _dropout_out(jax.random.key(0)))
  assert float(jnp.abs(a - _dropout_out(jax.random.key(1))).max()) > 1e-2


def test_dropout_keeps_the_expectation():
  """With value = 1 every output is sum_j w_j keep_j, whose expectation is 1."""
  q, k, _ = _arrays()
  v = jnp.ones_like(k)
  out = jattn.dot_product_attention(q, k, v, implementation="blockwise", dropout_rate=0.5,
                                    dropout_rng=jax.random.key(3), block_sizes=BS)
  assert abs(float(out.mean()) - 1.0) < 0.05
  assert float(out.std()) > 0.1  # and it did drop


def test_dropout_matches_dense_reference_with_the_same_draw():
  """Values and gradients against softmax * keep @ v with the blockwise draw rebuilt densely."""
  q, k, v = _arrays()
  rate, rng = 0.25, jax.random.key(7)
  Tp, Sp = 40, 32  # T, S rounded up to blocks of 8
  # the documented draw, straight from the rng: keep with probability 1 - rate,
  # kept weights scaled by 1 / (1 - rate) (inverted dropout)
  draw = lambda i, j: jax.random.bernoulli(
      jax.random.fold_in(jax.random.fold_in(rng, i), j), 1 - rate, (B, N, 8, 8)
  ).astype(jnp.float32) / (1 - rate)
  # keep [B, N, T, S]: block (i, j) drawn from the global positions of its corner
  # (vmapped over the corners: one draw to compile, not one per block)
  rows = jax.vmap(jax.vmap(draw, (None, 0), 3), (0, None), 2)(
      jnp.arange(0, Tp, 8), jnp.arange(0, Sp, 8))  # [B, N, Tp / 8, 8, Sp / 8, 8]
  keep = rows.reshape(B, N, Tp, Sp)[:, :, :T, :S]

  def reference(q, k, v):
    kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, kk) / np.sqrt(H)
    w = jax.nn.softmax(jnp.where(jattn.causal_mask(T, S), logits, -1e30), axis=-1)
    return jnp.einsum("BNTS,BSNH->BTNH", w * keep, vv)

  def blockwise(q, k, v):
    return jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise",
                                       dropout_rate=rate, dropout_rng=rng, block_sizes=BS)
  loss = lambda fn: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1, 2)))(
      q, k, v)
  (lr, gr), (lb, gb) = loss(reference), loss(blockwise)
  np.testing.assert_allclose(lb, lr, rtol=1e-5)
  for a, b in zip(gb, gr):
    np.testing.assert_allclose(a, b, **TOL)


# ----------------------------------------------------------------- primitives (ring contract)

def test_primitives_combine_over_kv_ranges_by_lse():
  """Two kv ranges at their global offsets, combined by lse, give the whole attention,
  and their backward contributions sum to the whole gradient."""
  q, k, v = _arrays(T=24, S=24)
  lay, sizes, split = Layout("BTNH"), jattn.BlockSizes(q=8, kv=8), 16
  spec = MaskSpec(is_causal=True)
  parts = [(k[:, :split], v[:, :split], 0), (k[:, split:], v[:, split:], split)]
  modifiers = Modifiers(structure=spec, scale=0.5)
  outs, lses = zip(*(_blockwise.forward(q, kk, vv, modifiers, lay, 0, off, sizes)
                     for kk, vv, off in parts))
  lse = jnp.logaddexp(*lses)  # [B, N, T]
  # out [B, T, N, D]: weight each range by exp(lse_r - lse)
  out = sum(o * jnp.exp(l - lse).transpose(0, 2, 1)[..., None] for o, l in zip(outs, lses))
  ref = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True, scale=0.5,
                                                    implementation="xla")
  np.testing.assert_allclose(out, ref(q, k, v), **TOL)

  d_out = jnp.cos(out)
  grads = [_blockwise.backward(q, kk, vv, modifiers, lay, 0, off, sizes, out, lse, d_out)
           for kk, vv, off in parts]
  assert all(len(g) == 4 and g[3] is None for g in grads)  # d_q, d_k, d_v, d_bias (no bias)
  _, pullback = jax.vjp(ref, q, k, v)
  dq, dk, dv = pullback(d_out)
  np.testing.assert_allclose(grads[0][0] + grads[1][0], dq, **TOL)
  np.testing.assert_allclose(jnp.concatenate([grads[0][1], grads[1][1]], 1), dk, **TOL)
  np.testing.assert_allclose(jnp.concatenate([grads[0][2], grads[1][2]], 1), dv, **TOL)


# ----------------------------------------------------------------- memory

def _temp_bytes(impl, L, block_sizes=None):
  """Compiled temp memory of the forward and of the backward at T = S = L (B=N=1, H=16)."""
  q, k, v = _arrays(B=1, T=L, S=L, N=1, K=1, H=16)
  fn = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation=impl, block_sizes=block_sizes)
  grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2))
  return [jax.jit(f).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
          for f in (fn, grad)]


def test_memory_is_linear():
  """No [T, S] buffer at T = S = 2048 in the compiled forward or backward, and temp
  memory at most doubles from T = S = 1024 (a [T, S] buffer would quadruple it).
  The same measure does see the [T, S] logits that "xla" holds."""
  sizes = jattn.BlockSizes(q=128, kv=128)
  small, large = _temp_bytes("blockwise", 1024, sizes), _temp_bytes("blockwise", 2048, sizes)
  logits_bytes = 2048 * 2048 * 4
  for pass_, s, l in zip(("forward", "backward"), small, large):
    assert l < logits_bytes / 8, (pass_, l)
    assert l <= 2.2 * s, (pass_, s, l)
  assert all(t >= logits_bytes for t in _temp_bytes("xla", 2048))


# ----------------------------------------------------------------- errors and dispatch

def test_return_weights_is_an_error():
  with pytest.raises(ValueError, match="return_weights.*blockwise"):
    jattn.dot_product_attention(*_arrays(), implementation="blockwise", return_weights=True)


def test_block_sizes_errors():
  with pytest.raises(ValueError, match="BlockSizes.q must be a positive int"):
    jattn.BlockSizes(q=0, kv=8)
  with pytest.raises(TypeError, match="block_sizes must be a jattn.BlockSizes"):
    jattn.dot_product_attention(*_arrays(), block_sizes=(8, 8))
  with pytest.raises(ValueError, match="block_sizes applies to implementation='blockwise'"):
    jattn.dot_product_attention(*_arrays(), implementation="xla", block_sizes=BS)


def test_cudnn_is_refused_where_it_cannot_run(host_without_cuda):
  """No GPU and no cuDNN: refused before any work, naming what is missing."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _arrays())
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run.*cuDNN is not detected"):
    jattn.dot_product_attention(q, k, v, implementation="cudnn")


def _chosen(T, S, N=1, platform="cpu", **kwargs):
  q = jax.ShapeDtypeStruct((1, T, N, 8), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, S, N, 8), jnp.float32)
  return jattn.explain(q, kv, kv, **kwargs).implementation(platform)


def test_default_implementation_rule():
  side = int(np.sqrt(CPU_BLOCKWISE_FROM))
  assert _chosen(side, side) == "blockwise"
  assert _chosen(side // 2, side) == "xla"
  assert _chosen(side, side, return_weights=True) == "xla"
  # a window: neither cuDNN (float32) nor jax's Pallas kernel, jattn's own does
  assert _chosen(64, 64, platform="cuda", local_window_size=3) == "flex_gpu"
  # a dense bias: no fused kernel; xla while the logits are small, then blockwise
  assert _chosen(64, 64, platform="cuda", bias=jnp.zeros(())) == "xla"
  assert _chosen(2**14, 2**14, N=8, platform="cuda", bias=jnp.zeros(())) == "blockwise"
  assert _chosen(2**14, 2**14, N=8, platform="tpu", bias=jnp.zeros(())) == "blockwise"


def test_default_is_blockwise_from_the_cpu_crossover():
  """implementation=None lowers the blockwise loop for the CPU from T * S = the crossover on."""
  side = int(np.sqrt(CPU_BLOCKWISE_FROM))
  lowered = lambda L: jax.jit(jattn.dot_product_attention).trace(
      *_arrays(B=1, T=L, S=L, N=1, K=1, H=4)).lower(lowering_platforms=("cpu",)).as_text()
  assert "stablehlo.while" in lowered(side)
  assert "stablehlo.while" not in lowered(side // 2)


# ----------------------------------------------------------------- random shapes

@hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
@hypothesis.given(
    T=st.integers(1, 20), S=st.integers(1, 20), K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 2]), bq=st.integers(1, 9), bk=st.integers(1, 9),
    causal=st.booleans(), lengths=st.booleans(), masked=st.booleans(),
    seed=st.integers(0, 2**16))
def test_random_shapes_match_xla(T, S, K, G, bq, bk, causal, lengths, masked, seed):
  rng = np.random.default_rng(seed)
  q, k, v = _arrays(B=2, T=T, S=S, N=K * G, K=K, H=4, seed=seed)
  kwargs = dict(is_causal=causal)
  if lengths:
    kwargs.update(query_seq_lengths=jnp.asarray(rng.integers(0, T + 1, 2)),
                  key_value_seq_lengths=jnp.asarray(rng.integers(0, S + 1, 2)))
  if masked:
    kwargs["mask"] = jnp.asarray(rng.random((2, 1, T, S)) > 0.3)
  _compare(q, k, v, block_sizes=jattn.BlockSizes(q=bq, kv=bk), **kwargs)
