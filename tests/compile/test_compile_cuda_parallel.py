"""jattn's GPU kernels past one card: calls sharded over a node of 4 H100s (compile-only
devices from this CPU, `deviceless_cuda.cuda_devices("h100", 4)`), compiled by XLA's GPU
compiler with its collectives (NCCL's), Triton and Mosaic GPU. Letters: B T S N K H.

What it proves: the sharded program compiles for the node, each card runs the kernel on
its own rows and heads (training's kernels, and the paged decoding kernel), and the
activations are never gathered. What it does not: the
values and the collectives' speed (nothing runs; the values of the same sharded calls are
checked on 8 simulated CPU devices, tests/multidevice).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from jattn import mods
from jattn._src import compat, deviceless_cuda

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(deviceless_cuda.missing() is not None,
                       reason=f"no deviceless CUDA compile: {deviceless_cuda.missing()}"),
]

B, T, N, H = 4, 512, 8, 64
KERNELS = {"flex_gpu": ("jattn_flex_gpu_fwd", "jattn_flex_gpu_dq", "jattn_flex_gpu_dkv"),
           "flex_mgpu": ("jattn_flex_mgpu_fwd", "jattn_flex_mgpu_dq", "jattn_flex_mgpu_dkv")}


def _node_mesh(axes: dict, axis_type) -> jax.sharding.Mesh:
  devices = deviceless_cuda.cuda_devices("h100", 4)
  return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(tuple(axes.values())),
                           tuple(axes), axis_types=(axis_type,) * len(axes))


def _on(mesh, shape, dtype, spec):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _gathered(text: str) -> list[str]:
  """The result shapes of the compiled program's all-gathers (sync or async)."""
  shapes = []
  for line in text.splitlines():
    if re.search(r"\ball-gather(-start)?\(", line):
      # "name = (operands..., result) all-gather-start(" or "name = result all-gather("
      result = line.split("=", 1)[1].split(" all-gather")[0]
      shapes.append(re.findall(r"\w+\[[\d,]*\]", result)[-1])
  return shapes


@pytest.mark.parametrize("implementation, axis_type", [
    ("flex_gpu", AxisType.Explicit), ("flex_mgpu", AxisType.Explicit),
    ("flex_gpu", AxisType.Auto)], ids=str)
def test_batch_and_head_sharded_call_runs_the_kernel_per_card_without_gathering(
    implementation, axis_type):
  """dot_product_attention with document ids on q, k, v [B, T, N, H] split over ("data",
  "model") = (2, 2), forward and gradient, bfloat16: each card runs the kernel's three
  programs on its rows and heads; the one thing gathered is the [B, T] ids (a ready-made
  mod's array is replicated for the call: docs/scaling.md), never an activation."""
  reason = compat.missing("pallas_mosaic_gpu" if implementation == "flex_mgpu" else
                          "pallas_triton")
  if reason:
    pytest.skip(reason)
  mesh = _node_mesh({"data": 2, "model": 2}, axis_type)
  q = _on(mesh, (B, T, N, H), jnp.bfloat16, P("data", None, "model"))
  ids = _on(mesh, (B, T), jnp.int32, P("data"))

  def loss(q, k, v, ids):
    out = jattn.dot_product_attention(q, k, v, mask_mod=mods.document(ids),
                                      implementation=implementation)
    return jnp.sum(out.astype(jnp.float32))

  text = deviceless_cuda.compile_for("h100", jax.value_and_grad(loss, (0, 1, 2)), q, q, q, ids,
                                     mesh=mesh).as_text()
  for kernel in KERNELS[implementation]:
    assert kernel in text, kernel
  assert set(_gathered(text)) <= {f"s32[{B},{T}]"}, _gathered(text)
  for moving in ("all-to-all", "collective-permute"):
    assert moving not in text, moving


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_paged_decoding_runs_the_kernel_per_card(axis_type):
  """decode_attention with "paged_gpu" (named: the CUDA default is "split" until a card
  times it) over a paged cache of bfloat16 pages, the query's rows over "data" and the
  pools' kv heads over "model", ALiBi and sinks: each card runs the Triton kernel on its
  rows and heads (the compiler cannot partition a Pallas call), and nothing is gathered."""
  reason = compat.missing("pallas_triton")
  if reason:
    pytest.skip(reason)
  mesh = _node_mesh({"data": 2, "model": 2}, axis_type)
  Bd, Nd, Kd, Hd = 4, 8, 2, 128
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      Bd, 1024, num_kv_heads=Kd, head_dim=Hd, page_size=64, num_pages=48, dtype=jnp.bfloat16))
  placed = lambda x, *spec: _on(mesh, x.shape, x.dtype, P(*spec))
  # as a sharded sampler holds them: pools by kv head, the rows' tables by row
  cache = dataclasses.replace(
      cache, key_pages=placed(cache.key_pages, None, "model"),
      value_pages=placed(cache.value_pages, None, "model"),
      block_table=placed(cache.block_table, "data"), lengths=placed(cache.lengths, "data"))
  q = _on(mesh, (Bd, 1, Nd, Hd), jnp.bfloat16, P("data", None, "model"))
  slopes = jax.ShapeDtypeStruct((Nd,), jnp.float32)
  text = deviceless_cuda.compile_for(
      "h100", lambda q, cache, slopes: jattn.decode_attention(
          q, cache, is_causal=True, score_mod=mods.alibi(slopes), sinks=slopes,
          implementation="paged_gpu"), q, cache, slopes, mesh=mesh).as_text()
  assert "jattn_paged_decode_gpu" in text
  assert not _gathered(text), _gathered(text)


def test_the_gather_reader_sees_an_activation_gathered():
  """The check above can fail: a call whose heads are sharded on a mesh axis that the
  program then gathers (the output laid out whole) shows [B, T, N, D] in an all-gather."""
  mesh = _node_mesh({"data": 2, "model": 2}, AxisType.Explicit)
  q = _on(mesh, (B, T, N, H), jnp.bfloat16, P("data", None, "model"))
  whole = lambda q: jax.sharding.reshard(jattn.dot_product_attention(q, q, q, is_causal=True,
                                                                     implementation="xla"), P())
  text = deviceless_cuda.compile_for("h100", whole, q, mesh=mesh).as_text()
  assert f"bf16[{B},{T},{N},{H}]" in _gathered(text), _gathered(text)


def test_ring_attention_compiles_on_a_node():
  """The sequence over the node's 4 cards as a ring (context_parallel_attention,
  strategy="ring"), causal, forward and gradient: the K/V blocks move by
  collective-permute."""
  mesh = _node_mesh({"seq": 4}, AxisType.Explicit)
  q = _on(mesh, (1, 1024, N, H), jnp.bfloat16, P(None, "seq"))

  def loss(q, k, v):
    out = jattn.context_parallel_attention(q, k, v, mesh=mesh, strategy="ring", is_causal=True)
    return jnp.sum(out.astype(jnp.float32))

  text = deviceless_cuda.compile_for("h100", jax.value_and_grad(loss, (0, 1, 2)), q, q, q,
                                     mesh=mesh).as_text()
  assert "collective-permute" in text


def test_a_node_has_one_to_eight_cards():
  assert len(deviceless_cuda.cuda_devices("h100", 4)) == 4
  with pytest.raises(ValueError, match="count must be an int from 1 to 8"):
    deviceless_cuda.cuda_devices("h100", 9)
