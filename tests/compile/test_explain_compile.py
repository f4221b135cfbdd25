"""`jattn.explain(..., compile=target)`: the call compiled for a TPU generation from this
host, the kernels in the compiled program against the implementation explain names."""

import jax
import jax.numpy as jnp
import pytest

import jattn


@pytest.mark.parametrize("target, kw, kernel", [
    ("v5e", dict(is_causal=True), "jattn_flex_tpu_fwd"),
    ("v6e", dict(score_mod=jattn.mods.alibi(jnp.linspace(0.1, 0.8, 8))), "jattn_flex_tpu_fwd"),
    ("tpu7x", dict(mask_mod=jattn.mods.causal(), implementation="xla"), None),
])
def test_explain_compiles_the_call_for_the_target(target, kw, kernel):
  q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)   # [B, T, N, H]
  report = jattn.explain(q, q, q, compile=target, **kw)
  compiled = report.compiled
  assert compiled.target == target and compiled.platform == "tpu"
  mosaic = [k for k in compiled.kernels if k.startswith(("splash_", "jattn_"))]
  if kernel is None:
    assert not mosaic, compiled
  else:
    assert mosaic and all(k.startswith(kernel) for k in mosaic), compiled
  assert compiled.memory["argument"] >= 3 * 1024 * 8 * 128 * 2  # q, k, v in bfloat16
  assert f"compiled for {target} (tpu): kernels" in str(report)


def test_the_docs_example():
  """docs/accelerators.md, "Compiled for a TPU from this host" (a notest block there)."""
  q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)   # [B, T, N, H]
  report = jattn.explain(q, q, q, score_mod=jattn.mods.alibi(jnp.linspace(0.1, 0.8, 8)),
                         mask_mod=jattn.mods.sliding_window(512), compile="v5e")
  print(report)
  assert report.implementation("tpu") == "flex_tpu"
  assert "jattn_flex_tpu_fwd" in report.compiled.kernels
  assert report.compiled.memory["temp"] < 2048 * 2048 * 4   # no [T, S] logits
