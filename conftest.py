"""Root conftest: the code blocks of README.md and docs/*.md run as tests.

pytest-markdown-docs (`--markdown-docs`, set in pyproject.toml) turns every
```python fence into a test; a fence marked `continuation` runs after the one
before it in the same file, `notest` is skipped (the text next to each such
fence says why). Every block imports what it uses, as a reader's would.
"""
