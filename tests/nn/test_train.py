"""The training example on the tiny config: outputs, resume equality, bad configs, 8 devices."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.compile_flags import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import mqar_data  # noqa: E402
import training  # noqa: E402
from configs import tiny  # noqa: E402


# the example's smoke tests: on one CI leg (the library's own tests run on both)
pytestmark = pytest.mark.training


def _params(state):
  return jax.tree.leaves(jax.tree.map(np.asarray, state["params"]))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """The tiny config trained 6 steps without stopping."""
  workdir = tmp_path_factory.mktemp("straight")
  return workdir, training.train_and_evaluate(tiny.get_config(), workdir)


def test_writes_metrics_checkpoints_and_plots(straight_run):
  workdir, _ = straight_run
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [l for l in lines if l["split"] == "train"]
  assert [l["step"] for l in train] == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(l["loss"]) and 0 <= l["accuracy"] <= 1 for l in train)
  assert [l["step"] for l in lines if l["split"] == "held_out"] == [3, 6]
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                if p.name.isdigit()) == [2, 4, 6]
  for png in ("loss.png", "accuracy.png", "attention.png"):
    assert (workdir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_killed_and_resumed_run_ends_with_identical_parameters(straight_run, tmp_path):
  _, straight = straight_run
  config = tiny.get_config()
  # killed after step 5: the last checkpoint is step 4, so step 5 is trained again
  stopped = training.train_and_evaluate(config, tmp_path, stop_after=5)
  assert not (tmp_path / "checkpoints" / "5").exists()
  resumed = training.train_and_evaluate(config, tmp_path)
  assert int(resumed["step"]) == 6
  for a, b in zip(_params(straight), _params(resumed)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(_params(stopped), _params(resumed)))
  steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if json.loads(l)["split"] == "train"]
  assert steps == [1, 2, 3, 4, 5, 6]  # the replayed step 5 is logged once


def test_data_is_a_function_of_seed_and_step_and_answers_are_recallable():
  config = tiny.get_config()
  a, b = mqar_data.train_batch(config, 3), mqar_data.train_batch(config, 3)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["tokens"], mqar_data.train_batch(config, 4)["tokens"])
  P = config.num_kv_pairs
  for tokens, positions, answers in zip(a["tokens"], a["positions"], a["answers"]):
    pairs = dict(zip(tokens[0:2 * P:2], tokens[1:2 * P:2]))
    assert len(pairs) == P  # distinct keys
    assert len(set(positions)) == P and positions.min() >= 2 * P
    assert dict(zip(tokens[positions], answers)) == pairs  # each key queried once
    rest = np.delete(tokens[2 * P:], positions - 2 * P)
    assert (rest == mqar_data.FILLER).all() and mqar_data.FILLER not in pairs


def test_attention_plot_of_a_blockwise_config(tmp_path):
  """The end-of-run plot sows the weights, which implementation="blockwise" never
  forms: the plotting model must not take the config's implementation."""
  import plots
  from flax import nnx
  from jattn.transformer import Transformer
  config = tiny.get_config()
  config.implementation = "blockwise"
  model = Transformer(training.model_config(config, for_weights=True), rngs=nnx.Rngs(0))
  plots.attention(tmp_path / "attention.png", model, mqar_data.held_out(config))
  assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_recallable(tokens, positions, answers, P, every_key_once):
  """Independent of mqar_data: the pairs from the first 2P tokens, each query a key
  of them answered by its value, every other token after the pairs the filler."""
  pairs = dict(zip(tokens[0:2 * P:2], tokens[1:2 * P:2]))
  assert len(pairs) == P and mqar_data.FILLER not in pairs  # distinct keys
  assert len(set(positions)) == len(positions) and positions.min() >= 2 * P
  assert [pairs[k] for k in tokens[positions]] == list(answers)
  if every_key_once:
    assert sorted(tokens[positions]) == sorted(pairs)
  rest = np.delete(tokens[2 * P:], positions - 2 * P)
  assert (rest == mqar_data.FILLER).all()


