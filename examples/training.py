"""Training the jattn Transformer on MQAR: config checks, mesh, pure train step, loop.

`train_and_evaluate(config, workdir)` trains over every device on a
("data", "model", "seq") mesh (config.mesh: batch, heads, sequence),
resumes from the latest orbax checkpoint in `workdir`, and writes there
metrics.jsonl, checkpoints/ and the PNG plots.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import mqar_data
import plots
from jattn import sharding
from jattn.transformer import POSITION_ENCODINGS, Transformer, TransformerConfig

LAYOUTS = ("rows", "columns")
LR_SCHEDULES = ("cosine", "constant")


def check_config(config) -> None:
  """Raises ValueError naming the first bad field; runs before anything is written."""
  def positive(*names):
    for name in names:
      value = config[name]
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.{name} must be a positive int, got {value!r}")
  positive("num_steps", "batch_size", "vocab_size", "seq_len", "num_kv_pairs",
           "num_layers", "features", "num_heads", "mlp_features", "log_every",
           "eval_every", "eval_examples", "checkpoint_every")
  if config.features % config.num_heads:
    raise ValueError(f"config.num_heads ({config.num_heads}) must divide "
                     f"config.features ({config.features})")
  if config.num_kv_heads is not None:
    positive("num_kv_heads")
    if config.num_heads % config.num_kv_heads:
      raise ValueError(f"config.num_kv_heads ({config.num_kv_heads}) must divide "
                       f"config.num_heads ({config.num_heads})")
  if config.layout not in LAYOUTS:
    raise ValueError(f"config.layout must be one of {LAYOUTS}, got {config.layout!r}")
  if config.position_encoding not in POSITION_ENCODINGS:
    raise ValueError(f"config.position_encoding must be one of {POSITION_ENCODINGS}, "
                     f"got {config.position_encoding!r}")
  if (config.position_encoding == "rope"
      and (config.features // config.num_heads) % 2):
    raise ValueError(f"config.position_encoding 'rope' needs an even depth per head, "
                     f"config.features // config.num_heads, got "
                     f"{config.features // config.num_heads}")
  if config.seq_len < 3 * config.num_kv_pairs:
    raise ValueError(f"config.seq_len ({config.seq_len}) must be at least 3 * "
                     f"config.num_kv_pairs ({config.num_kv_pairs}): the pairs, then "
                     "a place for each query")
  if config.vocab_size // 2 - 1 < config.num_kv_pairs:
    raise ValueError(f"config.vocab_size ({config.vocab_size}) is too small for "
                     f"config.num_kv_pairs ({config.num_kv_pairs}) distinct keys")
  if not all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0)
             for w in config.attention_pattern):
    raise ValueError(f"config.attention_pattern entries must be None or a positive int, "
                     f"got {tuple(config.attention_pattern)!r}")
  if config.logit_soft_cap is not None and not config.logit_soft_cap > 0:
    raise ValueError(f"config.logit_soft_cap must be None or positive, got "
                     f"{config.logit_soft_cap!r}")
  check_mesh(config)
  if config.lr_schedule not in LR_SCHEDULES:
    raise ValueError(f"config.lr_schedule must be one of {LR_SCHEDULES}, got "
                     f"{config.lr_schedule!r}")
  if not config.embed_init_std > 0:
    raise ValueError(f"config.embed_init_std must be positive, got {config.embed_init_std!r}")
  fraction = config.train_query_fraction
  if fraction is not None and not 0 < fraction <= 1:
    raise ValueError(f"config.train_query_fraction must be None or in (0, 1], got {fraction!r}")
  for phase in config.curriculum:
    ok = len(phase) == 4 and all(isinstance(n, int) and n > 0 for n in phase[:3])
    if ok:
      steps, seq_len, num_kv_pairs, fraction = phase
      ok = (seq_len >= 3 * num_kv_pairs and config.vocab_size // 2 - 1 >= num_kv_pairs
            and (fraction is None or 0 < fraction <= 1))
    if not ok:
      raise ValueError(f"config.curriculum entries must be (steps, seq_len, num_kv_pairs, "
                       f"query_fraction): positive ints with seq_len >= 3 * num_kv_pairs "
                       f"and num_kv_pairs < vocab_size / 2, and None or a fraction in "
                       f"(0, 1], got {tuple(phase)!r}")
    if config.position_encoding == "learned" and seq_len > config.seq_len:
      raise ValueError(f"config.curriculum: seq_len {seq_len} is longer than "
                       f"config.seq_len ({config.seq_len}), the learned positions' table")
  if not config.learning_rate > 0:
    raise ValueError(f"config.learning_rate must be positive, got {config.learning_rate!r}")
  if config.warmup_steps < 0 or config.warmup_steps >= config.num_steps:
    raise ValueError(f"config.warmup_steps must be in [0, config.num_steps), got "
                     f"{config.warmup_steps!r}")


# Auto axes: shardings of intermediates are left to the compiler (GSPMD); Explicit axes:
# every array's sharding is part of its type, and the model says it where jax cannot
# infer it (docs/scaling.md)
_AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def mesh_shape(config) -> tuple[int, int, int]:
  """(data, model, seq) device counts, with data = -1 resolved to what is left."""
  model, seq = config.mesh.model, config.mesh.seq
  data = jax.device_count() // (model * seq) if config.mesh.data == -1 else config.mesh.data
  return data, model, seq


def check_mesh(config) -> None:
  for axis in ("model", "seq"):
    value = config.mesh[axis]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"config.mesh.{axis} must be a positive int, got {value!r}")
  if config.mesh.data != -1 and (not isinstance(config.mesh.data, int)
                                 or config.mesh.data <= 0):
    raise ValueError(f"config.mesh.data must be -1 or a positive int, got "
                     f"{config.mesh.data!r}")
  if config.mesh.axis_types not in _AXIS_TYPES:
    raise ValueError(f"config.mesh.axis_types must be one of {sorted(_AXIS_TYPES)}, got "
                     f"{config.mesh.axis_types!r}")
  data, model, seq = mesh_shape(config)
  devices = jax.device_count()
  if data * model * seq != devices:
    raise ValueError(f"config.mesh data x model x seq = {config.mesh.data} x {model} x "
                     f"{seq} must use all {devices} devices")
  if config.batch_size % data:
    raise ValueError(f"config.batch_size ({config.batch_size}) must be divisible by "
                     f"the {data} devices of config.mesh.data")
  heads = [("num_heads", config.num_heads), ("mlp_features", config.mlp_features)]
  if config.num_kv_heads is not None:
    heads.append(("num_kv_heads", config.num_kv_heads))
  for name, value in heads:
    if value % model:
      raise ValueError(f"config.{name} ({value}) must be divisible by the {model} "
                       f"devices of config.mesh.model")
  if seq > 1:
    if config.seq_len % (2 * seq):
      raise ValueError(f"config.seq_len ({config.seq_len}) must be divisible by 2 x "
                       f"config.mesh.seq = {2 * seq} (two causal chunks per device)")
    if config.implementation not in (None, "ring", "context_parallel"):
      raise ValueError(f"config.mesh.seq = {seq} shards attention over the sequence: "
                       f"config.implementation must be None, 'ring' or "
                       f"'context_parallel', got "
                       f"{config.implementation!r}")


def make_mesh(config) -> jax.sharding.Mesh:
  """The ("data", "model", "seq") mesh of config.mesh over every device."""
  return jax.make_mesh(mesh_shape(config), sharding.MESH_AXES,
                       axis_types=(_AXIS_TYPES[config.mesh.axis_types],) * 3)


def model_config(config, *, for_weights: bool = False) -> TransformerConfig:
  """The Transformer of `config`; for_weights: one whose attention forms the
  weights (for plots): implementation None (it picks one that forms them), where
  training would run a ring or a config names one that never does ("blockwise")."""
  # seq > 1: the sequence sharded over "seq", the strategy chosen per call unless "ring"
  parallel = config.mesh.seq > 1 and not for_weights
  return TransformerConfig(
      vocab_size=config.vocab_size, max_len=config.seq_len,
      num_layers=config.num_layers, features=config.features,
      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
      mlp_features=config.mlp_features, layout=config.layout,
      implementation=None if for_weights else (
          config.implementation or "context_parallel") if parallel else config.implementation,
      position_encoding=config.position_encoding,
      previous_token_embedding=config.previous_token_embedding,
      embed_init_std=config.embed_init_std,
      attention_pattern=tuple(config.attention_pattern),
      logit_soft_cap=config.logit_soft_cap, sinks=config.sinks)


def make_optimizer(config) -> optax.GradientTransformation:
  if config.lr_schedule == "constant" and config.warmup_steps == 0:
    # optax's linear (and warmup_constant) schedule with 0 transition steps stays at
    # its initial value, 0: no step would ever move
    schedule = optax.constant_schedule(config.learning_rate)
  elif config.lr_schedule == "constant":
    schedule = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
  else:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.num_steps, end_value=0.01 * config.learning_rate)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=config.weight_decay))


def create_state(config, attention=None):
  """(graphdef, optimizer, state): state = {"step", "params", "opt_state"}, a pytree."""
  kwargs = {} if attention is None else {"attention": attention}
  model = Transformer(model_config(config), rngs=nnx.Rngs(config.seed), **kwargs)
  graphdef, params = nnx.split(model, nnx.Param)
  tx = make_optimizer(config)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
  return graphdef, tx, state


def loss_and_accuracy(model, batch):
  """Mean cross-entropy and accuracy at the answer positions only (the LM head
  runs on those P positions, not on all T)."""
  hidden = model.take(model.hidden(batch["tokens"]), batch["positions"])
  logits = model.logits(hidden)  # [B, P, V]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["answers"])  # [B, P]
  correct = (jnp.argmax(logits, axis=-1) == batch["answers"]).astype(jnp.float32)
  return jnp.mean(ce), jnp.mean(correct)


def make_train_step(graphdef, tx):
  """A pure train_step(state, batch) -> (state, metrics)."""
  def train_step(state, batch):
    def loss_fn(params):
      return loss_and_accuracy(nnx.merge(graphdef, params), batch)
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 counts
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    return new_state, {"loss": loss, "accuracy": accuracy,
                       "grad_norm": optax.tree.norm(grads)}
  return train_step


def make_eval_step(graphdef):
  def eval_step(params, batch):
    return loss_and_accuracy(nnx.merge(graphdef, params), batch)
  return eval_step


def evaluate(eval_step, params, examples, batch_size, batch_sharding) -> dict[str, float]:
  n = len(examples["tokens"]) // batch_size * batch_size
  losses, accs = [], []
  for i in range(0, n, batch_size):
    batch = put_global({k: v[i:i + batch_size] for k, v in examples.items()},
                       batch_sharding)
    loss, acc = eval_step(params, batch)
    losses.append(float(loss))
    accs.append(float(acc))
  return {"loss": float(np.mean(losses)), "accuracy": float(np.mean(accs))}


def put_global(tree, shardings):
  """Places values that every process computes alike (batches are a function of
  (seed, step), parameters of the seed) on the mesh. Each process fills only its
  own devices, so this works across hosts as well as on one."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)


