"""mask_mod, score_mod and sinks: checked once, turned into pure functions of explicit arrays.

A user's mod may close over arrays (segment ids, ALiBi slopes, a bias table),
traced or not. `Mods` traces each mod once to a jaxpr and keeps the arrays it
closes over as explicit pytree leaves (its `consts`), so that a custom VJP
(the blockwise path) can return their gradients, `jax.vmap` over them works,
and no function that closes over a tracer crosses a custom_vjp boundary.

`on_grid` vectorises a function of one entry over a block of the
[B, N, T, S] grid, given the global positions of that block's axes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

from jattn._src import compat
from jattn._src.core import checks as _checks
from jattn._src.core.explicit_axes import unsharded
from jattn._src.core.softmax import logits_dtype
from jattn._src.masks.closed_form_blocks import is_closed_form
from jattn._src.masks.mods import check_fit

_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class Mods:
  """The programmable part of one call.

  mask_jaxpr / score_jaxpr: the traced mods (static), evaluated by `mask` and
  `score` with their consts; sinks float [N] or None; block_mask a
  `jattn.BlockMask` or None; mask_mod: the user's mask_mod itself when it is a
  ready-made jattn.mods mask (a pytree, so it rides along under jit), whose
  block classes are then known in closed form (`_closed_form_blocks`), else None.
  """

  mask_jaxpr: object = None
  score_jaxpr: object = None
  mask_consts: tuple = ()
  score_consts: tuple = ()
  sinks: jax.Array | None = None
  block_mask: object = None
  mask_mod: object = None

  def tree_flatten(self):
    children = (self.mask_consts, self.score_consts, self.sinks, self.block_mask,
                self.mask_mod)
    return children, (self.mask_jaxpr, self.score_jaxpr)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], aux[1], *children)

  @property
  def has_mask(self) -> bool:
    return self.mask_jaxpr is not None or self.mask_mod is not None

  @property
  def is_traced(self) -> bool:
    """False while a ready-made mask_mod waits to be traced (`traced`), inside jit."""
    return self.mask_mod is None or self.mask_jaxpr is not None

  def traced(self) -> "Mods":
    """This value with a ready-made mask_mod traced to its jaxpr; its array leaves (traced
    under jit) become the consts. Deferred to here so that a jit keyed on the mod's
    static fields alone caches across calls."""
    if self.is_traced:
      return self
    jaxpr, consts = trace_mask_mod(self.mask_mod)
    return dataclasses.replace(self, mask_jaxpr=jaxpr, mask_consts=consts)

  @property
  def is_cacheable(self) -> bool:
    """Whether nothing static in this value is traced per call (no jaxpr of a user's
    function), so that a jit keyed on it caches across calls."""
    return self.score_jaxpr is None and self.block_mask is None and (
        self.mask_jaxpr is None)

  @property
  def has_score(self) -> bool:
    return self.score_jaxpr is not None

  def mask_uses(self, argument: int) -> bool:
    """Whether mask_mod reads its argument number `argument` (0 b, 1 n, 2 t, 3 s).

    A mask that reads neither b nor n is evaluated once for every batch row
    and head instead of per row and head.
    """
    return _reads(self.mask_jaxpr, argument)

  def score_uses(self, argument: int) -> bool:
    """Whether score_mod reads its argument number `argument` (0 score, 1 b, 2 n, 3 t, 4 s)."""
    return _reads(self.score_jaxpr, argument)

  def mask(self, b, n, t, s):
    """mask_mod(b, n, t, s) -> bool scalar."""
    return jax.core.eval_jaxpr(self.mask_jaxpr, self.mask_consts, b, n, t, s)[0]

  @property
  def score_dtype(self):
    """The dtype of the score score_mod was traced on (the call's logits')."""
    return self.score_jaxpr.invars[0].aval.dtype

  def score(self, score, b, n, t, s, consts=None):
    """score_mod(score, b, n, t, s) -> a scalar of score's dtype; consts replace the
    captured arrays."""
    consts = self.score_consts if consts is None else consts
    out = jax.core.eval_jaxpr(self.score_jaxpr, consts, score.astype(self.score_dtype), b, n,
                              t, s)[0]
    return out.astype(score.dtype)

  def without_score_consts(self) -> "Mods":
    return dataclasses.replace(self, score_consts=())

  def gradients(self, *, sinks, score_consts) -> "Mods":
    """A cotangent of this value: d sinks and d score_consts (each None or float32,
    cast to the primal dtypes), None (zero) for the rest."""
    return dataclasses.replace(
        self, mask_consts=(None,) * len(self.mask_consts), sinks=sinks, block_mask=None,
        mask_mod=None,
        score_consts=tuple(None if d is None else d.astype(c.dtype)
                           for d, c in zip(score_consts, self.score_consts)))


def _reads(jaxpr, argument: int) -> bool:
  var = jaxpr.invars[argument]
  return (any(any(v is var for v in eqn.invars) for eqn in jaxpr.eqns)
          or any(v is var for v in jaxpr.outvars))


def _check_arity(name: str, fn, arity: int, call: str) -> None:
  if not callable(fn):
    raise TypeError(f"{name} must be a function {call}, got {type(fn).__name__}")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # builtins and some C callables: the trace decides
    return
  try:
    signature.bind(*range(arity))
  except TypeError:
    raise TypeError(f"{name} must take {arity} positional arguments {call}, "
                    f"got a function with signature {signature}") from None


def _trace(name: str, fn, args, call: str, want: str):
  """fn traced on scalar avals -> ClosedJaxpr, checking it returns one `want` scalar."""
  try:
    # Traced with no mesh in context: the jaxpr is later evaluated on any
    # device, also inside shard_map (ring), whose mesh axes are manual there.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      closed = jax.make_jaxpr(fn)(*args)
  except Exception as e:  # the user's function: say which argument failed, keep the cause
    hint = ""
    if type(e).__name__ == "ShardingTypeError":
      hint = (f" ({name} reads an array whose type is sharded over Explicit mesh axes at "
              f"a traced index: pass it replicated, jax.sharding.reshard(x, "
              f"jax.P()), or use a ready-made jattn.mods, whose arrays jattn replicates)")
    raise TypeError(f"{name} failed when called {call} on int32 scalars{hint}: "
                    f"{type(e).__name__}: {e}") from e
  outs = closed.out_avals
  ok = len(outs) == 1 and outs[0].shape == ()
  if ok and want == "bool":
    ok = outs[0].dtype == jnp.bool_
  if ok and want == "float":
    ok = jnp.issubdtype(outs[0].dtype, jnp.floating)
  if not ok:
    got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
    raise TypeError(f"{name} must return one {want} scalar {call}, got {got}")
  return closed


_MASK_CALL = "(b, n, t, s) -> bool"


def trace_mask_mod(mask_mod) -> tuple:
  """mask_mod traced on int32 scalars -> (jaxpr, consts), checking it returns one bool;
  the arrays it closes over (traced or not) become the consts."""
  return compat.open_jaxpr(_trace("mask_mod", mask_mod, (_INDEX,) * 4, _MASK_CALL, "bool"))


def _is_pytree(mod) -> bool:
  """Whether mod is a registered pytree with leaves of its own (the ready-made mods)."""
  leaves = jax.tree.leaves(mod)
  return not (len(leaves) == 1 and leaves[0] is mod) and bool(leaves)


def build_mods(mask_mod, score_mod, sinks, block_mask, *, N: int, B: int | None = None,
               T: int | None = None, S: int | None = None,
               defer_ready_made: bool = False, logits_dtype=jnp.float32) -> Mods | None:
  """Checks the programmable arguments (before any work) and bundles them; None if all absent.

  B, T, S: the call's sizes that a ready-made mod's arrays must fit (`mods.check_fit`; N
  too), None where unchecked. defer_ready_made: keep a ready-made mask_mod (jattn.mods)
  untraced, for `Mods.traced` to trace inside the caller's jit (then the value is
  `is_cacheable`). logits_dtype: the score score_mod is traced on (`softmax.logits_dtype`
  of the inputs': float64 for float64 calls, else float32)."""
  if mask_mod is None and score_mod is None and sinks is None and block_mask is None:
    return None
  for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
    check_fit(mod, name, B=B, N=N, T=T, S=S)
  fields = {}
  # a ready-made mod's arrays (a pytree's leaves) are read at any (b, n, t, s)
  mask_mod, score_mod = (jax.tree.map(unsharded, m) if _is_pytree(m)
                         else m for m in (mask_mod, score_mod))
  if mask_mod is not None:
    _check_arity("mask_mod", mask_mod, 4, _MASK_CALL)
    jaxpr, consts = trace_mask_mod(mask_mod)
    fields.update(mask_jaxpr=jaxpr, mask_consts=consts)
    if is_closed_form(mask_mod):
      fields["mask_mod"] = mask_mod
      if defer_ready_made:  # checked above; traced again inside jit by Mods.traced
        fields.update(mask_jaxpr=None, mask_consts=())
  if score_mod is not None:
    call = "(score, b, n, t, s) -> float"
    _check_arity("score_mod", score_mod, 5, call)
    score = jax.ShapeDtypeStruct((), logits_dtype)
    closed = _trace("score_mod", score_mod, (score,) + (_INDEX,) * 4, call, "float")
    jaxpr, consts = compat.open_jaxpr(closed)
    fields.update(score_jaxpr=jaxpr, score_consts=consts)
  if sinks is not None:
    sinks = _checks.float_array("sinks", sinks)
    if sinks.shape != (N,):
      raise ValueError(f"sinks: expected shape [N] = ({N},), one logit per query head, "
                       f"got shape {sinks.shape}")
    fields["sinks"] = sinks
  if block_mask is not None:
    fields["block_mask"] = block_mask
    if mask_mod is None and getattr(block_mask, "mask_jaxpr", None) is not None:
      # the mask_mod the block mask was made from
      fields.update(mask_jaxpr=block_mask.mask_jaxpr, mask_consts=block_mask.mask_consts)
  return Mods(**fields)


def on_grid(entry: Callable, letters: str, index: dict, *arrays):
  """entry(*array_entries, idx) vectorised with nested `jax.vmap` over the axes `letters`.

  index[letter]: int32 [size] global index of every position on that axis;
  arrays carry exactly the axes `letters` (full size). idx maps each letter
  to its scalar. Returns the results with axes `letters`.
  """
  def f(*args):
    return entry(*args[len(letters):], dict(zip(letters, args[:len(letters)])))
  for pos in reversed(range(len(letters))):
    in_axes = tuple(0 if p == pos else None for p in range(len(letters)))
    f = jax.vmap(f, in_axes=in_axes + (0,) * len(arrays))
  return f(*(index[c] for c in letters), *arrays)


def head_index(idx: dict, G: int):
  """The query head n of a grid entry: N itself, or kv head K and group G as n = k G + g."""
  return idx["N"] if "N" in idx else idx["K"] * G + idx["G"]


def grid_index(letters: str, sizes: dict, q_offset=0, kv_offset=0) -> dict:
  """int32 position vectors per letter; T and S start at the given global offsets."""
  start = {"T": q_offset, "S": kv_offset}
  return {c: jnp.asarray(start.get(c, 0), jnp.int32) + jnp.arange(sizes[c], dtype=jnp.int32)
          for c in letters}


def dense_mask(mods: Mods, B: int, N: int, T: int, S: int) -> jax.Array:
  """bool [B, N, T, S]: mask_mod over the whole grid (for the dense implementations)."""
  index = grid_index("BNTS", dict(B=B, N=N, T=T, S=S))
  return on_grid(lambda i: mods.mask(i["B"], i["N"], i["T"], i["S"]), "BNTS", index)


def apply_score(mods: Mods, logits: jax.Array, letters: str, G: int,
                q_offset=0, kv_offset=0, consts=None) -> jax.Array:
  """score_mod applied to every entry of logits (axes `letters`, from B K G T S or N)."""
  sizes = dict(zip(letters, logits.shape))
  index = grid_index(letters, sizes, q_offset, kv_offset)
  return on_grid(lambda x, i: mods.score(x, i["B"], head_index(i, G), i["T"], i["S"], consts),
                 letters, index, logits)


def sinks_like(sinks: jax.Array, letters: str, K: int, dtype) -> jax.Array:
  """sinks [N] -> shaped to broadcast against an array with axes `letters` (K, G split)."""
  x = sinks.astype(dtype).reshape(K, -1)  # [K, G]
  shape = [1] * len(letters)
  shape[letters.index("K")], shape[letters.index("G")] = x.shape
  order = sorted("KG", key=letters.index)
  return jnp.transpose(x, ["KG".index(c) for c in order]).reshape(shape)



def _rows_like_out(rows: jax.Array, out_letters: str) -> jax.Array:
  """[B, N, T] -> broadcastable against out (letters out_letters, D of size 1)."""
  letters = out_letters.replace("D", "")
  return jnp.expand_dims(jnp.einsum(f"BNT->{letters}", rows), out_letters.index("D"))


def add_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array, out_letters: str):
  """(out, lse [B, N, T]) normalised over the keys -> with each head's sink in the
  denominator: lse' = logaddexp(lse, sink), out' = out exp(lse - lse').

  A row with no key (lse = LARGE_NEGATIVE) gets out' = 0 and lse' = sink.
  """
  acc = logits_dtype(lse.dtype)  # float32, float64 for float64 calls
  lse_all = jnp.logaddexp(lse, sinks.astype(acc)[None, :, None])
  factor = _rows_like_out(jnp.exp(lse - lse_all), out_letters)
  return (out.astype(acc) * factor).astype(out.dtype), lse_all


def sinks_grad(out: jax.Array, lse: jax.Array, d_out: jax.Array, sinks: jax.Array,
               out_letters: str) -> jax.Array:
  """float32 [N] (float64 for float64 calls): d loss / d sinks = -sum_{b,t} p_sink *
  (d_out . out), p_sink = exp(sink - lse).

  out and lse are the final ones (sinks included).
  """
  acc = logits_dtype(lse.dtype)
  # delta [B, N, T] = sum_D d_out * out
  delta = jnp.einsum(f"{out_letters},{out_letters}->BNT", d_out.astype(acc), out.astype(acc))
  p_sink = jnp.exp(sinks.astype(acc)[None, :, None] - lse)
  return -jnp.sum(p_sink * delta, axis=(0, 2))
