"""Every TPU path compiled by libtpu for v5e, v6e, v5p and TPU7x, deviceless, from this CPU.

`jax.export` stops before the TPU compiler; here Mosaic and XLA:TPU compile each
program as they would on the chip (VMEM limits, layouts, Mosaic's lowering to the
generation). Each program is checked for the kernels `jattn.explain` names for "tpu"
(tests/compile/tpu_programs.py) and, on the linear-memory paths, for no [T, S] buffer.

The default tier covers the matrix instead of multiplying it out (about 90 compiles):
every implementation on every generation; every `jattn.mods` mask and score function on
every generation (paired, one compile a pair); the built-in masks per kernel, every dtype
and head size, T != S, an unaligned T and grouped heads once each, the generation
rotating; the decode path on every generation; the context-parallel strategies and the
Transformer on a 2x2 v5e slice. `-m thorough` runs the cross product.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

from tests.compile.tpu_programs import (BUILT_IN_MASKS, GENERATIONS, IMPLEMENTATIONS, LINEAR,
                                        MASK_MODS, SCORE_MODS, Case, compile_case, ts_bytes)


def _gen(i: int) -> str:
  return GENERATIONS[i % len(GENERATIONS)]


# ---------------------------------------------------------------- every implementation


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("target", GENERATIONS)
def test_each_implementation_compiles_forward_and_gradient(target, implementation):
  """Causal, bfloat16, H = 128, T = S = 512: each path compiles with its own kernels."""
  case = Case(T=512, masks=("causal",))
  chosen, report = compile_case(case, implementation, target)
  assert chosen is not None, report


@pytest.mark.parametrize("target, implementation", [
    ("v5e", "splash"), ("v5e", "flex_tpu"), ("v5e", "blockwise"), ("v5e", "xla"),
    ("v6e", "flex_tpu"), ("v5p", "splash"), ("tpu7x", "flex_tpu")])
def test_no_TS_buffer_on_the_linear_paths(target, implementation):
  """T = S = 4096, forward (and gradient but for "xla"): the kernels and blockwise hold no
  [T, S] float32 buffer in HBM; "xla" holds several, so the check tells them apart. (At
  T = S = 1024 it cannot: XLA:TPU reports no temporary memory for the dense forward, and
  a gradient's float32 dq, dk, dv for N = 4, H = 128 outweigh one [T, S].)"""
  case = Case(T=4096, masks=("causal",))
  chosen, report = compile_case(case, implementation, target, grad=implementation != "xla")
  assert chosen == implementation, report
  if chosen in LINEAR:
    assert report.memory["temp"] < ts_bytes(case), report
  else:
    assert report.memory["temp"] >= ts_bytes(case), report


# ---------------------------------------------------------------- every mod, every generation

# each mask mod and score mod once per generation, paired so one compile covers two
MOD_PAIRS = list(itertools.zip_longest(MASK_MODS, SCORE_MODS))


@pytest.mark.parametrize("mask_mod, score_mod", MOD_PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("target", GENERATIONS)
def test_flex_tpu_compiles_every_mod(target, mask_mod, score_mod):
  case = Case(T=1024, S=1024, mask_mod=mask_mod, score_mod=score_mod,
              sinks=mask_mod == "document")
  chosen, report = compile_case(case, "flex_tpu", target)
  assert chosen == "flex_tpu", report


# ---------------------------------------------------------------- built-in masks


@pytest.mark.parametrize("implementation", ["splash", "flex_tpu"])
@pytest.mark.parametrize("mask", BUILT_IN_MASKS[1:])
def test_built_in_masks(mask, implementation):
  """Each kernel with every built-in mask (flex_tpu reads lengths and segment ids as mask
  mods)."""
  i = BUILT_IN_MASKS.index(mask) + (implementation == "flex_tpu")
  chosen, report = compile_case(Case(T=1024, masks=(mask,)), implementation, _gen(i))
  assert chosen == implementation, report


# ---------------------------------------------------------------- dtypes, head sizes, shapes

DTYPE_HEADS = list(itertools.product(("bfloat16", "float16", "float32"), (64, 128, 256)))


@pytest.mark.parametrize("dtype, H", DTYPE_HEADS)
def test_every_dtype_and_head_size_with_the_default_choice(dtype, H):
  """implementation=None: whatever the TPU plan chooses compiles, with its kernel. float16,
  which the kernels refuse, goes to "xla" (whose gradient the tests above compile): its
  forward only, at T = 512, as XLA:TPU's dense float16 gradient took minutes."""
  f16 = dtype == "float16"
  case = Case(T=512 if f16 else 1024, H=H, dtype=dtype, masks=("causal",))
  chosen, report = compile_case(case, None, _gen(DTYPE_HEADS.index((dtype, H))), grad=not f16)
  assert chosen == ("xla" if f16 else "flex_tpu"), report


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("implementation", ["splash", "flex_tpu"])
def test_the_kernels_in_each_dtype_they_take(implementation, dtype):
  case = Case(T=1024, H=64 if dtype == "float32" else 256, dtype=dtype,
              mask_mod="causal" if implementation == "flex_tpu" else None)
  chosen, report = compile_case(case, implementation, _gen(len(dtype) + len(implementation)))
  assert chosen == implementation, report


# issue 43 item 4: Gemma-style H = D = 256 and MLA-style H = 192, D = 128, with the score
# mods whose tiles flex_tpu evaluates (soft-cap's folded multiplies, ALiBi's split P V),
# and float32 inputs (the MXU's multi-pass dots); cheap sizes, one generation each
FLEX_HEADS = [dict(H=256, score_mod="soft_cap", target="v5e"),
              dict(H=192, D=128, score_mod="alibi", target="v6e"),
              dict(H=192, D=128, score_mod="soft_cap", target="v5e"),
              dict(H=128, dtype="float32", score_mod="alibi", target="v6e")]


@pytest.mark.parametrize("kw", FLEX_HEADS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_flex_tpu_long_and_unequal_heads_and_float32(kw):
  kw = dict(kw)
  target = kw.pop("target")
  case = Case(T=512, masks=("causal",), **kw)
  chosen, report = compile_case(case, "flex_tpu", target)
  assert chosen == "flex_tpu", report


def test_float16_is_refused_by_the_kernels_with_a_reason():
  """float16 is no Mosaic dtype jattn's TPU kernels take: they refuse, None falls back."""
  for implementation in ("splash", "flex_tpu"):
    chosen, reason = compile_case(Case(T=1024, dtype="float16"), implementation, "v5e")
    assert chosen is None and "float16" in reason, reason


SHAPES = {"T_ne_S": dict(T=512, S=1536), "unaligned_T": dict(T=1000, S=1000),
          "short_unaligned": dict(T=77, S=300), "grouped": dict(T=1024, N=8, K=2)}


@pytest.mark.parametrize("implementation", ["splash", "flex_tpu", None], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape, implementation):
  i = list(SHAPES).index(shape) + (implementation is None)
  case = Case(**SHAPES[shape], masks=("causal",))
  chosen, report = compile_case(case, implementation, _gen(i))
  if chosen is None:  # the kernel refuses this shape: with a reason, and None does not pick it
    assert implementation is not None and report, report
    assert compile_case(case, None, _gen(i))[0] != implementation
  else:
    assert implementation is None or chosen == implementation, report


@pytest.mark.parametrize("implementation", ["splash", "flex_tpu"])
def test_bfloat16_kernels_compile_at_highest_matmul_precision(implementation):
  """Found by this tier: with jax_default_matmul_precision "highest" (or "high"), every
  dot in the kernels asked Mosaic for float32 precision of bfloat16 operands, which it
  does not compile ("Bad lhs type"); the kernels now trace their dots at the default."""
  case = Case(T=512, mask_mod="causal" if implementation == "flex_tpu" else None,
              masks=() if implementation == "flex_tpu" else ("causal",))
  with jax.default_matmul_precision("highest"):
    chosen, report = compile_case(case, implementation, "v6e")
  assert chosen == implementation, report


# ---------------------------------------------------------------- thorough: the cross product

_EVERYTHING = [
    (target, implementation, Case(T=T, S=S, N=N, K=K, H=H, dtype=dtype, masks=masks,
                                  mask_mod=mask_mod, score_mod=score_mod))
    for target in GENERATIONS
    for implementation in IMPLEMENTATIONS
    for dtype in ("bfloat16", "float16", "float32")
    for H in (64, 128, 256)
    for T, S, N, K in ((1024, 1024, 4, 4), (512, 1536, 4, 4), (1000, 1000, 4, 4),
                       (1024, 1024, 8, 2))
    for masks, mask_mod, score_mod in (
        [((m,), None, None) for m in BUILT_IN_MASKS]
        + [((), m, None) for m in MASK_MODS] + [((), None, s) for s in SCORE_MODS])]


@pytest.mark.thorough
@pytest.mark.parametrize("target, implementation, case", _EVERYTHING, ids=str)
def test_cross_product(target, implementation, case):
  """Where the plan takes the call, it compiles with its kernels; else it says why."""
  chosen, report = compile_case(case, implementation, target)
  if chosen in LINEAR:
    assert report.memory["temp"] < ts_bytes(case), report
