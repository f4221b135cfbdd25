"""The "paged_gpu" kernel of decode_attention (Pallas Triton), interpreted on the CPU,
against the float64 full pass (tests/reference.py), and compiled for an H100 without a GPU.

The cache of tests/decode/test_paged_tpu.py (final lengths 13, 4, 9 with pages of 4,
interleaved in the pool by a prefill then the rest) is queried once per case: a chunk
of each row's last 3 tokens (query_lengths 3, 2, 3: a padding slot), every output
compared with the full pass at those positions. Interpreted Pallas is slow (about 15 s
a call on 2 cores): the default tier takes a mask that reads b and n stepping one page
at a time, sinks + window + a score that reads n, grouped heads, splits (some empty)
merged by log-sum-exp, NaN in every page a row must not read, freed pages reused and a
row with nothing to attend; every mod and the rest are `thorough`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.decode.test_decode_attention import B, CASES, FINAL, _data, _s, _t, full_pass
from tests.decode.test_paged_tpu import Q_LENGTHS, _check_rows, _filled, _last_queries
from jattn._src.core.softmax import LARGE_NEGATIVE
from tests.reference import reference_max_logits

pytestmark = pytest.mark.interpret


def _kernel(q, cache, **kwargs):
  with pallas_interpret():
    return jattn.decode_attention(q, cache, query_lengths=jnp.asarray(Q_LENGTHS),
                                  implementation="paged_gpu", **kwargs)


# CI: a hand-written mask reading b and n (not causal), one page a step (the loop and
# the mask between pages); sinks + a window + ALiBi (reads n), the default step (one
# step of 16 pages: the entries past a row's list masked, never read)
_CI = {"user_mask": 1, "sinks_window_alibi": None}
# the kernel refuses these (per-token arrays, tables): tested in test_refusals_say_why
_REFUSED = ("document", "relative_bias")


@pytest.mark.parametrize("case", [c if c in _CI else pytest.param(c, marks=pytest.mark.thorough)
                                  for c in CASES if c not in _REFUSED])
def test_kernel_equals_the_full_pass(case):
  """The outputs, and the max logits (return_max_logits) against float64's."""
  q, k, v = _data()
  kwargs, causal, allowed, score = CASES[case][:4]
  got, top = _kernel(_last_queries(q), _filled(k, v), is_causal=causal,
                     pages_per_step=_CI.get(case, 2), return_max_logits=True, **kwargs)
  _check_rows(got, full_pass(q, k, v, case))
  keep = (_s < FINAL[:, None, None, None]) & ((_s <= _t) | (not causal))
  keep = keep if allowed is None else keep & allowed
  want = reference_max_logits(q, k, allowed=keep, score=score)  # [B, N, L]
  want = np.where(np.isfinite(want), want, LARGE_NEGATIVE).transpose(0, 2, 1)  # [B, L, N]
  top = np.asarray(top)
  for b in range(B):
    first = FINAL[b] - Q_LENGTHS[b]
    np.testing.assert_allclose(top[b, :Q_LENGTHS[b]], want[b, first:FINAL[b]], rtol=1e-5)
    np.testing.assert_array_equal(top[b, Q_LENGTHS[b]:], np.float32(LARGE_NEGATIVE))  # padding


@pytest.mark.parametrize("k_heads", [1, pytest.param(4, marks=pytest.mark.thorough)])
def test_grouped_and_plain_heads(k_heads):
  """K = 1 (the G = 4 heads of the kv head in one tile, ALiBi reading n per head) and
  K = 4 (G = 1)."""
  q, k, v = _data(2, k_heads)
  kwargs, causal = CASES["alibi"][:2]
  got = _kernel(_last_queries(q), _filled(k, v), is_causal=causal, **kwargs)
  _check_rows(got, full_pass(q, k, v, "alibi"))


def _run_with(plan_change, case, seed=3, **kwargs):
  """The kernel with its plan changed (dataclasses.replace), called directly."""
  from jattn._src.decode import paged_gpu
  from jattn._src.masks.programmable import build_mods
  q, k, v = _data(seed)
  cache = _filled(k, v)
  query = _last_queries(q)
  call_kwargs, causal = CASES[case][:2]
  with pallas_interpret():
    plan = jattn.explain_decode(query, cache, implementation="paged_gpu", is_causal=causal,
                                **call_kwargs, **kwargs).choices["cpu"].plan
  plan = dataclasses.replace(plan, **plan_change)
  mods = build_mods(call_kwargs.get("mask_mod"), call_kwargs.get("score_mod"),
                    call_kwargs.get("sinks"), None, N=q.shape[2])
  got = paged_gpu.run(plan, query, cache, mods, dict(
      q_lengths=jnp.asarray(Q_LENGTHS, jnp.int32), scale=1 / np.sqrt(q.shape[3]),
      dtype=jnp.float32))
  return got, full_pass(q, k, v, case), plan


