"""No DeprecationWarning (or any warning) reaches a CPU user: `import jattn` and default
calls, forward and gradient, functions and modules, under `warnings.simplefilter("error")`.

A default call traces every platform's branch, the CUDA one included, which on
jax >= 0.11.1 imports jax's deprecated Pallas GPU `mha` (jattn/_src/compat.py
silences that import's warning). Run in a fresh interpreter, so no earlier import
has already spent the warning.
"""

import subprocess
import sys
import textwrap

_DEFAULT_CALLS = textwrap.dedent("""
    import warnings
    warnings.simplefilter("error")
    import jax, jax.numpy as jnp
    import jattn
    q = jnp.ones((1, 256, 2, 64))  # [B, T, N, H]: blockwise on CPU, kernels elsewhere
    attend = lambda q: jattn.dot_product_attention(q, q, q, is_causal=True)
    attend(q)
    jax.grad(lambda q: jnp.sum(attend(q)))(q)
    jax.jit(jax.vmap(attend))(q[None])
    jattn.dot_product_attention(q, q, q, mask_mod=jattn.mods.sliding_window(64, 0))
    str(jattn.explain(q, q, q, is_causal=True))

    import jattn.nnx, jattn.linen
    from flax import nnx
    x = jnp.ones((1, 256, 16))  # [B, T, F]
    module = jattn.nnx.MultiHeadAttention(2, 16, rngs=nnx.Rngs(0))
    module(x, is_causal=True)
    nnx.grad(lambda m: jnp.sum(m(x, is_causal=True)))(module)
    linen = jattn.linen.MultiHeadAttention(2)
    params = linen.init(jax.random.key(0), x)
    jax.grad(lambda p: jnp.sum(linen.apply(p, x, is_causal=True)))(params)
    print("no warning")
""")


def test_import_and_default_calls_emit_no_warning():
  run = subprocess.run([sys.executable, "-c", _DEFAULT_CALLS], capture_output=True,
                       text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == "no warning"
