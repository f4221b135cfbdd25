"""A config that trains in seconds, for tests: the default shrunk to one tiny layer."""

import ml_collections

from configs import mqar


def get_config() -> ml_collections.ConfigDict:
  config = mqar.get_config()
  config.vocab_size = 32  # V: small vocabulary
  config.seq_len = 16  # T: short sequences
  config.num_kv_pairs = 4  # P: four pairs
  config.num_layers = 1  # one block
  config.features = 16  # F
  config.num_heads = 2  # N
  config.mlp_features = 32  # E
  config.batch_size = 8  # B: divisible by 8 devices in the multi-device test
  config.num_steps = 6  # a handful of steps
  config.warmup_steps = 2  # short warm-up
  config.log_every = 1  # a metrics line every step
  config.eval_every = 3  # evaluate twice
  config.eval_examples = 16  # tiny held-out split
  config.checkpoint_every = 2  # checkpoints at steps 2, 4, 6
  return config
