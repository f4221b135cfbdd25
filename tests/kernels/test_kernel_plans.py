"""Which calls jax's fused kernels take, and with what plan (jattn/_src/impl/kernel_plans.py),
asked of `jattn.explain` with shapes only (nothing is computed, milliseconds a call).

The expected plans and reasons are written out by hand from the kernels' contracts
(splash: T and S multiples of 128, H == D, float32 or bfloat16, masks of causal,
local, chunk and segment ids; jax's Pallas GPU mha: causal and one segment-id
array for T == S, nothing else, H == D, blocks of min(128, length) that divide T
and S, are powers of 2 and at least 16, as many for T as for S (its backward), and
heads up to 128 in 16-bit floats and 32 in float32), not derived from jattn. Whether a row may see
no key (the splash plan's guard) is also checked against the masks in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret
from jattn._src.impl.kernel_plans import PallasPlan, SplashPlan
from tests.helpers import needs_api

B, T, N, K, H = 2, 256, 4, 2, 8
IDS = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [100, 100, 56], axis=1).astype(np.int32)
IDS2 = np.repeat(np.array([[0, 1, 2], [1, 1, 2]]), [50, 150, 56], axis=1).astype(np.int32)


def _shapes(T=T, S=None, D=None, dtype=jnp.bfloat16, kv_heads=K, H=H):
  S = T if S is None else S
  D = H if D is None else D
  return (jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, S, kv_heads, H), dtype),
          jax.ShapeDtypeStruct((B, S, kv_heads, D), dtype))


def plan(kernel, platform, *, T=T, S=None, D=None, dtype=jnp.bfloat16, H=H, **kw):
  """The kernel's plan on `platform`, or its reason (a str) for refusing the call."""
  choice = jattn.explain(*_shapes(T, S, D, dtype, H=H), implementation=kernel,
                         **kw).choices[platform]
  return choice.plan if choice.implementation == kernel else choice.passed_over[0][1]


def splash(**kw):
  return plan("splash", "tpu", **kw)


PALLAS_H = 16  # Triton's dot takes no head smaller than 16


def pallas(**kw):
  return plan("pallas", "cuda", **{"H": PALLAS_H, **kw})


def splash_plan(mask, **kw):
  fields = dict(soft_cap=None, segments=False, document=False, q_lengths=False,
                kv_lengths=False, sinks=False, guard_empty_rows=False, interpret=False)
  return SplashPlan(mask=mask, **{**fields, **kw})


# ------------------------------------------------------------------ splash

SPLASH_TAKES = {
    "nothing": (dict(), splash_plan(("and",))),
    "causal": (dict(is_causal=True), splash_plan(("and", ("causal",)))),
    "window": (dict(local_window_size=(64, 3)), splash_plan(("and", ("local", 64, 3)))),
    "causal_window": (dict(is_causal=True, local_window_size=(5, 0)),
                      splash_plan(("and", ("causal",), ("local", 5, 0)))),
    "mod_causal": (dict(mask_mod=mods.causal()), splash_plan(("and", ("causal",)))),
    "mod_window": (dict(mask_mod=mods.sliding_window(0, 7)), splash_plan(("and", ("local", 0, 7)))),
    "mod_chunked": (dict(mask_mod=mods.chunked(1)), splash_plan(("and", ("chunk", 1)))),
    "and_or": (dict(mask_mod=mods.and_masks(mods.causal(), mods.or_masks(
        mods.chunked(32), mods.sliding_window(4)))),
               splash_plan(("and", ("and", ("causal",), ("or", ("chunk", 32), ("local", 4, 0)))))),
    "document": (dict(mask_mod=mods.document(IDS)),
                 splash_plan(("and", ("full",)), segments=True, document=True)),
    "document_two_ids": (dict(mask_mod=mods.document(IDS, IDS2)),
                         splash_plan(("and", ("full",)), segments=True, document=True,
                                     guard_empty_rows=True)),
    "document_and_causal": (dict(mask_mod=mods.and_masks(mods.causal(), mods.document(IDS))),
                            splash_plan(("and", ("and", ("causal",), ("full",))), segments=True,
                                        document=True)),
    "segments": (dict(q_segment_ids=IDS, kv_segment_ids=IDS),
                 splash_plan(("and",), segments=True)),
    "segments_two": (dict(q_segment_ids=IDS, kv_segment_ids=IDS2),
                     splash_plan(("and",), segments=True, guard_empty_rows=True)),
    "soft_cap": (dict(is_causal=True, score_mod=mods.soft_cap(20)),
                 splash_plan(("and", ("causal",)), soft_cap=20.0)),
    "q_lengths": (dict(query_seq_lengths=np.array([256, 3])),
                  splash_plan(("and",), q_lengths=True)),
    "kv_lengths": (dict(key_value_seq_lengths=np.array([256, 0])),  # the second row sees no key
                   splash_plan(("and",), kv_lengths=True, guard_empty_rows=True)),
    "sinks": (dict(is_causal=True, sinks=np.zeros(N, np.float32)),
              splash_plan(("and", ("causal",)), sinks=True)),
    "more_queries": (dict(T=256, S=128), splash_plan(("and",), guard_empty_rows=True)),
    "more_keys": (dict(T=128, S=256), splash_plan(("and",))),
    "float32": (dict(dtype=jnp.float32, is_causal=True), splash_plan(("and", ("causal",)))),
}