def test_chunks_cover_each_rows_list_in_order():
  """White box: chunk c of row b takes entries lo .. lo + n - 1, every entry once, rows
  in order; past the last chunk n = 0; a row past the grid's capacity (only a page
  listed twice can do it) is flagged."""
  from jattn._src.decode import paged_gpu
  counts = np.array([5, 0, 1, 8])
  row, lo, n, overflow = (np.asarray(x) for x in paged_gpu.chunks(jnp.asarray(counts), 4, 7))
  want = [(0, 0, 4), (0, 4, 1), (2, 0, 1), (3, 0, 4), (3, 4, 4)]
  got = [(int(r), int(a), int(m)) for r, a, m in zip(row, lo, n) if m > 0]
  assert got == want and (n[len(want):] == 0).all()
  assert not overflow.any()
  assert np.asarray(paged_gpu.chunks(jnp.asarray(counts), 4, 4)[3]).tolist() == [
      False, False, False, True]


def test_splits_merge_by_log_sum_exp():
  """One page a chunk (rows of 4, 1 and 3 pages in 8 chunks; the grid's 10 leave two
  empty, which write nothing), merged outside the kernel, with sinks. Planted: the merge
  taking every chunk, written or not - this test failed."""
  got, want, plan = _run_with(dict(per_split=1), "sinks", pages_per_step=1)
  assert (plan.splits, plan.chunks) == (4, 10)
  _check_rows(got, want)


@pytest.mark.thorough
def test_two_pages_a_split_and_a_step():
  got, want, plan = _run_with(dict(per_split=2), "chunked", pages_per_step=2)
  assert plan.splits == 2
  _check_rows(got, want)


# NaN in unread pages, freed pages reused, a row with nothing to attend: the TPU
# kernel's tests, run for both (tests/decode/test_paged_tpu.py)


def test_refusals_say_why():
  """The plan refuses what the kernel cannot do, with the reason; named on CUDA, the
  default there stays "split" (no GPU measurement yet)."""
  q, k, v = _data()
  cache = _filled(k, v)
  query = _last_queries(q)
  for kwargs, words in ((CASES["document"][0], "per-token array"),
                        (CASES["relative_bias"][0], "table")):
    with pytest.raises(ValueError, match=words):
      jattn.decode_attention(query, cache, implementation="paged_gpu", **kwargs)
  # compiled (not interpreted): D = 6 is no Triton tile, pages of 4 under 16 keys a step
  with pytest.raises(ValueError, match="power-of-two sides"):
    jattn.explain_decode(query, cache, implementation="paged_gpu")


def _paged_abstract(B_, max_length, K_, H_, ps, P_, dtype=jnp.bfloat16):
  return jax.eval_shape(lambda: jattn.paged.init_cache(
      B_, max_length, num_kv_heads=K_, head_dim=H_, page_size=ps, num_pages=P_, dtype=dtype))


def test_explain_names_it_on_cuda_and_split_stays_the_default():
  cache = _paged_abstract(8, 32768, 4, 128, 64, 600)
  q = jax.ShapeDtypeStruct((8, 1, 16, 128), jnp.bfloat16)
  named = jattn.explain_decode(q, cache, is_causal=True, implementation="paged_gpu")
  assert named.implementation("cuda") == "paged_gpu"
  plan = named.choices["cuda"].plan
  # 64 keys a step, 1024 a program, the G T = 4 rows padded to 16; 45 chunks: the
  # pool's 600 pages in chunks of 16 plus one part-filled chunk a row at most
  assert (plan.pages_per_step, plan.per_split, plan.rows, plan.splits, plan.chunks) == (
      1, 16, 16, 32, 45)
  assert jattn.explain_decode(q, cache, is_causal=True).implementation("cuda") == "split"


