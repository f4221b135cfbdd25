"""The default MQAR task for attention alone: no previous-token embedding, no
convolution; rotary positions, global causal attention in every layer.

What makes it learn here (docs/training.md has the sweep that found it):
- a curriculum: the first 3000 steps on a short task (T = 64, 8 pairs) with a
  query at every position after the pairs (48 answers per sequence instead of
  8), where the induction circuit forms; then the task itself;
- a constant learning rate (a cosine decay shrinks it before the circuit forms),
  no weight decay, no gradient clipping, and token embeddings drawn with
  standard deviation 1 instead of 0.02.
The held-out examples are the default task's (T = 256, 32 pairs, each key asked
once among fillers), unchanged, and so are the batches after the first phase.
"""

import ml_collections

from configs import mqar


def get_config() -> ml_collections.ConfigDict:
  config = mqar.get_config()
  config.previous_token_embedding = False  # attention must form the induction circuit itself
  config.embed_init_std = 1.0  # 0.02 never left the plateau within 3500 steps of the short task
  config.curriculum = ((3000, 64, 8, 1.0),)  # T = 64 with 8 pairs, every position after them a query
  config.learning_rate = 1e-3
  config.lr_schedule = "constant"
  config.warmup_steps = 1
  config.weight_decay = 0.0
  config.grad_clip = 1e9  # no clipping
  config.num_steps = 4000  # 3000 on the short task, 1000 on the task itself
  return config
