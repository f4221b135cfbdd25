"""jax APIs that may be missing or moved (jattn/_src/compat.py): each one taken away
(its module blocked, or its name deleted) makes the implementation that needs it
refuse with the reason, `implementation=None` fall back, `jattn.explain` say why and
an explicit request raise it; `import jattn` and a CPU call never need them."""

import importlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods
from jattn._src import compat
from tests.helpers import raises


def _take_away(monkeypatch, api: str, how: str):
  loader, _ = compat.APIS[api]
  if how == "module":  # the module no longer exists in this jax
    monkeypatch.setitem(sys.modules, loader.module, None)
  else:  # the module exists, without the (last) name jattn reads
    monkeypatch.delattr(importlib.import_module(loader.module), loader.names[-1])
  compat.refresh()


@pytest.fixture(autouse=True)
def _fresh_answers():
  compat.refresh()
  yield
  compat.refresh()


# the fallbacks expected on CUDA are those of a host without jax's CUDA plugin (conftest)
pytestmark = pytest.mark.usefixtures("host_without_cuda")

# APIs the oldest supported jax lacks (a test that needs one skips there)
NEWER = {"mosaic_gpu_interpret": "jax >= 0.11"}
# APIs the newest supported jax removed: there, each is already missing, as a module
REMOVED = {"pallas_mha": (0, 12, 1)}  # 0.12.1 ships none of pallas/ops/gpu's Triton kernels


def _removed_here(api: str, how: str) -> bool:
  """This jax removed `api` (its module): the "module" case checks the refusal as it is."""
  if api not in REMOVED or jax.__version_info__ < REMOVED[api]:
    return False
  if how == "attribute":
    pytest.skip(f"jax {jax.__version__} removed {api}'s module: no name to delete from it")
  return True


def _check_reason(api: str, error: str):
  loader, needed_by = compat.APIS[api]
  reason = compat.missing(api)
  assert reason.startswith(f"it needs {loader.what}, which jax {jax.__version__} lacks ("), reason
  assert f"({error}: " in reason, reason
  with raises(RuntimeError, re.escape(f"{needed_by}: {reason}")):
    compat.load(api)


@pytest.mark.parametrize("how", ["module", "attribute"])
@pytest.mark.parametrize("api", list(compat.APIS))
def test_every_api_is_there_and_a_missing_one_is_named(api, how, monkeypatch):
  if api in NEWER and compat.missing(api) is not None:
    pytest.skip(f"{api} is in {NEWER[api]}, not jax {jax.__version__}")
  if _removed_here(api, how):  # missing already: named as one taken away would be
    _check_reason(api, "ModuleNotFoundError")
    return
  assert compat.missing(api) is None
  assert compat.load(api) is not None
  _take_away(monkeypatch, api, how)
  _check_reason(api, "ModuleNotFoundError" if how == "module" else "AttributeError")


T = 256
TRACED_SCALE = dict(is_causal=True, scale=jnp.float32(0.125))
# api -> (the implementation that needs it, the platform, a call it takes when the API
# is there, the implementation=None choice then, and without the API)
CASES = {
    # a traced scale: flex_tpu refuses it, so splash takes it
    "splash_kernel": ("splash", "tpu", TRACED_SCALE, "splash", "xla"),
    "splash_mask": ("splash", "tpu", TRACED_SCALE, "splash", "xla"),
    "splash_computable_mask": ("splash", "tpu", TRACED_SCALE, "splash", "xla"),
    # pallas is the default on CUDA where flex_gpu refuses: a traced scale
    "pallas_mha": ("pallas", "cuda", TRACED_SCALE, "pallas", "xla"),
    # a window: jax's mha refuses it, so flex_gpu takes it (without Triton, flex_mgpu)
    "pallas_triton": ("flex_gpu", "cuda", dict(local_window_size=(64, 0)), "flex_gpu",
                      "flex_mgpu"),
    # a hand-written mask: splash refuses it, so flex_tpu takes it
    "pallas_tpu": ("flex_tpu", "tpu", dict(mask_mod=lambda b, n, t, s: s <= t), "flex_tpu",
                   "xla"),
}


