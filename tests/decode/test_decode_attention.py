"""jattn.decode_attention over a paged, ragged cache against a float64 full pass.

A ragged batch (final lengths 13, 4 and 9 with pages of 4: past, on and past
a page edge) is prefilled with prompts of different lengths, then decoded
token by token or in chunks of 3, its pages interleaved in the pool. Every
output must equal the float64 reference of one full pass over the whole
sequences (tests/reference.py), with the mods written plainly in NumPy here.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import raises
from tests.reference import reference_mods

B, N, K, H, D = 3, 4, 2, 8, 6
PAGE = 4
FINAL = np.array([13, 4, 9])  # tokens per row at the end
PROMPT = np.array([5, 4, 1])  # the prefill: ragged, straddling page edges
L = int(FINAL.max())
MAX_LENGTH = 16  # 4 pages per row
NUM_PAGES = 10  # FINAL needs 4 + 1 + 3 = 8

_b = np.arange(B)[:, None, None, None]
_n = np.arange(N)[None, :, None, None]
_t = np.arange(L)[None, None, :, None]
_s = np.arange(L)[None, None, None, :]
SEGMENTS = (np.arange(MAX_LENGTH)[None, :] + 2 * np.arange(B)[:, None]) // 5  # [B, 16]
TABLE = np.random.default_rng(7).standard_normal((N, 7)).astype(np.float32)  # M = 3
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def _user_mask(b, n, t, s):  # per row and head: a hand-written mask_mod
  return ((s <= t) & ((s + n + b) % 3 != 0)) | (s == t)


def _user_score(x, b, n, t, s):
  return x + 0.25 * b.astype(x.dtype) - 0.5 * n.astype(x.dtype) + 0.1 * (t - s).astype(x.dtype)


# name -> (decode_attention keyword arguments, is_causal, NumPy mask or None,
#          NumPy score or None, NumPy sinks or None). Each is what a training
#          call would pass, and its plain formula.
CASES = {
    "none": ({}, True, None, None, None),
    "causal_mod": (dict(mask_mod=jattn.mods.causal()), False, _s <= _t, None, None),
    "sliding_window": (dict(mask_mod=jattn.mods.sliding_window(3)), False,
                       (_s <= _t) & (_s >= _t - 3), None, None),
    "local_window_size": (dict(local_window_size=(2, 0)), True, _s >= _t - 2, None, None),
    "chunked": (dict(mask_mod=jattn.mods.chunked(5)), True, _t // 5 == _s // 5, None, None),
    "prefix_lm": (dict(mask_mod=jattn.mods.prefix_lm(jnp.asarray(PROMPT))), False,
                  (_s <= _t) | (_s < PROMPT[:, None, None, None]), None, None),
    "document": (dict(mask_mod=jattn.mods.document(jnp.asarray(SEGMENTS))), True,
                 SEGMENTS[:, None, :L, None] == SEGMENTS[:, None, None, :L], None, None),
    "and_masks": (dict(mask_mod=jattn.mods.and_masks(jattn.mods.sliding_window(4),
                                                      jattn.mods.chunked(6))), False,
                  (_s <= _t) & (_s >= _t - 4) & (_t // 6 == _s // 6), None, None),
    "or_masks": (dict(mask_mod=jattn.mods.or_masks(jattn.mods.sliding_window(1),
                                                    jattn.mods.chunked(8))), True,
                 ((_s <= _t) & (_s >= _t - 1)) | (_t // 8 == _s // 8), None, None),
    "user_mask": (dict(mask_mod=_user_mask), False, _user_mask(_b, _n, _t, _s), None, None),
    "soft_cap": (dict(score_mod=jattn.mods.soft_cap(1.5)), True, None,
                 lambda x: 1.5 * np.tanh(x / 1.5), None),
    "alibi": (dict(score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N))), True, None,
              lambda x: x + 2.0 ** (-8.0 * (_n + 1) / N) * (_s - _t), None),
    "relative_bias": (dict(score_mod=jattn.mods.relative_bias(jnp.asarray(TABLE))), True, None,
                      lambda x: x + TABLE[_n, np.clip(_s - _t, -3, 3) + 3], None),
    "user_score": (dict(score_mod=_user_score), True, None,
                   lambda x: x + 0.25 * _b - 0.5 * _n + 0.1 * (_t - _s), None),
    "sinks": (dict(sinks=jnp.asarray(SINKS)), True, None, None, SINKS),
    "sinks_window_alibi": (dict(sinks=jnp.asarray(SINKS), local_window_size=(3, 0),
                                score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(N))), True,
                           _s >= _t - 3, lambda x: x + 2.0 ** (-8.0 * (_n + 1) / N) * (_s - _t),
                           SINKS),
}


def _data(seed=0, k_heads=K):
  rng = np.random.default_rng(seed)
  q = 2.0 * rng.standard_normal((B, L, N, H)).astype(np.float32)  # logits well past +-1
  k = rng.standard_normal((B, L, k_heads, H)).astype(np.float32)
  v = rng.standard_normal((B, L, k_heads, D)).astype(np.float32)
  return q, k, v


def full_pass(q, k, v, case):
  """float64 [B, L, N, D]: every row's queries against its own keys, one pass."""
  _, causal, allowed, score, sinks = CASES[case]
  keep = (_s < FINAL[:, None, None, None]) & np.ones((1, N, 1, 1), bool)
  if causal:
    keep = keep & (_s <= _t)
  if allowed is not None:
    keep = keep & allowed
  out, _ = reference_mods(q, k, v, allowed=keep, score=score, sinks=sinks)
  return out


