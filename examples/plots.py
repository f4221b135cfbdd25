"""PNG plots of a training run: loss and accuracy curves, attention weights per head."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402


def _curves(lines, split, field):
  rows = [l for l in lines if l["split"] == split]
  return [l["step"] for l in rows], [l[field] for l in rows]


def curve(path: pathlib.Path, lines, field: str, ylabel: str, log_y: bool = False) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  for split, style in (("train", "-"), ("held_out", "o-")):
    steps, values = _curves(lines, split, field)
    ax.plot(steps, values, style, label=split.replace("_", "-"))
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  if log_y:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def attention(path: pathlib.Path, model, example) -> None:
  """The weights [T, S] of every head of every layer on one held-out example."""
  forward = nnx.capture(lambda m, tokens: m(tokens, sow_weights=True), nnx.Intermediate)
  _, sown = forward(model, example["tokens"])
  layers = [np.asarray(block["attention"]["attention_weights"][0][0])  # [N, T, S]
            for block in nnx.to_pure_dict(sown)["blocks"].values()]
  L, N = len(layers), layers[0].shape[0]
  fig, axes = plt.subplots(L, N, figsize=(3 * N, 3 * L), squeeze=False)
  for layer, weights in enumerate(layers):
    for head in range(N):
      ax = axes[layer, head]
      ax.imshow(weights[head], cmap="viridis", vmin=0.0, vmax=1.0)
      ax.set_title(f"layer {layer} head {head}", fontsize=9)
      ax.set_xlabel("key position S", fontsize=8)
      ax.set_ylabel("query position T", fontsize=8)
      ax.tick_params(labelsize=6)
  fig.suptitle("attention weights on one held-out example")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_all(workdir: pathlib.Path, metrics_path: pathlib.Path, model, example) -> None:
  lines = [json.loads(l) for l in metrics_path.read_text().splitlines()]
  curve(workdir / "loss.png", lines, "loss", "cross-entropy at answer positions", log_y=True)
  curve(workdir / "accuracy.png", lines, "accuracy", "accuracy at answer positions")
  attention(workdir / "attention.png", model, example)
