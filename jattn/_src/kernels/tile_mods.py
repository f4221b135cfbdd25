"""A user's mask_mod / score_mod jaxpr evaluated on one [block_q, block_kv] tile.

`Mods` holds each mod traced on int32 scalars (b, n, t, s). Inside a kernel
program b and n are fixed scalars and t, s are [block_q, block_kv] tiles of
iota positions, so the jaxpr is evaluated here equation by equation with each
value either a scalar (it depends on b, n and captured arrays only) or a
tile (it depends on t, s or the score):

  * an elementwise primitive on scalars of int or bool type stays scalar
    (scalar-core arithmetic, e.g. the wrap of a negative index); any other
    elementwise primitive broadcasts its scalars to the tile and runs on tiles;
  * a captured array (a `Mods` const) is read element by element through a
    `read(const_index, flat_index)` callback: in the kernel, a load from the
    array's copy in SMEM (scalar prefetch). Only `dynamic_slice` of one
    element at scalar indices, then `squeeze`, may touch it: that is how
    `slopes[n]`, `prefix_lengths[b]` or a traced cap trace.

Anything else (an array indexed by a tile position such as `segment_ids[b, t]`,
a `jnp.take` gather, a reduction) raises `Unsupported` with a reason in words;
`check` runs the same evaluation on abstract values at plan time, so a call the
kernel cannot take is refused before any lowering, never answered wrongly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

# Elementwise primitives (shape-free parameters): run on scalars or on tiles.
_ELEMENTWISE = frozenset("""
  abs add sub mul div rem neg sign max min pow integer_pow exp exp2 log log1p
  tanh logistic sqrt rsqrt cbrt sin cos tan erf erfc floor ceil round nextafter
  eq ne lt le gt ge and or not xor select_n convert_element_type clamp square
  shift_left shift_right_logical shift_right_arithmetic is_finite copy copy_p
  stop_gradient reduce_precision atan2 asinh acosh atanh sinh cosh expm1
""".split())
# Scalar-core arithmetic: int and bool scalars stay scalars for these.
_SCALAR_SAFE = frozenset("""
  add sub mul div rem neg sign max min abs eq ne lt le gt ge and or not xor select_n
  convert_element_type clamp
