"""Which implementation runs, chosen per platform when the program is lowered.

A program is traced once and may be lowered for any platform (`jax.export`
for "tpu" from a CPU host, AOT lowering, `jax.default_device`). So the choice
is made for every platform in `registry.PLATFORMS`, statically, from the call
alone, and `per_platform` puts the distinct choices under
`jax.lax.platform_dependent`: only the branch of the platform being lowered
is lowered. When every platform makes the same choice, no branch is built.
`jax.devices()` takes no part in the platform. Inside the CUDA branch one choice reads
the GPU the process sees (`registry.hopper_fast_path`: a kernel that runs on Hopper
only, first there); with none seen, the branch stays portable.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jattn._src.impl.no_work import NoWork
from jattn._src.impl.registry import IMPLEMENTATIONS, PLATFORMS, preference, why_first

# platform_dependent's `default=` branch: every platform not named (ROCm and others).
_DEFAULT = "rocm"


@dataclasses.dataclass(frozen=True)
class Choice:
  """What runs on one platform: an implementation and its plan, or an error.

  passed_over: (name, reason) of every implementation tried before it and refused.
  error: an explicit implementation that cannot run there (raised if lowered there).
  why: where the preference put it before the platform's usual first choice, why.
  """

  platform: str
  implementation: str | None
  plan: object = None
  passed_over: tuple[tuple[str, str], ...] = ()
  error: str | None = None
  why: str | None = None

  @property
  def key(self):
    """What decides the computation (branches with equal keys are one branch)."""
    return (self.implementation, self.plan, self.error)


def choose(call, implementation: str | None, platform: str, *, registry=None,
           order=None) -> Choice:
  """The implementation `implementation` (None: the platform's best) runs on `platform`.

  registry / order: the implementations and their preference (default those of
  `dot_product_attention`; `decode_attention` passes its own)."""
  registry = IMPLEMENTATIONS if registry is None else registry
  order = preference if order is None else order
  if implementation is not None:
    return _explicit(call, implementation, platform, registry)
  passed_over = []
  for name in order(call, platform):
    plan = registry[name].plan_for(call, platform)
    if not isinstance(plan, str):
      # (no reason of speed for a call that runs nothing)
      why = (why_first(call, platform, name)
             if order is preference and not isinstance(plan, NoWork) else None)
      return Choice(platform, name, plan, tuple(passed_over), why=why)
    passed_over.append((name, plan))
  # "xla" takes every call, so this cannot happen
  raise AssertionError(f"no implementation takes this call on {platform}: {passed_over}")


def _explicit(call, name: str, platform: str, registry) -> Choice:
  """The one implementation the caller named; its refusal is the Choice's error."""
  plan = registry[name].plan_for(call, platform)
  if not isinstance(plan, str):
    return Choice(platform, name, plan)
  return Choice(platform, None, passed_over=((name, plan),),
                error=f"implementation={name!r} cannot run this call on {platform!r}: {plan}")


def choose_all(call, implementation: str | None, *, registry=None,
               order=None) -> tuple[Choice, ...]:
  """One `Choice` per platform; a ValueError when an explicit implementation runs nowhere."""
  choices = tuple(choose(call, implementation, p, registry=registry, order=order)
                  for p in PLATFORMS)
  if all(c.error is not None for c in choices):
    # the reason on the platforms it was made for (e.g. "it takes no bias"),
    # else that it runs on none of them
    own = (IMPLEMENTATIONS if registry is None else registry)[implementation].platforms or (
        PLATFORMS)
    reasons = dict.fromkeys(reason for c in choices if c.platform in own or call.interpret
                            for _, reason in c.passed_over)
    raise ValueError(f"implementation={implementation!r} cannot run this call: "
                     f"{'; '.join(reasons)}")
  return choices


_SHOWN = ("cpu", "tpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of `jattn.explain`: one `dispatch.Choice` per platform.

  choices[platform].implementation: what runs ("splash", "blockwise", ...), or
  None when an explicit implementation cannot run there (`.error` says why);
  .plan: its static plan (e.g. splash's mask expression); .passed_over: each
  implementation tried before it, with the reason it refused the call.
  `str()` gives the same as a readable report.
  """

  choices: dict
  # explain(..., compile=target): what the compiler made of the call for that target
  # (a `jattn._src.deviceless.CompileReport`), else None
  compiled: object = None

  def implementation(self, platform: str) -> str | None:
    return self.choices[platform].implementation

  def reasons(self, platform: str) -> dict[str, str]:
    """Implementation name -> why it refused the call on `platform`."""
    return dict(self.choices[platform].passed_over)

  def __str__(self) -> str:
    lines = []
    for platform in _SHOWN:
      choice = self.choices[platform]
      if choice.implementation is None:
        lines.append(f"{platform}: cannot run: {choice.error}")
      else:
        lines.append(f"{platform}: {choice.implementation}  {choice.plan}")
        if choice.why:
          lines.append(f"    why: {choice.why}")
        for name, reason in choice.passed_over:
          lines.append(f"    not {name}: {reason}")
    if self.compiled is not None:
      lines.append(str(self.compiled))
    return "\n".join(lines)


_RECORDING = contextvars.ContextVar("jattn_explain_calls", default=None)


@contextlib.contextmanager
def explain_calls():
  """Collects an `Explanation` of every `dot_product_attention` call made in the block.

  For models and modules: `with jattn.explain_calls() as reports: model(x)` gives
  one report per attention call (per layer), with the choices the call made.
  Calls inside a jitted function are seen when it is traced (its first call).

  Examples:
    >>> import jax, jattn
    >>> q = jax.numpy.ones((1, 256, 2, 64))
    >>> with jattn.explain_calls() as reports:
    ...   out = jattn.dot_product_attention(q, q, q, is_causal=True)
    >>> [r.implementation("cpu") for r in reports]
    ['blockwise']
  """
  reports = []
  token = _RECORDING.set(reports)
  try:
    yield reports
  finally:
    _RECORDING.reset(token)


def record(choices) -> None:
  """Inside `explain_calls`, keeps the report of one call's choices."""
  reports = _RECORDING.get()
  if reports is not None:
    reports.append(Explanation({c.platform: c for c in choices}))


def per_platform(branches: dict, *args):
  """branches: platform -> (key, fn). fn(*args) for the platform being lowered.

  Platforms whose keys are equal share one branch; a single branch is called
  directly. A branch fn of None raises its error (the key's last item) when
  lowered: its outputs take the shape of another branch's.
  """
  distinct = {key: fn for key, fn in branches.values()}
  if len(distinct) == 1:
    key, fn = next(iter(distinct.items()))
    return fn(*args)
  runnable = next(fn for fn in distinct.values() if fn is not None)
  shapes = None

  def refusal(error):
    def fn(*args):
      nonlocal shapes
      if shapes is None:
        shapes = jax.eval_shape(runnable, *args)
      leaves, tree = jax.tree.flatten(shapes)
      avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
      # No operands: nothing for vmap or grad to see, so the primitive needs no
      # batching or differentiation rule (platform_dependent broadcasts it under vmap).
      return jax.tree.unflatten(tree, _refused_p.bind(error=error, avals=avals))
    return fn

  # One callable per key: platform_dependent joins platforms whose branches are
  # the same object, so an equal choice is traced once, not once per platform.
  shared = {key: fn if fn is not None else refusal(key[-1]) for key, fn in distinct.items()}
  default = shared[branches[_DEFAULT][0]]
  # platform_dependent never joins a named branch with `default`: leave the
  # platforms that choose what the default does to it.
  fns = {p: shared[key] for p, (key, _) in branches.items() if shared[key] is not default}
  return jax.lax.platform_dependent(*args, default=default, **fns)


def compute(call, choices: tuple[Choice, ...]):
  """Runs the chosen implementations on the call's arrays -> (out, weights, lse, max_logits),
  each of the last three None unless asked for."""
  mods = call.modifiers.mods
  # A user's function traced for this call (a jaxpr in the static part of the
  # modifiers) would never hit a jit cache (and fill it), so it runs inside the
  # caller's trace; ready-made mask mods and sinks are traced inside the jit,
  # which caches on their static fields.
  fn = _compute if mods is None or mods.is_cacheable else _compute.__wrapped__
  try:
    return fn(call.query, call.key, call.value, call.modifiers, layout=call.layout,
              choices=choices, return_weights=call.return_weights,
              return_residual=call.return_residual, return_max_logits=call.return_max_logits)
  except (NotImplementedError, TypeError) as error:
    _explain_forward_mode(error, choices)
    raise


def _explain_forward_mode(error: Exception, choices) -> None:
  """Adds to a failed forward-mode derivative what jattn's implementations support: JAX
  takes none of a custom_vjp function itself, nor of jax's own kernels at all."""
  plain = "forward-mode" in str(error)  # JAX's words for a custom_vjp under jax.jvp
  if not (plain or isinstance(error, NotImplementedError)):
    return
  platforms = {}
  for c in choices:
    if c.implementation is not None and not IMPLEMENTATIONS[c.implementation].forward_mode:
      platforms.setdefault(c.implementation, []).append(c.platform)
  notes = []
  if plain:
    notes.append("JAX takes no forward-mode derivative (jax.jvp, jax.jacfwd, jax.linearize) "
                 "of a function with a custom VJP, which 'blockwise' and jattn's kernels "
                 "have; implementation='xla' has one. Forward over reverse (jax.jvp of "
                 "jax.grad, jax.hessian) passes through every jattn implementation.")
  if platforms:
    named = "; ".join(f"{name!r} on {', '.join(on)}" for name, on in platforms.items())
    notes.append(f"jax's own kernels have no forward-mode derivative at all, and this "
                 f"program holds one ({named}), for every platform it may be lowered for; "
                 f"name one of jattn's with implementation=..., e.g. 'blockwise' or "
                 f"'flex_tpu' (jattn.explain shows each platform's).")
  if notes:
    error.add_note("jattn: " + " ".join(notes))


def residual_in_layout(lse, layout, dtype) -> jax.Array:
  """lse float32 [B, N, T] -> the query's layout without H, in `dtype`, no gradient."""
  rows = layout.query.replace("H", "")
  return jax.lax.stop_gradient(jnp.einsum(f"BNT->{rows}", lse).astype(dtype))


@functools.partial(jax.jit, static_argnames=(
    "layout", "choices", "return_weights", "return_residual", "return_max_logits"))
def _compute(query, key, value, modifiers, *, layout, choices, return_weights,
             return_residual, return_max_logits):
  """Every platform's choice, under platform_dependent; the static choices are the
  jit's key, with the modifiers' flags (causal, window, dropout rate)."""
  if modifiers.mods is not None:
    modifiers = modifiers.replace(mods=modifiers.mods.traced())

  def branch(choice: Choice):
    if choice.implementation is None:
      return None
    implementation = IMPLEMENTATIONS[choice.implementation]

    def run(query, key, value, modifiers):
      out, weights, lse, max_logits = implementation.run(choice.plan, query, key, value,
                                                         modifiers, layout)
      # Only what was asked for leaves the jit, so the rest is never computed. The
      # max logits keep the logits' float32 (QK-clip compares them with a threshold).
      return (out, weights if return_weights else None,
              residual_in_layout(lse, layout, value.dtype) if return_residual else None,
              residual_in_layout(max_logits, layout, max_logits.dtype)
              if return_max_logits else None)
    return run

  branches = {c.platform: (c.key, branch(c)) for c in choices}
  return per_platform(branches, query, key, value, modifiers)


# ---- an explicit implementation on a platform it cannot run on: an error when
# (and only when) the program is lowered for that platform.


def _refuse(*, error, avals):
  raise ValueError(error)


_refused_p = Primitive("jattn_refused_implementation")
_refused_p.multiple_results = True
_refused_p.def_impl(_refuse)
_refused_p.def_abstract_eval(lambda *, error, avals: avals)
mlir.register_lowering(_refused_p, lambda ctx, *, error, avals: _refuse(error=error,
                                                                        avals=avals))
