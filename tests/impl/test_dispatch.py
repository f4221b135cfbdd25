"""The per-platform choice (jattn/_src/dispatch.py) where a platform refuses: an explicit
kernel is lowered for the platform that takes it, under jax.grad and jax.vmap too,
and raises only when lowered where it cannot run; `explain` and `explain_calls`
report it. Values on this CPU against float64 NumPy."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import jattn
from tests.helpers import needs_api, raises
from tests.reference import reference_mods

B, T, N, H = 1, 128, 2, 64
_rng = np.random.default_rng(0)
Q = _rng.standard_normal((B, T, N, H)).astype(np.float32)
CAUSAL = np.tril(np.ones((T, T), bool))
ON_CPU = "implementation='splash' cannot run this call on 'cpu': it needs a TPU"


def splash(q):
  return jattn.dot_product_attention(q, q, q, is_causal=True, implementation="splash")


def test_a_refused_platform_under_grad_and_vmap():
  """The CPU branch of an explicit splash call is a refusal: it takes the TPU branch's
  shapes under jax.grad (a zero tangent) and jax.vmap (the batch axis in front), so
  both export for TPU, and both raise when run here."""
  grad = jax.jit(jax.grad(lambda q: jnp.sum(splash(q) ** 2)))
  vmapped = jax.jit(jax.vmap(splash))
  stacked = jnp.stack([Q, 2 * Q])
  assert "tpu_custom_call" in export.export(grad, platforms=["tpu"])(Q).mlir_module()
  exported = export.export(vmapped, platforms=["tpu"])(stacked)
  assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].shape == (2, B, T, N, H)
  for fn, x in ((grad, Q), (vmapped, stacked)):
    with raises(ValueError, ON_CPU):
      fn(x)


# jattn's refusal of an explicit implementation on a platform it cannot run on is a
# primitive bound with no operands: it needs no batching or differentiation rule, so
# jattn reads neither jax's `batching.primitive_batchers` (a compatibility shim in jax)
# nor `ad.primitive_jvps`. Deleted before the import, grad and vmap still export.
_NO_RULES = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.interpreters import ad, batching
    for module, name in ((batching, "primitive_batchers"), (batching, "fancy_primitive_batchers"),
                         (batching, "axis_primitive_batchers"), (ad, "primitive_jvps")):
        delattr(module, name)
    import jattn
    from jax import export
    splash = lambda q: jattn.dot_product_attention(q, q, q, is_causal=True,
                                                   implementation="splash")
    q = jnp.ones((1, 128, 2, 64))
    grad = jax.jit(jax.grad(lambda q: jnp.sum(splash(q) ** 2)))
    vmapped = jax.jit(jax.vmap(splash))
    for fn, x in ((grad, q), (vmapped, jnp.stack([q, q]))):
        assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(x).mlir_module()
        try:
            fn(x)
        except ValueError as e:
            print(str(e).split(":")[0])
""")


def test_the_refusal_needs_no_batching_or_jvp_registry():
  run = subprocess.run([sys.executable, "-c", _NO_RULES], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr
  assert run.stdout.splitlines() == [
      "implementation='splash' cannot run this call on 'cpu'"] * 2, run.stdout


def test_a_choice_shared_by_every_platform_runs_here():
  """is_causal with "xla" on every platform: one branch, the reference's values."""
  out = jattn.dot_product_attention(Q, Q, Q, is_causal=True, implementation="xla")
  np.testing.assert_allclose(out, reference_mods(Q, Q, Q, allowed=CAUSAL)[0], rtol=2e-5,
                             atol=2e-5)


def test_explain_says_where_an_explicit_kernel_cannot_run():
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  report = jattn.explain(q, q, q, is_causal=True, implementation="splash")
  assert report.implementation("tpu") == "splash" and report.implementation("cpu") is None
  assert report.reasons("cpu") == {"splash": "it needs a TPU, the program is lowered for 'cpu'"}
  assert report.reasons("tpu") == {}
  lines = str(report).splitlines()
  assert lines[0] == f"cpu: {ON_CPU}".replace("cpu: implementation", "cpu: cannot run: implementation") + ", the program is lowered for 'cpu'"
  assert lines[1].startswith("tpu: splash  SplashPlan(")
  assert lines[2].startswith("cuda: cannot run: implementation='splash' cannot run this call on 'cuda'")
  assert len(lines) == 3  # cpu, tpu, cuda; rocm is not shown
  # implementation=None: each platform's best, with what it passed over and why
  report = jattn.explain(q, q, q, is_causal=True, bias=jnp.zeros((T, T)))
  assert report.implementation("tpu") == "xla"
  assert set(report.reasons("tpu")) == {"splash", "flex_tpu"}
  assert "    not splash: it takes no bias" in str(report).splitlines()


def test_an_explicit_kernel_that_runs_nowhere_gives_its_own_reason():
  """The reason given is the kernel's on its own platform, not "it needs a TPU"."""
  q = jnp.zeros((B, T, N, H))
  with raises(ValueError, r"implementation='splash' cannot run this call: it takes no bias$"):
    jattn.dot_product_attention(q, q, q, bias=jnp.zeros((T, T)), implementation="splash")
  with raises(ValueError, r"implementation='flex_gpu' cannot run this call: a dense bias "
                          r"\[\.\., T, S\]: not read by the kernel \(score_mod is\)$"):
    jattn.dot_product_attention(q, q, q, bias=jnp.zeros((T, T)), implementation="flex_gpu")


@needs_api("pallas_mha")
def test_jaxs_gpu_kernel_that_runs_nowhere_gives_its_own_reason():
  q = jnp.zeros((B, T, N, H))
  with raises(ValueError, r"implementation='pallas' cannot run this call: it cannot honour "
                          r"local_window_size$"):
    jattn.dot_product_attention(q, q, q, local_window_size=(2, 0), implementation="pallas")


def test_explain_calls_records_each_call_inside_the_block_only():
  with jattn.explain_calls() as reports:
    jattn.dot_product_attention(Q, Q, Q, implementation="xla")
    jattn.dot_product_attention(Q, Q, Q, is_causal=True)
  jattn.dot_product_attention(Q, Q, Q, implementation="xla")  # after the block: not recorded
  assert len(reports) == 2
  assert reports[0].implementation("cpu") == "xla" and reports[0].implementation("tpu") == "xla"
  assert reports[1].implementation("tpu") == "flex_tpu"
  with jattn.explain_calls() as inner:
    pass
  assert inner == []


def test_a_report_is_frozen():
  import dataclasses
  import pytest
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  report = jattn.explain(q, q, q, is_causal=True)
  for obj, field in ((report, "choices"), (report.choices["cpu"], "implementation")):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(obj, field, None)