def test_curriculum_and_query_fraction_shape_training_batches_only():
  config = tiny.get_config()  # T = 16, P = 4
  held_out = mqar_data.held_out(config)
  config.train_query_fraction = 0.5
  config.curriculum = ((2, 8, 2, 1.0), (1, 12, 3, None))
  for step, (T, P, Q) in enumerate([(8, 2, 4), (8, 2, 4), (12, 3, 3), (16, 4, 4), (16, 4, 4)]):
    batch = mqar_data.train_batch(config, step)
    assert batch["tokens"].shape == (8, T) and batch["positions"].shape == (8, Q), step
    for tokens, positions, answers in zip(batch["tokens"], batch["positions"], batch["answers"]):
      _check_recallable(tokens, positions, answers, P, every_key_once=(step == 2))
  config.seq_len, config.num_kv_pairs = 40, 4  # 32 places after the pairs: 16 queries
  assert mqar_data.train_batch(config, 5)["positions"].shape == (8, 16)
  # a key may be asked twice at fraction 0.5 (16 queries, 4 keys)
  assert len(set(mqar_data.train_batch(config, 5)["tokens"][0, 8:]) - {0}) <= 4
  for k, v in mqar_data.held_out(tiny.get_config()).items():
    np.testing.assert_array_equal(v, held_out[k])  # held-out examples never change


def test_constant_schedule_keeps_the_peak_learning_rate():
  """With a constant gradient, an Adam step is -lr * (1 - tiny) at every step (bias-
  corrected moments are both the gradient's): so the last update reads the rate."""
  config = tiny.get_config()
  config.num_steps, config.warmup_steps, config.weight_decay = 10, 2, 0.0
  last = {}
  for schedule in ("constant", "cosine"):
    config.lr_schedule = schedule
    tx = training.make_optimizer(config)
    params = {"w": np.zeros(3, np.float32)}
    state = tx.init(params)
    for _ in range(10):
      with jax.numpy_dtype_promotion("standard"):  # as make_train_step: optax's int counts
        updates, state = tx.update({"w": np.full(3, 0.5, np.float32)}, state, params)
    last[schedule] = -float(updates["w"][0])
  np.testing.assert_allclose(last["constant"], config.learning_rate, rtol=1e-4)
  assert last["cosine"] < 0.1 * config.learning_rate  # decayed near its end
  # without warm-up the first step already takes the full rate
  config.lr_schedule, config.warmup_steps = "constant", 0
  tx = training.make_optimizer(config)
  params = {"w": np.zeros(3, np.float32)}
  with jax.numpy_dtype_promotion("standard"):
    updates, _ = tx.update({"w": np.full(3, 0.5, np.float32)}, tx.init(params), params)
  np.testing.assert_allclose(-float(updates["w"][0]), config.learning_rate, rtol=1e-4)


@pytest.mark.parametrize("field, value, message", [
    ("num_steps", 0, "config.num_steps must be a positive int"),
    ("batch_size", -4, "config.batch_size must be a positive int"),
    ("num_heads", 3, r"config.num_heads \(3\) must divide config.features \(16\)"),
    ("layout", "diagonal", "config.layout must be one of"),
    ("position_encoding", "alibi", "config.position_encoding must be one of"),
    ("num_kv_heads", 3, r"config.num_kv_heads \(3\) must divide config.num_heads \(2\)"),
    ("mesh.model", 0, "config.mesh.model must be a positive int"),
    ("attention_pattern", (4, 0), r"config.attention_pattern entries must be None or a "
                                  r"positive int, got \(4, 0\)"),
    ("logit_soft_cap", -1.0, "config.logit_soft_cap must be None or positive, got -1.0"),
    ("mesh.seq", 2, r"config.mesh data x model x seq = -1 x 1 x 2 must use all 1 devices"),
    ("mesh.data", 2, r"config.mesh data x model x seq = 2 x 1 x 1 must use all 1 devices"),
    ("mesh.axis_types", "manual", r"config.mesh.axis_types must be one of \['auto', "
                                  r"'explicit'\], got 'manual'"),
    ("lr_schedule", "linear", "config.lr_schedule must be one of"),
    ("embed_init_std", 0.0, "config.embed_init_std must be positive, got 0.0"),
    ("train_query_fraction", 1.5, r"config.train_query_fraction must be None or in \(0, 1\]"),
    ("curriculum", ((10, 8, 3, None),), r"config.curriculum entries must be .*got \(10, 8, 3, None\)"),
    ("curriculum", ((10, 8, 2),), r"config.curriculum entries must be .*got \(10, 8, 2\)"),
    ("curriculum", ((10, 8, 2, 0.0),), r"config.curriculum entries must be .*got \(10, 8, 2, 0.0\)"),
])
def test_bad_config_fails_at_start_and_writes_nothing(tmp_path, field, value, message):
  config = tiny.get_config()
  *parents, name = field.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  node[name] = value
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=message):
    training.train_and_evaluate(config, workdir)
  assert not workdir.exists()


