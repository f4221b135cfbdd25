"""Draws each mask mod of jattn.mods: its [T, S] grid and its block classes.

Top row: mask_mod(b=0, n=0, t, s), True (may attend) dark. Bottom row: the
classes `jattn.create_block_mask` gives each (query block, key block) pair:
empty (skipped), partial (mask_mod evaluated), full (no mask_mod called).

    python examples/mask_gallery.py --out docs/images/mask_gallery.png
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402

L, BLOCK = 64, 8  # T = S = L, blocks of BLOCK x BLOCK
IDS = jnp.repeat(jnp.arange(4), jnp.array([10, 22, 12, 20]), total_repeat_length=L)[None]

GALLERY = {
    "causal()": mods.causal(),
    "sliding_window(12)": mods.and_masks(mods.causal(), mods.sliding_window(12)),
    "chunked(16) & causal": mods.and_masks(mods.causal(), mods.chunked(16)),
    "prefix_lm([20])": mods.prefix_lm(jnp.array([20])),
    "document(ids)": mods.document(IDS, IDS),
    "document & causal": mods.and_masks(mods.causal(), mods.document(IDS, IDS)),
}


def dense(mask_mod):
  """bool [T, S] of mask_mod at b = n = 0: the entry function under two vmaps."""
  t, s = jnp.arange(L), jnp.arange(L)
  row = jax.vmap(lambda t, s: mask_mod(0, 0, t, s), in_axes=(None, 0))
  return jax.vmap(row, in_axes=(0, None))(t, s)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("docs/images/mask_gallery.png"))
  args = parser.parse_args()
  fig, axes = plt.subplots(2, len(GALLERY), figsize=(2.2 * len(GALLERY), 4.6))
  classes_cmap = ListedColormap(["#f2f2f2", "#f4a259", "#3d5a80"])  # empty, partial, full
  for col, (name, mask_mod) in enumerate(GALLERY.items()):
    block_mask = jattn.create_block_mask(mask_mod, None, None, L, L,
                                         block_sizes=jattn.BlockSizes(BLOCK, BLOCK))
    axes[0, col].imshow(dense(mask_mod), cmap="Greys", vmin=0, vmax=1)
    axes[0, col].set_title(name, fontsize=8)
    axes[1, col].imshow(block_mask.classes[0, 0], cmap=classes_cmap, vmin=0, vmax=2)
    empty = float(block_mask.sparsity())
    axes[1, col].set_title(f"{empty:.0%} of blocks skipped", fontsize=8)
    for ax in axes[:, col]:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[0, 0].set_ylabel("mask  (t down, s across)", fontsize=8)
  axes[1, 0].set_ylabel("blocks: empty / partial / full", fontsize=8)
  fig.tight_layout()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