@pytest.mark.parametrize("name", list(SPLASH_TAKES))
def test_splash_plans(name):
  kw, want = SPLASH_TAKES[name]
  assert splash(**kw) == want


def test_splash_plan_in_interpret_mode():
  with pallas_interpret():
    assert splash(is_causal=True) == splash_plan(("and", ("causal",)), interpret=True)


SPLASH_REFUSES = {
    "bias": (dict(bias=np.zeros((1, 1, T, T), np.float32)), "it takes no bias"),
    "mask": (dict(mask=np.ones((1, 1, T, T), bool)), "it takes no dense mask"),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "no dropout"),
    "weights": (dict(return_weights=True), "does not form the weights"),
    "residual": (dict(return_residual=True), "return_residual=True is refused"),
    "float16": (dict(dtype=jnp.float16), "it takes float32 or bfloat16, got query dtype float16"),
    "head_sizes": (dict(D=16), "D equal to H, got H=8, D=16"),
    "T": (dict(T=384 - 128 + 1), "multiples of 128, got T=257, S=257"),
    "S": (dict(T=256, S=384 - 1), "multiples of 128, got T=256, S=383"),
    "prefix_lm": (dict(mask_mod=mods.prefix_lm(np.array([3, 4]))), "PrefixLM is not a ready-made"),
    "hand_written": (dict(mask_mod=lambda b, n, t, s: s <= t), "is not a ready-made"),
    "negative_window": (dict(mask_mod=mods.SlidingWindow(3, -1)), "non-negative Python ints"),
    "array_window": (dict(mask_mod=mods.SlidingWindow(np.int32(3), 0)), "non-negative Python ints"),
    "chunk_0": (dict(mask_mod=mods.Chunked(0)), "positive Python int size"),
    "chunk_array": (dict(mask_mod=mods.Chunked(np.int32(4))), "positive Python int size"),
    "document_under_or": (dict(mask_mod=mods.or_masks(mods.causal(), mods.document(IDS))),
                          "under or_masks"),
    "document_under_and_under_or": (dict(mask_mod=mods.or_masks(mods.and_masks(
        mods.causal(), mods.document(IDS)))), "under or_masks"),
    "two_documents": (dict(mask_mod=mods.and_masks(mods.document(IDS), mods.document(IDS2))),
                      "more than one mods.document"),
    "document_and_segments": (dict(mask_mod=mods.document(IDS), q_segment_ids=IDS,
                                   kv_segment_ids=IDS), "both segment ids and a mods.document"),
    # ids of one row for every batch row: the call takes them, the kernel wants [B, T]
    "document_shape": (dict(mask_mod=mods.document(IDS[:1], IDS)),
                       "ids must be [B, T] and [B, S] = ((2, 256), (2, 256)), got ((1, 256), (2, 256))"),
    "alibi": (dict(score_mod=mods.alibi(np.ones(N, np.float32))), "score_mod Alibi is not"),
    "array_cap": (dict(score_mod=mods.soft_cap(jnp.float32(2.0))), "Python-number cap"),
    "hand_written_score": (dict(score_mod=lambda x, b, n, t, s: x), "is not mods.soft_cap"),
}


@pytest.mark.parametrize("name", list(SPLASH_REFUSES))
def test_splash_refusals(name):
  kw, reason = SPLASH_REFUSES[name]
  got = splash(**kw)
  assert isinstance(got, str) and reason in got, got


