"""Every CUDA path compiled for an NVIDIA H100 and H200 by the real compilers, from this CPU.

`jattn._src.deviceless_cuda` gives compile-only CUDA devices described by the CUDA
plugin's own target configs; compiling on them runs cuDNN's graph build, Triton and
Mosaic GPU to PTX and ptxas, with the card's shared memory and register limits. Here:
cudnn, pallas, flex_gpu, flex_mgpu, xla, blockwise and implementation=None, forward and
`jax.grad`, the built-in masks and every `jattn.mods` mask and score function
(tests/kernels/test_gpu.py's cases), bfloat16 / float16 / float32, H = D in {64, 128,
256}, T != S, unaligned T, grouped heads. Each compiled program must hold the kernels
`jattn.explain` names for "cuda" and, for the fused kernels, no [T, S] array. A call a
plan refuses is skipped with the plan's reason; a call a plan accepts and the compiler
refuses fails. Values are not checked (nothing runs): tests/kernels/test_gpu.py does that
on a card.

Marked `compile` (the third CI leg, a venv with jax's CUDA plugin); skipped with the
reason where the plugin is missing. The default tier is a covering subset (every case on
each kernel once, each dtype, head size and shape on a few); the cross product is
`thorough`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import compat, deviceless_cuda
from jattn._src.kernels import flex_gpu, flex_mgpu
from tests.helpers import TRITON as _TRITON
from tests.kernels.test_gpu import CASES, _case

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(deviceless_cuda.missing() is not None,
                       reason=f"no deviceless CUDA compile: {deviceless_cuda.missing()}"),
]

IMPLEMENTATIONS = ("cudnn", "pallas", "flex_gpu", "flex_mgpu", "xla", "blockwise", None)
DTYPES = ("bfloat16", "float16", "float32")
# name -> (B, T, S, N, K, H = D): grouped heads (G = 2) except "unaligned"
SHAPES = {"base": (1, 256, 256, 4, 2, 64), "h128": (1, 256, 256, 4, 2, 128),
          "h256": (1, 256, 256, 4, 2, 256), "cross": (1, 192, 320, 4, 2, 64),
          "unaligned": (1, 200, 200, 4, 1, 64)}

# the custom-call target of Mosaic GPU kernels in compiled HLO (Triton's: tests.helpers.TRITON)
_MOSAIC = "mosaic_gpu_v2"


def _custom_calls(text: str, target: str) -> list[str]:
  """The kernel names of the compiled program's custom calls to `target`."""
  names = []
  for line in text.splitlines():
    if f'custom_call_target="{target}"' in line:
      # Triton: the module's `name = "..."`; Mosaic GPU: the kernel's symbol
      names += re.findall(r'\bname = \\?"(\w+)\\?"', line) if target == _TRITON else \
          sorted(set(re.findall(r"jattn_flex_mgpu_(?:fwd|dq|dkv)(?=_mosaic_gpu)", line)))
  return names


def kernels_in(text: str) -> tuple[str, set[str]]:
  """(implementation, its kernels) a compiled CUDA program runs, read from its custom calls."""
  cudnn = set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text))
  if cudnn:
    return "cudnn", cudnn
  mosaic = set(_custom_calls(text, _MOSAIC))
  if mosaic:
    return "flex_mgpu", mosaic
  triton = set(_custom_calls(text, _TRITON))
  if any(n.startswith("jattn_flex_gpu") for n in triton):
    return "flex_gpu", triton
  if any(n.startswith("mha_") for n in triton):
    return "pallas", triton
  # no kernel: "blockwise" is a while loop over kv blocks (which XLA may unroll, so read
  # the ops' names), "xla" has none
  return ("blockwise" if "/while/body/" in text else "xla"), set()


# implementation -> the kernels its gradient program adds to its forward's / its forward holds
BACKWARD = {"cudnn": {"__cudnn$fmhaSoftmaxBackward"}, "pallas": {"mha_backward"},
            "flex_gpu": {"jattn_flex_gpu_dq", "jattn_flex_gpu_dkv"},
            "flex_mgpu": {"jattn_flex_mgpu_dq", "jattn_flex_mgpu_dkv"}}
FORWARD = {"pallas": {"mha_forward"}, "flex_gpu": {"jattn_flex_gpu_fwd"},
           "flex_mgpu": {"jattn_flex_mgpu_fwd"}}


def _ts_arrays(text: str, T: int, S: int) -> list[str]:
  """Array shapes in the compiled program whose last two dims are [T, S] or [S, T]."""
  return sorted({m.group(0) for m in re.finditer(r"\w+\[[\d,]*?\b(\d+),(\d+)\]", text)
                 if {int(m.group(1)), int(m.group(2))} == {T, S}})


