"""`jattn.explain`: which implementation each platform would run for a call, and why."""

from __future__ import annotations

import jax
import numpy as np

from jattn._src import deviceless, dispatch
from jattn._src.dispatch import Explanation
from jattn._src.call import make_call
from jattn._src.dot_product_attention import check_implementation, dot_product_attention
from jattn._src.impl import interpret
from jattn._src.impl.registry import PLATFORMS
from jattn._src.parallel.context_parallel import context_parallel_plan
from jattn._src.parallel.plan import ContextParallelPlan

def explain(query, key, value, bias=None, mask=None, *, implementation=None,
            block_sizes=None, mesh=None, compile: str | None = None,
            **kwargs) -> Explanation | ContextParallelPlan:
  """What `dot_product_attention` with these arguments runs on each platform, and why.

  Takes the arguments of `jattn.dot_product_attention` (arrays or
  `jax.ShapeDtypeStruct`s); nothing is computed. For "cpu", "tpu" and "cuda":
  the implementation that `implementation` (None: the platform's best) resolves
  to when the program is lowered for that platform, its static plan, and for
  every implementation passed over on the way, the reason it refused the call.
  Bad arguments raise what `dot_product_attention` raises; an implementation that
  cannot take the call is reported, not raised.

  implementation="ring" or "context_parallel" (inside `jax.set_mesh`, as the call
  itself): for each platform the strategy ("ring", or the one chosen) with what
  every step runs (`RingStep`: "flex_tpu" on TPU where the kernel takes the step,
  else "blockwise") and the kernel's reason.

  mesh=mesh (with axis_name, strategy, batch_axis_name, head_axis_name,
  load_balance as `context_parallel_attention` takes them): the sequence-parallel
  plan instead, a `ContextParallelPlan` (`jattn.context_parallel_plan`): for each
  strategy the non-empty blocks per device (max / mean), the ring's critical
  path, the bytes each device sends and the memory it holds, or why it refused;
  the chunk order of the load balance, and which strategy strategy=None chooses.

  compile="v5e" (or "v6e", "v5p", "tpu7x", "h100", "h200"): the forward call is
  also compiled for that accelerator from this host, deviceless (libtpu for a TPU,
  `pip install "jax[tpu]"`; the CUDA plugin for a GPU), never run; the report's
  `compiled` (a `CompileReport`, printed after the choices) names the kernels in
  the compiled program and its memory (`memory_analysis()`: argument, output,
  temporary bytes). A compiled program whose kernels are not those of the
  implementation chosen for the target's platform raises a RuntimeError (a bug).

  Examples:
    >>> import jax, jax.numpy as jnp, jattn
    >>> q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)   # [B, T, N, H]
    >>> report = jattn.explain(q, q, q, is_causal=True)
    >>> report.implementation("tpu"), report.implementation("cpu")
    ('flex_tpu', 'blockwise')
    >>> report = jattn.explain(q, q, q, is_causal=True, scale=jnp.float32(0.1))
    >>> report.implementation("tpu"), report.reasons("tpu")["flex_tpu"]
    ('splash', 'a traced scale: the kernel takes a Python number')
  """
  if compile is not None and (mesh is not None or implementation in ("ring",
                                                                     "context_parallel")):
    raise ValueError("explain: compile= takes a call on one device; with mesh= or "
                     f"implementation={implementation!r} compile the sharded program "
                     "with jattn._src.deviceless.compile_for")
  if mesh is not None:
    return context_parallel_plan(query, key, value, bias, mask, mesh=mesh,
                                 implementation=implementation, block_sizes=block_sizes,
                                 **kwargs)
  implementation = check_implementation(implementation, block_sizes)
  if implementation in ("ring", "context_parallel"):
    return _explain_ring(implementation, query, key, value, bias, mask, block_sizes, kwargs)
  # Every array (or ShapeDtypeStruct) in the arguments becomes a tracer: shapes
  # and dtypes, no data. One object passed twice (q_segment_ids is
  # kv_segment_ids) stays one tracer, since the kernels' plans compare them.
  traceable = {name: x for name, x in kwargs.items() if _all_arrays(x)}
  leaves, tree = jax.tree.flatten(traceable)
  unique = list({id(x): x for x in leaves}.values())
  where = [[id(u) for u in unique].index(id(x)) for x in leaves]
  call = None

  def check(query, key, value, bias, mask, unique):
    nonlocal call  # only the static facts are used: the tracers die with this trace
    arrays = jax.tree.unflatten(tree, [unique[i] for i in where])
    call = make_call(query, key, value, bias, mask, block_sizes=block_sizes,
                     interpret=interpret.interpreting(), **{**kwargs, **arrays})

  jax.eval_shape(check, query, key, value, bias, mask, unique)
  choices = {}
  for platform in PLATFORMS:
    choices[platform] = dispatch.choose(call, implementation, platform)
  if compile is None:
    return Explanation(choices)
  return Explanation(choices, _compiled(compile, choices, query, key, value, bias, mask,
                                        implementation, block_sizes, kwargs))


def _compiled(target, choices, query, key, value, bias, mask, implementation, block_sizes,
              kwargs):
  """The forward call compiled for `target`, checked against the platform's choice."""
  choice = choices[deviceless.platform_of(target)]
  if choice.implementation is None:
    raise ValueError(f"explain: compile={target!r}: {choice.error}")
  arrays = {name: x for name, x in kwargs.items() if _all_arrays(x)}
  static = {name: x for name, x in kwargs.items() if name not in arrays}

  def call(query, key, value, bias, mask, arrays):
    return dot_product_attention(query, key, value, bias, mask, implementation=implementation,
                                 block_sizes=block_sizes, **static, **arrays)

  _, report = deviceless.compile_for(target, call, query, key, value, bias, mask, arrays)
  deviceless.check_kernels(report, choice.implementation)
  return report


def _explain_ring(implementation, query, key, value, bias, mask, block_sizes,
                  kwargs) -> Explanation:
  """The report the sequence-parallel call records, traced on shapes alone (nothing
  computed): its strategy and each platform's step."""
  arrays = {name: x for name, x in kwargs.items() if _all_arrays(x)}
  static = {name: x for name, x in kwargs.items() if name not in arrays}

  def ring(query, key, value, bias, mask, arrays):
    return dot_product_attention(query, key, value, bias, mask, implementation=implementation,
                                 block_sizes=block_sizes, **static, **arrays)

  with dispatch.explain_calls() as reports:
    jax.eval_shape(ring, query, key, value, bias, mask, arrays)
  return reports[0]


def _all_arrays(x) -> bool:
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(
      isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) for leaf in leaves)
