"""Ring attention with T != S on 8 simulated CPU devices: queries and keys of
different lengths (16 against 32 and the reverse) under position-dependent masks
(causal as jax.nn aligns it, kv lengths, and a hand-written mask_mod of absolute
positions, classified per block at global positions in every ring step, in the
zig-zag and the contiguous order), in the rows (BTNH) and columns (BNHT)
layouts: the output, the lse and the gradients against float64 NumPy
(tests/reference_grads.py; the lse written out here).

Run by tests/multidevice/test_ring_mods.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. One "ok  "/"FAIL" line per
case; exits non-zero on any failure. "quick" (the CI tier): the first two.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jattn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from reference_grads import reference_vjp  # noqa: E402
from reference import reference_mask  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5  # float32 against float64, relative to the largest entry (at least 1)
B, N, K, H = 2, 4, 2, 8
KV_LENGTHS = np.array([27, 11], np.int32)
EMPTY_LSE = -0.7 * float(np.finfo(np.float32).max)  # a row with no key, as jax.nn


def band(b, n, t, s):
  """Hand-written: a band along s ~ 2t, one key wider per head (absolute positions)."""
  return (s >= 2 * t - 12) & (s <= 2 * t + 3 + n)


def dense(mask_mod, T, S):
  """The mask_mod over the whole [B, N, T, S] grid, in NumPy."""
  b, n, t, s = np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S))
  return np.broadcast_to(mask_mod(b, n, t, s), (B, N, T, S))


def reference_lse(q, k, allowed):
  """float64 [B, N, T]: log sum_s exp(q . k * scale) over the allowed keys."""
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) / np.sqrt(H)
  top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  total = np.sum(np.where(allowed, np.exp(logits - top), 0.0), axis=-1)
  with np.errstate(divide="ignore"):
    return np.where(total > 0, np.log(total) + top[..., 0], EMPTY_LSE)


def case(name, mesh, T, S, *, layout, is_causal, load_balance=True, mask_mod=None, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, d_out = (rng.standard_normal(s) for s in ((B, T, N, H), (B, S, K, H),
                                                      (B, S, K, H), (B, T, N, H)))
  mask = None if mask_mod is None else dense(mask_mod, T, S)
  want = reference_vjp(q, k, v, d_out, mask=mask, is_causal=is_causal,
                       key_value_seq_lengths=KV_LENGTHS)[:4]
  allowed = reference_mask(B, N, T, S, mask=mask, is_causal=is_causal,
                           kv_lengths=KV_LENGTHS)
  want_lse = reference_lse(q, k, allowed)  # [B, N, T]
  to = lambda x: jnp.asarray(np.transpose(x, ["BTNH".index(c) for c in layout]), jnp.float32)
  back = lambda x: np.transpose(np.asarray(x, np.float64), [layout.index(c) for c in "BTNH"])

  def ring(q, k, v):
    return jattn.ring_attention(
        q, k, v, mesh=mesh, layout=layout, is_causal=is_causal, load_balance=load_balance,
        key_value_seq_lengths=jnp.asarray(KV_LENGTHS), mask_mod=mask_mod,
        block_sizes=jattn.BlockSizes(q=2, kv=3), return_residual=True)

  def values_grads_lse(q, k, v, d_out):
    out, pullback, lse = jax.vjp(ring, q, k, v, has_aux=True)
    return out, pullback(d_out), lse

  # one jitted program, forward and backward: called eagerly the ring compiles its
  # forward and backward afresh at every call (tests/multidevice/compare.py)
  out, grads, lse = jax.jit(values_grads_lse)(to(q), to(k), to(v), to(d_out))
  got = [back(x) for x in (out, *grads)]
  lse_letters = layout.replace("H", "")  # [B, N, T] in the columns layout
  lse = np.einsum(f"{lse_letters}->BNT", np.asarray(lse, np.float64))
  scale = lambda w: max(1.0, np.max(np.abs(w)))
  errors = [np.max(np.abs(g - w)) / scale(w) for g, w in zip(got, want)]
  seen = want_lse != EMPTY_LSE
  errors.append(np.max(np.abs(lse[seen] - want_lse[seen])) / scale(want_lse[seen]))
  ok = (all(e <= TOL for e in errors) and np.all(lse[~seen] == np.float32(EMPTY_LSE))
        and seen.any())
  print(f"{'ok  ' if ok else 'FAIL'} {name}: max |err| out, dq, dk, dv, lse = "
        + ", ".join(f"{e:.1e}" for e in errors)
        + f"; {np.sum(~seen)} empty rows", flush=True)
  return ok


def main():
  assert jax.device_count() == 8, jax.devices()
  seq = jax.make_mesh((4,), ("seq",))  # zig-zag: chunks of 2 queries and 4 keys (or reverse)
  cases = [  # the quick two: T < S and T > S, every mask, both layouts, both orders
      ("T=16 < S=32, causal zig-zag + kv lengths + hand-written mask_mod, columns BNHT",
       dict(T=16, S=32, layout="BNHT", is_causal=True, mask_mod=band)),
      ("T=32 > S=16, contiguous, kv lengths + hand-written mask_mod, BTNH",
       dict(T=32, S=16, layout="BTNH", is_causal=False, mask_mod=band)),
  ]
  if "quick" not in sys.argv:
    cases += [
        ("T=32 > S=16, causal zig-zag + kv lengths + hand-written mask_mod, BNTH",
         dict(T=32, S=16, layout="BNTH", is_causal=True, mask_mod=band)),
        ("T=16 < S=32, causal contiguous + hand-written mask_mod, BTNH",
         dict(T=16, S=32, layout="BTNH", is_causal=True, load_balance=False, mask_mod=band)),
        ("T=32 > S=16, causal zig-zag + kv lengths, columns BNHT",
         dict(T=32, S=16, layout="BNHT", is_causal=True)),
    ]
  ok = True
  for i, (name, kwargs) in enumerate(cases):
    ok &= case(name, seq, seed=i, **kwargs)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