def _program(shape, dtype, case, implementation, grad):
  B, T, S, N, K, H = SHAPES[shape]
  kw = _case(case, B, T, S, N)[0]
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.dtype(dtype))
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.dtype(dtype))
  forward = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=implementation,
                                                        **kw)
  fn = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)), (0, 1, 2)) \
      if grad else forward
  return fn, (q, kv, kv), kw


def check_compiles(target, implementation, case, dtype, shape, grad):
  """Compiles the call for `target`; skips a plan's refusal with its reason."""
  fn, args, kw = _program(shape, dtype, case, implementation, grad)
  named = jattn.explain(*args, implementation=implementation, **kw)
  if named.implementation("cuda") is None:
    pytest.skip(f"refused on cuda: {named.choices['cuda'].error}")
  named = named.implementation("cuda")
  text = deviceless_cuda.compile_for(target, fn, *args).as_text()
  ran, kernels = kernels_in(text)
  assert ran == named, f"explain names {named}, the compiled program runs {ran}"
  assert FORWARD.get(named, set()) <= kernels, (named, kernels)
  if grad:
    assert BACKWARD.get(named, set()) <= kernels, (named, kernels)
  B, T, S, N, K, H = SHAPES[shape]
  if named in FORWARD or named == "cudnn":
    if T != S or H != T:  # a [T, S] shape is told from a [T, H] one
      assert not _ts_arrays(text, T, S), f"{named} holds [T, S] arrays: {_ts_arrays(text, T, S)}"


# flex_mgpu in the default tier: the mods and score paths not already compiled by flex_gpu's
# rows of the same case (its plain masks ride on the dtype, head and shape rows)
_MGPU_CASES = ("causal", "mods_chunked", "mods_prefix_lm", "mods_document", "mods_and_or",
               "soft_cap", "alibi", "sinks", "hand_written")


def _default_rows():
  """(target, implementation, case, dtype, shape, grad): every case on flex_gpu and cuDNN,
  the mods on flex_mgpu; each dtype, head size and shape on a few; forward-only programs;
  the H200 on a few. About 80 compiles: the tier's CUDA part on 2 cores."""
  rows = [("h100", i, c, "bfloat16", "base", True) for i in ("flex_gpu", "cudnn")
          for c in CASES]
  rows += [("h100", "flex_mgpu", c, "bfloat16", "base", True) for c in _MGPU_CASES]
  rows += [("h100", None, c, "bfloat16", "base", True) for c in ("causal", "alibi", "segments")]
  rows += [("h100", "pallas", c, "bfloat16", "base", True) for c in ("causal", "segments")]
  rows += [("h100", "xla", "causal", "bfloat16", "base", True),
           ("h100", "blockwise", "alibi", "bfloat16", "base", True)]
  rows += [("h100", i, "causal", d, "base", g) for i, d, g in (
      ("flex_gpu", "float32", False), ("cudnn", "float32", True), ("flex_mgpu", "float16", True),
      ("cudnn", "float16", True), ("pallas", "float16", True))]
  kernels = ("cudnn", "flex_gpu", "flex_mgpu")
  rows += [("h100", i, "causal", "bfloat16", s, True) for i in kernels for s in ("h128", "h256")]
  rows += [("h100", i, "mods_document" if i != "cudnn" else "causal", "bfloat16", s, True)
           for i in kernels for s in ("cross", "unaligned")]
  rows += [("h100", i, "causal", "bfloat16", "base", False) for i in (*kernels, None)]
  rows += [("h200", i, c, "bfloat16", "base", True) for i, c in (
      ("cudnn", "causal"), ("flex_gpu", "causal"), ("flex_mgpu", "causal"), (None, "alibi"))]
  return rows


DEFAULT = _default_rows()


def _id(row):
  target, implementation, case, dtype, shape, grad = row
  return f"{target}-{implementation}-{case}-{dtype}-{shape}-{'grad' if grad else 'fwd'}"


@pytest.mark.parametrize("row", DEFAULT, ids=_id)
def test_compiles_with_the_kernels_explain_names(row):
  check_compiles(*row)


@pytest.mark.skipif(compat.missing("pallas_mosaic_gpu_ws") is not None,
                    reason=f"no warp-specialised Mosaic GPU API: "
                           f"{compat.missing('pallas_mosaic_gpu_ws')}")
