"""Block sizes of the blockwise implementation, and their default per platform."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Queries per block (q) and keys/values per block (kv) of `implementation="blockwise"`.

  A size larger than the sequence is clipped to it; sequences that are not a
  multiple of the block are padded internally (and the padding masked).
  """

  q: int
  kv: int

  def __post_init__(self):
    for name in ("q", "kv"):
      size = getattr(self, name)
      if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {size!r}")

  def clipped(self, T: int, S: int) -> "BlockSizes":
    return BlockSizes(q=max(1, min(self.q, T)), kv=max(1, min(self.kv, S)))


def default_block_sizes(platform: str) -> BlockSizes:
  """Measured on a 2-core AMD EPYC (AVX-512), B=1 N=8 H=64 float32: 512 x 512
  blocks (8 heads x 1 MiB of logits per block) were fastest of
  {128..4096} x {256..2048} (README, "Blockwise attention and benchmark").
  Accelerators use smaller tiles in the usual flash-attention range."""
  if platform == "cpu":
    return BlockSizes(q=512, kv=512)
  return BlockSizes(q=128, kv=128)