@pytest.mark.compile
def test_compiles_for_an_h100_with_the_kernel_and_no_dense_buffer():
  """Compiled for an H100 from this host (deviceless; the benchmark's batch: B = 8 rows
  of up to 32k, N = 16, K = 4, H = 128, pages of 64, bfloat16): the program calls the
  kernel, and its temporaries hold nothing near [B, N, T, max_length] (dense logits)
  nor a copy of the pool. A query chunk (T = 2) with mods and sinks compiles too."""
  from jattn._src import deviceless_cuda
  from tests.compile.test_compile_cuda import _custom_calls, _TRITON
  if deviceless_cuda.missing() is not None:
    pytest.skip(f"no deviceless CUDA compile: {deviceless_cuda.missing()}")
  B_, N_, K_, H_, ps, max_length, P_ = 8, 16, 4, 128, 64, 32768, 600
  cache = _paged_abstract(B_, max_length, K_, H_, ps, P_)
  pool_bytes = 2 * P_ * ps * K_ * H_ * 2  # keys and values, bfloat16
  for T_, kwargs in ((1, dict(is_causal=True)),
                     (2, dict(mask_mod=jattn.mods.sliding_window(4000), sinks=jnp.zeros(N_),
                              score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N_))))):
    q = jax.ShapeDtypeStruct((B_, T_, N_, H_), jnp.bfloat16)
    assert jattn.explain_decode(q, cache, implementation="paged_gpu",
                                **kwargs).implementation("cuda") == "paged_gpu"
    compiled = deviceless_cuda.compile_for(
        "h100", lambda q, c: jattn.decode_attention(q, c, implementation="paged_gpu",
                                                    **kwargs), q, cache)
    assert _custom_calls(compiled.as_text(), _TRITON) == ["jattn_paged_decode_gpu"]
    dense_bytes = B_ * N_ * T_ * max_length * 4  # float32 logits [B, N, T, max_length]
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < dense_bytes / 4 and temp < pool_bytes / 8, temp


@pytest.mark.compile
def test_int8_pages_compile_for_an_h100_without_a_dequantized_copy():
  """int8 pages (bfloat16 queries, the benchmark's batch) compiled for an H100: the
  program calls the kernel, and its temporaries hold no dequantized pool (the pool in
  bfloat16 would be 2x the int8 pool's bytes)."""
  from jattn._src import deviceless_cuda
  from tests.compile.test_compile_cuda import _custom_calls, _TRITON
  if deviceless_cuda.missing() is not None:
    pytest.skip(f"no deviceless CUDA compile: {deviceless_cuda.missing()}")
  B_, N_, K_, H_, ps, max_length, P_ = 8, 16, 4, 128, 64, 32768, 600
  cache = _paged_abstract(B_, max_length, K_, H_, ps, P_, jnp.int8)
  q = jax.ShapeDtypeStruct((B_, 1, N_, H_), jnp.bfloat16)
  assert "int8 keys and values dequantized in the kernel" in str(jattn.explain_decode(
      q, cache, implementation="paged_gpu", is_causal=True).choices["cuda"].plan)
  compiled = deviceless_cuda.compile_for("h100", lambda q, c: jattn.decode_attention(
      q, c, implementation="paged_gpu", is_causal=True), q, cache)
  assert _custom_calls(compiled.as_text(), _TRITON) == ["jattn_paged_decode_gpu"]
  int8_pool = 2 * P_ * ps * K_ * H_  # keys and values
  assert compiled.memory_analysis().temp_size_in_bytes < int8_pool / 8


@pytest.mark.compile
@pytest.mark.thorough
@pytest.mark.parametrize("page_size, dtype, head", [(128, "bfloat16", 128), (64, "float32", 128),
                                                    (16, "bfloat16", 64), (64, "float16", 256)])
def test_compiles_for_an_h100_at_other_pages_dtypes_and_heads(page_size, dtype, head):
  """Pages of 16 (4 a step), 64 and 128 keys, float32 / 16-bit pages, H = 64 to 256,
  a chunk of 3 queries with max logits: each compiles with the kernel."""
  from jattn._src import deviceless_cuda
  from tests.compile.test_compile_cuda import _custom_calls, _TRITON
  if deviceless_cuda.missing() is not None:
    pytest.skip(f"no deviceless CUDA compile: {deviceless_cuda.missing()}")
  cache = _paged_abstract(2, 4096, 2, head, page_size, 80, jnp.dtype(dtype))
  q = jax.ShapeDtypeStruct((2, 3, 8, head), jnp.dtype(dtype))
  compiled = deviceless_cuda.compile_for("h100", lambda q, c: jattn.decode_attention(
      q, c, implementation="paged_gpu", is_causal=True, return_max_logits=True), q, cache)
  assert _custom_calls(compiled.as_text(), _TRITON) == ["jattn_paged_decode_gpu"]
