"""Why attention scales the logits by 1/sqrt(d_k), measured.

For q, k with independent unit-variance entries, q.k = sum_i q_i k_i is a sum of
d_k terms of variance 1, so Var(q.k) = d_k, and Var(q.k / sqrt(d_k)) = 1.
Unscaled, the logits grow with d_k and the softmax saturates: its entropy
collapses towards 0 (one key takes all the weight, and the gradients vanish).
With the scale the entropy stays put whatever d_k.

  python examples/why_sqrt_dk.py --out=why_sqrt_dk.png
"""

import argparse

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DEPTHS = (16, 32, 64, 128, 256, 512, 1024)


def logits(rng, d_k: int, T: int, S: int, scale: bool) -> jax.Array:
  """float32 [T, S]: q.k (/ sqrt(d_k)) for random q [T, d_k] and k [S, d_k]."""
  q_rng, k_rng = jax.random.split(rng)
  q = jax.random.normal(q_rng, (T, d_k))  # [T, H], unit variance
  k = jax.random.normal(k_rng, (S, d_k))  # [S, H]
  out = jnp.einsum("TH,SH->TS", q, k)
  return out / jnp.sqrt(jnp.float32(d_k)) if scale else out


def entropy(x: jax.Array) -> jax.Array:
  """Mean softmax entropy (nats) of the rows of x [T, S]."""
  p = jax.nn.softmax(x, axis=-1)
  return jnp.mean(-jnp.sum(p * jnp.log(jnp.clip(p, 1e-30)), axis=-1))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="why_sqrt_dk.png")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--queries", type=int, default=256)
  parser.add_argument("--keys", type=int, default=256)
  args = parser.parse_args()
  rng = jax.random.key(args.seed)
  rows = []
  print(f"{'d_k':>5} {'Var(q.k)':>10} {'Var/d_k':>8} {'Var scaled':>10} "
        f"{'H unscaled':>10} {'H scaled':>9}  (uniform: {np.log(args.keys):.2f} nats)")
  for d_k in DEPTHS:
    raw = logits(rng, d_k, args.queries, args.keys, scale=False)
    scaled = logits(rng, d_k, args.queries, args.keys, scale=True)
    row = (d_k, float(jnp.var(raw)), float(jnp.var(scaled)), float(entropy(raw)),
           float(entropy(scaled)))
    rows.append(row)
    print(f"{d_k:>5} {row[1]:>10.1f} {row[1] / d_k:>8.3f} {row[2]:>10.3f} "
          f"{row[3]:>10.3f} {row[4]:>9.3f}")
  d, var, var_scaled, h_raw, h_scaled = map(np.array, zip(*rows))

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  left.loglog(d, var, "o-", label="Var(q.k)")
  left.loglog(d, var_scaled, "s-", label="Var(q.k / sqrt(d_k))")
  left.loglog(d, d, "k--", alpha=0.4, label="d_k")
  left.set_xlabel("d_k")
  left.set_ylabel("variance of the logits")
  left.legend()
  right.semilogx(d, h_raw, "o-", label="softmax(q.k)")
  right.semilogx(d, h_scaled, "s-", label="softmax(q.k / sqrt(d_k))")
  right.axhline(np.log(args.keys), color="k", ls="--", alpha=0.4, label="uniform, log S")
  right.set_xlabel("d_k")
  right.set_ylabel("entropy of the attention weights (nats)")
  right.legend()
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.suptitle(f"random unit-variance q, k: {args.queries} queries x {args.keys} keys")
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
