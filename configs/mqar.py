"""Default config: MQAR with T = 256 tokens and 32 key-value pairs, on a 2-core CPU."""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # seeds the parameters and every batch (a batch is a function of seed and step)
  # task
  config.vocab_size = 512  # V: keys from [1, V/2), values from [V/2, V)
  config.seq_len = 256  # T: tokens per example
  config.num_kv_pairs = 32  # P: key-value pairs, each queried once after them
  # model
  config.num_layers = 2  # pre-norm Transformer blocks
  config.features = 64  # F: model width
  config.num_heads = 2  # N: query heads; must divide features
  config.num_kv_heads = config_dict.placeholder(int)  # K: kv heads (None: N); must divide num_heads
  config.mlp_features = 128  # E: MLP hidden width
  config.layout = "rows"  # "rows" (activations [B, T, F]) or "columns" ([B, F, T])
  config.position_encoding = "rope"  # "rope" (rotary q and k in every layer), "learned" or "none"
  config.previous_token_embedding = True  # add an embedding of token t-1 at t (see README)
  config.embed_init_std = 0.02  # standard deviation of the token embeddings at initialisation
  config.attention_pattern = ()  # per layer, cycled: None global causal, int w a window of w keys back
  config.logit_soft_cap = config_dict.placeholder(float)  # cap * tanh(logit / cap) in every layer (None: off)
  config.sinks = False  # a learned attention sink per head in every layer
  config.implementation = config_dict.placeholder(str)  # jattn.dot_product_attention implementation (None: best; "context_parallel" when mesh.seq > 1, or "ring")
  # devices: a ("data", "model", "seq") mesh; data * model * seq = all devices
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # devices on the batch axis B (-1: all that model and seq leave)
  config.mesh.model = 1  # devices on the heads and MLP hidden units (tensor parallel)
  config.mesh.seq = 1  # devices on the sequence axis T (ring attention)
  # "auto": the compiler shards the intermediates (GSPMD); "explicit": every array's
  # sharding in its type (jax.make_mesh's default; docs/scaling.md)
  config.mesh.axis_types = "auto"
  # optimisation
  config.batch_size = 16  # B: examples per step, split over mesh.data devices
  config.num_steps = 1500  # training steps
  config.learning_rate = 3e-3  # AdamW peak learning rate
  config.warmup_steps = 100  # linear warm-up to the peak, then the schedule below
  config.lr_schedule = "cosine"  # "cosine" (decay to 1% of the peak at num_steps) or "constant"
  config.weight_decay = 0.1  # AdamW decoupled weight decay
  # training data (held-out examples are always the task above)
  config.train_query_fraction = config_dict.placeholder(float)  # None: P queries, each key once; f: queries at f of the positions after the pairs
  config.curriculum = ()  # ((steps, seq_len, num_kv_pairs, query_fraction or None), ...): the first steps' batches from these tasks, in order
  config.grad_clip = 1.0  # clip gradients to this global norm
  # bookkeeping
  config.log_every = 50  # steps between training metrics lines
  config.eval_every = 250  # steps between held-out evaluations
  config.eval_examples = 512  # held-out examples
  config.checkpoint_every = 500  # steps between orbax checkpoints (and one at the end)
  return config
