"""Ring attention's TPU branch runs the flex_tpu kernel for every ring step.

On this CPU: the kernel at traced global offsets (one ring step) in Pallas interpret
mode against float64 NumPy; the ring itself on 8 simulated devices in a subprocess
(tests/multidevice/ring_flex_tpu_cases.py: interpret mode and `jax.export` for TPU);
and which step each platform runs, from `jattn.explain_calls()`. No TPU: nothing here
says how fast the kernel is.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.core.layout import Layout
from jattn._src.masks.modifiers import Modifiers
from jattn._src.kernels import flex_tpu, flex_tpu_call
from jattn._src.masks.programmable import build_mods
from jattn._src.masks.structural import MaskSpec
from tests.multidevice.test_ring import assert_checks_pass

from tests.reference_grads import reference_vjp

# two query tiles of 8 and two key tiles of 128; the step's first query and key are
# at global positions 200 and 64, so at local positions the band would see other tiles
B, T, S, N, K, H = 1, 16, 256, 2, 1, 8
Q_OFFSET, KV_OFFSET = 200, 64


def band(b, n, t, s):
  """Hand-written, of absolute positions: a band around the diagonal (one key wider per
  head), without the keys s = 3 mod 7."""
  return (s >= t - 10) & (s <= t + 2 + n) & (s % 7 != 3)


def test_one_step_at_global_offsets_values_lse_and_gradients():
  """The kernel's step_forward / step_backward at offsets (traced, under jit), causal,
  a hand-written mask_mod and ALiBi, against float64 NumPy at the global positions;
  the step's max logits (the ring's return_max_logits) too."""
  rng = np.random.default_rng(0)
  q, k, v, d_out = (rng.standard_normal(s) for s in ((B, T, N, H), (B, S, K, H),
                                                      (B, S, K, H), (B, T, N, H)))
  slopes = np.array([0.5, -0.25])
  t = Q_OFFSET + np.arange(T)[:, None]
  s = KV_OFFSET + np.arange(S)[None, :]
  mask = np.broadcast_to(band(0, np.arange(N)[:, None, None], t, s), (B, N, T, S))
  mask = mask & (s <= t)
  bias = slopes[None, :, None, None] * (s - t)
  out_w, dq_w, dk_w, dv_w, dl = reference_vjp(q, k, v, d_out, bias, mask=mask)
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N, axis=2)) / np.sqrt(H) + bias
  top = np.max(np.where(mask, logits, -np.inf), axis=-1)
  lse_w = top + np.log(np.sum(np.where(mask, np.exp(logits - top[..., None]), 0.0), -1))
  d_slopes_w = np.einsum("bnts,ts->n", dl, (s - t).astype(np.float64))
  assert mask.any(-1).all() and not mask.all()

  lay = Layout("BTNH")

  def modifiers(sl):
    return Modifiers(structure=MaskSpec(is_causal=True), scale=1 / np.sqrt(H),
                     mods=build_mods(band, jattn.mods.alibi(sl), None, None, N=N))

  plan = flex_tpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=jnp.float32,
                       modifiers=modifiers(jnp.zeros(N)), block_q=8, block_kv=128,
                       interpret=True, offsets=True, return_max_logits=True)
  assert not isinstance(plan, str), plan

  @jax.jit
  def step(q, k, v, sl, d_out, q_offset, kv_offset):
    m = modifiers(sl)
    out, lse, max_logits = flex_tpu_call.step_forward(plan, lay, q, k, v, m.mods, q_offset,
                                                      kv_offset)
    grads = flex_tpu_call.step_backward(plan, lay, q, k, v, m, q_offset, kv_offset, out, lse,
                                   d_out)
    return out, lse, max_logits, grads

  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out, lse, max_logits, (dq, dk, dv, d_consts) = step(f32(q), f32(k), f32(v), f32(slopes),
                                                      f32(d_out), Q_OFFSET, KV_OFFSET)
  np.testing.assert_allclose(out, out_w, atol=2e-6)
  np.testing.assert_allclose(lse, lse_w, atol=2e-5, rtol=1e-6)
  np.testing.assert_allclose(max_logits, top, atol=2e-5, rtol=1e-6)
  for got, want in ((dq, dq_w), (dk, dk_w), (dv, dv_w), (d_consts[0], d_slopes_w)):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_each_platform_reports_its_step_and_the_kernel_reason():
  """TPU runs the kernel per step; CPU keeps the blockwise loop (the same program as
  before); lengths, read as mask mods where the batch is whole on each device; a call the
  kernel refuses (lengths with the batch sharded) keeps blockwise on TPU, with the
  reason."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  data_seq = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
  q = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
  slopes = jnp.ones(2)
  with jattn.explain_calls() as reports:
    jax.eval_shape(lambda q: jattn.ring_attention(
        q, q, q, mesh=mesh, is_causal=True, score_mod=jattn.mods.alibi(slopes)), q)
    jax.eval_shape(lambda q: jattn.ring_attention(
        q, q, q, mesh=data_seq, batch_axis_name="data", key_value_seq_lengths=jnp.asarray([3])),
        q)
    # the max logits asked for: each step's kernel writes its running max (TPU branch traced)
    out, top = jax.eval_shape(lambda q: jattn.ring_attention(
        q, q, q, mesh=mesh, is_causal=True, return_max_logits=True), q)
    jax.eval_shape(lambda q: jattn.ring_attention(
        q, q, q, mesh=mesh, key_value_seq_lengths=jnp.asarray([3])), q)
  kernel, lengths, with_max, as_mods = reports
  assert as_mods.choices["tpu"].plan.implementation == "flex_tpu"
  assert as_mods.choices["tpu"].plan.plan.has_mask_mod
  assert kernel.implementation("tpu") == "ring"
  step = kernel.choices["tpu"].plan
  assert step.implementation == "flex_tpu" and step.plan.offsets and step.plan.is_causal
  assert not step.plan.max_logits and with_max.choices["tpu"].plan.plan.max_logits
  assert top.shape == (1, 32, 2) and top.dtype == jnp.float32
  assert kernel.choices["cpu"].plan.implementation == "blockwise"
  assert lengths.choices["tpu"].plan.implementation == "blockwise"
  assert "sequence lengths" in lengths.reasons("tpu")["flex_tpu"]
  lines = {line.split(":")[0]: line for line in str(kernel).splitlines()}
  assert lines["tpu"].startswith("tpu: ring  each step runs flex_tpu: Plan(")
  assert "sequence lengths" in str(lengths)


