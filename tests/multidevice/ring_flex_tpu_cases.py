"""Ring attention running the flex_tpu Pallas kernel for every ring step, in Pallas
interpret mode on simulated CPU devices: out, lse and gradients (query, key, value
and the arrays a score_mod captures) against float64 NumPy (tests/reference_grads.py;
the lse and the captured arrays' gradients written out here).

Inside `pallas_interpret()` ring attention plans the kernel on every platform (on a
TPU it is the TPU branch's choice), so the CPU runs it interpreted; each case first
checks, from `jattn.explain_calls()`, that the step is the kernel's (or, for a call
the kernel refuses, the blockwise loop with the reason). Values only: nothing here
says how fast it is on a TPU.

Run by tests/multidevice/test_ring_flex_tpu.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. One "ok  "/"FAIL" line per
case; exits non-zero on any failure. "quick" (the CI tier): the first.
"""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jattn
from jattn import mods
from jattn._src.impl.interpret import pallas_interpret

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from reference import reference_mask  # noqa: E402
from reference_grads import reference_vjp  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5  # float32 against float64, relative to the largest entry (at least 1)
# d slopes sums T S terms dL (s - t) in float32: the blockwise loop is 1.6e-5 off too
SCORE_TOL = 1e-4
B, H = 1, 8  # B = 2 in the case on a 2x2x2 mesh
EMPTY_LSE = -0.7 * float(np.finfo(np.float32).max)  # a row with no key, as jax.nn


def band(b, n, t, s):
  """Hand-written: a band along s ~ 2t, one key wider per head (absolute positions)."""
  return (s >= 2 * t - 12) & (s <= 2 * t + 3 + n)


def reference_lse(logits, allowed):
  """float64 [B, N, T]: log sum_s exp(logits) over the allowed keys."""
  top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  total = np.sum(np.where(allowed, np.exp(logits - top), 0.0), axis=-1)
  with np.errstate(divide="ignore"):
    return np.where(total > 0, np.log(total) + top[..., 0], EMPTY_LSE)


