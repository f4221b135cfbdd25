"""The default MQAR task with Gemma 2 / gpt-oss attention: alternating local and
global layers, soft-capped logits and a learned sink per head."""

import ml_collections

from configs import mqar


def get_config() -> ml_collections.ConfigDict:
  config = mqar.get_config()
  config.attention_pattern = (32, None)  # layer 0 a causal window of 32 keys back, layer 1 global (cycled)
  config.logit_soft_cap = 50.0  # attention logits capped at 50 * tanh(logit / 50), Gemma 2's value
  config.sinks = True  # a learned sink logit per head in every layer (gpt-oss)
  return config
