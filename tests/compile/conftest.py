"""The compile tier: programs compiled by the real TPU compiler on this CPU host.

Every test in tests/compile is marked `compile` here (CI's third leg runs
`pytest -m "compile and not thorough"`; legs 1 and 2 deselect the marker). The TPU
tests need libtpu (`pip install "jax[tpu]"`), and are skipped with that reason where
it is missing; the CUDA tests (test_compile_cuda.py) bring their own condition.
"""

import pytest

from jattn._src import deviceless

_HERE = __file__.rsplit("/", 1)[0]


# tryfirst: the marker is on every item before `-m` selects by it
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  missing = deviceless.tpu_available()
  for item in items:
    if str(item.path).startswith(_HERE):
      item.add_marker(pytest.mark.compile)
      if missing and "cuda" not in item.path.name:
        item.add_marker(pytest.mark.skip(reason=missing))
