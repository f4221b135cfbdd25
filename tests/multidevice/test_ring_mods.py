"""Ring attention with mask_mod, score_mod and sinks on 8 simulated devices (a subprocess),
and the refusals that need no devices."""

import numpy as np
import pytest

import jattn
from jattn import mods
from tests.multidevice.test_ring import assert_checks_pass


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 2), pytest.param("all", 3, marks=pytest.mark.thorough)])
def test_ring_mods_match_single_device_values_and_gradients(cases, count):
  assert_checks_pass("ring_mod_cases.py", cases, count)


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 2), pytest.param("all", 5, marks=pytest.mark.thorough)])
def test_ring_with_t_not_s_and_a_hand_written_mask_mod(cases, count):
  """16 queries against 32 keys and the reverse; causal, kv lengths and a hand-written
  mask_mod at global positions (zig-zag and contiguous); out, lse (the columns
  layout BNHT included) and gradients against float64 NumPy."""
  assert_checks_pass("ring_lengths_cases.py", cases, count)


def test_ring_mods_refuse_a_sharded_batch():
  import jax
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(ValueError, match="mask_mod, score_mod and sinks in ring.*batch_axis_name"):
    jattn.ring_attention(q, q, q, mesh=mesh, batch_axis_name="data",
                         score_mod=mods.soft_cap(1.0))