def case(name, *, devices, T, S, N, K, is_causal, mask_mod=None, mask=None, score=None,
         sinks=None, kv_lengths=None, q_lengths=None, segment_ids=None, expect="flex_tpu",
         cube=False, seed=0):
  """Ring over `devices` devices, kernel tiles 8 x 128; cube: on a 2x2x2 mesh of data,
  model and seq instead, with B = 2 (the kernel at one device's B, N and K).
  mask: mask_mod's dense [B, N, T, S]
  (else evaluated here on the grid); score: None, ("alibi", slopes [N]) or
  ("relative", table [N, 2M + 1]), whose array's gradient is checked too; sinks [N]: in
  the reference one more key, of logit sinks[n] and value 0, visible to every row;
  q_lengths, kv_lengths [B] and segment_ids [B, T] (for queries and keys, T = S): the
  built-in arguments."""
  B = 2 if cube else 1
  rng = np.random.default_rng(seed)
  q, k, v, d_out = (rng.standard_normal(s) for s in ((B, T, N, H), (B, S, K, H),
                                                      (B, S, K, H), (B, T, N, H)))
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  bias = None
  if score is not None and score[0] == "alibi":
    bias = score[1][None, :, None, None] * (s - t)  # [1, N, T, S]
  elif score is not None:  # table[n, clip(s - t, -M, M) + M]
    M = score[1].shape[1] // 2
    column = np.clip(s - t, -M, M) + M  # [T, S]
    bias = score[1][:, column][None]
  if mask_mod is not None and mask is None:
    b_, n_, t_, s_ = np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S))
    mask = np.broadcast_to(mask_mod(b_, n_, t_, s_), (B, N, T, S))
  allowed = reference_mask(B, N, T, S, mask=mask, is_causal=is_causal, kv_lengths=kv_lengths,
                           q_lengths=q_lengths, q_segment_ids=segment_ids,
                           kv_segment_ids=segment_ids)
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) / np.sqrt(H)
  logits = logits if bias is None else logits + bias
  if sinks is None:
    out_w, dq_w, dk_w, dv_w, dl = reference_vjp(q, k, v, d_out, bias, mask=allowed)
  else:  # key S: zero key and value, logit sinks[n]
    zero = np.zeros((B, 1, K, H))
    sink_bias = np.broadcast_to(sinks[None, :, None, None], (B, N, T, 1))
    bias_ext = np.concatenate([np.broadcast_to(0.0 if bias is None else bias, (B, N, T, S)),
                               sink_bias], axis=-1)
    allowed = np.concatenate([allowed, np.ones((B, N, T, 1), bool)], axis=-1)
    out_w, dq_w, dk_w, dv_w, dl = reference_vjp(
        q, np.concatenate([k, zero], 1), np.concatenate([v, zero], 1), d_out, bias_ext,
        mask=allowed)
    dk_w, dv_w, d_sinks_w, dl = dk_w[:, :S], dv_w[:, :S], dl[..., S].sum((0, 2)), dl[..., :S]
    logits = np.concatenate([logits, sink_bias], axis=-1)
  lse_w = reference_lse(logits, allowed)
  want = [out_w, dq_w, dk_w, dv_w]
  if score is not None and score[0] == "alibi":  # d slopes[n] = sum of dL (s - t)
    want.append(np.einsum("bnts,ts->n", dl, (s - t).astype(np.float64)))
  elif score is not None:  # d table[n, m] = sum of dL where clip(s - t) + M = m
    onehot = column[..., None] == np.arange(score[1].shape[1])  # [T, S, 2M + 1]
    want.append(np.einsum("bnts,tsm->nm", dl, onehot.astype(np.float64)))
  if sinks is not None:
    want.append(d_sinks_w)
  score_mod = None if score is None else (
      mods.alibi if score[0] == "alibi" else mods.relative_bias)

  mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
  axes = dict(batch_axis_name="data", head_axis_name="model") if cube else {}
  if cube:
    mesh = jax.make_mesh((2, 2, 2), ("data", "model", "seq"))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  ints = lambda x: None if x is None else jnp.asarray(x, jnp.int32)

  def ring(q, k, v, *captured):
    captured = list(captured)
    table = None if score is None else captured.pop(0)
    return jattn.ring_attention(
        q, k, v, mesh=mesh, is_causal=is_causal, mask_mod=mask_mod,
        score_mod=None if score is None else score_mod(table),
        sinks=None if sinks is None else captured.pop(0),
        key_value_seq_lengths=ints(kv_lengths), query_seq_lengths=ints(q_lengths),
        q_segment_ids=ints(segment_ids), kv_segment_ids=ints(segment_ids),
        block_sizes=jattn.BlockSizes(q=8, kv=128),
        return_residual=True, **axes)

  @jax.jit  # one program: compiling the interpreted kernels is most of the time
  def values_and_grads(args, d_out):
    out, pullback, lse = jax.vjp(ring, *args, has_aux=True)
    return out, lse, pullback(d_out)

  args = [f32(x) for x in (q, k, v)] + ([] if score is None else [f32(score[1])]) + (
      [] if sinks is None else [f32(sinks)])
  with pallas_interpret(), jattn.explain_calls() as reports:
    traced = values_and_grads.trace(args, f32(d_out))
    out, lse, grads = traced.lower().compile()(args, f32(d_out))
  step = reports[0].choices["cpu"].plan
  kernels = str(traced.jaxpr).count("pallas_call")  # per chunk pair: forward, dq, dk/dv
  ran = (step.implementation == expect and reports[0].choices["tpu"].plan == step
         and (kernels >= 3 if expect == "flex_tpu" else kernels == 0)
         and (expect == "flex_tpu" or "flex_tpu" in reports[0].reasons("cpu")))
  got = [np.asarray(x, np.float64) for x in (out, *grads)]
  lse = np.einsum("btn->bnt", np.asarray(lse, np.float64))
  scale = lambda w: max(1.0, np.max(np.abs(w)))
  errors = [np.max(np.abs(g - w)) / scale(w) for g, w in zip(got, want)]
  seen = lse_w != EMPTY_LSE
  errors.append(np.max(np.abs(lse[seen] - lse_w[seen])) / scale(lse_w[seen]))
  tols = [TOL] * 4 + [SCORE_TOL] * (score is not None) + [TOL] * (sinks is not None) + [TOL]
  ok = (ran and all(e <= tol for e, tol in zip(errors, tols))
        and np.all(lse[~seen] == np.float32(EMPTY_LSE))
        and all(np.all(np.isfinite(g)) for g in got))
  print(f"{'ok  ' if ok else 'FAIL'} {name}: step {step.implementation} ({kernels} "
        f"pallas_call); max |err| out, grads..., lse = "
        + ", ".join(f"{e:.1e}" for e in errors) + f"; {np.sum(~seen)} empty rows", flush=True)
  return ok


