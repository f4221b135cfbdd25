"""The "splash" (TPU) and "pallas" (GPU) implementations: jax's own fused Pallas kernels.

The kernel-calling functions take arrays in a fixed layout plus a static plan
(`jattn._src.impl.kernel_plans`); the adapters at the bottom fit them to the
implementation signature of `_dot_product_attention._IMPLEMENTATIONS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn._src import compat
from jattn._src.impl.kernel_plans import PallasPlan, SplashPlan, find_document, pallas_blocks
from jattn._src.impl.splash_mask import splash_mask


def _block(n: int) -> int:
  return next(b for b in (512, 256, 128) if n % b == 0)


@functools.lru_cache(maxsize=32)
def _splash_kernel(plan: SplashPlan, T: int, S: int, heads: int, mqa: bool,
                   save_residuals: bool):
  sk, sm = compat.load("splash_kernel"), compat.load("splash_mask")
  mask = sm.MultiHeadMask([splash_mask(plan.mask, T, S)] * heads)
  bq, bkv = _block(T), _block(S)
  sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                        block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                        block_kv_dq=bkv)
  make = sk.make_splash_mqa if mqa else sk.make_splash_mha
  # The kernel holds its mask's block tables as arrays; made eagerly, so the
  # cached kernel never holds a tracer of the call that first built it, and on the
  # host (a set mesh of compile-only devices can hold none)
  with compat.host_eval(), jax.ensure_compile_time_eval():
    return make(mask, block_sizes=sizes, save_residuals=save_residuals,
                attn_logits_soft_cap=plan.soft_cap, head_shards=1, q_seq_shards=1,
                interpret=plan.interpret)


def _run_splash(plan, q, k, v, q_ids, kv_ids, sinks, save_residuals):
  """q [B, N, T, H], k/v [B, K, S, H] -> out [B, N, T, H] (and lse [B, N, T])."""
  run = functools.partial(_run_splash_kernel, plan, save_residuals=save_residuals)
  if q.dtype != jnp.bfloat16:
    return run(q, k, v, q_ids, kv_ids, sinks)
  return _at_default_precision(run, q, k, v, q_ids, kv_ids, sinks)


def _at_default_precision(fn, *args):
  """fn(*args) with its forward and its backward traced at the default matmul precision.

  Mosaic compiles no "high" or "highest" dot of bfloat16 operands ("Bad lhs type", found
  by the compile tier), which a jax_default_matmul_precision of "high" or "highest" asks
  of every dot in splash's kernels; for bfloat16 operands the default is exact (bf16
  products, float32 sums). A custom VJP, so that the backward, traced when the gradient
  is taken and outside this call, is traced under it too."""
  default = lambda: jax.default_matmul_precision("default")

  @jax.custom_vjp
  def call(*args):
    with default():
      return fn(*args)

  def forward(*args):
    with default():
      return jax.vjp(fn, *args)

  def backward(pullback, cotangent):
    with default():
      return pullback(cotangent)

  call.defvjp(forward, backward)
  return call(*args)


def _run_splash_kernel(plan, q, k, v, q_ids, kv_ids, sinks, *, save_residuals):
  sk = compat.load("splash_kernel")
  B, N, T, H = q.shape
  K, S = k.shape[1], k.shape[2]
  G = N // K
  mqa = K != N  # grouped heads: the MQA kernel per key head, K and V never repeated
  kernel = _splash_kernel(plan, T, S, G if mqa else N, mqa, save_residuals)

  def one(q, k, v, q_ids, kv_ids, sinks):  # one batch element (and key head when mqa)
    ids = None if q_ids is None else sk.SegmentIds(q=q_ids, kv=kv_ids)
    return kernel(q, k, v, segment_ids=ids, sinks=sinks)

  if mqa:
    q = q.reshape(B, K, G, T, H)
    sinks = None if sinks is None else sinks.reshape(K, G)
    one = jax.vmap(one, in_axes=(0, 0, 0, None, None, 0 if sinks is not None else None))
  ids_axis = None if q_ids is None else 0
  res = jax.vmap(one, in_axes=(0, 0, 0, ids_axis, ids_axis, None))(
      q, k, v, q_ids, kv_ids, sinks)
  if save_residuals:
    out, (lse,) = res
    return out.reshape(B, N, T, -1), lse.reshape(B, N, T)
  return res.reshape(B, N, T, -1)


def splash_attention(q, k, v, *, q_ids, kv_ids, q_lengths, kv_lengths, sinks, scale,
                     plan: SplashPlan):
  """q [B, N, T, H], k/v [B, K, S, H]; ids int [B, T]/[B, S] or None; lengths int [B] or
  None; sinks float [N] or None. -> out [B, N, T, H] in value's dtype."""
  B, N, T, H = q.shape
  S = k.shape[2]
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # splash applies no scale
  if plan.segments or plan.kv_lengths:
    q_ids = jnp.zeros((B, T), jnp.int32) if q_ids is None else q_ids.astype(jnp.int32)
    kv_ids = jnp.zeros((B, S), jnp.int32) if kv_ids is None else kv_ids.astype(jnp.int32)
    if plan.kv_lengths:  # padding keys get an id no query has
      outside = jnp.minimum(q_ids.min(), kv_ids.min()) - 1
      s = jnp.arange(S, dtype=jnp.int32)
      kv_ids = jnp.where(s[None, :] < kv_lengths[:, None], kv_ids, outside)
  else:
    q_ids = kv_ids = None
  sinks = None if sinks is None else sinks.astype(jnp.float32)
  out = _run_splash(plan, q, k, v, q_ids, kv_ids, sinks, save_residuals=False)
  keep = jnp.ones((B, 1, T, 1), bool)
  if plan.q_lengths:
    keep &= (jnp.arange(T, dtype=jnp.int32)[None, :] < q_lengths[:, None])[:, None, :, None]
  if plan.guard_empty_rows:
    # A row with no key gets splash's average of masked values; jattn returns
    # zeros. Such rows carry splash's mask value as lse: find them with a
    # forward-only pass (an extra forward's cost, only for plans that may empty a row).
    stop = jax.lax.stop_gradient
    _, lse = _run_splash(plan, stop(q), stop(k), stop(v), q_ids, kv_ids,
                         None if sinks is None else stop(sinks), save_residuals=True)
    keep &= (lse > -1e37)[..., None]
  if plan.q_lengths or plan.guard_empty_rows:
    out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out


