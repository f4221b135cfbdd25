"""MQAR at T = 4096 with 128 key-value pairs, trained with the blockwise path.

The default recipe (previous-token embedding, rotary positions) on sequences 16x
longer and with 4x more pairs; `implementation="blockwise"` keeps attention's
memory linear in T (`benchmarks/train_memory.py` measures it against the dense
path). A documented run, not CI: docs/training.md has its time and accuracy.
"""

import ml_collections

from configs import mqar


def get_config() -> ml_collections.ConfigDict:
  config = mqar.get_config()
  config.seq_len = 4096  # T
  config.num_kv_pairs = 128  # P: 256 tokens of pairs, then 128 queries among the fillers
  config.implementation = "blockwise"  # the flash-style path: no [T, S] array
  config.batch_size = 4  # B
  config.num_steps = 300
  config.warmup_steps = 50
  config.log_every = 10
  config.eval_every = 50
  config.eval_examples = 64
  config.checkpoint_every = 100
  return config
