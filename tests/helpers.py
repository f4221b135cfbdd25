"""Input builders and assertion helpers shared by the jattn tests."""

import contextlib

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jattn._src import compat

# The seed's hand-computable 4-token example (examples/worked_example.py).
X = np.array([[1, 1, 1, 0], [1, 2, 1, 0], [0, 1, 0, 1], [0, 1, 1, 0]], np.float32)
W_Q = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 1], [1, 0, 0]], np.float32)
W_K = np.array([[1, 0, 0], [1, 1, 1], [1, 0, 1], [0, 1, 0]], np.float32)
W_V = np.array([[1, 2, 0], [1, 3, 1], [1, 0, 2], [1, 1, 0]], np.float32)
EXPECTED = np.array([
    [3.9492, 7.8588, 3.9577],
    [3.9924, 7.9784, 3.9934],
    [3.8407, 7.5669, 3.8595],
    [3.7902, 7.4482, 3.8228],
])


def needs_api(api: str):
  """Skips a test of what a kernel of jax's does with `api` (a key of compat.APIS) where
  this jax lacks it: jax 0.12.1 removed its Pallas Triton ops, "pallas_mha" (the
  implementation "pallas") with them. tests/impl/test_compat.py checks, there, that the
  kernel refuses every call with the reason and that implementation=None passes over it."""
  reason = compat.missing(api)
  return pytest.mark.skipif(reason is not None, reason=f"{api}: {reason}")


# Custom calls without jax's compatibility guarantee in jattn's CUDA programs: Triton's
# (flex_gpu, jax's Pallas mha) and cuDNN's fused attention, which the plan takes where jax
# finds cuDNN (a host with jax's CUDA plugin, with or without a GPU). An export made to be
# read, never kept, allows them by name.
TRITON = "__gpu$xla.gpu.triton"
CUDNN = "__cudnn$fmha"  # the prefix of each of its targets
CUDNN_TARGETS = tuple(f"{CUDNN}{kind}{way}" for kind in ("Softmax", "ScaleBiasSoftmax")
                      for way in ("", "Backward"))


def unguaranteed_calls() -> list:
  """export.export's disabled_checks for the kernels of a CUDA program (above)."""
  return [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, *CUDNN_TARGETS)]


def exported_text(fn, platform: str, *args) -> str:
  """The StableHLO text of jit(fn)(*args) exported for `platform` from this host (CUDA:
  an abstract GPU, jax >= 0.11), its kernels' custom calls allowed: a program to read."""
  import jattn  # noqa: PLC0415  (the helpers' other users need no jattn)
  with jattn.lowering_for(platform):
    return export.export(jax.jit(fn), platforms=[platform],
                         disabled_checks=unguaranteed_calls())(*args).mlir_module()


def randn(rng, shape, dtype=np.float32, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(dtype)


def make_qkv(rng, B=2, T=5, S=6, N=4, K=None, H=8, D=None, dtype=np.float32):
  """Random query [B,T,N,H], key [B,S,K,H], value [B,S,K,D] (no B if B=None)."""
  K = N if K is None else K
  D = H if D is None else D
  lead = () if B is None else (B,)
  q = randn(rng, lead + (T, N, H), dtype)
  k = randn(rng, lead + (S, K, H), dtype)
  v = randn(rng, lead + (S, K, D), dtype)
  return q, k, v


def random_mask(rng, shape, p=0.7):
  """Random bool mask, True (may attend) with probability p."""
  return rng.random(shape) < p


def to_layout(x, layout, src="BTNH"):
  """Transpose x from `src` letter order to `layout` letter order."""
  if len(src) != x.ndim:
    src = src.replace("B", "")
  if len(layout) != x.ndim:
    raise ValueError(f"layout {layout} vs ndim {x.ndim}")
  return np.transpose(np.asarray(x), [src.index(c) for c in layout])


def from_layout(x, layout, dst="BTNH"):
  """Inverse of to_layout."""
  if len(dst) != np.ndim(x):
    dst = dst.replace("B", "")
  return np.transpose(np.asarray(x), [layout.index(c) for c in dst])


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


@contextlib.contextmanager
def raises(exc, name, *needles):
  """pytest.raises that also checks the message names `name` and the needles.

  `name` is a regex searched case-insensitively; needles (e.g. shape
  strings like "(2, 8, 4, 16)") must appear literally.
  """
  with pytest.raises(exc, match=f"(?i){name}") as info:
    yield info
  message = str(info.value)
  for needle in needles:
    assert needle in message, f"{needle!r} not in error message {message!r}"




def hypothesis_tiers(check, strategy):
  """(CI test, thorough test) of one property, each under its hypothesis profile
  ("ci": a few derandomized examples; "thorough": hundreds, in the slow tier)."""
  def make(profile):
    @hypothesis.settings(hypothesis.settings.get_profile(profile))
    @hypothesis.given(strategy)
    def test(example):
      check(example)
    return test
  return make("ci"), pytest.mark.thorough(make("thorough"))
