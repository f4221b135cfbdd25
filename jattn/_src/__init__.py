"""The implementation of jattn; the public names live in jattn/__init__.py."""