def test_splash_block_mask_needs_its_mask_mod():
  block_mask = jattn.create_block_mask(lambda b, n, t, s: s <= t, None, None, T, T,
                                       block_sizes=jattn.BlockSizes(q=128, kv=128))
  got = splash(block_mask=block_mask)
  assert isinstance(got, str) and "a block_mask without its mask_mod" in got
  got = splash(block_mask=jattn.create_block_mask(mods.causal(), None, None, T, T,
                                                  block_sizes=jattn.BlockSizes(q=128, kv=128)),
               mask_mod=mods.causal())
  assert got == splash_plan(("and", ("causal",)))


def _rows_without_keys(T, S, ids_q=None, ids_kv=None, kv_lengths=None):
  """NumPy: whether some query row sees no key under these masks (all keys else)."""
  allowed = np.ones((B, T, S), bool)
  if ids_q is not None:
    allowed &= ids_q[:, :, None] == ids_kv[:, None, :]
  if kv_lengths is not None:
    allowed &= np.arange(S)[None, None, :] < kv_lengths[:, None, None]
  return bool((~allowed.any(-1)).any())


@pytest.mark.parametrize("name", ["nothing", "segments", "segments_two", "kv_lengths",
                                  "more_queries", "more_keys", "document_two_ids"])
def test_splash_guards_every_call_that_can_empty_a_row(name):
  """The guard is on wherever NumPy finds a query row with no key (here each such
  call has one; the others keep every row's diagonal)."""
  kw, want = SPLASH_TAKES[name]
  Tq, S = kw.get("T", T), kw.get("S", T)
  ids = kw.get("q_segment_ids"), kw.get("kv_segment_ids")
  if "mask_mod" in kw:
    ids = kw["mask_mod"].q_segment_ids, kw["mask_mod"].kv_segment_ids
  lengths = kw.get("key_value_seq_lengths")
  empty = _rows_without_keys(Tq, S, *ids, lengths) if ids[0] is not None or lengths is not None \
      else Tq > S
  assert splash(**kw).guard_empty_rows == want.guard_empty_rows == empty


# ------------------------------------------------------------------ pallas (GPU)

SCALE = 1 / np.sqrt(PALLAS_H)
PALLAS_TAKES = {
    "nothing": (dict(), PallasPlan(False, False, False, SCALE, False)),
    "causal": (dict(is_causal=True), PallasPlan(True, False, False, SCALE, False)),
    "mod_causal": (dict(mask_mod=mods.causal()), PallasPlan(True, False, False, SCALE, False)),
    "scale": (dict(scale=0.5), PallasPlan(False, False, False, 0.5, False)),
    "int_scale": (dict(scale=2), PallasPlan(False, False, False, 2.0, False)),
    "traced_scale": (dict(scale=jnp.float32(0.5)), PallasPlan(False, False, False, None, False)),
    "segments": (dict(q_segment_ids=IDS, kv_segment_ids=IDS), PallasPlan(False, True, False, SCALE, False)),
    "document": (dict(mask_mod=mods.document(IDS)), PallasPlan(False, True, True, SCALE, False)),
    "causal_document": (dict(is_causal=True, mask_mod=mods.document(IDS)),
                        PallasPlan(True, True, True, SCALE, False)),
    "short": (dict(T=64, S=64), PallasPlan(False, False, False, SCALE, False)),
    "one_block_each": (dict(T=16, S=128), PallasPlan(False, False, False, SCALE, False)),
    "three_blocks_each": (dict(T=384, S=384), PallasPlan(False, False, False, SCALE, False)),
    "widest_head": (dict(H=128), PallasPlan(False, False, False, 1 / np.sqrt(128), False)),
    "widest_float32_head": (dict(H=32, dtype=jnp.float32),
                            PallasPlan(False, False, False, 1 / np.sqrt(32), False)),
    "float16": (dict(dtype=jnp.float16), PallasPlan(False, False, False, SCALE, False)),
    "float32": (dict(dtype=jnp.float32), PallasPlan(False, False, False, SCALE, False)),
}


@needs_api("pallas_mha")
@pytest.mark.parametrize("name", list(PALLAS_TAKES))
def test_pallas_plans(name):
  kw, want = PALLAS_TAKES[name]
  got = pallas(**kw)
  assert got == want, got
  if want.scale is not None:
    assert type(got.scale) is float


@needs_api("pallas_mha")
def test_pallas_plan_in_interpret_mode():
  with pallas_interpret():
    assert pallas(is_causal=True) == PallasPlan(True, False, False, SCALE, True)


