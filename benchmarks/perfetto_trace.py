"""The events of a few calls under `jax.profiler.trace`, read back from the Perfetto
trace it writes; shared by profile_ops.py (XLA:CPU) and gpu_profile.py (GPU kernels)."""

import glob
import gzip
import json
import tempfile

import jax


def trace_events(f, inputs, calls: int) -> list[dict]:
  """The trace events of `calls` calls of f(*inputs), each waited for."""
  with tempfile.TemporaryDirectory() as workdir:
    with jax.profiler.trace(workdir, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(f(*inputs))
    path, = glob.glob(f"{workdir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as file:
      trace = json.load(file)
  return trace["traceEvents"] if isinstance(trace, dict) else trace
