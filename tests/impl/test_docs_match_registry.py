"""The implementation lists and per-platform orders that the docs spell out match the
registry (jattn/_src/impl/registry.py), so that a new kernel or a new order cannot
leave dot_product_attention's docstring, the README table or docs/implementations.md
behind."""

import inspect
import pathlib
import re
import types

import pytest

import jattn
from jattn._src.impl import registry

# the docs spell the portable order (a Hopper GPU's adds flex_mgpu_ws: registry.hopper_fast_path)
pytestmark = pytest.mark.usefixtures("host_without_cuda")

ROOT = pathlib.Path(__file__).resolve().parents[2]
_LARGE = types.SimpleNamespace(dims=types.SimpleNamespace(B=8, N=32, T=8192, S=8192),
                               mask_mod=None,
                               structure=types.SimpleNamespace(local_window=None))


def _kernels(platform):
  """The platform's own kernels in preference order (before the generic fallbacks)."""
  return tuple(n for n in registry.preference(_LARGE, platform)
               if n not in ("xla", "blockwise"))


def _quoted(text):
  return re.findall(r'"([a-z_]+)"', text)


def _implementation_paragraph():
  # cleaned: Python 3.13 strips a docstring's common indentation when it compiles it
  doc = inspect.cleandoc(jattn.dot_product_attention.__doc__)
  return doc[doc.index("  implementation:"):doc.index("  dropout_rate")]


def test_the_docstring_names_every_implementation_and_each_platforms_order():
  text = _implementation_paragraph()
  assert set(_quoted(text)) >= set(registry.NAMES), set(registry.NAMES) - set(_quoted(text))
  for platform, phrase in (("cuda", "on GPU"), ("tpu", "on TPU")):
    segment = re.split(r"[;)]", text[text.index(phrase):])[0]
    assert tuple(_quoted(segment)) == _kernels(platform), (platform, segment)


def test_the_readme_table_lists_every_implementation_with_the_cuda_order():
  readme = (ROOT / "README.md").read_text()
  names = re.findall(r'^\| `"([a-z_]+)"` \|', readme, flags=re.M)
  assert sorted(names) == sorted(registry.NAMES)
  cuda = _kernels("cuda")
  assert tuple(n for n in names if n in cuda) == cuda  # rows in the order tried


def test_the_performance_guide_spells_the_cuda_order():
  guide = (ROOT / "docs" / "implementations.md").read_text()
  sentence = guide[guide.index('On GPU, "cudnn"'):]
  sentence = sentence[:sentence.index('else "xla"')]
  assert tuple(_quoted(sentence)) == _kernels("cuda")