PALLAS_REFUSES = {
    "bias": (dict(bias=np.zeros((1, 1, T, T), np.float32)), "it takes no bias"),
    "weights": (dict(return_weights=True), "does not form the weights"),
    "window": (dict(local_window_size=(3, 0)), "cannot honour local_window_size"),
    "q_lengths": (dict(query_seq_lengths=np.array([256, 3])), "cannot honour query_seq_lengths"),
    "kv_lengths": (dict(key_value_seq_lengths=np.array([256, 3])),
                   "cannot honour key_value_seq_lengths"),
    "score_mod": (dict(score_mod=mods.soft_cap(2.0)), "cannot honour score_mod"),
    "sinks": (dict(sinks=np.zeros(N, np.float32)), "cannot honour sinks"),
    "head_sizes": (dict(D=32), "D equal to H, got H=16, D=32"),
    "T": (dict(T=200, S=256), "multiples of 128 (or smaller), got T=200, S=256"),
    "S": (dict(T=256, S=200), "multiples of 128 (or smaller), got T=256, S=200"),
    # issue 37: what mha's backward, Triton and the GPU cannot take
    "blocks_not_powers_of_2": (dict(T=96, S=96), "powers of 2, got blocks of 96 x 96"),
    "odd_lengths": (dict(T=7, S=8), "powers of 2, got blocks of 7 x 8"),
    "small_blocks": (dict(T=8, S=8), "at least 16, got blocks of 8 x 8 and H=16"),
    "small_head": (dict(H=8), "at least 16, got blocks of 128 x 128 and H=8"),
    "more_key_blocks": (dict(T=16, S=256), "same number of blocks, got T=16 in 1 and S=256 in 2"),
    "fewer_key_blocks": (dict(T=256, S=128), "got T=256 in 2 and S=128 in 1"),
    "wide_head": (dict(H=192), "heads of up to 128 in 16-bit floats (GPU shared memory), got H=192"),
    "wide_float32_head": (dict(H=48, dtype=jnp.float32), "heads of up to 32 in 32-bit floats"),
    "chunked": (dict(mask_mod=mods.chunked(4)), "lowers only mods.causal and mods.document, "
                                                "got mask_mod Chunked"),
    "and_masks": (dict(mask_mod=mods.and_masks(mods.causal())), "got mask_mod And"),
    "document_and_segments": (dict(mask_mod=mods.document(IDS), q_segment_ids=IDS,
                                   kv_segment_ids=IDS), "both segment ids and a mods.document"),
    "document_shape": (dict(mask_mod=mods.document(IDS[:1], IDS)), "must be [B, T] and [B, S]"),
    # T and S in one block each: only the masks stand in the way
    "causal_T_S": (dict(T=128, S=64, is_causal=True), "need T == S, got T=128, S=64"),
    "mod_causal_T_S": (dict(T=64, S=128, mask_mod=mods.causal()), "need T == S"),
    "segments_T_S": (dict(T=64, S=128, q_segment_ids=IDS[:, :64], kv_segment_ids=IDS[:, :128]),
                     "need T == S"),
    "two_id_arrays": (dict(q_segment_ids=IDS, kv_segment_ids=IDS.copy()),
                      "pass the same array as q_segment_ids and kv_segment_ids"),
    "document_two_ids": (dict(mask_mod=mods.document(IDS, IDS2)), "the same array"),
}


@needs_api("pallas_mha")
@pytest.mark.parametrize("name", list(PALLAS_REFUSES))
def test_pallas_refusals(name):
  kw, reason = PALLAS_REFUSES[name]
  got = pallas(**kw)
  assert isinstance(got, str) and reason in got, got


@pytest.mark.parametrize("make", [
    splash, pytest.param(pallas, marks=needs_api("pallas_mha"))])
def test_plans_are_hashable_values(make):
  """A plan is a jit static: equal plans hash equal."""
  a, b = make(is_causal=True), make(is_causal=True)
  assert a == b and hash(a) == hash(b) and a is not b


def test_find_document():
  from jattn._src.impl.kernel_plans import find_document
  doc = mods.document(IDS)
  assert find_document(doc) is doc
  assert find_document(mods.and_masks(mods.causal(), doc)) is doc
  assert find_document(mods.and_masks(mods.causal(), mods.and_masks(mods.chunked(4), doc))) is doc
  assert find_document(mods.causal()) is None
  assert find_document(mods.and_masks(mods.causal(), mods.chunked(4))) is None
  assert find_document(mods.or_masks(mods.causal(), doc)) is None  # only at the top or under and