_ON_DEVICES = """
import json, sys
sys.path[:0] = [{root!r}, {examples!r}]
import jax, jattn, training
from configs import tiny
config = tiny.get_config()
config.num_steps, config.warmup_steps = 3, 1
runs = []
for i, (data, model, seq, axis_types) in enumerate({meshes!r}):
  config.mesh.data, config.mesh.model, config.mesh.seq = data, model, seq
  config.mesh.axis_types = axis_types
  workdir = f"{{sys.argv[1]}}/{{i}}"
  with jattn.explain_calls() as reports:  # what each attention call ran (traced once)
    state = training.train_and_evaluate(config, workdir)
  kernel = state["params"]["blocks"][0]["attention"]["query"]["kernel"][...]
  metrics = [json.loads(l) for l in open(f"{{workdir}}/metrics.jsonl")]
  attention = sorted({{r.implementation("cpu") for r in reports}})
  runs.append({{"metrics": metrics, "kernel_spec": str(kernel.sharding.spec),
               "attention": attention}})
print(json.dumps({{"devices": jax.device_count(), "runs": runs}}))
"""


def _train_on(devices, meshes, workdir):
  env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
             JAX_PLATFORMS="cpu")
  code = _ON_DEVICES.format(root=str(ROOT), examples=str(ROOT / "examples"), meshes=meshes)
  result = subprocess.run([sys.executable, "-c", code, str(workdir)], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["devices"] == devices
  return out["runs"]


@pytest.mark.slow
@pytest.mark.parametrize("meshes", [
    [(2, 2, 2, "auto"), (2, 2, 2, "explicit")],
    pytest.param([(8, 1, 1, "auto"), (2, 2, 2, "auto"), (2, 2, 2, "explicit")],
                 marks=pytest.mark.thorough)])
def test_eight_devices_give_the_loss_of_one(tmp_path, meshes):
  """A 2x2x2 mesh (batch over data, heads over model, the sequence over seq by the
  strategy context_parallel_attention chooses: all-gather, since Ulysses cannot split
  the one head per model device over 2 seq devices and the gathered K/V is small), of
  Auto axes and of Explicit ones, and, in the slow tier, data parallel over 8 devices:
  the losses of one device."""
  [one] = _train_on(1, [(1, 1, 1, "auto")], tmp_path / "one")
  runs = _train_on(8, meshes, tmp_path / "eight")
  for (*shape, _), run in zip(meshes, runs):
    if shape == [2, 2, 2]:
      assert run["kernel_spec"] == "P(None, 'model', None)"  # heads split over model
      # (the plots' model forms the weights on one device: "xla")
      assert set(run["attention"]) - {"xla"} == {"all_gather"}, run["attention"]
  assert "all_gather" not in one["attention"]
  for run in runs:
    assert [l["step"] for l in run["metrics"]] == [l["step"] for l in one["metrics"]]
    for a, b in zip(one["metrics"], run["metrics"]):
      np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
      np.testing.assert_allclose(a["accuracy"], b["accuracy"], rtol=1e-6)



_SHRUNK = ("vocab_size", "seq_len", "num_kv_pairs", "features", "num_heads", "mlp_features",
           "batch_size", "warmup_steps")


@pytest.mark.parametrize("name", ["mqar_gemma2_style", "mqar_attention_only",
                                  "mqar_long_context"])
def test_new_configs_train_a_few_steps_with_one_layer(name):
  """Each config of the training page, shrunk to tiny's sizes and one layer, keeps its
  own options (windows, cap, sinks, positions) and its pure train_step runs 3 steps
  to finite losses, moving the sinks where it has them. (The loop, checkpoints and
  plots are tested on the tiny config above; here only one compilation.)"""
  import importlib
  config = importlib.import_module(f"configs.{name}").get_config()
  small = tiny.get_config()
  for field in _SHRUNK:
    config[field] = small[field]
  config.num_layers, config.num_steps = 1, 3
  if config.curriculum:  # one step of a shorter task, then the config's own
    config.curriculum = ((1, small.seq_len // 2, small.num_kv_pairs // 2,
                          config.curriculum[0][3]),)
  training.check_config(config)
  model = training.model_config(config)
  assert model.attention_pattern == tuple(config.attention_pattern)
  assert (model.logit_soft_cap, model.sinks) == (config.logit_soft_cap, config.sinks)
  assert model.previous_token_embedding == config.previous_token_embedding
  assert model.embed_init_std == config.embed_init_std
  assert model.implementation == config.implementation
  graphdef, tx, state = training.create_state(config)
  first = [np.array(x) for x in _params(state)]  # copies: the state is donated
  train_step = jax.jit(training.make_train_step(graphdef, tx), donate_argnums=0)
  for step in range(3):
    state, metrics = train_step(state, mqar_data.train_batch(config, step))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert int(state["step"]) == 3
  assert all(not np.array_equal(a, b) for a, b in zip(first, _params(state)))
  attention = state["params"]["blocks"][0]["attention"]
  assert ("sinks" in attention) == config.sinks
