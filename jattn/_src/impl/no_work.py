"""A call with nothing to compute: no batch row (B = 0), no query (T = 0) or no key (S = 0).

Every row of such a call is a row with no visible key, or there is no row: the answer is
known without running anything (out zeros, weights zeros, lse the empty-row constant or
the sink's logit, max logits the constant), and running would fail (a max over no key has
no identity; the kernels' tilings divide by T and S). So every implementation takes it
with a `NoWork` plan (`taking_empty_calls` wraps the registry's entries), which
`jattn.explain` shows, and returns that answer, as jax.nn does for T = 0 and S = 0.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jattn._src.core.softmax import LARGE_NEGATIVE, logits_dtype


@dataclasses.dataclass(frozen=True)
class NoWork:
  """The plan of an empty call; `empty` names its sizes that are 0, e.g. "S = 0"."""

  empty: str

  def __str__(self) -> str:
    return f"NoWork({self.empty}: zeros, as for rows with no visible key; nothing runs)"


def plan(call) -> NoWork | None:
  """NoWork for a call with B, T or S of 0, else None. (D = 0 is no such call: its
  weights, lse and max logits are those of its keys, and the dense and blockwise paths
  compute them; the kernels refuse it by their head sizes.)"""
  d = call.dims
  empty = [f"{letter} = 0" for letter in "BTS" if getattr(d, letter) == 0]
  return NoWork(", ".join(empty)) if empty else None


def run(plan_: NoWork, query, key, value, modifiers, layout):
  """(out zeros in the layout with D, weights zeros [B, N, T, S], lse [B, N, T],
  max_logits [B, N, T]), as the implementations return them: a row that sees no key has
  lse LARGE_NEGATIVE (with sinks, logaddexp(LARGE_NEGATIVE, sink) = the sink) and max
  logits LARGE_NEGATIVE."""
  size = {letter: query.shape[layout.axis(letter)] for letter in layout.query}
  size.update(S=key.shape[layout.axis("S")], D=value.shape[layout.axis("D")])
  B, N, T, S = (size[letter] for letter in "BNTS")
  dtype = logits_dtype(query.dtype)
  out = jnp.zeros(tuple(size[letter] for letter in layout.out), value.dtype)
  no_key = jnp.full((B, N, T), LARGE_NEGATIVE, dtype)
  sinks = modifiers.sinks
  lse = no_key if sinks is None else jnp.broadcast_to(
      sinks.astype(dtype)[None, :, None], (B, N, T))
  return out, jnp.zeros((B, N, T, S), dtype), lse, no_key


def taking_empty_calls(implementation):
  """The registry entry `implementation` (a `registry.Implementation`), planning NoWork
  for an empty call before its own plan, and running it as `run`."""
  own_plan, own_run = implementation.plan, implementation.run

  def plan_or_no_work(call, platform):
    no_work = plan(call)
    return own_plan(call, platform) if no_work is None else no_work

  def run_or_no_work(plan_, *args):
    return (run if isinstance(plan_, NoWork) else own_run)(plan_, *args)

  return dataclasses.replace(implementation, plan=plan_or_no_work, run=run_or_no_work)