def _step(kwargs, **options):
  """A jitted call: append row b's new[b] tokens, then attend their queries."""
  @jax.jit
  def step(cache, qq, kk, vv, new):
    cache = jattn.paged.append(cache, kk, vv, new)
    return cache, jattn.decode_attention(qq, cache, query_lengths=new, **options, **kwargs)
  return step


def _empty_cache(k_heads=K):
  return jattn.paged.init_cache(B, MAX_LENGTH, num_kv_heads=k_heads, head_dim=H, value_dim=D,
                                page_size=PAGE, num_pages=NUM_PAGES)


def decode(q, k, v, kwargs, *, chunk, prompt=PROMPT, implementation=None,
           pages_per_step=None):
  """[B, L, N, D]: prefill each row's prompt, then `chunk` tokens per call (ragged ends);
  jitted once per T."""
  cache = _empty_cache(k.shape[2])
  step = _step(kwargs, implementation=implementation, pages_per_step=pages_per_step)

  out = np.zeros((B, L, N, D), np.float32)
  pos, new, T = np.zeros(B, int), np.asarray(prompt), int(np.max(prompt))
  while (pos < FINAL).any():
    at = np.minimum(pos[:, None] + np.arange(T)[None, :], L - 1)  # [B, T]
    take = lambda x: jnp.asarray(x[np.arange(B)[:, None], at])
    cache, got = step(cache, take(q), take(k), take(v), jnp.asarray(new, jnp.int32))
    for b in range(B):
      out[b, pos[b]:pos[b] + new[b]] = np.asarray(got)[b, :new[b]]
    pos = pos + new
    new, T = np.minimum(chunk, FINAL - pos), chunk
  jattn.paged.check(cache)
  return out, cache


def _compare(got, want, atol=2e-5):
  for b in range(B):
    np.testing.assert_allclose(got[b, :FINAL[b]], want[b, :FINAL[b]], rtol=2e-5, atol=atol)


# every case in chunks of 3 (ragged ends, several queries a step); token by token for a
# few in CI, for every case in the slow tier
_TOKEN_BY_TOKEN = ("none", "document", "user_mask", "sinks_window_alibi")


@pytest.mark.parametrize("case,chunk", [(c, 3) for c in CASES] + [
    (c, 1) if c in _TOKEN_BY_TOKEN else pytest.param(c, 1, marks=pytest.mark.thorough)
    for c in CASES])
def test_decoding_equals_the_full_pass(case, chunk):
  q, k, v = _data()
  kwargs, causal = CASES[case][:2]
  got, _ = decode(q, k, v, dict(kwargs, is_causal=causal), chunk=chunk)
  _compare(got, full_pass(q, k, v, case))