class MetricsLog:
  """metrics.jsonl: one JSON object per line, {"step", "split", ...}."""

  def __init__(self, path: pathlib.Path, resume_step: int):
    self.path = path
    kept = []
    if jax.process_index() != 0:
      return
    if path.exists():  # lines past the checkpoint were from a run that did not finish
      kept = [l for l in path.read_text().splitlines() if json.loads(l)["step"] <= resume_step]
    path.write_text("".join(l + "\n" for l in kept))

  def write(self, step: int, split: str, values: dict[str, Any]) -> None:
    if jax.process_index() != 0:  # one writer when training across hosts
      return
    with self.path.open("a") as f:
      f.write(json.dumps({"step": step, "split": split, **values}) + "\n")


def train_and_evaluate(config, workdir, *, stop_after: int | None = None) -> dict:
  """Trains (or resumes) and returns the final state; stop_after: stop after that
  step without a final checkpoint, as if killed (for tests)."""
  check_config(config)
  workdir = pathlib.Path(workdir).resolve()
  mesh = make_mesh(config)
  with jax.set_mesh(mesh):  # the context mesh of implementation="context_parallel"
    return _train(config, workdir, mesh, stop_after)


def _train(config, workdir, mesh, stop_after):
  graphdef, tx, state = create_state(config)
  state_sharding = sharding.state_shardings(state, mesh)  # heads over "model"
  batch_sharding = sharding.batch_shardings(mqar_data.train_batch(config, 0), mesh)
  state = put_global(state, state_sharding)
  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True))
  start = manager.latest_step() or 0
  if start:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
  log = MetricsLog(workdir / "metrics.jsonl", start)

  train_step = jax.jit(make_train_step(graphdef, tx), donate_argnums=0,
                       in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, NamedSharding(mesh, P())))
  eval_step = jax.jit(make_eval_step(graphdef))
  held_out = mqar_data.held_out(config)
  last = config.num_steps if stop_after is None else min(stop_after, config.num_steps)

  bar = tqdm(range(start + 1, last + 1), initial=start, total=config.num_steps,
             desc="train", dynamic_ncols=True, disable=jax.process_index() != 0)
  tick, tick_step, running = time.perf_counter(), start, []
  for step in bar:
    batch = put_global(mqar_data.train_batch(config, step - 1), batch_sharding)
    state, metrics = train_step(state, batch)
    running.append(metrics)
    if step % config.log_every == 0 or step == last:
      values = {k: float(np.mean([m[k] for m in running])) for k in running[0]}
      now = time.perf_counter()
      values["steps_per_second"] = (step - tick_step) / (now - tick)
      tick, tick_step, running = now, step, []
      log.write(step, "train", values)
      bar.set_postfix(loss=f"{values['loss']:.3f}", acc=f"{values['accuracy']:.3f}",
                      steps_per_s=f"{values['steps_per_second']:.1f}")
    if step % config.eval_every == 0 or step == config.num_steps:
      log.write(step, "held_out", evaluate(eval_step, state["params"], held_out,
                                           config.batch_size, batch_sharding))
    if step % config.checkpoint_every == 0 or step == config.num_steps:
      manager.save(step, args=ocp.args.StandardSave(state))
  bar.close()
  manager.wait_until_finished()
  manager.close()
  if last == config.num_steps and jax.process_index() == 0:
    plotting = model_config(config, for_weights=True)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(plotting, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, state["params"])
    plots.write_all(workdir, log.path, model,
                    {k: v[:1] for k, v in held_out.items()})
  return state