def bfloat16_case(name, *, devices=2, T=32, N=2, K=1, seed=7):
  """bfloat16 ring, causal zig-zag + band mask_mod, kernel per step (interpret mode):
  out and gradients against float64, each error at most twice that of a naive dense
  computation done in bfloat16 (the suite's low-precision rule)."""
  rng = np.random.default_rng(seed)
  q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                    for s in ((1, T, N, H), (1, T, K, H), (1, T, K, H), (1, T, N, H)))
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  allowed = np.broadcast_to(band(0, np.arange(N)[:, None, None], t, s) & (s <= t), (1, N, T, T))
  want = reference_vjp(f64(q), f64(k), f64(v), f64(d_out), mask=allowed)[:4]
  seen = allowed.any(-1)  # [1, N, T]

  def naive(q, k, v):  # every step in bfloat16
    kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, kk) * jnp.asarray(1 / np.sqrt(H), q.dtype)
    weights = jax.nn.softmax(jnp.where(allowed, logits, jnp.asarray(-1e4, q.dtype)), axis=-1)
    weights = jnp.where(seen[..., None], weights, jnp.zeros((), q.dtype))
    return jnp.einsum("BNTS,BSNH->BTNH", weights, vv)

  mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
  ring = lambda q, k, v: jattn.ring_attention(q, k, v, mesh=mesh, is_causal=True,
                                              mask_mod=band)

  def values_and_grads(fn):
    out, pullback = jax.vjp(fn, q, k, v)
    return [out, *pullback(d_out)]

  with pallas_interpret(), jattn.explain_calls() as reports:
    got = [f64(x) for x in jax.jit(lambda: values_and_grads(ring))()]
  base = [f64(x) for x in values_and_grads(naive)]
  errors = [np.max(np.abs(g - w)) for g, w in zip(got, want)]
  bounds = [2 * np.max(np.abs(b - w)) for b, w in zip(base, want)]
  ok = (reports[0].choices["cpu"].plan.implementation == "flex_tpu"
        and all(e <= b for e, b in zip(errors, bounds)))
  print(f"{'ok  ' if ok else 'FAIL'} {name}: max |err| out, dq, dk, dv = "
        + ", ".join(f"{e:.1e} (<= {b:.1e})" for e, b in zip(errors, bounds)), flush=True)
  return ok


