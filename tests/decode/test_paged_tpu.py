"""The "paged_tpu" kernel of decode_attention, interpreted on the CPU, against the
float64 full pass (tests/reference.py), and compiled for TPU v5e and v6e without a TPU.

The cache of tests/decode/test_decode_attention.py (final lengths 13, 4, 9 with
pages of 4, interleaved in the pool by a prefill then the rest) is queried once
per case: a chunk of the last 3 tokens of each row (query_lengths 3, 2, 3 so a
padded query slot is in it), every output compared with the full pass at those
positions. Interpreted Pallas is slow (about 10 s a call on the 2-core CI
machine): CI takes six calls that cover every kind of mod (a closed-form mask
with EMPTY pages, a mask that reads b and n, a score that reads n, sinks, a
window), a chunk, splits, grouped heads, NaN pages and reuse; every case is in
the `thorough` tier.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.impl.interpret import pallas_interpret
from tests.decode.test_decode_attention import (B, CASES, FINAL, K, NEEDED, PROMPT, _data,
                                                _empty_cache, _late_case, _poison_unread,
                                                _s, _t, full_pass)
from tests.reference import reference_mods

pytestmark = pytest.mark.interpret

T = 3
Q_LENGTHS = np.array([3, 2, 3])


def _filled(k, v):
  """The cache holding every row's FINAL tokens, its pages interleaved in the pool."""
  cache = jattn.paged.append(_empty_cache(k.shape[2]), k, v, jnp.asarray(PROMPT))
  at = np.minimum(PROMPT[:, None] + np.arange(k.shape[1])[None, :], k.shape[1] - 1)
  take = lambda x: jnp.asarray(x[np.arange(B)[:, None], at])
  return jattn.paged.append(cache, take(k), take(v), jnp.asarray(FINAL - PROMPT))


def _last_queries(q):
  """[B, T, N, H]: each row's last Q_LENGTHS[b] queries, then padding slots."""
  at = np.clip(FINAL[:, None] - Q_LENGTHS[:, None] + np.arange(T)[None, :], 0, q.shape[1] - 1)
  return jnp.asarray(q[np.arange(B)[:, None], at])


def _check_rows(got, want):
  """got [B, T, N, D] against the full pass want [B, L, N, D] at the queried positions;
  padding slots must be 0."""
  got = np.asarray(got)
  for b in range(B):
    first = FINAL[b] - Q_LENGTHS[b]
    np.testing.assert_allclose(got[b, :Q_LENGTHS[b]], want[b, first:FINAL[b]], rtol=2e-5,
                               atol=2e-5)
    np.testing.assert_array_equal(got[b, Q_LENGTHS[b]:], 0.0)


def _kernel(q, cache, implementation="paged_tpu", **kwargs):
  with pallas_interpret():
    return jattn.decode_attention(q, cache, query_lengths=jnp.asarray(Q_LENGTHS),
                                  implementation=implementation, **kwargs)


# the edge cases below hold for both page-reading kernels: the TPU one and the GPU one
# (paged_gpu, tests/decode/test_paged_gpu.py), each interpreted
_KERNELS = pytest.mark.parametrize("implementation", ["paged_tpu", "paged_gpu"])


_CI = ("user_mask", "sinks_window_alibi")
# the kernel refuses these (per-token arrays, tables): tested in test_refusals
_REFUSED = ("document", "relative_bias")


@pytest.mark.parametrize("case", [c if c in _CI else pytest.param(c, marks=pytest.mark.thorough)
                                  for c in CASES if c not in _REFUSED])
def test_kernel_equals_the_full_pass(case):
  q, k, v = _data()
  kwargs, causal = CASES[case][:2]
  got = _kernel(_last_queries(q), _filled(k, v), is_causal=causal, **kwargs)
  _check_rows(got, full_pass(q, k, v, case))


@pytest.mark.parametrize("k_heads", [1, pytest.param(4, marks=pytest.mark.thorough)])
def test_grouped_and_plain_heads(k_heads):
  """K = 1 (G = 4 heads in one tile, two splits per row: B K < 4) and K = 4 (G = 1)."""
  q, k, v = _data(2, k_heads)
  kwargs, causal = CASES["alibi"][:2]
  cache = _filled(k, v)
  with pallas_interpret():
    report = jattn.explain_decode(_last_queries(q), cache, implementation="paged_tpu",
                                  is_causal=causal, **kwargs)
  assert report.choices["cpu"].plan.splits == (2 if k_heads == 1 else 1)
  got = _kernel(_last_queries(q), cache, is_causal=causal, **kwargs)
  _check_rows(got, full_pass(q, k, v, "alibi"))