def test_the_default_on_a_hopper_gpu_compiles_ws_with_flex_mgpus_backward(monkeypatch):
  """Where the process sees a Hopper GPU (patched here: none is seen), implementation=None
  takes flex_mgpu_ws for a mask function in bfloat16 at H = 128; its gradient program
  compiles for an H100 with the warp-specialised forward and flex_mgpu's dq and dk/dv."""
  monkeypatch.setattr(flex_mgpu, "gpu_capability", lambda: (9, 0))
  fn, args, kw = _program("h128", "bfloat16", "mods_document", None, grad=True)
  assert jattn.explain(*args, **kw).implementation("cuda") == "flex_mgpu_ws"
  text = deviceless_cuda.compile_for("h100", fn, *args).as_text()
  mosaic = {line for line in text.splitlines() if f'custom_call_target="{_MOSAIC}"' in line}
  kernels = {name for line in mosaic
             for name in re.findall(r"jattn_flex_mgpu_(?:ws_fwd|fwd|dq|dkv)(?=_mosaic_gpu)", line)}
  assert kernels == {"jattn_flex_mgpu_ws_fwd", "jattn_flex_mgpu_dq", "jattn_flex_mgpu_dkv"}, kernels


@pytest.mark.thorough
@pytest.mark.parametrize("row", [
    (t, i, c, d, s, g) for t in deviceless_cuda.TARGETS for i in IMPLEMENTATIONS for c in CASES
    for d in DTYPES for s in SHAPES for g in (False, True)
    if (t, i, c, d, s, g) not in DEFAULT], ids=_id)
def test_cross_product_compiles_with_the_kernels_explain_names(row):
  check_compiles(*row)


# ---- faithful to the card: what failed on the H200 fails here, with the same reason

@pytest.mark.parametrize("target", deviceless_cuda.TARGETS)
def test_a_tile_setting_over_the_cards_shared_memory_fails_as_on_the_h200(target):
  """flex_gpu's backward at H = 128 with 128 x 64 tiles, 8 warps and 3 stages asks for
  240 KiB of shared memory, over the card's 227 KiB: the H200 run's failure, here too."""
  fn, args, _ = _program("h128", "bfloat16", "causal", "flex_gpu", grad=True)
  with flex_gpu.launch_parameters(block_q=128, block_kv=64, num_warps=8, num_stages=3):
    with pytest.raises(Exception, match="Shared memory size limit exceeded: requested "
                                        r"\d+, available: 232448"):
      deviceless_cuda.compile_for(target, fn, *args)


def test_the_targets_are_the_cards():
  for target, kind in (("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200 141GB HBM3e")):
    [device] = deviceless_cuda.cuda_devices(target)
    assert device.device_kind == kind and device.platform == "gpu"
    text = deviceless_cuda.target_config(target)
    assert "major: 9" in text and "shared_memory_per_block_optin: 232448" in text
  with pytest.raises(ValueError, match="target must be one of"):
    deviceless_cuda.cuda_devices("h300")


def test_saved_descriptions_stand_in_for_a_plugin_without_them(tmp_path, monkeypatch):
  """$JATTN_CUDA_TARGET_CONFIGS (for jax 0.11's plugin, which embeds none): the saved
  text is what target_config gives; a folder without the card's file is named in the
  error."""
  saved = deviceless_cuda.save_target_configs(tmp_path / "saved")
  assert sorted(p.name for p in saved) == ["h100.txtpb", "h200.txtpb"]
  (tmp_path / "saved" / "h200.txtpb").write_text("a stand-in description")
  (tmp_path / "empty").mkdir()
  deviceless_cuda.target_config.cache_clear()
  try:
    monkeypatch.setenv(deviceless_cuda.CONFIGS_FOLDER, str(tmp_path / "saved"))
    assert deviceless_cuda.target_config("h200") == "a stand-in description"
    assert "major: 9" in deviceless_cuda.target_config("h100")
    monkeypatch.setenv(deviceless_cuda.CONFIGS_FOLDER, str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match=r"JATTN_CUDA_TARGET_CONFIGS=.*empty has no "
                                           r"h100\.txtpb"):
      deviceless_cuda.target_config.__wrapped__("h100")
  finally:
    deviceless_cuda.target_config.cache_clear()


def test_the_kernel_reader_sees_a_TS_array_and_the_xla_path():
  """The checks above can fail: the "xla" implementation materializes [T, S] scores."""
  fn, args, _ = _program("cross", "bfloat16", "causal", "xla", grad=False)
  text = deviceless_cuda.compile_for("h100", fn, *args).as_text()
  assert kernels_in(text) == ("xla", set())
  assert _ts_arrays(text, 192, 320)
