"""implementation=None: the fastest correct implementation for the platform and shape."""

from __future__ import annotations

# On CPU, blockwise beats the dense einsum from this many logits per head
# (T * S) on: measured with both laid out for XLA:CPU's matmuls, float32 and
# bfloat16, forward and forward+backward, causal or not, at T = S in 64..4096
# (README, "Blockwise attention and benchmark"). At 64 they tie.
CPU_BLOCKWISE_FROM = 128 * 128

# On TPU and GPU, calls the fused kernels cannot take run "xla" while its
# float32 logits [B, N, T, S] stay under this many bytes, else "blockwise"
# (linear memory). NOT MEASURED: no TPU or GPU was available; the rule rests
# only on the expectation that fused kernels beat the blockwise lax loop and
# that XLA's dense einsum beats it while the logits fit comfortably in memory
# (256 MiB: far below a TPU v4/v5 core's 16-95 GiB or any datacentre GPU's).
ACCELERATOR_XLA_LOGITS_BYTES = 256 * 2**20


def default_implementation(*, platform: str, T: int, S: int, return_weights: bool,
                           cudnn_reason: str | None, splash_reason: str | None = "",
                           pallas_reason: str | None = "", B: int = 1, N: int = 1) -> str:
  """The implementation that None stands for.

  *_reason: why that kernel cannot run this call (None when it can).
  TPU: splash, else xla if the logits fit, else blockwise.
  GPU: cuDNN, else Pallas mha, else xla if the logits fit, else blockwise.
  CPU: xla below CPU_BLOCKWISE_FROM logits per head, else blockwise.
  """
  if return_weights:
    return "xla"  # the only fast path that forms the weights
  if platform == "cpu":
    return "blockwise" if T * S >= CPU_BLOCKWISE_FROM else "xla"
  if platform == "tpu" and splash_reason is None:
    return "splash"
  if platform == "gpu" and cudnn_reason is None:
    return "cudnn"
  if platform == "gpu" and pallas_reason is None:
    return "pallas"
  return "xla" if 4 * B * N * T * S <= ACCELERATOR_XLA_LOGITS_BYTES else "blockwise"
