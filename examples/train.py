"""Trains the jattn Transformer on MQAR.

  python examples/train.py --workdir=runs/mqar                      # configs/mqar.py
  python examples/train.py --config=configs/tiny.py --workdir=/tmp/t --config.num_steps=20

Re-running with the same --workdir resumes from its latest checkpoint.
--distributed runs one process per host (see README, "Many hosts").
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # configs/ (and jattn, from a checkout)

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import training  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and plots.")
config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "mqar.py"),
                                "Training config file.", lock_config=True)
flags.DEFINE_bool("distributed", False,
                  "Call jax.distributed.initialize() first: one process per host of a "
                  "TPU pod or GPU cluster (coordinator found from the environment).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  if FLAGS.distributed:
    jax.distributed.initialize()
  training.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main)
