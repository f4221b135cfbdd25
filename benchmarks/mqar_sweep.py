"""Sweep of attention-only MQAR recipes: held-out accuracy vs step, one run at a time.

Every recipe is the default task (configs/mqar.py: V = 512, T = 256, 32 pairs)
without the previous-token embedding, with some fields overridden. Each run
trains up to --max-steps (its learning-rate schedule spans the recipe's own
num_steps), evaluates on held-out examples every --eval-every steps, and stops
early once held-out accuracy reaches --target, or when it is still below
--cut-accuracy at --cut-step (a run that is clearly failing). Written to --out:
a JSON of every run (curve, steps to target, wall time, load average, CPU) after
each run, and a plot of held-out accuracy vs step per recipe.

  python benchmarks/mqar_sweep.py --recipes rope_lr3e-3 rope_lr1e-3 --out benchmarks/results/mqar_sweep
  python benchmarks/mqar_sweep.py --list
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import mqar_data  # noqa: E402
import training  # noqa: E402
from configs import mqar  # noqa: E402

_CURRICULUM = dict(curriculum=((3000, 64, 8, 1.0),), embed_init_std=1.0, learning_rate=1e-3,
                   lr_schedule="constant", warmup_steps=1, weight_decay=0.0, grad_clip=1e9)

# name -> overrides of configs/mqar.py (previous_token_embedding is always False)
RECIPES = {
    "rope_F64_N2_lr3e-3": dict(),
    "rope_F64_N2_lr1e-3": dict(learning_rate=1e-3),
    "rope_F64_N2_lr1e-2": dict(learning_rate=1e-2),
    "rope_F64_N4_lr3e-3": dict(num_heads=4),
    "rope_F128_N2_lr3e-3": dict(features=128, mlp_features=256),
    "rope_F128_N4_lr1e-3": dict(features=128, num_heads=4, mlp_features=256, learning_rate=1e-3),
    "rope_F128_N4_lr3e-3": dict(features=128, num_heads=4, mlp_features=256),
    "rope_F64_N2_L3_lr3e-3": dict(num_layers=3),
    "rope_F64_N2_B32_lr3e-3": dict(batch_size=32),
    "rope_F64_N2_wu500_lr3e-3": dict(warmup_steps=500),
    "rope_F64_N2_wd0_lr3e-3": dict(weight_decay=0.0),
    "learned_F64_N2_lr3e-3": dict(position_encoding="learned"),
    # layer 0 a causal window of w keys back, layer 1 global: the previous-token head
    # must still be learned, among w + 1 keys instead of all of them
    "rope_local8_global_lr3e-3": dict(attention_pattern=(8, None)),
    "rope_local1_global_lr3e-3": dict(attention_pattern=(1, None)),
    "rope_local32_global_lr3e-3": dict(attention_pattern=(32, None)),
    "rope_local1_global_lr1e-2": dict(attention_pattern=(1, None), learning_rate=1e-2),
    "rope_F64_N4_lr1e-2": dict(num_heads=4, learning_rate=1e-2),
    "rope_F64_N4_L3_lr3e-3": dict(num_heads=4, num_layers=3),
    # token embeddings initialised with std 1 instead of the Transformer's 0.02, so the
    # token's own identity is not drowned by the first layer's output (a hypothesis)
    "rope_F64_N2_embed1_lr3e-3": dict(_embed_std=1.0),
    "rope_local1_global_embed1_lr3e-3": dict(attention_pattern=(1, None), _embed_std=1.0),
    # no position encoding (NoPE): the global layer matches a query against the keys
    # with all H dimensions of q and k (rotary leaves only its slowest pairs for that
    # across 256 positions); positions come from the causal mask and the window alone
    "nope_local1_global_lr3e-3": dict(position_encoding="none", attention_pattern=(1, None)),
    # the short task (T = 64, 8 pairs): does attention alone learn it at all here?
    "short_nope_local1_global_lr3e-3": dict(position_encoding="none", attention_pattern=(1, None),
                                            seq_len=64, num_kv_pairs=8),
    "short_rope_F64_N2_lr3e-3": dict(seq_len=64, num_kv_pairs=8),
    # The recipe of configs/mqar_attention_only.py and one change each. A short task
    # (T = 64, 8 pairs) with a query at every position after the pairs for 3000 steps,
    # then the task itself; constant rate, no decay or clipping, embeddings std 1.
    "curriculum_e1_const": dict(_CURRICULUM),
    "curriculum_e1_cosine": dict(_CURRICULUM, lr_schedule="cosine"),
    "curriculum_e0.02_const": dict(_CURRICULUM, embed_init_std=0.02),
    "curriculum_sparse_e1_const": dict(_CURRICULUM, curriculum=((3000, 64, 8, None),)),
    "no_curriculum_e1_const": dict(_CURRICULUM, curriculum=()),
    # the curriculum's first phase as a task of its own (held-out: T = 64, 8 pairs)
    "short_dense_e1_const": dict(_CURRICULUM, curriculum=(), seq_len=64, num_kv_pairs=8,
                                 train_query_fraction=1.0),
    "short_sparse_e1_const": dict(_CURRICULUM, curriculum=(), seq_len=64, num_kv_pairs=8),
    "short_dense_e0.02_const": dict(_CURRICULUM, curriculum=(), seq_len=64, num_kv_pairs=8,
                                    train_query_fraction=1.0, embed_init_std=0.02),
    # every block's attention and MLP output projections scaled by 0.1 at init: the
    # residual stream starts as the embeddings (another hypothesis)
    "rope_F64_N4_out0.1_lr3e-3": dict(num_heads=4, _out_scale=0.1),
    "rope_local1_global_out0.1_lr3e-3": dict(attention_pattern=(1, None), _out_scale=0.1),
}


def cpu_model() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def has_avx512f() -> bool:
  try:
    return " avx512f " in open("/proc/cpuinfo").read().replace("\n", " ")
  except OSError:
    return False


def recipe_config(name: str, num_steps: int):
  config = mqar.get_config()
  config.previous_token_embedding = False
  config.num_steps = num_steps
  for field, value in RECIPES[name].items():
    if not field.startswith("_"):  # "_" fields act on the parameters (see run)
      config[field] = value
  return config


def run(name, args):
  config = recipe_config(name, args.num_steps)
  training.check_config(config)
  graphdef, tx, state = training.create_state(config)
  if "_embed_std" in RECIPES[name]:  # re-draw the token embeddings, std 0.02 -> _embed_std
    embedding = state["params"]["token_embed"]["embedding"]
    embedding[...] = embedding[...] * (RECIPES[name]["_embed_std"] / 0.02)
  if "_out_scale" in RECIPES[name]:  # the blocks' output projections times _out_scale
    for block in state["params"]["blocks"].values():
      for param in (block["attention"]["out"]["kernel"], block["mlp"]["w_out"]):
        param[...] = param[...] * RECIPES[name]["_out_scale"]
  if any(field.startswith("_") for field in RECIPES[name]):
    state["opt_state"] = tx.init(state["params"])
  train_step = jax.jit(training.make_train_step(graphdef, tx), donate_argnums=0)
  eval_step = jax.jit(training.make_eval_step(graphdef))
  config.eval_examples = args.eval_examples
  held_out = {k: jax.device_put(v) for k, v in mqar_data.held_out(config).items()}

  def evaluate(params):
    n = args.eval_examples // config.batch_size * config.batch_size
    accs = [eval_step(params, {k: v[i:i + config.batch_size] for k, v in held_out.items()})[1]
            for i in range(0, n, config.batch_size)]
    return float(np.mean(accs))

  load_start, start = os.getloadavg(), time.perf_counter()
  curve, steps_to_target, stopped = [], None, "max_steps"
  bar = tqdm(range(1, min(args.max_steps, config.num_steps) + 1), desc=name,
             dynamic_ncols=True)
  for step in bar:
    state, metrics = train_step(state, mqar_data.train_batch(config, step - 1))
    if step % args.eval_every == 0:
      acc = evaluate(state["params"])
      curve.append({"step": step, "held_out_accuracy": acc, "train_loss": float(metrics["loss"]),
                    "seconds": time.perf_counter() - start})
      bar.set_postfix(acc=f"{acc:.3f}", loss=f"{float(metrics['loss']):.3f}")
      if acc >= args.target:
        steps_to_target, stopped = step, "target"
        break
      if step >= args.cut_step and acc < args.cut_accuracy:
        stopped = f"cut: below {args.cut_accuracy} at step {step}"
        break
  bar.close()
  seconds = time.perf_counter() - start
  return {"recipe": name, "overrides": RECIPES[name], "num_steps_schedule": config.num_steps,
          "steps_to_target": steps_to_target, "target": args.target,
          "final_step": curve[-1]["step"] if curve else 0,
          "final_held_out_accuracy": curve[-1]["held_out_accuracy"] if curve else None,
          "stopped": stopped, "wall_seconds": seconds,
          "load_average_start": load_start, "load_average_end": os.getloadavg(),
          "eval_examples": args.eval_examples, "curve": curve}


def plot(results, path):
  """Held-out accuracy (left) and the training loss of the step evaluated (right) vs step."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (acc, loss) = plt.subplots(1, 2, figsize=(12, 5))
  for i, r in enumerate(results):
    steps = [p["step"] for p in r["curve"]]
    style = dict(marker=".", label=r["recipe"], color=plt.cm.tab20(i % 20),
                 linestyle=("-", "--")[i // 10 % 2])  # 20 colours, then dashed
    acc.plot(steps, [p["held_out_accuracy"] for p in r["curve"]], **style)
    loss.plot(steps, [p["train_loss"] for p in r["curve"]], **style)
  acc.axhline(0.99, color="gray", linestyle="--", linewidth=0.8)
  acc.set_ylabel("held-out accuracy")
  loss.axhline(np.log(32), color="gray", linestyle=":", linewidth=0.8)  # uniform over the 32 values in context
  loss.set_ylabel("training loss (dotted: ln 32)")
  for ax in (acc, loss):
    ax.set_xlabel("training step")
  loss.legend(fontsize=7)
  fig.suptitle("MQAR (V=512, T=256, 32 pairs; short_ recipes: T=64, 8 pairs), attention only")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def table(results, machine) -> str:
  cpu = f"{machine['cpu']}, {machine['cores']} cores{', AVX-512' if machine['avx512f'] else ''}"
  lines = ["| recipe | overrides of configs/mqar.py (no previous-token embedding) | steps to "
           "99% | last held-out accuracy | training loss there | wall time | load average "
           "start / end | stopped |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    overrides = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(none)"
    lines.append(
        f"| `{r['recipe']}` | {overrides} | {r['steps_to_target'] or 'not reached'} | "
        f"{100 * r['final_held_out_accuracy']:.1f}% at {r['final_step']} | "
        f"{r['curve'][-1]['train_loss']:.2f} | {r['wall_seconds']:.0f} s | "
        f"{r['load_average_start'][0]:.1f} / {r['load_average_end'][0]:.1f} | {r['stopped']} |")
  return "\n".join(lines) + f"\n\nCPU: {cpu}; wall time includes compilation and evaluations."


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
  parser.add_argument("--list", action="store_true", help="print the recipes and exit")
  parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
  parser.add_argument("--table", action="store_true", help="print the JSON as a Markdown table")
  parser.add_argument("--out", default="benchmarks/results/mqar_sweep")
  parser.add_argument("--num-steps", type=int, default=3000, help="schedule length")
  parser.add_argument("--max-steps", type=int, default=1500, help="steps actually run")
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--eval-examples", type=int, default=256)
  parser.add_argument("--target", type=float, default=0.99)
  parser.add_argument("--cut-step", type=int, default=10**9)
  parser.add_argument("--cut-accuracy", type=float, default=0.0)
  args = parser.parse_args()
  if args.list:
    for name, overrides in RECIPES.items():
      print(name, overrides)
    return
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "results.json"
  results = json.loads(path.read_text())["runs"] if path.exists() else []
  if args.plot_only:
    plot(results, out / "accuracy.png")
    return
  if args.table:
    print(table(results, json.loads(path.read_text())["machine"]))
    return
  machine = {"cpu": cpu_model(), "avx512f": has_avx512f(), "cores": os.cpu_count(),
             "devices": str(jax.devices())}
  for name in args.recipes:
    results = [r for r in results if r["recipe"] != name] + [run(name, args)]
    r = results[-1]
    print(f"{name}: steps to {args.target}: {r['steps_to_target']}, final "
          f"{r['final_held_out_accuracy']} at {r['final_step']}, {r['wall_seconds']:.0f} s, "
          f"load {r['load_average_start'][0]:.1f}", flush=True)
    path.write_text(json.dumps({"machine": machine, "runs": results}, indent=1))
    plot(results, out / "accuracy.png")


if __name__ == "__main__":
  main()