@pytest.mark.parametrize("case", ["none", "document", "user_mask", "sinks_window_alibi"])
def test_gather_all_path_equals_the_full_pass(case):
  q, k, v = _data(1)
  kwargs, causal = CASES[case][:2]
  got, _ = decode(q, k, v, dict(kwargs, is_causal=causal), chunk=2, implementation="xla")
  _compare(got, full_pass(q, k, v, case))


@pytest.mark.parametrize("k_heads", [1, 4])
def test_grouped_and_plain_heads(k_heads):
  q, k, v = _data(2, k_heads)
  kwargs, causal = CASES["alibi"][:2]
  got, _ = decode(q, k, v, dict(kwargs, is_causal=causal), chunk=1)
  _compare(got, full_pass(q, k, v, "alibi"))


@pytest.mark.parametrize("pages_per_step", [1, 2, 5])
def test_any_number_of_pages_per_step(pages_per_step):
  q, k, v = _data(3)
  kwargs, causal = CASES["sinks"][:2]
  got, _ = decode(q, k, v, dict(kwargs, is_causal=causal), chunk=3,
                  pages_per_step=pages_per_step)
  _compare(got, full_pass(q, k, v, "sinks"))


def test_hand_computable_case():
  """One query, two equal keys and one masked: the output is the mean of two values."""
  cache = jattn.paged.init_cache(1, 8, num_kv_heads=1, head_dim=2, value_dim=1, page_size=2)
  keys = jnp.ones((1, 3, 1, 2))
  values = jnp.array([[[[1.0]], [[3.0]], [[100.0]]]])
  cache = jattn.paged.append(cache, keys, values)
  out = jattn.decode_attention(jnp.ones((1, 1, 1, 2)), cache, query_lengths=jnp.array([1]),
                               mask_mod=lambda b, n, t, s: s < 2)
  np.testing.assert_allclose(np.asarray(out), [[[[2.0]]]], rtol=1e-6)


