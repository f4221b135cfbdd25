"""The decode path on every TPU generation, and the sequence over a slice: the
context-parallel strategies and the Transformer on a ("data", "model", "seq") mesh of a
2x2 v5e, compiled by libtpu from this CPU. Letters: B T S N K G H D F.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from jattn import mods, sharding
from jattn._src import deviceless
from jattn.transformer import Transformer, TransformerConfig
from tests.compile.tpu_programs import GENERATIONS

SLICE = "v5e=2x2"
MOSAIC = ("jattn_flex_tpu_", "splash_mha_", "splash_mqa_")  # the TPU kernels, by name
# the collective each strategy's compiled program moves the sequence with
COLLECTIVE = {"ring": "collective-permute", "all_gather": "all-gather", "ulysses": "all-to-all"}


@pytest.mark.parametrize("target", GENERATIONS)
def test_decode_split_compiles_on_every_generation(target):
  """decode_attention's "split" (named: explain_decode names "paged_tpu" for "tpu" here,
  and "split" where the kernel refuses), causal, a sliding window mod and ALiBi, grouped
  heads, over a paged cache of bfloat16 pages."""
  B, T, N, K, H = 4, 1, 8, 2, 128
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B, 1024, num_kv_heads=K, head_dim=H, page_size=64, num_pages=48, dtype=jnp.bfloat16))
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((N,), jnp.float32)
  kw = lambda slopes: dict(is_causal=True, mask_mod=mods.sliding_window(1024),
                           score_mod=mods.alibi(slopes), implementation="split")
  assert jattn.explain_decode(q, cache, **kw(jnp.ones(N))).implementation("tpu") == "split"
  _, report = deviceless.compile_for(
      target, lambda q, cache, slopes: jattn.decode_attention(q, cache, **kw(slopes)),
      q, cache, slopes)
  assert not report.kernels, report  # pure JAX: XLA's own fusions


def _on(mesh, shape, dtype, spec):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@pytest.mark.parametrize("strategy", COLLECTIVE)
def test_context_parallel_strategies_compile_on_a_slice(strategy):
  """Forward and gradient, causal, bfloat16, the sequence over the 4 chips of a 2x2 v5e:
  the strategy's collective and a Mosaic kernel per device in the compiled program."""
  mesh = deviceless.mesh(SLICE, {"seq": 4})
  B, T, N, H = 1, 1024, 8, 128
  q = _on(mesh, (B, T, N, H), jnp.bfloat16, P(None, "seq"))

  def loss(q, k, v):
    out = jattn.context_parallel_attention(q, k, v, mesh=mesh, strategy=strategy,
                                           is_causal=True)
    return jnp.sum(out.astype(jnp.float32))

  compiled, report = deviceless.compile_for(SLICE, jax.value_and_grad(loss, (0, 1, 2)), q, q, q)
  assert COLLECTIVE[strategy] in compiled.as_text(), report
  assert any(k.startswith(MOSAIC) for k in report.kernels), report


def test_batch_and_head_sharded_call_runs_the_kernel_per_device_without_gathering():
  """dot_product_attention on arrays sharded over Explicit axes ("data", "model") of a
  2x2 v5e, forward and gradient, bfloat16, causal and document ids: each chip runs
  flex_tpu on its rows and heads, and the compiled program gathers nothing (the one
  collective: the all-reduce of the scalar loss)."""
  devices = np.asarray(deviceless.devices(SLICE), dtype=object).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  B, T, N, H = 4, 1024, 8, 128
  q = _on(mesh, (B, T, N, H), jnp.bfloat16, P("data", None, "model"))
  ids = _on(mesh, (B, T), jnp.int32, P("data"))

  def loss(q, k, v, ids):
    out = jattn.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=ids,
                                      kv_segment_ids=ids)
    return jnp.sum(out.astype(jnp.float32))

  compiled, report = deviceless.compile_for(SLICE, jax.value_and_grad(loss, (0, 1, 2)),
                                            q, q, q, ids, mesh=mesh)
  text = compiled.as_text()
  assert sum(k.startswith("jattn_flex_tpu_") for k in report.kernels) >= 2, report  # fwd, bwd
  for gathering in ("all-gather", "all-to-all", "collective-permute"):
    assert gathering not in text, (gathering, report)


