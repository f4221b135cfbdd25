"""`import jattn` imports JAX and NumPy only: flax (the modules), and what only the
training example uses (optax, orbax, ml_collections, matplotlib, tqdm), load on use."""

import subprocess
import sys

import pytest

HEAVY = ("flax", "optax", "orbax", "ml_collections", "matplotlib", "tqdm")


def _imported_after(code: str) -> set[str]:
  probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       check=True).stdout.split()
  return {name for name in HEAVY if name in out}


def test_import_jattn_and_a_call_pull_in_no_flax_or_example_libraries():
  code = ("import jax.numpy as jnp, jattn\n"
          "q = jnp.ones((1, 8, 2, 4))\n"
          "jattn.dot_product_attention(q, q, q, is_causal=True)")
  assert _imported_after(code) == set()


@pytest.mark.parametrize("code", ["import jattn.nnx", "from jattn import linen",
                                  "import jattn; jattn.transformer.Transformer"])
def test_the_flax_submodules_load_on_use(code):
  imported = _imported_after(code)  # (one interpreter: each imports flax anew, seconds)
  # flax brings optax itself (a dependency of flax); jattn adds nothing of the examples'
  assert {"orbax", "ml_collections", "matplotlib", "tqdm"}.isdisjoint(imported)
  assert "flax" in imported
