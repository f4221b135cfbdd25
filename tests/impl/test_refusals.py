"""Refusals that need hardware this machine lacks, tested with the hardware faked:
cuDNN's reasons (asked of `jattn.explain` for the "cuda" platform) and the training example's mesh checks
(jax.device_count patched to 8). Each message names the argument and the value."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src.impl import cudnn

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import training  # noqa: E402
from configs import tiny  # noqa: E402


@pytest.fixture
def host_with_cudnn(monkeypatch):
  """A CUDA build host: cuDNN is detected (without jax's CUDA plugin it is not)."""
  monkeypatch.setattr(cudnn, "cudnn_missing", lambda: None)


def _cudnn_reason(dtype=jnp.bfloat16, H=64, D=64, T=16, S=16, **kwargs):
  q = jax.ShapeDtypeStruct((2, T, 4, H), dtype)
  k = jax.ShapeDtypeStruct((2, S, 4, H), dtype)
  v = jax.ShapeDtypeStruct((2, S, 4, D), dtype)
  report = jattn.explain(q, k, v, implementation="cudnn", **kwargs)
  return {p: report.reasons(p).get("cudnn") for p in ("cpu", "tpu", "cuda")}


def test_cudnn_accepts_what_it_can_run(host_with_cudnn):
  assert _cudnn_reason()["cuda"] is None
  assert _cudnn_reason(jnp.float16, H=128, D=128)["cuda"] is None
  assert _cudnn_reason(H=8, D=8)["cuda"] is None
  # issue 37, each seen right on an H200: cross-attention, a left window (run as
  # causal), a right one under is_causal, a window with T < S, a full-size bias
  assert _cudnn_reason(T=8, S=256)["cuda"] is None
  assert _cudnn_reason(local_window_size=(3, 0))["cuda"] is None
  assert _cudnn_reason(local_window_size=(3, 2), is_causal=True)["cuda"] is None
  assert _cudnn_reason(T=8, S=16, local_window_size=(3, 0))["cuda"] is None
  assert _cudnn_reason(bias=jnp.zeros((1, 1, 16, 16)))["cuda"] is None


def test_cudnn_is_refused_without_cudnn_on_the_host(host_without_cuda):
  assert "cuDNN is not detected" in _cudnn_reason()["cuda"]


@pytest.mark.parametrize("change, platform, reason", [
    (dict(), "cpu", "it needs a NVIDIA GPU (CUDA), the program is lowered for 'cpu'"),
    (dict(), "tpu", "the program is lowered for 'tpu'"),
    (dict(dtype=jnp.float32), "cuda", "it takes float16 or bfloat16, got query dtype"),
    (dict(D=32), "cuda", "H == D, a multiple of 8 and <= 128, got H=64, D=32"),
    (dict(H=136, D=136), "cuda", "got H=136, D=136"),
    (dict(H=12, D=12), "cuda", "got H=12, D=12"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "cuda",
     "no dropout, got dropout_rate=0.1"),
    (dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32),
          kv_segment_ids=jnp.zeros((2, 16), jnp.int32)), "cuda",
     "no q_segment_ids / kv_segment_ids"),
    (dict(return_weights=True), "cuda", "return_weights=True"),
    (dict(sinks=jnp.zeros(4)), "cuda", "it cannot honour sinks"),
    # issue 37: what jax's cuDNN path raises while the call or its gradient is traced
    (dict(T=7, S=8), "cuda", "needs even T and S, got T=7, S=8"),
    (dict(T=16, S=13), "cuda", "needs even T and S, got T=16, S=13"),
    (dict(bias=jnp.zeros((1, 1, 1, 16))), "cuda",
     "its bias must span T and S (jax's cuDNN takes no broadcast there), got bias of "
     "shape (1, 1, 1, 16)"),
    (dict(mask=jnp.ones((2, 1, 16, 1), bool)), "cuda", "its mask must span T and S"),
    (dict(local_window_size=(3, 2)), "cuda",
     "looks left only (jax.nn raises for a right window without is_causal), got "
     "local_window_size=(3, 2)"),
    (dict(T=16, S=8, local_window_size=(3, 0)), "cuda", "needs T <= S"),
])
def test_cudnn_refusal_reasons(host_with_cudnn, change, platform, reason):
  got = _cudnn_reason(**change)[platform]
  assert got is not None and reason in got, got


@pytest.fixture
def eight_devices(monkeypatch):
  """The mesh checks count devices; these cases need 8 (none is created)."""
  monkeypatch.setattr(jax, "device_count", lambda *a: 8)


@pytest.mark.parametrize("fields, message", [
    (dict(data=0), "config.mesh.data must be -1 or a positive int, got 0"),
    (dict(seq=True), "config.mesh.seq must be a positive int, got True"),
    (dict(data=2, model=2), "config.mesh data x model x seq = 2 x 2 x 1 must use all 8 devices"),
    (dict(batch_size=4), r"config.batch_size \(4\) must be divisible by the 8 devices"),
    (dict(data=2, model=4), r"config.num_heads \(2\) must be divisible by the 4 devices"),
    (dict(data=2, model=4, num_heads=4, mlp_features=30),
     r"config.mlp_features \(30\) must be divisible by the 4 devices"),
    (dict(data=4, model=2, num_heads=4, num_kv_heads=1),
     r"config.num_kv_heads \(1\) must be divisible by the 2 devices"),
    (dict(data=1, seq=8, seq_len=24),
     r"config.seq_len \(24\) must be divisible by 2 x config.mesh.seq = 16"),
    (dict(data=4, seq=2, implementation="xla"),
     "config.mesh.seq = 2 shards attention over the sequence: config.implementation must be "
     "None, 'ring' or 'context_parallel'"),
])
def test_training_mesh_errors(eight_devices, fields, message):
  config = tiny.get_config()
  for name, value in fields.items():
    if name in ("data", "model", "seq"):
      config.mesh[name] = value
    else:
      config[name] = value
  with pytest.raises(ValueError, match=message):
    training.check_config(config)


def test_training_mesh_accepts_a_full_mesh(eight_devices):
  config = tiny.get_config()
  config.mesh.data, config.mesh.model, config.mesh.seq = 2, 2, 2
  training.check_config(config)
