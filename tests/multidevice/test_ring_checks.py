"""ring_attention in this process (jattn/_src/parallel/ring.py): its checks on meshes of any
size (an AbstractMesh: checked before any device is needed), and its values on a
one-device mesh against float64 NumPy: unbatched and columns layouts, T != S, the
zig-zag order (two chunks on the one device), lse, a block mask. The 8-device cases
are in test_ring.py and test_ring_mods.py (subprocesses)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

import jattn
from jattn import mods
from tests.helpers import raises
from tests.reference import reference_mods

B, T, S, N, K, H = 2, 8, 12, 4, 2, 8
_rng = np.random.default_rng(0)
Q = _rng.standard_normal((B, T, N, H)).astype(np.float32)
KEY = _rng.standard_normal((B, S, K, H)).astype(np.float32)
V = _rng.standard_normal((B, S, K, H)).astype(np.float32)
TOL = dict(rtol=2e-5, atol=2e-5)
t_ = np.arange(T)[:, None]
s_ = np.arange(S)[None, :]


def abstract(**axes):
  return AbstractMesh(tuple(axes.values()), tuple(axes))


def ring(q=Q, k=KEY, v=V, **kw):
  return jattn.ring_attention(q, k, v, **kw)


# ----------------------------------------------------------------- checks

def test_mesh_must_be_a_mesh():
  with raises(TypeError, "mesh must be a jax.sharding.Mesh, got dict"):
    ring(mesh={"seq": 1})
  # query, key and value may be named; the options are keyword-only
  with raises(TypeError, "mesh must be a jax.sharding.Mesh, got dict"):
    jattn.ring_attention(query=Q, key=KEY, value=V, mesh={"seq": 1})
  with raises(TypeError, "takes 3 positional arguments but 4 were given"):
    jattn.ring_attention(Q, KEY, V, abstract(seq=1))


@pytest.mark.parametrize("arg", ["axis_name", "batch_axis_name", "head_axis_name"])
def test_each_axis_name_must_be_the_meshs(arg):
  kw = {"axis_name": "seq", arg: "nope"}
  with raises(ValueError, f"{arg} 'nope' is not an axis of the mesh", "{'seq': 4, 'data': 2}"):
    ring(mesh=abstract(seq=4, data=2), **kw)


@pytest.mark.parametrize("kw,names", [
    (dict(batch_axis_name="seq"), "batch_axis_name and axis_name"),
    (dict(head_axis_name="seq"), "head_axis_name and axis_name"),
    (dict(batch_axis_name="data", head_axis_name="data"), "head_axis_name and batch_axis_name")])
def test_one_mesh_axis_named_twice(kw, names):
  with raises(ValueError, f"{names} are both mesh axis"):
    ring(mesh=abstract(seq=1, data=2), **kw)


@pytest.mark.parametrize("P,kw,shapes,message", [
    (4, {}, (8, 12), None),  # 8 and 12 divisible by 4: the checks pass
    (3, {}, (8, 12), "length T=8 must be divisible by 3 (1 chunk(s) for each of the 3 devices "
                     "of mesh axis 'seq')"),
    (4, {}, (12, 10), "length S=10 must be divisible by 4"),
    (4, dict(is_causal=True), (8, 12), "length S=12 must be divisible by 8 (2 chunk(s)"),
    (4, dict(is_causal=True), (12, 16), "length T=12 must be divisible by 8 (2 chunk(s)"),
    (4, dict(is_causal=True, load_balance=False), (12, 16), None),  # no zig-zag: one chunk
    (2, dict(is_causal=True), (4, 12), None)])
def test_lengths_must_divide_over_the_ring(P, kw, shapes, message):
  q = np.zeros((1, shapes[0], 2, 8), np.float32)
  k = np.zeros((1, shapes[1], 2, 8), np.float32)
  if message is not None:
    with raises(ValueError, message.replace("(", r"\(").replace(")", r"\)")):
      ring(q, k, k, mesh=abstract(seq=P), **kw)
    return
  try:  # past the checks, an abstract mesh cannot run: any other error is fine
    ring(q, k, k, mesh=abstract(seq=P), **kw)
  except Exception as e:  # noqa: BLE001
    assert "divisible" not in str(e), e


@pytest.mark.parametrize("kw,axes,message", [
    (dict(batch_axis_name="data"), dict(seq=1, data=3), "B=2 must be divisible by the 3 devices "
                                                        "of batch_axis_name 'data'"),
    (dict(head_axis_name="model"), dict(seq=1, model=3), "N=4 must be divisible by the 3 devices "
                                                         "of head_axis_name 'model'"),
    (dict(head_axis_name="model"), dict(seq=1, model=4), "K=2 must be divisible by the 4 devices")])
def test_batch_and_heads_must_divide_over_their_axes(kw, axes, message):
  with raises(ValueError, message):
    ring(mesh=abstract(**axes), **kw)


def test_bad_arguments_are_named():
  mesh = abstract(seq=1)
  with raises(TypeError, "is_causal must be a bool, got 1"):
    ring(mesh=mesh, is_causal=1)
  with raises(TypeError, "scale must be a Python float for ring_attention"):
    ring(mesh=mesh, scale=jnp.float32(0.5))
  for kw in (dict(batch_axis_name="data"), dict(head_axis_name="data")):
    with raises(ValueError, "mask_mod, score_mod and sinks in ring_attention need the whole",
                next(iter(kw))):
      ring(mesh=abstract(seq=1, data=1), sinks=np.zeros(N, np.float32), **kw)


def test_ring_from_context_names_every_unsupported_argument():
  q = np.zeros((1, 4, 2, 8), np.float32)
  for kw, name in ((dict(mask=np.ones((4, 4), bool)), "mask"),
                   (dict(dropout_rate=0.5, dropout_rng=jax.random.key(0)), "dropout_rate"),
                   (dict(return_weights=True), "return_weights"),
                   (dict(broadcast_dropout=True, dropout_rate=0.5, dropout_rng=jax.random.key(0)),
                    "broadcast_dropout")):
    with raises(ValueError, f"implementation='ring' does not support .*{name}"):
      jattn.dot_product_attention(q, q, q, implementation="ring", **kw)
  with raises(ValueError, "needs a mesh with a 'seq' axis"):
    with jax.sharding.use_abstract_mesh(abstract(data=1)):
      jattn.dot_product_attention(q, q, q, implementation="ring")


# ----------------------------------------------------------------- values on one device

MESH = Mesh(np.array(jax.devices()[:1]), ("seq",))


# CI keeps one (3.4 s here with both cores busy, about half that on a quiet machine);
# zig-zag on 8 devices is in test_ring.py's quick set
@pytest.mark.parametrize("kw,allowed", [
    pytest.param(dict(), np.ones((T, S), bool), marks=pytest.mark.thorough),
    pytest.param(dict(is_causal=True), s_ <= t_,  # zig-zag: two chunks of the one device
                 marks=pytest.mark.thorough),
    pytest.param(dict(is_causal=True, load_balance=False), s_ <= t_, marks=pytest.mark.thorough),
    (dict(mask_mod=mods.sliding_window(2, 1)), (s_ >= t_ - 2) & (s_ <= t_ + 1))])
def test_values_and_lse_on_one_device(kw, allowed):
  out, lse = ring(mesh=MESH, return_residual=True, scale=0.3, **kw)
  want, w = reference_mods(Q, KEY, V, allowed=allowed, scale=0.3)
  np.testing.assert_allclose(out, want, **TOL)
  logits = np.einsum("BTNH,BSNH->BNTS", Q.astype(np.float64),
                     np.repeat(KEY, N // K, axis=2).astype(np.float64)) * 0.3
  want_lse = np.log(np.sum(np.where(allowed, np.exp(logits), 0.0), -1))  # [B, N, T]
  assert lse.shape == (B, T, N)
  np.testing.assert_allclose(lse, np.transpose(want_lse, (0, 2, 1)), **TOL)


@pytest.mark.thorough  # 3-14 s; the columns layout's lse runs on 8 devices in CI
def test_unbatched_and_columns_layouts_on_one_device():
  want = reference_mods(Q, KEY, V, allowed=s_ <= t_)[0]
  out = ring(Q[1], KEY[1], V[1], mesh=MESH, layout="TNH", is_causal=True)
  np.testing.assert_allclose(out, want[1], **TOL)
  cols = lambda x: np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))  # BTNH -> BNHT
  out, lse = ring(cols(Q), cols(KEY), cols(V), mesh=MESH, layout="BNHT", is_causal=True,
                  return_residual=True)
  np.testing.assert_allclose(out, cols(want), **TOL)
  assert lse.shape == (B, N, T)


@pytest.mark.thorough  # 3 s
def test_a_block_mask_is_checked_and_each_step_classifies_its_own():
  block_mask = jattn.create_block_mask(mods.causal(), B, N, T, S,
                                       block_sizes=jattn.BlockSizes(q=4, kv=4))
  out = ring(mesh=MESH, mask_mod=mods.causal(), block_mask=block_mask,
             block_sizes=jattn.BlockSizes(q=4, kv=4))
  np.testing.assert_allclose(out, reference_mods(Q, KEY, V, allowed=s_ <= t_)[0], **TOL)
  other = jattn.create_block_mask(mods.causal(), B, N, T, T,
                                  block_sizes=jattn.BlockSizes(q=4, kv=4))
  with raises(ValueError, "block_mask"):
    ring(mesh=MESH, mask_mod=mods.causal(), block_mask=other,
         block_sizes=jattn.BlockSizes(q=4, kv=4))


def test_explain_reports_each_platforms_step():
  with jax.set_mesh(MESH):
    report = jattn.explain(jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
                           jax.ShapeDtypeStruct((B, S, K, H), jnp.float32),
                           jax.ShapeDtypeStruct((B, S, K, H), jnp.float32),
                           implementation="ring", is_causal=True)
  cpu = report.choices["cpu"]
  assert cpu.implementation == "ring" and cpu.plan.implementation == "blockwise"
  assert cpu.passed_over == ()  # the TPU kernel is not tried on CPU
  assert str(cpu.plan).startswith("each step runs blockwise: ")


@pytest.mark.thorough  # 8 s (four compilations); on 8 devices: test_ring.py's sharding quick set
def test_explicit_axes_keep_the_querys_sharding():
  """On a mesh of Explicit axes (jax.make_mesh's default; one device here) the output
  comes back sharded as the query (D unsharded), the lse as the query without H;
  an input sharded over an axis the mesh lacks is refused, naming it."""
  from jax.sharding import NamedSharding, PartitionSpec as Spec
  mesh = jax.make_mesh((1, 1), ("data", "seq"))
  q = np.asarray(Q[:, :, :2])  # [B, T, 2, H]: self-attention, 2 heads
  want = reference_mods(q, q, q)[0]
  for spec, out_spec, lse_spec in (
      (Spec(None, "seq", None, None), Spec(None, "seq", None, None), Spec(None, "seq", None)),
      (Spec("data", None, "seq", None), Spec("data", None, "seq", None), Spec("data", None, "seq")),
      (Spec(("data", "seq"), None, None, None), Spec(("data", "seq"), None, None, None),
       Spec(("data", "seq"), None, None)),
      (Spec(None, None, None, "seq"), Spec(None, None, None, None), Spec(None, None, None))):
    with jax.set_mesh(mesh):
      x = jax.device_put(q, NamedSharding(mesh, spec))
      out, lse = jattn.ring_attention(x, x, x, mesh=mesh, return_residual=True)
    assert jax.typeof(out).sharding.spec == out_spec, spec
    assert jax.typeof(lse).sharding.spec == lse_spec, spec
    np.testing.assert_allclose(out, want, **TOL)
  other = jax.make_mesh((1,), ("x",))
  x = jax.device_put(q, NamedSharding(other, Spec("x")))
  with raises(ValueError, "query float32", "is sharded over mesh axis 'x'", "{'data': 1, 'seq': 1}"):
    jattn.ring_attention(x, x, x, mesh=mesh)
  with raises(ValueError, "key float32", "is sharded over mesh axis 'x'"):
    jattn.ring_attention(q, x, q, mesh=jax.make_mesh((1,), ("seq",), axis_types=(
        jax.sharding.AxisType.Auto,)))


# An AbstractMesh's axes are Auto by default on jax 0.10 and Explicit from 0.11.1: both
# kinds on every jax.
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_explain_ring_steps_on_an_abstract_mesh(kind):
  """What each ring step runs, traced on shapes alone over data x seq x model = 2 x 2 x 2:
  one device's step is B / 2 rows, N / 2 and K / 2 heads, T / 2 queries against S / 2 keys
  (halved again by the zig-zag order, given as a ChunkOrder); blockwise on CPU with block
  sizes clipped to one step's queries and keys; the TPU kernel on TPU, or blockwise with
  its reason."""
  from jattn._src.impl.interpret import pallas_interpret
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  q, k, v = sd(4, 32, 4, 8), sd(4, 48, 2, 8), sd(4, 48, 2, 16)

  def steps(**kw):
    mesh = AbstractMesh((2, 2, 2), ("data", "seq", "model"), axis_types=(kind,) * 3)
    with jattn.explain_calls() as reports:
      jax.eval_shape(lambda q, k, v: jattn.ring_attention(
          q, k, v, mesh=mesh, batch_axis_name="data", head_axis_name="model", **kw), q, k, v)
    return {p: reports[0].choices[p] for p in ("cpu", "tpu", "cuda")}

  zigzag = jattn.ChunkOrder(((0, 3), (1, 2)), "zig-zag")
  got = steps(is_causal=True, load_balance=zigzag)
  assert got["cpu"].plan == type(got["cpu"].plan)("blockwise", jattn.BlockSizes(q=8, kv=12))
  assert got["cuda"].plan.implementation == "blockwise" and got["cuda"].passed_over == ()
  tpu = got["tpu"].plan
  assert tpu.implementation == "flex_tpu" and got["tpu"].passed_over == ()
  kernel = tpu.plan
  dims = (kernel.B, kernel.T, kernel.S, kernel.N, kernel.K, kernel.H, kernel.D)
  assert dims == (2, 8, 12, 2, 1, 8, 16) and all(type(x) is int for x in dims)
  assert kernel.is_causal and kernel.offsets and str(tpu).startswith("each step runs flex_tpu: ")
  kernel = steps(is_causal=True, load_balance=False)["tpu"].plan.plan  # one chunk per device
  assert (kernel.T, kernel.S) == (16, 24)
  kernel = steps(block_sizes=jattn.BlockSizes(q=16, kv=128))["tpu"].plan.plan  # its tiles
  assert (kernel.T, kernel.S, kernel.block_q, kernel.block_kv) == (16, 24, 16, 128)
  got = steps(block_sizes=jattn.BlockSizes(q=8, kv=16))["tpu"]  # tiles the kernel refuses
  assert got.plan.plan == jattn.BlockSizes(q=8, kv=16)
  assert "block_kv of 128" in dict(got.passed_over)["flex_tpu"]
  assert steps(block_sizes=jattn.BlockSizes(q=8, kv=64))["cpu"].plan.plan == jattn.BlockSizes(
      q=8, kv=24)
  ids = np.zeros((4, 32), np.int32), np.zeros((4, 48), np.int32)
  got = steps(q_segment_ids=ids[0], kv_segment_ids=ids[1])["tpu"]
  assert got.plan.implementation == "blockwise" and [n for n, _ in got.passed_over] == ["flex_tpu"]
  assert got.plan.plan == jattn.BlockSizes(q=16, kv=24)
  with pallas_interpret():  # the kernel is tried on every platform, interpreted
    got = steps(is_causal=True)
  assert got["cpu"].plan.implementation == "flex_tpu" and got["cpu"].plan.plan.interpret


def test_an_input_sharded_over_foreign_axes_is_refused_naming_the_first():
  from jax.sharding import NamedSharding, PartitionSpec as Spec
  other = jax.make_mesh((1, 1), ("y", "x"))
  x = jax.device_put(Q, NamedSharding(other, Spec("y", "x")))
  with raises(ValueError, "query float32", "is sharded over mesh axis 'x'", "{'seq': 1}"):
    jattn.ring_attention(x, KEY, V, mesh=jax.make_mesh((1,), ("seq",)))