def export_check(name, *, grad, mask_mod, score_mod, load_balance):
  """jax.export for TPU of a causal ring call (or its gradient) on 4 devices, T = S =
  2048 (steps of 256 x 256 in zig-zag order, else 512 x 512): the flex_tpu Mosaic
  kernels (`tpu_custom_call`) and no [T, S] or [step, step] tensor. Lowering only."""
  T, N, K = 2048, 4, 2
  mesh = jax.make_mesh((4,), ("seq",), devices=jax.devices()[:4])
  q = jax.ShapeDtypeStruct((B, T, N, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, K, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((N,), jnp.float32)

  def ring(q, k, v, slopes):
    return jattn.ring_attention(q, k, v, mesh=mesh, is_causal=True, mask_mod=mask_mod,
                                score_mod=score_mod(slopes), load_balance=load_balance)

  fn = ring if not grad else jax.grad(
      lambda *a: jnp.sum(ring(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))
  with jax.set_mesh(mesh):
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(q, kv, kv, slopes).mlir_module()
  kernels = ["jattn_flex_tpu_fwd"] + ["jattn_flex_tpu_dq", "jattn_flex_tpu_dkv"] * grad
  found = {k: text.count(k) for k in kernels}
  dense = re.findall(r"tensor<[^>]*\b(?:2048x2048|512x512|256x256)\b[^>]*>", text)
  ok = all(found.values()) and "tpu_custom_call" in text and not dense
  print(f"{'ok  ' if ok else 'FAIL'} export {name}: kernels {found}, "
        f"{text.count('tpu_custom_call')} tpu_custom_call, [T, S] tensors {dense[:2]}",
        flush=True)
  return ok


def main():
  assert jax.device_count() == 8, jax.devices()
  # the quick one: the gradient (forward, dq and dk/dv kernels), contiguous order
  ok = export_check("gradient, contiguous, band mask_mod + ALiBi", grad=True, mask_mod=band,
                    score_mod=mods.alibi, load_balance=False)
  if "quick" not in sys.argv:
    ok &= export_check("forward, zig-zag, band mask_mod + ALiBi", grad=False, mask_mod=band,
                       score_mod=mods.alibi, load_balance=True)
    ok &= export_check("gradient, zig-zag, mods.document + relative_bias", grad=True,
                       mask_mod=mods.document(jnp.zeros((B, 2048), jnp.int32),
                                              jnp.zeros((B, 2048), jnp.int32)),
                       score_mod=lambda t: mods.relative_bias(jnp.ones((4, 9))),
                       load_balance=True)
  slopes = np.array([0.5, -0.25])
  table = np.random.default_rng(9).standard_normal((2, 9))  # relative bias, M = 4
  ids = np.repeat(np.arange(4), [5, 13, 10, 4])[None]  # [B, T = 32]: four documents
  same_doc = (ids[:, :, None] == ids[:, None, :])[:, None]  # [B, 1, T, T]
  alibi = ("alibi", slopes)
  cases = [  # the quick one: offsets in causal, a hand-written mask_mod and a score_mod,
      # with lengths and segment ids (which the ring reads as mask mods of the global arrays,
      # here traced with the hand-written mask into one)
      ("causal zig-zag + band mask_mod + ALiBi + query and kv lengths + segment ids, "
       "2 devices, T=S=32",
       dict(devices=2, T=32, S=32, N=2, K=1, is_causal=True, mask_mod=band, score=alibi,
            q_lengths=np.array([27]), kv_lengths=np.array([21]), segment_ids=ids)),
  ]
  if "quick" not in sys.argv:
    cases += [
        ("causal zig-zag + band mask_mod + ALiBi, 2 devices, T=S=32",
         dict(devices=2, T=32, S=32, N=2, K=1, is_causal=True, mask_mod=band, score=alibi)),
        ("causal zig-zag + query and kv lengths + segment ids (ready-made mods), 4 devices",
         dict(devices=4, T=32, S=32, N=2, K=1, is_causal=True, q_lengths=np.array([27]),
              kv_lengths=np.array([21]), segment_ids=ids)),
        ("causal zig-zag + ALiBi + sinks, 2 devices, 2 query tiles a step",
         dict(devices=2, T=64, S=64, N=2, K=1, is_causal=True, score=alibi,
              sinks=np.array([0.3, 1.5]))),
        ("hand-written band mask_mod, contiguous, T=32 < S=64, N=4 on K=2, 2 devices",
         dict(devices=2, T=32, S=64, N=4, K=2, is_causal=False, mask_mod=band)),
        ("causal zig-zag + band mask_mod + ALiBi, 4 devices, T=64 > S=32",
         dict(devices=4, T=64, S=32, N=2, K=1, is_causal=True, mask_mod=band, score=alibi)),
        ("causal zig-zag + mods.document (ids as blocks) + relative_bias table, 4 devices",
         dict(devices=4, T=32, S=32, N=2, K=1, is_causal=True,
              mask_mod=mods.document(jnp.asarray(ids), jnp.asarray(ids)),
              mask=np.broadcast_to(same_doc, (B, 2, 32, 32)), score=("relative", table))),
        ("2x2x2 mesh (batch, heads and sequence sharded), causal zig-zag, N=4 on K=2",
         dict(devices=8, T=32, S=32, N=4, K=2, is_causal=True, cube=True)),
        ("kv lengths with the batch and heads sharded: the kernel refuses, the steps run "
         "blockwise (2x2x2 mesh, causal zig-zag)",
         dict(devices=8, T=32, S=32, N=4, K=2, is_causal=True, cube=True,
              kv_lengths=np.array([21, 30]), expect="blockwise")),
    ]
  for i, (name, kwargs) in enumerate(cases):
    ok &= case(name, seed=i, **kwargs)
  if "quick" not in sys.argv:
    ok &= bfloat16_case("bfloat16, causal zig-zag + band mask_mod, 2 devices")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
