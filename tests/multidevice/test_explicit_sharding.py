"""dot_product_attention on arrays sharded over Explicit mesh axes, on 8 simulated
devices (a subprocess, so the suite keeps one device)."""

import pytest

from tests.multidevice.test_ring import assert_checks_pass


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 7), pytest.param("all", 9, marks=pytest.mark.thorough)])
def test_batch_and_head_sharded_calls_match_float64_and_keep_the_query_sharding(cases, count):
  """The batch and heads split over ("data", "model"): mods reading b and n, sinks,
  lengths, grouped heads, a bias, the lse, a gathered sequence, dropout per device, the
  interpreted flex_tpu kernel, and the errors (a mod over a sharded array, two meshes)."""
  assert_checks_pass("explicit_sharding_cases.py", cases, count)
