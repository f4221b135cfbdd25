"""MQAR at T = 4096 with 128 key-value pairs, trained with the blockwise path.

The default recipe (previous-token embedding, rotary positions) on sequences 16x
longer and with 4x more pairs; `implementation="blockwise"` keeps attention's
memory linear in T (`benchmarks/train_memory.py` measures it against the dense
path). The first 1000 steps train on the default task (T = 256, 32 pairs), where
a step is 16x cheaper and the look-up forms; rotary positions carry it to T =
4096. A documented run, not CI: docs/training.md has its time and accuracy.
"""

import ml_collections

from configs import mqar


def get_config() -> ml_collections.ConfigDict:
  config = mqar.get_config()
  config.seq_len = 4096  # T
  config.num_kv_pairs = 128  # P: 256 tokens of pairs, then 128 queries among the fillers
  config.implementation = "blockwise"  # the flash-style path: no [T, S] array
  config.batch_size = 4  # B
  config.curriculum = ((1000, 256, 32, None),)  # the default task first
  config.num_steps = 1600  # 1000 at T = 256, then 600 at T = 4096
  config.warmup_steps = 50
  config.log_every = 10
  config.eval_every = 100
  config.eval_examples = 64
  config.checkpoint_every = 100
  return config
