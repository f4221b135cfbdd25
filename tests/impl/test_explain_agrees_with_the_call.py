"""`jattn.explain` describes the call it is given: for each platform, its implementation,
plan and refusals equal what the call itself records (`jattn.explain_calls`), argument by
argument. An explain that dropped an argument (block_sizes, a window, lengths, ...) would
report a plan the call does not run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods

B, T, N, K, H = 2, 256, 4, 2, 32
IDS = np.repeat(np.array([[0, 1], [0, 0]]), [100, 156], axis=1).astype(np.int32)

CALLS = {  # name -> keyword arguments: each changes the plan on some platform
    "default": dict(),
    "float32": dict(dtype=jnp.float32),
    "implementation": dict(implementation="xla"),
    "block_sizes": dict(block_sizes=jattn.BlockSizes(q=64, kv=32)),
    "is_causal": dict(is_causal=True),
    "window": dict(local_window_size=(16, 0)),
    "lengths": dict(query_seq_lengths=np.array([200, 256]),
                    key_value_seq_lengths=np.array([256, 100])),
    "segments": dict(q_segment_ids=IDS, kv_segment_ids=IDS),
    "scale": dict(scale=0.5, is_causal=True),
    "mask_mod": dict(mask_mod=mods.and_masks(mods.causal(), mods.chunked(64))),
    "score_mod": dict(score_mod=mods.soft_cap(20.0), is_causal=True),
    "sinks": dict(sinks=jnp.linspace(-1.0, 1.0, N), is_causal=True),
    "bias": dict(bias=np.zeros((1, 1, T, T), np.float32)),
    "dropout": dict(dropout_rate=0.1, dropout_rng=np.array([0, 1], np.uint32)),
    "return_residual": dict(return_residual=True, is_causal=True),
    "return_weights": dict(return_weights=True),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_explain_reports_the_choices_the_call_records(name):
  kw = dict(CALLS[name])
  dtype = kw.pop("dtype", jnp.bfloat16)
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, T, K, H), dtype)
  explained = jattn.explain(q, kv, kv, **kw)
  with jattn.explain_calls() as reports:  # the call traced, nothing computed
    jax.eval_shape(lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw), q, kv, kv)
  (recorded,) = reports
  for platform in ("cpu", "tpu", "cuda", "rocm"):
    got, want = explained.choices[platform], recorded.choices[platform]
    assert got == want, (platform, got, want)
