"""The XLA:CPU flags the suite compiles with, for this process and its subprocesses."""

import os

# The suite compiles thousands of small programs and runs each once or twice: XLA:CPU's
# LLVM optimisation is most of its time and buys nothing at these sizes. Level 0 and no
# expensive LLVM passes keep the same program semantics (every value is still checked
# against float64 references) and cut the suite's time by about a third (docs/testing.md).
# JATTN_TEST_XLA_OPTIMIZE=1 keeps XLA's defaults.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(*extra: str) -> str:
  """XLA_FLAGS for this process or a subprocess of the suite: the fast-compile flags
  (unless JATTN_TEST_XLA_OPTIMIZE=1), the caller's own XLA_FLAGS, and `extra`."""
  flags = [os.environ.get("XLA_FLAGS", "")]
  if os.environ.get("JATTN_TEST_XLA_OPTIMIZE") != "1" and FAST_COMPILE_FLAGS not in flags[0]:
    flags.append(FAST_COMPILE_FLAGS)
  return " ".join(f for f in (*flags, *extra) if f)
