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
  """The default block sizes of "blockwise" on `platform`: 512 queries x 256 keys on all.

  512 x 256 (8 heads x 512 KiB of float32 logits per block) was the fastest of
  {128..2048} x {256..1024} at B=1 N=8 H=64 T=S=4096 on a 2-core AMD EPYC
  (AVX-512), in same-process runs against torch SDPA (docs/implementations.md).
  On TPU and GPU "blockwise" is the lax-loop fallback for calls no fused kernel
  takes; no size was measured there, and one size everywhere means a program
  traced for every platform (`implementation=None`) holds one blockwise loop,
  not one per platform (docs/implementations.md, "What the choice at lowering
  costs").
  """
  del platform  # the same everywhere until a TPU or GPU measurement says otherwise
  return BlockSizes(q=512, kv=256)
