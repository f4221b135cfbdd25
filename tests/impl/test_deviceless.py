"""jattn._src.deviceless where the compilers may be missing (CI's legs 1 and 2): target
names are checked, and a missing libtpu is named with its fix, before any work."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import deviceless


@pytest.mark.parametrize("target", ["v4", "h100=2", "", "v5e-2x2"])
def test_unknown_targets_are_refused_by_name(target):
  with pytest.raises(ValueError, match="is not one of v5e, v6e, v5p, tpu7x, h100, h200"):
    deviceless.devices(target)


def test_a_target_that_is_not_a_string():
  with pytest.raises(TypeError, match="target must be a str"):
    deviceless.platform_of(5)


@pytest.mark.parametrize("target, platform", [("v5e", "tpu"), ("v5p=2x2x1", "tpu"),
                                              ("tpu7x", "tpu"), ("h200", "cuda")])
def test_the_platform_comes_from_the_name(target, platform):
  assert deviceless.platform_of(target) == platform


def test_without_libtpu_the_error_says_how_to_install_it(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  deviceless._tpu_devices.cache_clear()
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(RuntimeError, match=r"needs libtpu.*pip install 'jax\[tpu\]'"):
    jattn.explain(q, q, q, is_causal=True, compile="v6e")
  deviceless._tpu_devices.cache_clear()


def test_compile_with_a_mesh_is_refused():
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))
  with pytest.raises(ValueError, match="compile= takes a call on one device"):
    jattn.explain(q, q, q, mesh=mesh, compile="v5e")