def test_explain_ring_under_a_mesh_names_the_step_and_the_reason():
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))):
    kernel = jattn.explain(q, q, q, implementation="ring", is_causal=True,
                           mask_mod=lambda b, n, t, s: s % 3 != 1)
  data_seq = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
  with jax.set_mesh(data_seq):  # the batch sharded over "data"
    refused = jattn.explain(q, q, q, implementation="ring", key_value_seq_lengths=lengths)
  assert kernel.choices["tpu"].plan.implementation == "flex_tpu"
  assert kernel.choices["tpu"].plan.plan.has_mask_mod
  assert kernel.choices["cpu"].plan.implementation == "blockwise"
  assert refused.choices["tpu"].plan.implementation == "blockwise"
  assert refused.reasons("tpu") == {"flex_tpu": "sequence lengths and segment ids of a ring "
                                                "step's chunks, with the batch or heads "
                                                "sharded: the ring's blockwise step applies "
                                                "them"}
  with pytest.raises(ValueError, match="needs a mesh with a 'seq' axis"):
    jattn.explain(q, q, q, implementation="ring")


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 2), pytest.param("all", 13, marks=pytest.mark.thorough)])
def test_ring_runs_the_kernel_per_step_interpreted_and_exported(cases, count):
  """8 simulated devices: the export for TPU of a ring's gradient holds the forward, dq
  and dk/dv Mosaic kernels and no [T, S] tensor; in interpret mode, causal zig-zag with
  a hand-written mask_mod and ALiBi: out, lse and gradients (slopes too) against float64.
  "all" adds T != S, grouped heads, sinks, mods.document, relative_bias, bfloat16, a 2x2x2 mesh
  (batch and heads sharded too) and a refused call."""
  assert_checks_pass("ring_flex_tpu_cases.py", cases, count)