def test_eager_calls_compile_once_and_follow_new_arrays(caplog):
  """Eager calls with the same static facts (a ready-made mask's included) reuse one
  compiled program, and its arrays (the cache's pages, a document mask's ids, sinks)
  are arguments: new values give new outputs, as jax.nn's (float64 NumPy reference)."""
  cache = jattn.paged.init_cache(2, 16, num_kv_heads=1, head_dim=4, page_size=4)
  keys = jax.random.normal(jax.random.key(0), (2, 6, 1, 4))
  cache = jattn.paged.append(cache, keys, keys)
  q = jax.random.normal(jax.random.key(1), (2, 1, 2, 4))
  ids = jnp.array([[0, 0, 1, 1, 1, 1] + [0] * 10, [0, 1, 1, 1, 1, 1] + [0] * 10])

  def reference(ids, sinks):
    s = np.einsum("BNH,BSH->BNS", np.float64(q[:, 0]), np.float64(keys[:, :, 0])) / 2.0
    s = np.where(np.asarray(ids[:, :6] == ids[:, 5:6])[:, None, :], s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(np.float64(sinks)[None, :, None], (2, 2, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p[..., :6] / p.sum(-1, keepdims=True)
    return np.einsum("BNS,BSD->BND", p, np.float64(keys[:, :, 0]))

  def run(ids, sinks):
    return jattn.decode_attention(q, cache, mask_mod=jattn.mods.document(ids), sinks=sinks)

  np.testing.assert_allclose(run(ids, jnp.zeros(2))[:, 0], reference(ids, np.zeros(2)),
                             rtol=1e-5, atol=1e-6)
  other_ids, sinks = jnp.zeros_like(ids).at[:, 3:].set(1), jnp.array([0.5, -1.0])
  with caplog.at_level(logging.WARNING), jax.log_compiles():
    out = run(other_ids, sinks)
  np.testing.assert_allclose(out[:, 0], reference(other_ids, sinks), rtol=1e-5, atol=1e-6)
  assert not [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]


def _poison_unread(keep_pages):
  """A cache transform: NaN in the keys and values of every pool page that no row
  holds in keep_pages (bool [B, max_pages]), and in slots past each row's length."""
  def poison(cache):
    table = np.asarray(cache.block_table)
    read = np.zeros(cache.num_pages, bool)
    read[table[np.asarray(keep_pages) & (table >= 0)]] = True
    slot = np.arange(cache.max_pages * PAGE).reshape(cache.max_pages, PAGE)
    stale = np.zeros((cache.num_pages, cache.page_size), bool)  # [P, page_size]
    for b in range(B):
      for j, page in enumerate(table[b]):
        if page >= 0:
          stale[page] = slot[j] >= int(cache.lengths[b])
    nan = ~read[:, None] | stale
    return cache.__class__(
        jnp.where(nan[:, None, :, None], jnp.nan, cache.key_pages),  # [P, K, S, H]
        jnp.where(nan[:, None, :, None], jnp.nan, cache.value_pages),
        cache.block_table, cache.lengths, cache.page_free, cache.error)
  return poison


# The last query of each row (positions 12, 3, 8): which of its pages 0..3 it needs.
NEEDED = [
    ("none", [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]),  # up to each row's length
    ("bidirectional", [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]),  # no more: not causal
    ("sliding_window", [[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0]]),  # keys t-3..t
    ("local_window_size", [[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0]]),  # keys t-2..t
    ("document", [[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0]]),  # the last document only
    ("user_mask_late", [[0, 0, 1, 1], [1, 0, 0, 0], [0, 0, 1, 0]]),  # keys s >= 8 or s == t
]


def _late_case(case):
  """(keyword arguments, is_causal) of a case, with "user_mask_late" (keys s >= 8 or t)
  and "bidirectional" (every key up to the row's length)."""
  if case == "bidirectional":
    return {}, False
  if case == "user_mask_late":
    return dict(mask_mod=lambda b, n, t, s: (s >= 8) | (s == t)), True
  return CASES[case][0], CASES[case][1]


@pytest.mark.parametrize("case, pages", NEEDED)
def test_pages_out_of_range_or_empty_are_never_read(case, pages):
  """The last token of each row, with NaN in every page it must not read (free
  pages, pages outside its window, EMPTY pages, slots past its length): any read
  of one would make the output NaN (0 * NaN in the weighted sum)."""
  q, k, v = _data(4)
  kwargs, causal = _late_case(case)
  kwargs = dict(kwargs, is_causal=causal)
  want_mask = {"user_mask_late": (_s >= 8) | (_s == _t), "bidirectional": True}.get(
      case, CASES.get(case, (None,) * 3)[2])
  want_mask = True if want_mask is None else want_mask
  cache = jattn.paged.append(_empty_cache(), k, v, jnp.asarray(FINAL))
  poisoned = _poison_unread(np.asarray(pages, bool))(cache)
  last = jnp.asarray(q[np.arange(B), FINAL - 1][:, None])  # [B, 1, N, H]
  got = np.asarray(jattn.decode_attention(last, poisoned, **kwargs))[:, 0]  # [B, N, D]
  if case not in ("none", "bidirectional"):  # a read of a page in range shows as NaN
    assert np.isnan(np.asarray(jattn.decode_attention(last, poisoned, implementation="xla",
                                                      **kwargs))).any()
  keep = (_s < FINAL[:, None, None, None]) & ((_s <= _t) | (not causal)) & want_mask
  want, _ = reference_mods(q, k, v, allowed=keep)
  np.testing.assert_allclose(got, want[np.arange(B), FINAL - 1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case, pages", NEEDED)
def test_the_work_list_is_the_pages_needed(case, pages):
  """White box: the split path's steps gather exactly the pages of NEEDED (no page
  past a length, outside a window or EMPTY; the padding of the last step repeats a
  listed page)."""
  from jattn._src.decode import split, work_list
  from jattn._src.masks.programmable import build_mods
  q, k, v = _data(4)
  kwargs, causal = _late_case(case)
  cache = jattn.paged.append(_empty_cache(), k, v, jnp.asarray(FINAL))
  mods = build_mods(kwargs.get("mask_mod"), None, None, None, N=N)
  ones = jnp.ones(B, jnp.int32)
  _, q_pos, q_valid, q_first = split._queries(jnp.zeros((B, 1, N, H)), cache, ones)
  window = kwargs.get("local_window_size")
  needed = split.needed_pages(mods, cache, q_first=q_first, q_pos=q_pos, q_valid=q_valid,
                              q_lengths=ones, causal=causal, window=window, T=1, N=N, W=3)
  np.testing.assert_array_equal(needed, np.asarray(pages, bool))
  rows, slots, count = work_list.items(needed, 3)
  read = set()
  for i in range(int(work_list.steps(count, 3))):
    r, j, _ = work_list.at_step(rows, slots, count, i, 3)
    read |= set(zip(np.asarray(r).tolist(), np.asarray(j).tolist()))
  assert read == set(zip(*np.nonzero(np.asarray(pages))))


def test_freed_pages_are_reused_with_the_same_result():
  """Row 1 finishes, its pages go back to the pool (stale values in them), and a new
  sequence decoded in row 1 gives what it gives in a fresh cache."""
  q, k, v = _data(5)
  kwargs = dict(CASES["alibi"][0], is_causal=True)
  _, cache = decode(q, k, v, kwargs, chunk=4)
  held = set(np.asarray(cache.block_table)[1]) - {-1}  # row 1's one page, full
  cache = jattn.paged.free(cache, jnp.array([False, True, False]))
  assert held <= set(np.flatnonzero(np.asarray(cache.page_free)))
  q2, k2, v2 = (jnp.asarray(x[:, :4]) for x in _data(6))
  new = jnp.array([0, 3, 0])  # 3 tokens: the page's last slot keeps a stale value
  step = _step(kwargs)
  cache, got = step(cache, q2, k2, v2, new)
  assert set(np.asarray(cache.block_table)[1]) - {-1} == held  # the freed page again
  _, want = step(_empty_cache(), q2, k2, v2, new)
  np.testing.assert_allclose(np.asarray(got)[1], np.asarray(want)[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got)[[0, 2]], 0.0)  # rows with no query


def test_explain_decode_reports_each_platform():
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(8, 4096, num_kv_heads=4, head_dim=128,
                                                        page_size=64, num_pages=600))
  q = jax.ShapeDtypeStruct((8, 1, 16, 128), jnp.float32)
  report = jattn.explain_decode(q, cache, mask_mod=jattn.mods.causal())
  for platform in ("cpu", "cuda"):
    assert report.implementation(platform) == "split"
    assert report.choices[platform].plan.pages_per_step == 16  # 1024 keys per step
  # the TPU kernel by default (tests/decode/test_paged_tpu.py), from the TPU compiler's
  # estimates (docs/sampling.md); split for a call it refuses, with the reason
  assert report.implementation("tpu") == "paged_tpu"
  refused = jattn.explain_decode(q, cache, mask_mod=jattn.mods.causal(), return_max_logits=True)
  assert refused.implementation("tpu") == "split" and "max logits" in str(refused)
  named = jattn.explain_decode(q, cache, mask_mod=jattn.mods.causal(), implementation="paged_tpu")
  assert named.implementation("tpu") == "paged_tpu" and named.implementation("cpu") is None
  assert "closed form" in str(report)
  user = jattn.explain_decode(q, cache, mask_mod=_user_mask, implementation="xla")
  assert user.implementation("cpu") == "xla" and "4096 keys per row" in str(user)
  assert "evaluating mask_mod" in str(jattn.explain_decode(q, cache, mask_mod=_user_mask))


def test_the_call_records_what_explain_reports():
  q, k, v = _data()
  cache = jattn.paged.append(jattn.paged.init_cache(
      B, MAX_LENGTH, num_kv_heads=K, head_dim=H, value_dim=D, page_size=PAGE), k, v)
  with jattn.explain_calls() as reports:
    jattn.decode_attention(jnp.asarray(q[:, :1]), cache, pages_per_step=3)
  [report] = reports
  assert report.choices["cpu"].plan == jattn.explain_decode(
      jnp.asarray(q[:, :1]), cache, pages_per_step=3).choices["cpu"].plan


# ids not named "tpu" or "gpu": conftest would skip them as needing that device
@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"], ids=lambda p: f"for_{p}")
def test_export_reads_pages_not_a_dense_cache(platform):
  """Lowered for each platform from this host: the program holds no [B, max_length]
  key tensor ([B, K, max_length, H] as "xla" gathers it), only pages (the split path's W
  pages per step)."""
  B_, M_, ps = 4, 64, 16
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B_, M_ * ps, num_kv_heads=2, head_dim=32, page_size=ps, num_pages=80))
  q = jax.ShapeDtypeStruct((B_, 1, 4, 32), jnp.float32)
  f = jax.jit(lambda q, c: jattn.decode_attention(q, c, mask_mod=jattn.mods.causal()))
  with jattn.lowering_for(platform):
    text = jax.export.export(f, platforms=[platform])(q, cache).mlir_module()
  assert f"tensor<{B_}x2x{M_ * ps}x32xf32>" not in text
  dense = jax.jit(lambda q, c: jattn.decode_attention(q, c, implementation="xla"))
  with jattn.lowering_for(platform):
    text = jax.export.export(dense, platforms=[platform])(q, cache).mlir_module()
  assert f"tensor<{B_}x2x{M_ * ps}x32xf32>" in text  # the check can fail


# ---------------------------------------------------------------- errors


def _cache(**kw):
  return jattn.paged.init_cache(2, 32, num_kv_heads=2, head_dim=8, page_size=8, **kw)


def test_decode_errors_name_the_argument():
  cache = jattn.paged.append(_cache(), jnp.ones((2, 3, 2, 8)), jnp.ones((2, 3, 2, 8)))
  with raises(ValueError, "query", "(2, 1, 4)"):
    jattn.decode_attention(jnp.ones((2, 1, 4)), cache)
  with raises(ValueError, "query", "(3, 1, 4, 8)", "(2, 4)"):
    jattn.decode_attention(jnp.ones((3, 1, 4, 8)), cache)
  with raises(ValueError, "query", "(2, 1, 4, 16)", "key_pages"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 16)), cache)
  with raises(ValueError, "query", "N = 3"):
    jattn.decode_attention(jnp.ones((2, 1, 3, 8)), cache)
  with raises(ValueError, "query_lengths", "[3, 3]"):
    jattn.decode_attention(jnp.ones((2, 4, 4, 8)), cache, query_lengths=jnp.array([4, 1]))
  with raises(ValueError, "query_lengths", "(3,)"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), cache, query_lengths=jnp.array([1, 1, 1]))
  with raises(TypeError, "cache", "dict"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), {})
  with raises(ValueError, "sinks", "(3,)"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), cache, sinks=jnp.ones(3))
  with raises(TypeError, "mask_mod"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), cache, mask_mod=lambda b, n, t: t)
  with raises(ValueError, "implementation", "'splash'"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), cache, implementation="splash")
  bad = cache.__class__(cache.key_pages, cache.value_pages,
                        cache.block_table.at[1, 0].set(99), cache.lengths, cache.page_free,
                        cache.error)
  with raises(ValueError, "block_table", "page id 99", "row 1", "[0, 8)"):
    jattn.decode_attention(jnp.ones((2, 1, 4, 8)), bad)


