"""Block sizes of the blockwise implementation, and their default per platform."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Queries per block (q) and keys/values per block (kv) of `implementation="blockwise"`.

  A size larger than the sequence is clipped to it; sequences that are not a
  multiple of the block are padded internally (and the padding masked).

  Attributes:
    q: queries per block (rows of T).
    kv: keys and values per block (rows of S).

  Raises:
    ValueError: a size that is not a positive int, naming the field.

  Examples:
    >>> import jattn
    >>> jattn.BlockSizes(q=128, kv=64)
    BlockSizes(q=128, kv=64)
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
  """The platform's default block sizes.

  CPU: 512 queries x 256 keys (8 heads x 512 KiB of float32 logits per block)
  was the fastest of {128..2048} x {256..1024} at B=1 N=8 H=64 T=S=4096 on a
  2-core AMD EPYC (AVX-512), in same-process runs against torch SDPA (README,
  "Blockwise attention and benchmark"). Accelerators: flash-attention's usual tiles.
  """
  if platform == "cpu":
    return BlockSizes(q=512, kv=256)
  return BlockSizes(q=128, kv=128)
