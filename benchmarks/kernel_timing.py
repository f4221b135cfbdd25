"""The timing protocol of the accelerator kernel benchmarks (tpu_kernels.py, gpu_kernels.py):
each contender compiled and warmed up once, then timed in interleaved rounds in a
shuffled order, so that drifts of the machine hit every contender alike."""

from __future__ import annotations

import random
import time

import jax
import jax.numpy as jnp


def timed(fn, inputs, backward: bool):
  """A function that runs fn (forward, or forward + backward into q, k, v) once, compiled
  and warmed up beforehand, and returns its seconds."""
  if backward:
    run = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                           argnums=(0, 1, 2)))
  else:
    run = jax.jit(fn)
  jax.block_until_ready(run(*inputs))  # compile and warm up

  def once():
    start = time.perf_counter()
    jax.block_until_ready(run(*inputs))
    return time.perf_counter() - start
  return once


def interleaved(fns: dict, rounds: int) -> dict:
  """name -> [seconds per round]: every round runs each timed function once, shuffled."""
  times = {name: [] for name in fns}
  for _ in range(rounds):
    order = list(fns)
    random.shuffle(order)
    for name in order:
      times[name].append(fns[name]())
  return times