@pytest.mark.thorough
def test_splits_merge_by_log_sum_exp():
  """Three splits per row (some empty for the short row), merged outside the kernel."""
  from jattn._src.decode import paged_tpu
  from jattn._src.masks.programmable import build_mods
  q, k, v = _data(3)
  cache = _filled(k, v)
  query = _last_queries(q)
  with pallas_interpret():
    plan = jattn.explain_decode(query, cache, implementation="paged_tpu", sinks=jnp.asarray(
        CASES["sinks"][0]["sinks"]), is_causal=True).choices["cpu"].plan
  plan = dataclasses.replace(plan, splits=3)
  mods = build_mods(None, None, CASES["sinks"][0]["sinks"], None, N=q.shape[2])
  got = paged_tpu.run(plan, query, cache, mods, dict(
      q_lengths=jnp.asarray(Q_LENGTHS, jnp.int32), scale=1 / np.sqrt(q.shape[3]),
      dtype=jnp.float32))
  _check_rows(got, full_pass(q, k, v, "sinks"))


@pytest.mark.parametrize("case, pages", [NEEDED[2]] + [
    pytest.param(c, p, marks=pytest.mark.thorough) for c, p in NEEDED[:2] + NEEDED[3:]
    if c != "document"])  # refused: test_refusals_say_why
@_KERNELS
def test_pages_a_row_must_not_read_hold_nan(case, pages, implementation):
  """NaN in every page the last token of each row must not read (free pages, pages
  outside its window, EMPTY pages) and in slots past each row's length. Planted in
  paged_gpu: the load mask without `s_pos < length` (the stale slots read) made this
  fail (NaN)."""
  q, k, v = _data(4)
  kwargs, causal = _late_case(case)
  want_mask = {"user_mask_late": (_s >= 8) | (_s == _t), "bidirectional": True}.get(
      case, CASES.get(case, (None,) * 3)[2])
  want_mask = True if want_mask is None else want_mask
  cache = jattn.paged.append(_empty_cache(), k, v, jnp.asarray(FINAL))
  poisoned = _poison_unread(np.asarray(pages, bool))(cache)
  last = jnp.asarray(q[np.arange(B), FINAL - 1][:, None])  # [B, 1, N, H]
  with pallas_interpret():
    got = np.asarray(jattn.decode_attention(last, poisoned, implementation=implementation,
                                            is_causal=causal, **kwargs))[:, 0]
  keep = (_s < FINAL[:, None, None, None]) & ((_s <= _t) | (not causal)) & want_mask
  want, _ = reference_mods(q, k, v, allowed=keep)
  np.testing.assert_allclose(got, want[np.arange(B), FINAL - 1], rtol=2e-5, atol=2e-5)


