"""tokamax's ragged_paged_attention compiled for TPU v5e / v6e on the decode batch of
`decode_tpu.py` (deviceless; nothing runs on a TPU): what the compiler reports of it.

tokamax (0.0.17, Python 3.12, jax >= 0.11.1) is no dependency of jattn. Installed
beside a venv without touching it:

  pip install --target DIR --no-deps tokamax einshape pydantic pydantic-core \\
      annotated-types typing-inspection qwix immutabledict tensorboardX xprof fire \\
      termcolor six
  JAX_PLATFORMS=cpu PYTHONPATH=DIR python benchmarks/decode_tokamax_tpu.py v5e [--out FILE]

Its cache is one array [P, page_size, 2 K, H] (keys and values of a head side by
side); the metadata (lengths, page indices, cumulative query lengths, the
decode/prefill split) are traced. The call skips the cache update (attention
only, as jattn's estimate) but returns the cache. Reported: the compile time,
the program's temporaries, XLA's bytes accessed, and the bundles of its decode
kernel's final schedule (LIBTPU_INIT_ARGS=--xla_jf_dump_to, set by this script
before libtpu loads). Its decode kernel is a loop over the steps of a schedule
computed at run time, with nested loops whose trip counts that schedule sets, so
its bundles are not turned into a time here (docs/sampling.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def main():
  generation = sys.argv[1]
  out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
  dump = tempfile.mkdtemp(prefix="jattn_tokamax_dump_")
  os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={dump}"
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  sys.argv[1:] = ["--tokamax_cross_compile"]  # tokamax reads its --tokamax_* flags from argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import tokamax
  from jax.experimental import topologies
  from benchmarks import decode_tpu

  lengths, max_length = decode_tpu.BATCHES["B=8, 256..32k"]
  N, K, H, ps = decode_tpu.N, decode_tpu.K, decode_tpu.H, decode_tpu.PAGE
  B = len(lengths)
  devices = topologies.get_topology_desc(f"{generation}=1x1", "tpu").devices
  mesh = jax.sharding.Mesh(devices, ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.P())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shard)
  num_pages = sum(-(-n // ps) for n in lengths) + B
  args = dict(queries=spec((B, N, H), jnp.bfloat16), keys=spec((B, K, H), jnp.bfloat16),
              values=spec((B, K, H), jnp.bfloat16),
              kv_cache=spec((num_pages, ps, 2 * K, H), jnp.bfloat16),
              kv_lens=spec((B,), jnp.int32), page_indices=spec((B * (max_length // ps),),
                                                               jnp.int32),
              cu_q_lens=spec((B + 1,), jnp.int32), distribution=spec((3,), jnp.int32))

  def attend(**a):
    return tokamax.ops.ragged_paged_attention(**a, sm_scale=1 / float(np.sqrt(H)),
                                              skip_kv_update=True)

  start = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the TPU generation for its plan
    traced = jax.jit(attend).trace(**args)
  compiled = traced.lower(lowering_platforms=("tpu",)).compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  kernels = sorted({name for name in os.listdir(dump) if name.endswith("-final_bundles.txt")
                    and "RPA" in name and "schedule" not in name})
  counted = {}
  for name in kernels:
    kernel = name.split("-", 1)[1].rsplit(".1-", 1)[0]
    counted[kernel] = decode_tpu.bundles(pathlib.Path(dump), kernel)[0]
  result = {"generation": generation, "tokamax": tokamax.__version__ if hasattr(
      tokamax, "__version__") else "0.0.17", "jax": jax.__version__, "lengths": list(lengths),
            "compile_s": seconds,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "bytes_accessed": compiled.cost_analysis().get("bytes accessed"),
            "kernel_bundles": counted, "custom_calls": text.count("tpu_custom_call")}
  print(json.dumps(result, indent=1))
  if out is not None:
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
  main()
