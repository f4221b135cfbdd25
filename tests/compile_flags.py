"""The XLA:CPU flags the suite compiles with, for this process and its subprocesses."""

import functools
import importlib.metadata
import os

# The suite compiles thousands of small programs and runs each once or twice: XLA:CPU's
# LLVM optimisation is most of its time and buys nothing at these sizes. Level 0 and no
# expensive LLVM passes keep the same program semantics (every value is still checked
# against float64 references) and cut the suite's time by about a third (docs/testing.md).
# JATTN_TEST_XLA_OPTIMIZE=1 keeps XLA's defaults.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# jaxlib up to 0.11.0 also has XLA:CPU's elemental emitters beside its MLIR fusion
# emitters (its default there): the same programs, compiled in about 40% less time
# (docs/testing.md). jaxlib 0.11.1 removed the flag, and XLA aborts on a flag it does
# not know, so it goes only to the jaxlibs that have it.
ELEMENTAL_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
LAST_JAXLIB_WITH_ELEMENTAL_EMITTERS = (0, 11, 0)


@functools.cache
def _jaxlib_has_elemental_emitters() -> bool:
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return False
  release = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
  return release <= LAST_JAXLIB_WITH_ELEMENTAL_EMITTERS


def fast_compile_flags() -> str:
  """The flags that make XLA:CPU compile the suite's small programs fast, for this jaxlib."""
  if _jaxlib_has_elemental_emitters():
    return f"{FAST_COMPILE_FLAGS} {ELEMENTAL_EMITTERS_FLAG}"
  return FAST_COMPILE_FLAGS


def xla_flags(*extra: str) -> str:
  """XLA_FLAGS for this process or a subprocess of the suite: the fast-compile flags
  (unless JATTN_TEST_XLA_OPTIMIZE=1), the caller's own XLA_FLAGS, and `extra`."""
  flags = [os.environ.get("XLA_FLAGS", "")]
  if os.environ.get("JATTN_TEST_XLA_OPTIMIZE") != "1" and FAST_COMPILE_FLAGS not in flags[0]:
    flags.append(fast_compile_flags())
  return " ".join(f for f in (*flags, *extra) if f)