def test_cache_errors_name_the_argument():
  cache = _cache(num_pages=3)
  kv = jnp.ones((2, 20, 2, 8))
  with raises(ValueError, "new_tokens", "pool is full", "[20, 20]", "3 of 3 pages free"):
    jattn.paged.append(cache, kv, kv)
  with raises(ValueError, "new_tokens", "block table", "max_pages 4"):
    big = jnp.ones((2, 40, 2, 8))
    jattn.paged.append(_cache(), big, big)
  with raises(ValueError, "key", "(2, 20, 2, 4)", "key_pages"):
    jattn.paged.append(cache, jnp.ones((2, 20, 2, 4)), kv)
  with raises(ValueError, "value", "(2, 20, 2, 3)"):
    jattn.paged.append(cache, kv, jnp.ones((2, 20, 2, 3)))
  with raises(ValueError, "new_tokens", "(3,)"):
    jattn.paged.append(cache, kv, kv, jnp.array([1, 2, 3]))
  with raises(ValueError, "new_tokens", ">= 0", "[-1, 2]"):
    jattn.paged.append(cache, kv, kv, jnp.array([-1, 2]))
  with raises(ValueError, "new_tokens", "at most T = 20", "[21, 2]"):
    jattn.paged.append(cache, kv, kv, jnp.array([21, 2]))
  with raises(ValueError, "new_tokens", "pool is full", "[16, 9]", "3 of 3 pages free"):
    jattn.paged.allocate(cache, np.array([16, 9]))  # 2 + 2 pages of 8
  with raises(ValueError, "rows", "(3,)"):
    jattn.paged.free(cache, jnp.array([True, False, True]))
  with raises(ValueError, "page_size"):
    jattn.paged.init_cache(2, 32, num_kv_heads=2, head_dim=8, page_size=0)