""".split())
# An array in SMEM takes at most this many elements here (SMEM is small).
MAX_SMEM_ELEMENTS = 1 << 14


class Unsupported(Exception):
  """The function cannot be evaluated on a tile in the kernel; str() is the reason."""


class _Const:
  """A captured array, readable one element at a time."""

  def __init__(self, index, shape, dtype):
    self.index, self.shape, self.dtype = index, tuple(shape), np.dtype(dtype)


class _Element:
  """dynamic_slice of one element of a _Const: shape (1, ..., 1), held as its scalar."""

  def __init__(self, value, ndim):
    self.value, self.ndim = value, ndim


def _is_tile(x) -> bool:
  return isinstance(x, Linear) or (hasattr(x, "shape") and len(x.shape) == 2)


class Linear:
  """A float32 tile held as sum_i tile_i * c_i with scalar c_i (numbers or traced
  scalars), multiplied out only where an operation needs the tile itself. A product
  of constants then costs one multiply per entry, not one per factor: the kernel's
  scale, soft-cap's 1 / cap and its cap, ALiBi's slope and the softmax's log2(e)
  (`evaluate(..., out_scale=)`) fold into one multiply per term.
  Pass one (`Linear.of`) as an argument to evaluate to use it."""

  def __init__(self, terms):
    self.terms = tuple(terms)  # ((tile [bq, bk] float32, c), ...)
    self.shape, self.dtype = self.terms[0][0].shape, np.dtype(np.float32)

  @classmethod
  def of(cls, tile, c=1.0):
    return cls(((tile, c),))

  def times(self, c) -> "Linear":
    return Linear((t, _product(k, c)) for t, k in self.terms)

  def value(self):
    out = None
    for t, c in self.terms:
      x = t if isinstance(c, float) and c == 1.0 else t * c
      out = x if out is None else out + x
    return out


def _product(a, b):
  if isinstance(a, float) and isinstance(b, float):
    return a * b
  return jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32)


def _float_scalar(x) -> bool:
  return not _is_tile(x) and hasattr(x, "dtype") and x.dtype == jnp.float32 and (
      np.shape(x) == ())


def _linear(name, ins):
  """The result of `name` on ins kept as a `Linear`, or None where it needs the tiles."""
  if name == "mul" and len(ins) == 2:
    for a, b in (ins, ins[::-1]):
      if _float_scalar(b) and (isinstance(a, Linear) or (
          _is_tile(a) and a.dtype == jnp.float32)):
        return (a if isinstance(a, Linear) else Linear.of(a)).times(_number(b))
  if name == "div" and len(ins) == 2 and isinstance(ins[0], Linear) and _float_scalar(ins[1]):
    d = _number(ins[1])
    if not (isinstance(d, float) and d == 0.0):  # x / 0 stays the division (inf, nan)
      return ins[0].times(_product(1.0, 1.0 / d) if isinstance(d, float) else 1.0 / d)
  if name == "neg" and isinstance(ins[0], Linear):
    return ins[0].times(-1.0)
  if name in ("add", "sub") and len(ins) == 2 and all(
      isinstance(x, Linear) or (_is_tile(x) and x.dtype == jnp.float32) for x in ins):
    a, b = (x if isinstance(x, Linear) else Linear.of(x) for x in ins)
    return Linear(a.terms + (b.terms if name == "add" else b.times(-1.0).terms))
  return None


def _number(x):
  """A literal scalar as a Python float (folded at trace time), else the traced scalar."""
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return x


def evaluate(jaxpr, consts_meta, read, args, tile_shape, *, positions=None,
             read_block=None, read_table=None, out_scale=None):
  """jaxpr (open, its constvars = the Mods consts) on args (scalars or tiles) -> list.

  consts_meta: [(shape, dtype)] per const; read(i, flat_index) -> that element
  of const i as a scalar of its dtype. positions: {argument number: "t" or "s"},
  the arguments that are the position tiles; read_block(i, letter, row) -> the
  tile x[row, t] (letter "t") or x[row, s] of const i (a 1-D const: row 0), for a
  captured per-token array indexed by the position itself. Without read_block
  such a read is `Unsupported`. read_table(i, row, index) -> the tile x[row, index]
  of a small table i at a [bq, bk] tile of int32 indices (already clamped), e.g.
  a relative-bias table at clip(s - t) + M; without it such a read is `Unsupported`.
  """
  consts = [_Const(i, shape, dtype) for i, (shape, dtype) in enumerate(consts_meta)]
  tags = {k: ("at", c) for k, c in (positions or {}).items()}
  ctx = _Ctx(read, read_block, tile_shape, read_table)
  ctx.lazy = any(isinstance(x, Linear) for x in args)
  outs = _evaluate(jaxpr, consts, ctx, args, tags)
  if out_scale is not None:
    outs = [x.times(out_scale) if isinstance(x, Linear) else x * out_scale for x in outs]
  return [x.value() if isinstance(x, Linear) else x for x in outs]


class _Ctx:
  def __init__(self, read, read_block, tile_shape, read_table=None):
    self.read, self.read_block, self.tile_shape = read, read_block, tile_shape
    self.read_table = read_table
    self.lazy = False  # float tiles kept as `Linear` where they can be


class _Row:
  """dynamic_slice of one element of a per-token _Const at (row, t) or (row, s): the tile."""

  def __init__(self, tile):
    self.tile = tile


def _evaluate(jaxpr, consts, ctx, args, arg_tags):
  """arg_tags {argument number: tag}: ("at", letter) marks a value equal to the position
  tile t or s (for t, s >= 0); ("neg", letter) the test `position < 0`."""
  env, tags = {}, {}

  def get(v):
    if isinstance(v, jex_core.Literal):
      return jnp.asarray(v.val, v.aval.dtype)
    return env[v]

  def tag(v):
    return None if isinstance(v, jex_core.Literal) else tags.get(v)

  for var, x in zip(jaxpr.constvars, consts):
    env[var] = x
  for k, (var, x) in enumerate(zip(jaxpr.invars, args)):
    env[var] = x
    if k in arg_tags:
      tags[var] = arg_tags[k]
  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    in_tags = [tag(v) for v in eqn.invars]
    outs = _eqn(eqn, ins, in_tags, ctx)
    for var, x in zip(eqn.outvars, outs):
      env[var] = x
    out_tag = _tag_of(eqn, in_tags)
    if out_tag is not None:
      tags[eqn.outvars[0]] = out_tag
  return [get(v) for v in jaxpr.outvars]


def _tag_of(eqn, in_tags):
  """Follows a position through what jnp indexing does to it: the negative-index test
  `x < 0`, the wrap `select_n(x < 0, x, x + L)` (x for x >= 0), a cast to int32."""
  name = eqn.primitive.name
  first = in_tags[0] if in_tags else None
  if name == "lt" and first and first[0] == "at":
    other = eqn.invars[1]
    if isinstance(other, jex_core.Literal) and other.val == 0:
      return ("neg", first[1])
  if name == "select_n" and len(in_tags) == 3 and first and first[0] == "neg":
    picked = in_tags[1]
    if picked == ("at", first[1]):
      return picked
  if name == "convert_element_type" and first and first[0] == "at" and (
      eqn.params["new_dtype"] == np.int32):
    return first
  return None


def _eqn(eqn, ins, in_tags, ctx):
  read, tile_shape = ctx.read, ctx.tile_shape
  name = eqn.primitive.name
  sub = _called(eqn)
  if sub is not None:  # jit, custom_jvp_call, ...: evaluated inline
    inner = getattr(sub, "jaxpr", sub)
    inner_consts = list(getattr(sub, "consts", []))
    if any(np.size(c) != 1 for c in inner_consts):
      raise Unsupported(f"'{name}' inside the function closes over an array")
    inner_consts = [jnp.asarray(c).reshape(()) for c in inner_consts]
    arg_tags = {k: t for k, t in enumerate(in_tags) if t is not None}
    return _evaluate(inner, inner_consts, ctx, ins, arg_tags)
  if name == "dynamic_slice" and isinstance(ins[0], _Const) and any(
      t is not None and t[0] == "at" for t in in_tags[1:]):
    return [_read_row(eqn, ins, in_tags, ctx)]
  if any(isinstance(x, _Row) for x in ins):
    if name in ("squeeze", "reshape") and eqn.outvars[0].aval.shape == ():
      return [ins[0].tile]
    raise Unsupported(f"an element of a per-token array goes into '{name}'")
  # A captured scalar (a traced cap) is read where it is used.
  ins = [read(x.index, jnp.int32(0)) if isinstance(x, _Const) and x.shape == () else x
         for x in ins]
  if (name == "dynamic_slice" and isinstance(ins[0], _Const) and ctx.read_table is not None
      and _is_tile(ins[-1]) and not any(_is_tile(x) for x in ins[1:-1])
      and len(ins[0].shape) in (1, 2) and all(s == 1 for s in eqn.params["slice_sizes"])):
    const = ins[0]
    width = const.shape[-1]  # dynamic_slice clamps its starts
    index = jnp.minimum(jnp.maximum(ins[-1].astype(jnp.int32), 0), width - 1)
    row = jnp.int32(0)
    if len(const.shape) == 2:
      row = jnp.minimum(jnp.maximum(ins[1].astype(jnp.int32), 0), const.shape[0] - 1)
    return [_Row(ctx.read_table(const.index, row, index))]
  if any(isinstance(x, _Const) for x in ins):
    return [_read_const(eqn, ins, read)]
  if any(isinstance(x, _Element) for x in ins):
    x = ins[0]
    if name in ("squeeze", "reshape") and eqn.outvars[0].aval.shape == ():
      return [x.value]
    raise Unsupported(f"an element of a captured array goes into '{name}' "
                      "before it is reduced to a scalar")
  if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
    if eqn.outvars[0].aval.shape == () and eqn.invars[0].aval.shape == ():
      return [ins[0]]
    raise Unsupported(f"'{name}' to shape {eqn.outvars[0].aval.shape}: the function "
                      "builds an array, where the kernel evaluates it on one entry")
  if name == "iota" or name not in _ELEMENTWISE:
    raise Unsupported(f"the primitive '{name}' is not evaluated on a tile by the kernel "
                      "(elementwise arithmetic, comparisons and scalar reads of captured "
                      "arrays are)")
  if any(eqn.invars[k].aval.shape != () for k in range(len(eqn.invars))):
    raise Unsupported(f"'{name}' on a non-scalar value")
  if ctx.lazy and eqn.outvars[0].aval.dtype == np.float32:
    kept = _linear(name, ins)
    if kept is not None:
      return [kept]
  ins = [x.value() if isinstance(x, Linear) else x for x in ins]
  out_dtype = eqn.outvars[0].aval.dtype
  scalar = (not any(_is_tile(x) for x in ins) and name in _SCALAR_SAFE
            and all(jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_
                    for x in ins)
            and (jnp.issubdtype(out_dtype, jnp.integer) or out_dtype == jnp.bool_))
  if not scalar:
    ins = [x if _is_tile(x) else jnp.broadcast_to(x, tile_shape) for x in ins]
  if name == "sign":  # Mosaic's rule asks the TPU generation (not known when exporting)
    x = ins[0]
    # -1 as a constant: Triton's rule for neg takes no literal (jax's own floor_divide
    # asks for the sign of its constant divisor)
    one, zero, minus_one = (jnp.full((), c, x.dtype) for c in (1, 0, -1))
    return [jnp.where(x > zero, one, jnp.where(x < zero, minus_one, x))]
  out = eqn.primitive.bind(*ins, **eqn.params)
  return out if eqn.primitive.multiple_results else [out]


def _read_row(eqn, ins, in_tags, ctx):
  """dynamic_slice(const, [row,] position) of one element, position the tile t or s."""
  const = ins[0]
  starts, start_tags = ins[1:], in_tags[1:]
  letter = start_tags[-1][1] if start_tags[-1] and start_tags[-1][0] == "at" else None
  if (letter is None or len(const.shape) not in (1, 2)
      or any(s != 1 for s in eqn.params["slice_sizes"])
      or any(_is_tile(x) for x in starts[:-1])):
    raise Unsupported(f"a captured array of shape {list(const.shape)} indexed by a position "
                      "other than as x[t], x[s], x[row, t] or x[row, s] with a scalar row")
  if ctx.read_block is None:
    raise Unsupported(f"a captured array of shape {list(const.shape)} is indexed by a query "
                      "or key position (t or s) in score_mod; the kernel takes such per-token "
                      "arrays in mask_mod only")
  row = jnp.int32(0)
  if len(const.shape) == 2:  # dynamic_slice clamps its start
    row = jnp.minimum(jnp.maximum(starts[0].astype(jnp.int32), 0), const.shape[0] - 1)
  return _Row(ctx.read_block(const.index, letter, row))


def _read_const(eqn, ins, read):
  """dynamic_slice(const, *scalar starts) of one element -> _Element."""
  name = eqn.primitive.name
  const = ins[0]
  if name != "dynamic_slice" or not isinstance(const, _Const) or any(
      isinstance(x, _Const) for x in ins[1:]):
    raise Unsupported(f"a captured array of shape {list(const.shape)} is used by '{name}'; "
                      "the kernel reads captured arrays only one element at a time "
                      "(x[b], x[n], a scalar)")
  if any(s != 1 for s in eqn.params["slice_sizes"]):
    raise Unsupported(f"a slice of shape {list(eqn.params['slice_sizes'])} of a captured "
                      "array; the kernel reads one element at a time")
  starts = ins[1:]
  if any(_is_tile(x) for x in starts):
    raise Unsupported(f"a captured array of shape {list(const.shape)} is indexed by a query "
                      "or key position (t or s) through arithmetic; the kernel takes arrays "
                      "indexed by b, n or constants, and in mask_mod x[t], x[s], x[row, t], "
                      "x[row, s] (a relative-bias table is not taken yet)")
  flat = jnp.int32(0)
  for start, dim in zip(starts, const.shape):  # dynamic_slice clamps its starts
    start = jnp.minimum(jnp.maximum(start.astype(jnp.int32), 0), dim - 1)
    flat = flat * dim + start
  return _Element(read(const.index, flat), len(const.shape))


def _called(eqn):
  """The jaxpr (Jaxpr or ClosedJaxpr) an equation calls (jit, custom_jvp_call, ...), or None."""
  return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def primitives(jaxpr) -> set[str]:
  """The names of the primitives `jaxpr` (a Jaxpr or ClosedJaxpr) applies, those of the
  functions it calls included."""
  names = set()
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    names.add(eqn.primitive.name)
    if (sub := _called(eqn)) is not None:
      names |= primitives(sub)
  return names


def consts_meta(consts) -> tuple:
  return tuple((tuple(np.shape(c)), np.dtype(c.dtype)) for c in consts)


def check_consts(consts, skip=()) -> str | None:
  """A reason why these captured arrays cannot go to SMEM (those not in skip), or None."""
  for i, c in enumerate(consts):
    if i in skip:
      continue
    dtype = np.dtype(c.dtype)
    if dtype.itemsize != 4 and dtype != np.bool_:
      return (f"a captured array of dtype {dtype} (SMEM holds 32-bit values: int32, "
              "uint32, float32)")
    if np.size(c) > MAX_SMEM_ELEMENTS:
      return (f"a captured array of {np.size(c)} elements (over {MAX_SMEM_ELEMENTS} for "
              "SMEM; per-token arrays as blocks are not done yet)")
  return None


def check(jaxpr, meta, score: bool) -> str | tuple:
  """The reason in words why `evaluate` cannot take this jaxpr on a tile, or (it can)
  (the const index of every read of a floating captured array, in evaluation order:
  the reads whose gradients the backward returns (`evaluate` always reads in this
  order), ((const index, "t" or "s"), ...) for the per-token arrays read by
  position: mask_mod only, (const index, ...) for the tables read at a tile of
  indices: score_mod only, the const index of every read of a floating table at a
  tile of indices, in evaluation order: the table reads whose gradients the
  backward returns)."""
  tile = (8, 128)
  reads, rows, tables, table_reads = [], set(), set(), []

  def read_table(i, row, index):
    tables.add(i)
    if jnp.issubdtype(meta[i][1], jnp.floating):
      table_reads.append(i)
    return jnp.zeros(tile, meta[i][1])

  def read_block(i, letter, row):
    rows.add((i, letter))
    return jnp.zeros(tile, meta[i][1])

  scalar_reads = set()

  def read(i, flat):
    dtype = meta[i][1]
    scalar_reads.add(i)
    if jnp.issubdtype(dtype, jnp.floating):
      reads.append(i)
    return jnp.zeros((), dtype)

  positions = {3: "t", 4: "s"} if score else {2: "t", 3: "s"}

  def f(*args):
    return evaluate(jaxpr, meta, read, args, tile, positions=positions,
                    read_block=None if score else read_block,
                    read_table=read_table if score else None)

  args = [jax.ShapeDtypeStruct((), jnp.int32)] * 2 + [jax.ShapeDtypeStruct(tile, jnp.int32)] * 2
  if score:
    # the score's dtype as traced (float64 for a float64 call, which kernels refuse later)
    args = [jax.ShapeDtypeStruct(tile, jaxpr.invars[0].aval.dtype)] + args
  try:
    jax.eval_shape(f, *args)  # a scalar result (of b and n alone) is broadcast by the caller
  except Unsupported as e:
    return str(e)
  if ({i for i, _ in rows} | tables) & scalar_reads:
    return "a captured array read both by position and as a scalar"
  return tuple(reads), tuple(sorted(rows)), tuple(sorted(tables)), tuple(table_reads)


def const_indices(mods) -> tuple[tuple, tuple, tuple, tuple]:
  """(score_mod's float reads, mask_mod's per-token rows, score_mod's tables, its float
  table reads) of these traced mods, as `check` gives them.

  A plan made from one trace of the mods must not be applied to another: a plan
  traced outside `jit` sees one array passed twice (`mods.document(ids)`: ids for
  the queries and the keys) as one captured array, the trace inside `jit` as two,
  so the const indices differ. The kernels take them from the trace they run.
  """
  reads = rows = tables = table_reads = ()
  for kind, jaxpr, consts in (("mask_mod", mods.mask_jaxpr, mods.mask_consts),
                              ("score_mod", mods.score_jaxpr, mods.score_consts)):
    if jaxpr is None:
      continue
    got = check(jaxpr, consts_meta(consts), kind == "score_mod")
    if isinstance(got, str):  # the plan took the same function: cannot happen
      raise AssertionError(f"{kind} planned for the kernel, then refused: {got}")
    if kind == "score_mod":
      reads, tables, table_reads = got[0], got[2], got[3]
    else:
      rows = got[1]
  return reads, rows, tables, table_reads
