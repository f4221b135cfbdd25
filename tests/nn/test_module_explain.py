"""The modules' `explain` and `jattn.explain_calls`: each attention call's choice per
platform, with the module's own mask, mods and sinks (compared with `jattn.explain` of
the same arguments, written out by hand)."""

import jax
import jax.numpy as jnp
from flax import nnx

import jattn
import jattn.linen
from jattn import mods
from jattn.transformer import Transformer, TransformerConfig

B, T, F, N = 1, 256, 16, 2


def test_nnx_module_reports_its_call():
  mha = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  x = jnp.ones((B, T, F))
  [report] = mha.explain(x, mask_mod=mods.sliding_window(4, 0))
  head = jax.ShapeDtypeStruct((B, T, N, F // N), jnp.float32)  # what the module attends
  want = jattn.explain(head, head, head, mask_mod=mods.sliding_window(4, 0))
  for platform in ("cpu", "tpu", "cuda"):
    assert report.choices[platform] == want.choices[platform], platform
  assert report.implementation("tpu") == "flex_tpu"


def test_linen_module_reports_through_apply():
  layer = jattn.linen.MultiHeadAttention(num_heads=N, qkv_features=F, use_sinks=True)
  x = jnp.ones((B, T, F))
  [report] = layer.apply(layer.init(jax.random.key(0), x), x,
                         score_mod=mods.alibi(jnp.ones(N)), method="explain")
  assert report.implementation("tpu") == "flex_tpu"  # with the reason it comes first
  assert report.choices["tpu"].why.startswith("flex_tpu before splash")
  assert report.choices["tpu"].plan.has_score_mod


def test_explain_calls_sees_every_layer_of_a_model():
  config = TransformerConfig(vocab_size=8, max_len=32, num_layers=3, features=16, num_heads=2,
                             attention_pattern=(4, None))  # local, global, local
  model = Transformer(config, rngs=nnx.Rngs(0))
  with jattn.explain_calls() as reports:
    model(jnp.zeros((1, 32), jnp.int32))
  assert len(reports) == 3
  plans = [r.choices["tpu"].plan for r in reports]  # flex_tpu: T = 32 is no splash tile
  assert plans[0] == plans[2] != plans[1]  # the local layers' mask differs from the global
  assert [p.has_mask_mod for p in plans] == [True, False, True]
  with jattn.explain_calls() as outside:
    pass
  assert outside == []  # nothing recorded outside a call