def test_splash_on_a_set_mesh_of_the_slice_compiles_per_chip():
  """implementation="splash" on q sharded over Explicit ("data", "model") of a 2x2 v5e,
  the mesh set: splash's block tables are made eagerly when its kernel is built, which
  under a set mesh of compile-only devices failed ("'Executable' object has no attribute
  'local_devices'") before `compat.host_eval` made them on the host."""
  devices = np.asarray(deviceless.devices(SLICE), dtype=object).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  q = _on(mesh, (4, 1024, 8, 128), jnp.bfloat16, P("data", None, "model"))
  compiled, report = deviceless.compile_for(SLICE, lambda q: jattn.dot_product_attention(
      q, q, q, is_causal=True, implementation="splash"), q, mesh=mesh)
  assert report.kernels == ("splash_mha_fwd_no_residuals",), report
  assert "all-gather" not in compiled.as_text(), report


def test_decode_on_a_data_model_mesh_of_auto_axes_runs_the_kernel_per_chip():
  """decode_attention under a mesh of Auto ("data", "model") axes of a 2x2 v5e: the
  paged kernel cannot be partitioned by the compiler (before: "Mosaic kernels cannot be
  automatically partitioned"), so each chip runs it on its rows and kv heads, with ALiBi
  and sinks, and the program gathers nothing."""
  devices = np.asarray(deviceless.devices(SLICE), dtype=object).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  B, N, K, H = 4, 8, 2, 128
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B, 1024, num_kv_heads=K, head_dim=H, page_size=64, num_pages=48, dtype=jnp.bfloat16))
  q = jax.ShapeDtypeStruct((B, 1, N, H), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((N,), jnp.float32)
  compiled, report = deviceless.compile_for(
      SLICE, lambda q, cache, slopes: jattn.decode_attention(
          q, cache, is_causal=True, score_mod=mods.alibi(slopes), sinks=slopes),
      q, cache, slopes, mesh=mesh)
  assert report.kernels == ("jattn_paged_decode_tpu",), report
  assert "all-gather" not in compiled.as_text(), report


def _compile_transformer_step(mesh, batch: int, **config):
  """The Transformer's loss and gradient compiled for SLICE on `mesh`, parameters and
  tokens [batch, 1024] sharded by jattn.sharding's rules -> (compiled, report)."""
  config = TransformerConfig(vocab_size=128, max_len=1024, num_layers=1, features=256,
                             num_heads=4, mlp_features=512, position_encoding="rope",
                             dtype=jnp.bfloat16, **config)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))),
                               nnx.Param)
  on = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  params = on(params, sharding.state_shardings(params, mesh))
  tokens = {"tokens": jax.ShapeDtypeStruct((batch, 1024), jnp.int32)}
  tokens = on(tokens, sharding.batch_shardings(tokens, mesh))

  def loss(params, batch):
    logits = nnx.merge(graphdef, params)(batch["tokens"])
    return jnp.mean(logits.astype(jnp.float32))

  return deviceless.compile_for(SLICE, jax.value_and_grad(loss), params, tokens, mesh=mesh)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_transformer_train_step_compiles_on_a_data_model_mesh(axis_type):
  """The Transformer's loss and gradient on a 2x2 v5e, ("data", "model") = (2, 2),
  parameters and batch sharded by jattn.sharding, the default implementation. Auto
  axes, as examples/training.py makes them: the compiler cannot partition a Mosaic
  kernel (before: "Mosaic kernels cannot be automatically partitioned. Please wrap the
  call in a shard_map"). Explicit axes (jax.make_mesh's default): before, the embedding
  lookup did not trace. On both each chip runs flex_tpu on its rows and heads, and
  nothing gathers the activations for attention."""
  devices = np.asarray(deviceless.devices(SLICE), dtype=object).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(axis_type,) * 2)
  compiled, report = _compile_transformer_step(mesh, 4)
  assert {"jattn_flex_tpu_fwd", "jattn_flex_tpu_dq", "jattn_flex_tpu_dkv"} <= set(
      report.kernels), report
  assert "all-gather" not in compiled.as_text(), report


def test_transformer_train_step_compiles_on_the_data_model_seq_mesh():
  """The Transformer's loss and gradient on a ("data", "model", "seq") = (1, 2, 2) mesh of
  a 2x2 v5e: parameters and batch sharded by jattn.sharding's rules, attention
  context-parallel over "seq". Before, it did not compile: the context-parallel plan
  computes its static block classes eagerly, and under a set mesh of compile-only devices
  every eager op failed ("'Executable' object has no attribute 'local_devices'");
  `compat.host_eval` now runs them on the host."""
  mesh = deviceless.mesh(SLICE, {"data": 1, "model": 2, "seq": 2})
  compiled, report = _compile_transformer_step(mesh, 2, implementation="context_parallel")
  text = compiled.as_text()
  assert any(c in text for c in COLLECTIVE.values()), report
  assert any(k.startswith(MOSAIC) for k in report.kernels), report
