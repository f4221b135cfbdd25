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


@pytest.mark.parametrize("value, runs", [("9.0", True), ("nine", False), ("9", False)])
def test_the_hopper_plan_check_takes_a_compute_capability(value, runs, tmp_path):
  """JATTN_TEST_GPU_CAPABILITY (conftest, docs/testing.md) plans CUDA calls as on that GPU:
  9.0 puts flex_mgpu_ws first for a bfloat16 call at H = 128; a bad value stops the run
  before any test, naming the variable."""
  check = ("import jax, jax.numpy as jnp, jattn\n"
           "def test_plan():\n"
           "  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)\n"
           "  got = jattn.explain(q, q, q, is_causal=True, score_mod=jattn.mods.soft_cap(9.0))\n"
           "  assert got.implementation('cuda') == 'flex_mgpu_ws', str(got)\n")
  probe = tmp_path / "test_hopper_probe.py"
  probe.write_text(check)
  env = dict(os.environ, JATTN_TEST_GPU_CAPABILITY=value, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "tests.conftest", str(probe)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  if runs:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  else:
    assert done.returncode != 0
    assert f"JATTN_TEST_GPU_CAPABILITY must be a compute capability such as 9.0, got {value!r}" in (
        done.stdout + done.stderr), done.stdout[-2000:] + done.stderr[-2000:]