def test_pool_sharding_errors_name_the_argument():
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  mesh = AbstractMesh((2, 4), ("data", "model"))  # a layout to check, not to place
  make = lambda sharding, K=4: jattn.paged.init_cache(2, 32, num_kv_heads=K, head_dim=8,
                                                      pool_sharding=sharding)
  with raises(TypeError, "pool_sharding", "NamedSharding", "P(None, 'model')"):
    make(P(None, "model"))
  with raises(ValueError, "pool_sharding", "only the kv heads", "P('data', 'model')"):
    make(NamedSharding(mesh, P("data", "model")))
  with raises(ValueError, "pool_sharding", "only the kv heads", "P(None, None, 'model')"):
    make(NamedSharding(mesh, P(None, None, "model")))
  with raises(ValueError, "pool_sharding", "('model',) (4 devices)", "num_kv_heads = 2"):
    make(NamedSharding(mesh, P(None, "model")), K=2)
  with raises(ValueError, "pool_sharding", "('data', 'model') (8 devices)", "num_kv_heads = 4"):
    make(NamedSharding(mesh, P(None, ("data", "model"))))


def test_a_pool_sharding_on_one_device_gives_the_same_cache():
  """The placement changes where pages live, not what they hold."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((1,), ("model",))
  placed = _cache(pool_sharding=NamedSharding(mesh, P(None, "model")))
  kv = jnp.asarray(np.random.default_rng(0).standard_normal((2, 20, 2, 8)), jnp.float32)
  got = jattn.paged.append(placed, kv, kv, jnp.array([20, 9]))
  want = jattn.paged.append(_cache(), kv, kv, jnp.array([20, 9]))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert tuple(got.key_pages.sharding.spec)[:2] == (None, "model")
  with jax.set_mesh(mesh):  # under jit (the mesh set, as any Explicit program) too
    jitted = jax.jit(lambda: _cache(pool_sharding=NamedSharding(mesh, P(None, "model"))))()
  assert tuple(jax.typeof(jitted.key_pages).sharding.spec)[:2] == (None, "model")


def test_a_refusal_under_jit_leaves_the_cache_and_is_raised_by_check():
  cache = _cache(num_pages=3)
  kv = jnp.ones((2, 10, 2, 8))
  ok = jax.jit(jattn.paged.append)(cache, kv, kv, jnp.array([10, 2]))  # 2 + 1 pages
  refused = jax.jit(jattn.paged.append)(ok, kv, kv, jnp.array([10, 0]))  # 1 more: none free
  refused = jax.jit(jattn.paged.append)(refused, kv, kv, jnp.array([10, 0]))  # again
  np.testing.assert_array_equal(refused.lengths, [10, 2])
  np.testing.assert_array_equal(refused.block_table, ok.block_table)
  np.testing.assert_array_equal(refused.key_pages, ok.key_pages)
  jattn.paged.check(ok)
  with raises(ValueError, "cache.error", "pool is full"):
    jattn.paged.check(refused)


def test_allocation_interleaves_rows_and_free_returns_pages():
  cache = _cache(num_pages=6)
  kv = jnp.ones((2, 9, 2, 8))
  cache = jattn.paged.append(cache, kv, kv, jnp.array([9, 3]))  # 2 pages, then 1
  np.testing.assert_array_equal(cache.block_table, [[0, 1, -1, -1], [2, -1, -1, -1]])
  cache = jattn.paged.append(cache, kv, kv, jnp.array([0, 9]))  # row 1: 12 tokens, 2 pages
  np.testing.assert_array_equal(cache.block_table, [[0, 1, -1, -1], [2, 3, -1, -1]])
  np.testing.assert_array_equal(cache.lengths, [9, 12])
  cache = jattn.paged.free(cache, jnp.array([True, False]))
  np.testing.assert_array_equal(cache.page_free, [True, True, False, False, True, True])
  np.testing.assert_array_equal(cache.lengths, [0, 12])
  assert cache.memory_bytes() == 2 * 6 * 8 * 2 * 8 * 4
