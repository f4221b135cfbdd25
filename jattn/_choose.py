"""implementation=None: the fastest correct implementation for the platform and shape."""

from __future__ import annotations

# On CPU, blockwise beats the dense einsum from this many logits per head
# (T * S) on: measured with both laid out for XLA:CPU's matmuls, float32 and
# bfloat16, forward and forward+backward, causal or not, at T = S in 64..4096
# (README, "Blockwise attention and benchmark"). At 64 they tie.
CPU_BLOCKWISE_FROM = 128 * 128


def default_implementation(*, platform: str, T: int, S: int, return_weights: bool,
                           cudnn_reason: str | None) -> str:
  """The implementation that None stands for.

  cudnn_reason: why cuDNN cannot run this call (None when it can).
  """
  if return_weights:
    return "xla"  # the only fast path that forms the weights
  if platform == "gpu" and cudnn_reason is None:
    return "cudnn"
  if platform == "cpu":
    return "blockwise" if T * S >= CPU_BLOCKWISE_FROM else "xla"
  return "blockwise"  # GPU calls cuDNN cannot take, and TPU: linear memory
