"""The documentation site builds without a warning (`mkdocs build --strict`).

A broken link, a nav entry without its page, a docstring mkdocstrings cannot
parse or a public name that moved fail here. The code blocks of README.md and
docs/ are tested by pytest-markdown-docs (see conftest.py).
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
