"""flex_tpu's forward, dq and dk/dv kernels under jax's TPU interpreter
(`pltpu.InterpretParams`: the kernel's DMAs and semaphores simulated, races
detected, uninitialised memory read as NaN, out-of-bounds reads checked), against
the float64 reference. The generic interpreter of tests/kernels/test_flex_tpu.py
(interpret=True) checks values only; this one also fails on a race or on a read of
memory the kernel never wrote. Tiny shapes: the TPU interpreter is slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.core.layout import Layout
from jattn._src.impl.interpret import pallas_interpret
from jattn._src.kernels import flex_tpu, flex_tpu_call
from jattn._src.masks.modifiers import Modifiers
from jattn._src.masks.programmable import build_mods
from tests.reference_grads import reference_mods_vjp

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
if not hasattr(pltpu, "InterpretParams"):
  pytest.skip("this jax has no TPU interpreter (pltpu.InterpretParams)", allow_module_level=True)

B, T, S, N, K, H = 1, 24, 200, 2, 1, 128  # two kv tiles of 128, the second padded
SLOPES = np.array([0.5, -0.25], np.float32)


def _races_found() -> bool:
  """jax 0.10's interpreter records races in a module global (0.12 raises by default)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  races = getattr(ipc, "races", None)
  return bool(races is not None and races.races_found)


def _params():
  return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               out_of_bounds_reads="raise")


@pytest.mark.parametrize("skip", [True, pytest.param(False, marks=pytest.mark.thorough)],
                         ids=["block_tables", "every_tile"])
def test_forward_dq_dkdv_under_the_tpu_interpreter(skip):
  r = np.random.default_rng(0)
  q, k, v, d_out = (jnp.asarray(r.standard_normal(shape), jnp.float32) for shape in (
      (B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
  lay = Layout("BTNH")

  def loss(q, k, v, slopes):
    # a causal mask_mod whose queries start at S - T (decoding's alignment): the
    # first kv tile is FULL for every query, the second PARTIAL
    mods = build_mods(lambda b, n, t, s: s <= t + (S - T), jattn.mods.alibi(slopes), None,
                      None, N=N)
    m = Modifiers(mods=mods, scale=1 / np.sqrt(H))
    with pallas_interpret(tpu=_params()):
      p = flex_tpu.plan(B=B, T=T, S=S, N=N, K=K, H=H, D=H, dtype=q.dtype, modifiers=m,
                        block_q=8, block_kv=128, interpret=True, skip=skip)
      assert not isinstance(p, str), p
      assert isinstance(p.interpret, pltpu.InterpretParams)
      out = flex_tpu_call.run(p, q, k, v, m, lay)[0]
    return jnp.sum(out * d_out), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      q, k, v, jnp.asarray(SLOPES))
  assert not _races_found()
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  n = np.arange(N)[:, None, None]
  want_out, dq, dk, dv = reference_mods_vjp(
      q, k, v, d_out, allowed=(s <= t + (S - T))[None, None],
      score=lambda x: x + SLOPES[n].astype(np.float64) * (s - t - (S - T)))
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
  for g, w in zip(grads[:3], (dq, dk, dv)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
  assert np.isfinite(np.asarray(grads[3])).all()  # the slopes' (dq kernel): no NaN read


@pytest.mark.thorough  # about a minute on a quiet 2-core host
def test_window_grid_over_only_the_nonempty_tiles_under_the_tpu_interpreter():
  """The compacted grids (each row's non-empty kv tiles, each column's non-empty query
  tiles, grouped heads: steps r = g Wq + w of dk/dv) under the TPU interpreter: no race,
  no read of unwritten memory, no out-of-bounds block, values and gradients against
  float64."""
  from jattn._src.kernels.tile_classes import grid_widths
  from jattn._src.masks.structural import MaskSpec
  T_ = S_ = 264
  r = np.random.default_rng(1)
  q, d_out = (jnp.asarray(r.standard_normal((B, T_, N, H)), jnp.float32) for _ in "qo")
  k, v = (jnp.asarray(r.standard_normal((B, S_, K, H)), jnp.float32) for _ in "kv")
  lay = Layout("BTNH")

  def loss(q, k, v):
    m = Modifiers(structure=MaskSpec(is_causal=True, local_window=(8, 0)), scale=1 / np.sqrt(H))
    with pallas_interpret(tpu=_params()):
      p = flex_tpu.plan(B=B, T=T_, S=S_, N=N, K=K, H=H, D=H, dtype=q.dtype, modifiers=m,
                        block_q=8, block_kv=128, interpret=True)
      assert not isinstance(p, str) and p.skip, p
      assert grid_widths(p) == (2, 17)  # of 3 kv tiles and 33 query tiles
      out = flex_tpu_call.run(p, q, k, v, m, lay)[0]
    return jnp.sum(out * d_out), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  assert not _races_found()
  t, s = np.arange(T_)[:, None], np.arange(S_)[None, :]
  want_out, dq, dk, dv = reference_mods_vjp(q, k, v, d_out,
                                            allowed=((s <= t) & (s >= t - 8))[None, None])
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
  for g, w in zip(grads, (dq, dk, dv)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