@pytest.mark.parametrize("how", ["module", "attribute"])
@pytest.mark.parametrize("api", list(CASES))
def test_a_missing_api_refuses_its_plan_and_none_falls_back(api, how, monkeypatch):
  name, platform, kw, before, after = CASES[api]
  q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
  if not _removed_here(api, how):  # (else this jax has taken its module away already)
    assert jattn.explain(q, q, q, **kw).implementation(platform) == before
    _take_away(monkeypatch, api, how)
  report = jattn.explain(q, q, q, **kw)
  assert report.implementation(platform) == after, str(report)
  reason = report.reasons(platform)[name]
  loader, _ = compat.APIS[api]
  # the first of the kernel's APIs found missing (splash's two share one module)
  assert reason in {compat.missing(a) for a in compat.APIS}
  assert (loader.module if how == "module" else loader.names[-1]) in reason, reason
  assert f"not {name}: {reason}" in str(report)
  # asked for by name: explain reports it, and the call raises it before any work
  error = f"implementation={name!r} cannot run this call"
  assert jattn.explain(q, q, q, implementation=name, **kw).choices[platform].error == (
      f"{error} on {platform!r}: {reason}")
  x = jnp.zeros(q.shape, q.dtype)
  with raises(ValueError, re.escape(f"{error}: {reason}")):
    jattn.dot_product_attention(x, x, x, implementation=name, **kw)


@pytest.mark.parametrize("how", ["module", "attribute"])
def test_without_triton_flex_mgpu_takes_over_and_without_mosaic_gpu_refuses(how, monkeypatch):
  q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
  _take_away(monkeypatch, "pallas_triton", "module")
  assert jattn.explain(q, q, q, local_window_size=(64, 0)).implementation("cuda") == "flex_mgpu"
  _take_away(monkeypatch, "pallas_mosaic_gpu", how)
  report = jattn.explain(q, q, q, local_window_size=(64, 0))
  assert report.implementation("cuda") == "xla", str(report)
  assert report.reasons("cuda")["flex_mgpu"] == compat.missing("pallas_mosaic_gpu")
  assert "jax.experimental.pallas.mosaic_gpu" in compat.missing("pallas_mosaic_gpu")


def test_a_missing_cudnn_check_refuses_cudnn_with_the_reason(host_without_cuda, monkeypatch):
  q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
  assert "cuDNN is not detected" in jattn.explain(q, q, q).reasons("cuda")["cudnn"]
  _take_away(monkeypatch, "cudnn_check", "attribute")
  report = jattn.explain(q, q, q, is_causal=True)
  assert report.reasons("cuda")["cudnn"] == compat.missing("cudnn_check")
  assert "check_cudnn_version" in compat.missing("cudnn_check")
  assert report.implementation("cuda") == "flex_gpu"


def test_the_cpu_result_is_unchanged_without_the_kernels(monkeypatch):
  """Every kernel API gone: a default call (its TPU and CUDA branches traced) and its
  gradient still run here, with the values they had."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, 2, 64)), jnp.float32) for _ in "qkv")
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                  score_mod=mods.soft_cap(20.0))
  loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
  want, want_grad = f(q, k, v), jax.grad(loss)(q, k, v)
  for api in compat.APIS:
    _take_away(monkeypatch, api, "module")
  got, got_grad = f(q, k, v), jax.grad(loss)(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-6)


# Every optional module blocked before jattn is imported: what a jax without them sees.
_BLOCKED = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error")
    import jax, jax.numpy as jnp
    blocked = {blocked!r}
    for name in blocked:
        sys.modules[name] = None
    import jattn
    q = jnp.ones((1, 256, 2, 64))
    out = jattn.dot_product_attention(q, q, q, is_causal=True)
    grad = jax.grad(lambda q: jattn.dot_product_attention(q, q, q, is_causal=True).sum())(q)
    report = jattn.explain(q, q, q, is_causal=True)
    print(report.implementation("tpu"), report.implementation("cuda"))
    print(sorted(name for name in blocked if sys.modules.get(name) is not None))
""")


def test_import_jattn_and_a_cpu_call_need_no_optional_api():
  blocked = sorted({loader.module for loader, _ in compat.APIS.values()}
                   | {"jax.experimental.pallas.ops.tpu.splash_attention",
                      "jax.experimental.pallas.ops.gpu"})
  run = subprocess.run([sys.executable, "-c", _BLOCKED.format(blocked=blocked)],
                       capture_output=True, text=True)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split("\n")[:2] == ["xla xla", "[]"], run.stdout