def pallas_attention(q, k, v, *, ids, plan: PallasPlan):
  """q [B, T, N, H], k/v [B, S, K, H]; ids int [B, T] or None -> out [B, T, N, H]."""
  gpu_attention = compat.load("pallas_mha")
  N, K = q.shape[2], k.shape[2]
  if K != N:  # the kernel has no grouped heads: repeat K and V (a copy)
    k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
  T, S = q.shape[1], k.shape[1]
  bq, bk = pallas_blocks(T, S)
  sizes = gpu_attention.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bq, block_kv_dkv=bk,
                                   block_q_dq=bq, block_kv_dq=bk)
  return gpu_attention.mha(q, k, v, None if ids is None else ids.astype(jnp.int32),
                           sm_scale=1.0 if plan.scale is None else plan.scale,
                           causal=plan.causal, block_sizes=sizes,
                           interpret=plan.interpret)


# ---- adapters to the implementation signature
# run(plan, query, key, value, modifiers, layout) -> (out, None, None, None); the plan
# says what the kernel takes, and the plan refused every other modifier.


def _segment_ids(plan, modifiers):
  """The segment ids the kernel applies: a lowered mods.document's, else the user's."""
  if getattr(plan, "document", False):
    doc = find_document(modifiers.mods.mask_mod)
    return doc.q_segment_ids, doc.kv_segment_ids
  return modifiers.structure.q_segment_ids, modifiers.structure.kv_segment_ids


def splash_implementation(plan: SplashPlan, query, key, value, modifiers, layout):
  structure = modifiers.structure
  q, k, v = (jnp.einsum(f"{sub}->{canon}", x) for x, sub, canon in (
      (query, layout.query, "BNTH"), (key, layout.key, "BKSH"), (value, layout.value, "BKSD")))
  q_ids, kv_ids = _segment_ids(plan, modifiers)
  out = splash_attention(q, k, v, q_ids=q_ids, kv_ids=kv_ids, q_lengths=structure.q_lengths,
                         kv_lengths=structure.kv_lengths, sinks=modifiers.sinks,
                         scale=modifiers.scale, plan=plan)
  return jnp.einsum(f"BNTD->{layout.out}", out).astype(value.dtype), None, None, None


def pallas_implementation(plan: PallasPlan, query, key, value, modifiers, layout):
  q, k, v = (jnp.einsum(f"{sub}->{canon}", x) for x, sub, canon in (
      (query, layout.query, "BTNH"), (key, layout.key, "BSKH"), (value, layout.value, "BSKD")))
  if plan.scale is None:  # a traced scale: the kernel takes a constant, the query carries it
    q = (q.astype(jnp.float32) * modifiers.scale).astype(q.dtype)
  ids = _segment_ids(plan, modifiers)[0] if plan.segments else None
  out = pallas_attention(q, k, v, ids=ids, plan=plan)
  return jnp.einsum(f"BTND->{layout.out}", out).astype(value.dtype), None, None, None