@_KERNELS
def test_freed_pages_are_reused(implementation):
  """Row 1 finishes; every free page is then filled with NaN (stale values) and row 1
  takes a new sequence of 3 tokens into a freed page: its last slot stays NaN."""
  q, k, v = _data(5)
  cache = jattn.paged.free(_filled(k, v), jnp.array([False, True, False]))
  free = np.asarray(cache.page_free)
  cache = dataclasses.replace(
      cache, key_pages=jnp.where(free[:, None, None, None], jnp.nan, cache.key_pages),
      value_pages=jnp.where(free[:, None, None, None], jnp.nan, cache.value_pages))
  q2, k2, v2 = _data(6)
  new = np.array([0, 3, 0])
  cache = jattn.paged.append(cache, jnp.asarray(k2[:, :3]), jnp.asarray(v2[:, :3]),
                             jnp.asarray(new))
  assert free[np.asarray(cache.block_table)[1, 0]]  # a freed page again
  with pallas_interpret():
    got = np.asarray(jattn.decode_attention(
        jnp.asarray(q2[:, :3]), cache, query_lengths=jnp.asarray(new), is_causal=True,
        implementation=implementation))
  keep = (_s[:, :, :3, :3] <= _t[:, :, :3, :3])
  want, _ = reference_mods(q2[1:2, :3], k2[1:2, :3], v2[1:2, :3], allowed=keep)
  np.testing.assert_allclose(got[1], want[0], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(got[[0, 2]], 0.0)  # rows with no query


@_KERNELS
def test_a_row_with_nothing_to_attend_gives_zeros(implementation):
  """Row 1's mask hides every key (with sinks too): zeros, no NaN; the others as usual."""
  q, k, v = _data(7)
  sinks = CASES["sinks"][0]["sinks"]
  got = _kernel(_last_queries(q), _filled(k, v), implementation, is_causal=True,
                sinks=sinks, mask_mod=lambda b, n, t, s: b != 1)
  assert not np.isnan(np.asarray(got)).any()
  np.testing.assert_array_equal(np.asarray(got)[1], 0.0)
  keep = (_s < FINAL[:, None, None, None]) & (_s <= _t) & (np.arange(B) != 1)[:, None, None,
                                                                              None]
  want, _ = reference_mods(q, k, v, allowed=keep, sinks=np.asarray(sinks))
  _check_rows(got, want)


def test_refusals_say_why():
  """The plan refuses what the kernel cannot do, with the reason; the default is split."""
  q, k, v = _data()
  cache = _filled(k, v)
  query = _last_queries(q)
  for kwargs, words in ((CASES["document"][0], "per-token array"),
                        (CASES["relative_bias"][0], "table")):
    with pytest.raises(ValueError, match=words):
      jattn.decode_attention(query, cache, implementation="paged_tpu", **kwargs)
    assert jattn.explain_decode(query, cache, **kwargs).implementation("tpu") == "split"
  # H = 8: not lane-aligned on a real TPU
  with pytest.raises(ValueError, match="multiples of 128"):
    jattn.explain_decode(query, cache, implementation="paged_tpu")
  report = jattn.explain_decode(query, cache)
  assert report.implementation("cpu") == "split"


def _tpu_devices(generation):
  # deviceless: no TPU to hold, and other processes on the host may have libtpu loaded
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    from jax.experimental import topologies
    return topologies.get_topology_desc(f"{generation}=1x1", "tpu").devices
  except Exception as e:  # no libtpu (jax 0.10.2's venv): nothing to compile with
    pytest.skip(f"no deviceless TPU compiler here: {type(e).__name__}: {e}")


@pytest.mark.compile
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_compiles_for_tpu_with_the_kernel_and_no_dense_buffer(generation):
  """Compiled for a TPU from this host (the benchmark's batch: B = 8 rows of up to 32k,
  N = 16, K = 4, H = 128, pages of 64, bfloat16): the program calls the kernel, and its
  temporaries hold nothing near [B, N, T, max_length] (dense logits) nor a copy of the
  pool. Planted: the pool viewed as [P, S, K H] for the kernel made XLA copy it (a
  relayout, 39 MB of temporaries), and this test failed. A query chunk (T = 2) with
  mods compiles too."""
  devices = _tpu_devices(generation)
  mesh = jax.sharding.Mesh(devices, ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.P())
  B_, N_, K_, H_, ps, max_length, P_ = 8, 16, 4, 128, 64, 32768, 600
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B_, max_length, num_kv_heads=K_, head_dim=H_, page_size=ps, num_pages=P_,
      dtype=jnp.bfloat16))
  cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard), cache)
  pool_bytes = 2 * P_ * ps * K_ * H_ * 2  # keys and values, bfloat16

  def compiled(T_, **kwargs):
    q = jax.ShapeDtypeStruct((B_, T_, N_, H_), jnp.bfloat16, sharding=shard)
    f = jax.jit(lambda q, c: jattn.decode_attention(q, c, **kwargs))
    with jattn.lowering_for("tpu"):
      return f.trace(q, cache).lower(lowering_platforms=("tpu",)).compile()

  for T_, kwargs in ((1, dict(is_causal=True)),
                     (2, dict(mask_mod=jattn.mods.sliding_window(4000), sinks=jnp.zeros(N_),
                              score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N_))))):
    kernel = compiled(T_, implementation="paged_tpu", **kwargs)
    assert "jattn_paged_decode_tpu" in kernel.as_text()
    dense_bytes = B_ * N_ * T_ * max_length * 4  # float32 logits [B, N, T, max_length]
    temp = kernel.memory_analysis().temp_size_in_bytes
    assert temp < dense_bytes / 4 and temp < pool_bytes / 8, temp


@pytest.mark.parametrize("case, pages_per_step", [("none", 2)] + [
    pytest.param(c, u, marks=pytest.mark.thorough)
    for c, u in (("none", 1), ("none", 3), ("local_window_size", 1), ("local_window_size", 2),
                 ("sinks", 3))])
def test_steps_of_several_pages(case, pages_per_step):
  """U pages a loop step (pages_per_step): steps wholly visible to every query run
  unmasked (row 0's pages 0-1 at U = 2), the others masked, and a row's last step
  short of U pages re-reads its last page (masked); NaN in every page no row holds
  and in the slots past each row's length. Planted: the unmasked step without the
  scale, and the short step's repeated page left unmasked; this test failed."""
  q, k, v = _data(7)
  kwargs, causal = CASES[case][:2]
  cache = _filled(k, v)
  poisoned = _poison_unread(np.asarray(cache.block_table) >= 0)(cache)
  with pallas_interpret():
    report = jattn.explain_decode(_last_queries(q), poisoned, implementation="paged_tpu",
                                  is_causal=causal, pages_per_step=pages_per_step, **kwargs)
  assert report.choices["cpu"].plan.step_pages == pages_per_step
  got = _kernel(_last_queries(q), poisoned, is_causal=causal, pages_per_step=pages_per_step,
                **kwargs)
  _check_rows(got, full_pass(q, k, v, case))
