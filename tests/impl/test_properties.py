"""Property-based: random shapes, block sizes and masks against the float64 reference
(the output, its gradients and, when drawn, the max logits).

Each property runs twice: with the "ci" hypothesis profile in the default tier
(a few derandomized examples) and with the "thorough" profile (hundreds of random
examples) in the slow tier, `python -m pytest -m thorough tests/impl/test_properties.py`.
Letters: B T S N K G H D.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import jattn
from tests.reference import reference_mask, reference_max_logits
from tests.helpers import hypothesis_tiers
from tests.reference_grads import reference_vjp

TOL = dict(rtol=2e-5, atol=2e-5)
EMPTY_ROW = np.float32(-0.7 * np.finfo(np.float32).max)  # the documented lse of no key


@st.composite
def attention_calls(draw):
  """A random call: sizes, block sizes, GQA, and any combination of the masks."""
  T, S = draw(st.integers(1, 24)), draw(st.integers(1, 24))
  K, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
  seed = draw(st.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  masks = {}
  if draw(st.booleans()):
    masks["is_causal"] = True
  if draw(st.booleans()):
    masks["local_window_size"] = (draw(st.integers(0, 8)), draw(st.integers(0, 8)))
  if draw(st.booleans()):
    masks["query_seq_lengths"] = rng.integers(0, T + 1, 2)
    masks["key_value_seq_lengths"] = rng.integers(0, S + 1, 2)
  if draw(st.booleans()):
    masks["q_segment_ids"] = np.sort(rng.integers(0, 3, (2, T)), axis=-1)
    masks["kv_segment_ids"] = np.sort(rng.integers(0, 3, (2, S)), axis=-1)
  if draw(st.booleans()):
    masks["mask"] = rng.random((2, 1, T, S)) < 0.7
  return dict(T=T, S=S, K=K, G=G, bq=draw(st.integers(1, 9)), bk=draw(st.integers(1, 9)),
              impl=draw(st.sampled_from(["blockwise", "blockwise", "xla", "vmap"])),
              seed=seed, masks=masks, max_logits=draw(st.booleans()))


def _check(call):
  T, S, K, G = call["T"], call["S"], call["K"], call["G"]
  rng = np.random.default_rng(call["seed"])
  q, k, v, d_out = (rng.standard_normal(shape).astype(np.float32) for shape in (
      (2, T, K * G, 4), (2, S, K, 4), (2, S, K, 4), (2, T, K * G, 4)))
  masks = call["masks"]
  sizes = (jattn.BlockSizes(q=call["bq"], kv=call["bk"]) if call["impl"] == "blockwise"
           else None)
  fn = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation=call["impl"], block_sizes=sizes,
      return_max_logits=call["max_logits"],
      **{n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in masks.items()})
  # with the max logits asked for, the output's gradient must not change
  out, pullback, *max_logits = jax.vjp(fn, q, k, v, has_aux=call["max_logits"])
  got = (out,) + pullback(jnp.asarray(d_out))
  want = reference_vjp(q, k, v, d_out, **masks)
  for label, g, w in zip(("out", "d_query", "d_key", "d_value"), got, want):
    assert np.all(np.isfinite(g)), label
    np.testing.assert_allclose(g, w, **TOL, err_msg=label)
  if max_logits:
    allowed = reference_mask(
        2, K * G, T, S, mask=masks.get("mask"), is_causal=masks.get("is_causal", False),
        q_lengths=masks.get("query_seq_lengths"), kv_lengths=masks.get("key_value_seq_lengths"),
        window=masks.get("local_window_size"), q_segment_ids=masks.get("q_segment_ids"),
        kv_segment_ids=masks.get("kv_segment_ids"))
    want = np.einsum("BNT->BTN", reference_max_logits(q, k, allowed=allowed))
    want = np.where(np.isfinite(want), want, EMPTY_ROW)  # a row that sees no key
    np.testing.assert_allclose(max_logits[0], want, **TOL, err_msg="max_logits")


test_matches_float64_reference, test_matches_float64_reference_thorough = hypothesis_tiers(
    _check, attention_calls())
