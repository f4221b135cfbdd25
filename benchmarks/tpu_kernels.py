"""TPU benchmark of jattn's own Pallas kernel ("flex_tpu") against the alternatives.

NOT RUN: no TPU was available when this was written. It was checked only with
--smoke (tiny shapes, flex_tpu in interpret mode and blockwise, on a CPU: the
script runs; the times say nothing about a TPU). The splash and tokamax calls
were never executed (tokamax was not installed; its call follows its README's
`tokamax.dot_product_attention(..., implementation="mosaic")` and may need
adjusting). A TPU owner runs it as

    python benchmarks/tpu_kernels.py [--T 4096] [--B 4] [--N 16] [--K 16] [--H 128]
                                     [--dtype bfloat16] [--rounds 5] [--out results.json]

Cases, forward and forward+backward, the same inputs for every contender:
  causal      flex_tpu (is_causal)  vs  jax's splash kernel (CausalMask)
              vs tokamax's Mosaic attention (if `import tokamax` works)
              vs jattn "blockwise" (pure JAX)
  alibi       flex_tpu (score_mod=mods.alibi, causal)   vs blockwise
  prefix_lm   flex_tpu (mask_mod=mods.prefix_lm)        vs blockwise
  hand        flex_tpu (a hand-written mask_mod)        vs blockwise
  soft_cap    flex_tpu (mods.soft_cap, causal)          vs splash (attn_logits_soft_cap) vs blockwise

TFLOP/s counts the visible entries only (4 B N H per visible (t, s) forward, 2.5x that
forward+backward), so a kernel that skips empty blocks is not credited for them;
ratios are medians of interleaved rounds, relative to flex_tpu.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from benchmarks.kernel_timing import interleaved, timed  # noqa: E402
from jattn._src.core.layout import Layout  # noqa: E402
from jattn._src.masks.modifiers import Modifiers  # noqa: E402
from jattn._src.core.block_sizes import default_block_sizes  # noqa: E402
from jattn._src.impl.blockwise import blockwise_attention  # noqa: E402
from jattn._src.kernels import flex_tpu, flex_tpu_call  # noqa: E402
from jattn._src.masks.programmable import build_mods  # noqa: E402
from jattn._src.masks.structural import MaskSpec  # noqa: E402


def hand_mask(b, n, t, s):
  """A mask no ready-made kernel takes: causal, every third key hidden, a 16-key prefix."""
  return ((s <= t) & ((t - s) % 3 != 1)) | (s < 16)


def cases(args):
  """name -> (mask_mod, score_mod, is_causal, visible fraction of [T, S], splash spec)."""
  N, T = args.N, args.T
  slopes = jnp.asarray(2.0 ** (-8.0 * (np.arange(N) + 1) / N), jnp.float32)
  prefix = jnp.full((args.B,), T // 4, jnp.int32)
  half = 0.5 + 0.5 / T
  return {
      "causal": (None, None, True, half, "causal"),
      "alibi": (None, jattn.mods.alibi(slopes), True, half, None),
      "prefix_lm": (jattn.mods.prefix_lm(prefix), None, False, half + 0.5 * (1 / 4) ** 2, None),
      "hand": (hand_mask, None, False, 2 * half / 3, None),
      "soft_cap": (None, jattn.mods.soft_cap(30.0), True, half, "soft_cap"),
  }


def contenders(args, name, spec):
  mask_mod, score_mod, is_causal, _, splash = spec
  layout = Layout("BTNH")
  out = {}

  def modifiers():
    return Modifiers(mods=build_mods(mask_mod, score_mod, None, None, N=args.N),
                     structure=MaskSpec(is_causal=is_causal), scale=1 / np.sqrt(args.H))

  def flex(q, k, v):
    m = modifiers()
    p = flex_tpu.plan(B=args.B, T=args.T, S=args.T, N=args.N, K=args.K, H=args.H, D=args.H,
                      dtype=q.dtype, modifiers=m, block_q=args.block_q,
                      block_kv=args.block_kv, interpret=args.smoke)
    if isinstance(p, str):
      raise SystemExit(f"flex_tpu refused {name}: {p}")
    return flex_tpu_call.run(p, q, k, v, m, layout)[0]

  out["flex_tpu"] = flex
  out["blockwise"] = lambda q, k, v: blockwise_attention(
      q, k, v, modifiers(), layout, block_sizes=default_block_sizes("tpu"))[0]
  if splash and not args.smoke:
    out["splash"] = splash_call(args, soft_cap=30.0 if splash == "soft_cap" else None)
  if name == "causal" and not args.smoke:
    try:
      import tokamax  # noqa: F401
      out["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=True, implementation="mosaic")
    except Exception as e:  # optional contender: say why it is missing
      print(f"tokamax not run: {type(e).__name__}: {e}")
  return out


def splash_call(args, soft_cap):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  mask = sm.MultiHeadMask([sm.CausalMask((args.T, args.T)) for _ in range(args.N)])
  kernel = sk.make_splash_mha_single_device(mask, attn_logits_soft_cap=soft_cap)
  G = args.N // args.K

  def f(q, k, v):  # splash: unbatched [N, T, H], scale applied to q; K/V repeated per group
    q = jnp.einsum("btnh->bnth", q) / np.sqrt(args.H)
    k, v = (jnp.repeat(jnp.einsum("bskh->bksh", x), G, axis=1) for x in (k, v))
    return jnp.einsum("bnth->btnh", jax.vmap(kernel)(q, k, v))
  return f


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--B", type=int, default=4)
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--N", type=int, default=16)
  parser.add_argument("--K", type=int, default=16)
  parser.add_argument("--H", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--block_q", type=int, default=256)
  parser.add_argument("--block_kv", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes in interpret mode on any backend: checks the script, "
                           "measures nothing")
  args = parser.parse_args()
  platform = jax.devices()[0].platform
  if args.smoke:
    args.B, args.T, args.N, args.K, args.H, args.rounds = 1, 256, 2, 1, 128, 1
    args.block_q, args.block_kv = 128, 128
  elif platform != "tpu":
    raise SystemExit(f"needs a TPU (found {platform}); --smoke checks the script anywhere")
  r = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  inputs = tuple(jnp.asarray(r.normal(size=(args.B, args.T, n, args.H)), dtype)
                 for n in (args.N, args.K, args.K))
  device = jax.devices()[0].device_kind
  results = []
  for name, spec in cases(args).items():
    visible = spec[3]
    for backward in (False, True):
      fns = {c: timed(f, inputs, backward) for c, f in contenders(args, name, spec).items()}
      times = interleaved(fns, args.rounds)
      flops = 4 * args.B * args.N * args.H * args.T * args.T * visible * (2.5 if backward else 1)
      base = statistics.median(times["flex_tpu"])
      for c, ts in times.items():
        med = statistics.median(ts)
        row = dict(case=name, pass_="fwd+bwd" if backward else "fwd", contender=c,
                   ms=1e3 * med, tflops=flops / med / 1e12, vs_flex_tpu=med / base,
                   device=device, smoke=args.smoke)
        results.append(row)
        print(f"{name:10s} {row['pass_']:8s} {c:10s} {row['ms']:9.3f} ms "
              f"{row['tflops']:7.2f} TFLOP/s  x{row['vs_flex_tpu']:.2f} of flex_tpu")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results),
                                                 indent=1))


if __name__ == "__main__":
  main()
