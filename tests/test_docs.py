"""The documentation site builds without a warning (`mkdocs build --strict`).

A broken link, a nav entry without its page, a docstring mkdocstrings cannot
parse or a public name that moved fail here. The code blocks of README.md and
docs/ are tested by pytest-markdown-docs (see conftest.py).
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.docs_build
def test_mkdocs_build_strict(tmp_path):
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr


def public_objects():
  import jattn
  import jattn.rope
  import jattn.transformer
  modules = [jattn, jattn.mods, jattn.nnx, jattn.linen, jattn.transformer, jattn.sharding,
             jattn.rope, jattn.paged]
  seen = set()
  for module in modules:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
      obj = getattr(module, name)
      if getattr(obj, "__module__", "").startswith("jattn") and id(obj) not in seen:
        seen.add(id(obj))
        yield f"{module.__name__}.{name}", obj


def test_docstring_examples_run():
  """Every `>>>` example in a public docstring gives the output it shows."""
  import doctest
  finder = doctest.DocTestFinder(recurse=False)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  ran = 0
  for name, obj in public_objects():
    for test in finder.find(obj, name, globs={}):
      if test.examples:
        ran += 1
        runner.run(test)
  failed, attempted = runner.summarize(verbose=False)
  assert failed == 0, f"{failed} of {attempted} docstring examples failed (printed above)"
  assert ran >= 10, ran
