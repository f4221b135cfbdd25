"""What the Flax modules share: head projections, the KV cache, flax's attention_fn."""
