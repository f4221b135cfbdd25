"""dot_product_attention on a mesh (Explicit axes, and Auto axes where the choices are
Pallas kernels), on 8 simulated devices (a subprocess, so the suite keeps one device)."""

import pytest

from tests.multidevice.test_ring import assert_checks_pass


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 16), pytest.param("all", 22, marks=pytest.mark.thorough)])
def test_batch_and_head_sharded_calls_match_float64_and_keep_the_query_sharding(cases, count):
  """The batch and heads split over ("data", "model"), on Explicit and Auto axes: mods
  reading b and n, sinks, lengths, grouped heads, a bias, ALiBi, the lse, a gathered
  sequence, dropout per device, the interpreted flex_tpu kernel, the errors (a mod
  over a sharded array, two meshes), decode_attention over a paged cache, the
  Transformer's training step and sampling and the nnx and linen modules on Explicit
  axes, and a vmap over an Explicit-sharded axis."""
  assert_checks_pass("sharded_call_cases.py", cases, count)
