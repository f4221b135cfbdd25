"""Context-parallel attention (jattn/_src/parallel/): the strategies against one device on
8 simulated devices (a subprocess), and in this process the refusals, the load balance
(against counts made from the dense mask), the chunk moves and their inverse (simulated
in NumPy), the plan that `jattn.explain(..., mesh=mesh)` reports, and one-device values."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

import jattn
from jattn import mods
from jattn._src.parallel import balance, relayout
from tests.helpers import raises
from tests.reference import reference_mask, reference_mods
from tests.multidevice.test_ring import assert_checks_pass


@pytest.mark.slow
@pytest.mark.parametrize("cases,count", [
    ("quick", 9), pytest.param("all", 35, marks=pytest.mark.thorough)])
def test_every_strategy_matches_one_device_values_and_gradients(cases, count):
  assert_checks_pass("context_parallel_cases.py", cases, count)


def sd(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def seq(P):
  return AbstractMesh((P,), ("seq",))


def on_shapes(q, k, v, **kw):
  """context_parallel_attention traced on shapes alone (an abstract mesh cannot run)."""
  return jax.eval_shape(lambda q, k, v: jattn.context_parallel_attention(q, k, v, **kw), q, k, v)


def documents(T, count, seed=0):
  """int [1, T]: `count` packed documents of random lengths."""
  cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), count - 1, replace=False))
  return np.searchsorted(cuts, np.arange(T), side="right")[None].astype(np.int32)


# ----------------------------------------------------------------- refusals, named


def test_a_strategy_must_be_one_of_the_three():
  q = sd(1, 16, 8, 4)
  for bad in ("Ring", "allgather", 3):
    with raises(ValueError, "strategy must be None .* 'ring', 'all_gather', 'ulysses', got"):
      on_shapes(q, q, q, mesh=seq(8), strategy=bad)


@pytest.mark.parametrize("strategy", [None, "ring", "all_gather", "ulysses"])
def test_lengths_not_divisible_by_p_name_the_lengths_and_p(strategy):
  q, k = sd(1, 12, 8, 4), sd(1, 16, 8, 4)
  with raises(ValueError, r"length T=12 must be divisible by 8 \(1 chunk\(s\) for each of "
                          r"the 8 devices of mesh axis 'seq'\)"):
    on_shapes(q, k, k, mesh=seq(8), strategy=strategy)
  with raises(ValueError, "length S=18 must be divisible by 4"):
    on_shapes(k, sd(1, 18, 8, 4), sd(1, 18, 8, 4), mesh=seq(4), strategy=strategy)


def test_the_balance_needs_two_chunks_per_device_where_the_mask_is_uneven():
  q = sd(1, 24, 8, 4)  # 24 = 3 x 8: one chunk per device, not two
  with raises(ValueError, r"length T=24 must be divisible by 16 \(2 chunk\(s\).*for the load "
                          r"balance of this mask \(load_balance=False keeps"):
    on_shapes(q, q, q, mesh=seq(8), strategy="ring", is_causal=True)
  plan = jattn.context_parallel_plan(q, q, q, mesh=seq(8), is_causal=True)
  assert plan.strategy == "ulysses" and "T=24" in plan.costs["ring"].refused
  # no mask: one contiguous chunk per device is already balanced
  assert jattn.context_parallel_plan(q, q, q, mesh=seq(8), strategy="ring").order.c == 1


@pytest.mark.parametrize("kw,name", [
    (dict(bias=np.zeros((16, 16), np.float32)), "bias: a dense bias is"),
    (dict(mask=np.ones((16, 16), bool)), "mask: a dense mask is"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate: dropout's draw"),
    (dict(return_weights=True), "return_weights: the weights are"),
    (dict(implementation="xla"), "implementation: each device runs")])
def test_what_cannot_be_split_is_refused_by_name(kw, name):
  q = np.zeros((1, 16, 8, 4), np.float32)
  with raises(ValueError, f"context_parallel_attention does not support .*{name}"):
    jattn.context_parallel_attention(q, q, q, mesh=seq(8), **kw)


def test_ulysses_needs_heads_divisible_by_p_and_says_so():
  q, kv = sd(1, 16, 8, 4), sd(1, 16, 2, 4)  # K = 2 < 8 devices
  with raises(ValueError, "heads N=8 and K=2 .* divisible by the 8 devices of mesh axis 'seq': "
                          "Ulysses shards the heads"):
    on_shapes(q, kv, kv, mesh=seq(8), strategy="ulysses")
  report = jattn.explain(q, kv, kv, mesh=seq(8), is_causal=True)
  assert report.strategy != "ulysses" and "K=2" in report.costs["ulysses"].refused
  assert "ulysses   " in str(report) and "refused: heads N=8 and K=2" in str(report)


# ----------------------------------------------------------------- the load balance


def test_work_per_device_counts_the_dense_masks_blocks():
  """Work of an order = non-empty (b x b) blocks of each device's query chunks, counted
  here from the dense mask of 3 documents, causal, block by block."""
  T, P, c, b = 48, 4, 2, 3
  ids = documents(T, 3)
  allowed = reference_mask(1, 1, T, T, is_causal=True, q_segment_ids=ids,
                           kv_segment_ids=ids)[0, 0]
  blocks = allowed.reshape(T // b, b, T // b, b).any(axis=(1, 3))
  order = balance.ChunkOrder(((0, 7), (2, 5), (1, 6), (3, 4)))
  size = T // (P * c)
  want = [sum(blocks[g * size // b:(g + 1) * size // b].sum() for g in chunks)
          for chunks in order.devices]
  work = balance.work_of(order, blocks)
  assert list(work.per_device) == want
  # the ring step r of device i meets the keys of device i - r
  kv_of = lambda i: [g for g in order.devices[i]]
  rows = lambda g: slice(g * size // b, (g + 1) * size // b)
  step1 = [sum(blocks[rows(a), rows(k)].sum() for a in order.devices[i] for k in kv_of(i - 1))
           for i in range(P)]
  assert list(work.per_step[1]) == step1
  assert work.critical_path == sum(max(row) for row in work.per_step)


def steps_counted(blocks, devices):
  """int [r, i]: device i's non-empty blocks at ring step r, its queries against the keys of
  device i - r, counted in the bool block table itself."""
  P = len(devices)
  size = blocks.shape[0] // sum(len(d) for d in devices)  # blocks per chunk
  held = lambda i: [x for g in devices[i] for x in range(g * size, (g + 1) * size)]
  return np.array([[blocks[np.ix_(held(i), held((i - r) % P))].sum() for i in range(P)]
                   for r in range(P)])


def document_blocks(n, count, seed, size=4):
  """bool [n, n]: the non-empty size x size blocks of `count` causal documents of random
  lengths (a block is non-empty where its rows and columns share a document)."""
  ranges = documents(n * size, count, seed)[0].reshape(n, size)
  return np.tril((ranges.min(1)[:, None] <= ranges.max(1)[None, :])
                 & (ranges.max(1)[:, None] >= ranges.min(1)[None, :]))


def every_order(P, c):
  """int [orders, P, c]: every way to deal P * c chunks to P devices in ring order, c each."""
  def deal(left, devices):
    if devices == 0:
      yield ()
      return
    for first in itertools.combinations(left, c):
      for rest in deal([g for g in left if g not in first], devices - 1):
        yield (first,) + rest
  return np.array(list(deal(range(P * c), P)))


@pytest.mark.parametrize("order", [
    balance.zigzag(4), balance.contiguous(4, 3),
    balance.ChunkOrder(((0, 5, 9), (2, 7, 11), (1, 4, 10), (3, 6, 8)))])
def test_work_per_ring_step_and_the_critical_path_against_a_count(order):
  blocks = np.random.default_rng(order.c).random((2 * order.C, 2 * order.C)) < 0.4
  work = balance.work_of(order, blocks)
  steps = steps_counted(blocks, order.devices)
  assert np.array_equal(np.array(work.per_step), steps)
  assert work.critical_path == steps.max(axis=1).sum()
  assert list(work.per_device) == list(steps.sum(axis=0))


def search_state(P, c, seed, documents=False):
  """A random block table (or causal documents) and order, and what the search reads."""
  rng = np.random.default_rng(seed)
  blocks = rng.random((2 * P * c, 2 * P * c)) < 0.5
  if documents:
    blocks = document_blocks(2 * P * c, 5, seed, size=2)
  table = rng.permutation(P * c).reshape(P, c)
  pairs = balance.chunk_pairs(blocks, P * c)
  tables = balance._tables(table, pairs)
  steps = balance._steps(tables[2])
  dev = np.argsort(table.reshape(-1)) // c
  return blocks, table, pairs, tables, steps, dev, int(balance.TARGET * blocks.sum() / P)


def keys_counted(blocks, table, limit):
  """(work above the limit, critical path, entries at their step's peak), counted."""
  steps = steps_counted(blocks, table)
  peak = steps.max(axis=1)
  return (max(steps.sum(axis=0).max() - limit, 0), peak.sum(), (steps == peak[:, None]).sum())


@pytest.mark.parametrize("P,c", [(4, 2), (3, 3), (2, 1), (7, 2)])
def test_the_search_weighs_each_swap_as_a_recount_would(P, c):
  """The search weighs each swap of two chunks between devices, and of two devices' places
  on the ring, from the entries it changes; here each is made and its steps counted again.
  Of a batch it keeps the least, the first on ties, as the counts do."""
  blocks, table, pairs, tables, steps, dev, limit = search_state(P, c, P)
  tops = balance._tops(steps)
  a, b, took = balance._pick(table, dev, np.arange(P), 1 << 20)
  assert len(a) == (P * c) ** 2 * (P - 1) // (2 * P)  # each pair on different devices, once
  want = []
  for x, y in zip(a, b):
    want.append(keys_counted(blocks, np.where(table == x, y, np.where(table == y, x, table)),
                             limit))
    assert balance._swap_keys(table, pairs, tables, tops, limit, a[[len(want) - 1]],
                              b[[len(want) - 1]]) == (0, want[-1]), (x, y)
  assert balance._swap_keys(table, pairs, tables, tops, limit, a, b) == (
      want.index(min(want)), min(want))
  x, y = np.triu_indices(P, 1)
  want = []
  for u, v in zip(x, y):
    places = np.arange(P)
    places[u], places[v] = v, u
    want.append(keys_counted(blocks, table[places], limit))
    assert balance._place_keys(tables[2], tops, np.array([u]), np.array([v]), limit) == (
        0, want[-1]), (u, v)
  assert balance._place_keys(tables[2], tops, x, y, limit) == (want.index(min(want)), min(want))


@pytest.mark.parametrize("P,c,seed,documents", [
    (4, 2, 0, False), (5, 3, 1, False), (6, 2, 2, True), (8, 2, 3, True)])
def test_every_swap_that_lowers_the_keys_touches_a_hot_device(P, c, seed, documents):
  """The search weighs only the swaps of the devices `_hot` names (all of them where they
  fit the round's budget): here every swap and place swap is counted, and each that lowers
  the keys touches one."""
  blocks, table, pairs, tables, steps, dev, limit = search_state(P, c, seed, documents)
  hot = balance._hot(steps, tables[2].sum(axis=1), limit)
  now = keys_counted(blocks, table, limit)
  a, b, _ = balance._pick(table, dev, np.arange(P), 1 << 20)
  lower = [(dev[x], dev[y]) for x, y in zip(a, b)
           if keys_counted(blocks, np.where(table == x, y, np.where(table == y, x, table)),
                           limit) < now]
  for u, v in zip(*np.triu_indices(P, 1)):
    places = np.arange(P)
    places[u], places[v] = v, u
    if keys_counted(blocks, table[places], limit) < now:
      lower.append((u, v))
  assert lower, "no swap lowers the keys: nothing checked"
  assert all(u in hot or v in hot for u, v in lower), (hot, lower)
  assert len(hot) < P or not documents  # on documents it leaves devices out


def test_the_critical_path_is_near_the_best_of_every_order():
  """4 devices, 2 chunks each, causal documents: every order (2520) is tried here. The
  planner's critical path is within 1.25x of the best, 1.1x on average (balancing the totals
  first and the steps second gave 1.57x and 1.23x)."""
  P, c, n = 4, 2, 64
  orders = every_order(P, c)
  i, r = np.arange(P)[:, None], np.arange(P)
  ratios = []
  for count, seed in itertools.product((5, 8), range(4)):
    blocks = document_blocks(n, count, seed)
    size = n // (P * c)
    chunks = blocks.reshape(P * c, size, P * c, size).sum(axis=(1, 3))
    between = chunks[orders[:, :, :, None, None], orders[:, None, None]].sum(axis=(2, 4))
    best = between[:, i, (i - r) % P].max(axis=1).sum(axis=1).min()
    _, work = balance.plan(blocks, P, (2,))
    ratios.append(work.critical_path / best)
  assert max(ratios) <= 1.25 and np.mean(ratios) <= 1.1, ratios


def test_the_ring_of_16_documents_waits_little_beyond_the_mean_work():
  """T = 32k on 8 devices in 256 x 256 blocks: the critical path is within 12% of the mean
  work per device, its lower bound (balancing the totals first gave 181 against 133.4,
  1.36x); causal stays zig-zag, whose critical path is the mean."""
  T, P, b = 32768, 8, 256
  chunks = (1, 2, 4, 8, 16)
  order, work = balance.plan(document_blocks(T // b, 16, 0, size=b), P, chunks)
  assert sorted(g for d in order.devices for g in d) == list(range(order.C))
  assert work.imbalance <= balance.TARGET and work.critical_path <= 1.12 * work.mean
  order, work = balance.plan(np.tril(np.ones((T // b, T // b), bool)), P, chunks)
  assert order == balance.zigzag(P) and work.critical_path == work.mean


def benchmark_blocks(P, b=256):
  """The masks of benchmarks/context_parallel.py at T = 4096 P (16 P chunks of b): bool
  block tables, from each block's first and last rows and columns."""
  T = 4096 * P
  q0 = np.arange(T // b)[:, None] * b
  k0, q1, k1 = q0.T, q0 + b - 1, q0.T + b - 1
  return {"causal": k0 <= q1, "16 documents": document_blocks(T // b, 16, 0, size=b),
          "4k window": (k0 <= q1) & (q0 - k1 <= 4096), "prefix-LM": (k0 < T // 4) | (k0 <= q1)}


# the planner's critical path over zig-zag's, as the exhaustive search (before the pod-scale
# budget) had it, and 5% more: the budget must not cost more than that
WITHIN_5_PERCENT = {8: {"causal": 1.0, "16 documents": 1.05 * 148 / 336,
                        "4k window": 1.05 * 258 / 408, "prefix-LM": 1.05 * 1094 / 1252},
                    16: {"16 documents": 1.05 * 288 / 724}, 32: {"16 documents": 1.05 * 531 / 1596}}


@pytest.mark.parametrize("P", [8, pytest.param(16, marks=pytest.mark.thorough),
                               pytest.param(32, marks=pytest.mark.thorough)])
def test_the_planners_critical_path_against_zig_zags_counted(P):
  """Each order's steps counted in the block table itself: the plan's critical path is what
  it reports, and no more over zig-zag's than `WITHIN_5_PERCENT` allows."""
  for name, blocks in benchmark_blocks(P).items():
    if name not in WITHIN_5_PERCENT[P]:
      continue
    order, work = balance.plan(blocks, P, (1, 2, 4, 8, 16))
    path = steps_counted(blocks, order.devices).max(axis=1).sum()
    zigzag = steps_counted(blocks, balance.zigzag(P).devices).max(axis=1).sum()
    assert work.critical_path == path, name
    assert path <= WITHIN_5_PERCENT[P][name] * zigzag, (name, path, zigzag)


def test_causal_is_dealt_in_zig_zag_and_documents_are_balanced():
  """At T = 32k on 8 devices in 256 x 256 blocks: zig-zag for causal (exact); for 16
  documents of random lengths the balance is within TARGET, zig-zag is not."""
  T, P, b = 32768, 8, 256
  q = sd(1, T, 8, 64, dtype=jnp.bfloat16)
  causal = jattn.context_parallel_plan(q, q, q, mesh=seq(P), strategy="ring", is_causal=True)
  assert causal.order == balance.zigzag(P) and causal.costs["ring"].imbalance == 1.0
  ids = documents(T, 16)
  plan = jattn.context_parallel_plan(q, q, q, mesh=seq(P), strategy="ring", is_causal=True,
                                     mask_mod=mods.document(ids))
  assert plan.block == (b, b) and plan.notes == ()
  ranges = ids[0].reshape(-1, b)
  blocks = np.tril((ranges.min(1)[:, None] <= ranges.max(1)[None, :])
                   & (ranges.max(1)[:, None] >= ranges.min(1)[None, :]))
  assert plan.costs["ring"].work == tuple(balance.work_of(plan.order, blocks).per_device)
  assert plan.costs["ring"].imbalance <= balance.TARGET
  zz = balance.work_of(balance.zigzag(P), blocks)
  assert zz.imbalance > 1.5 and zz.critical_path > 1.5 * plan.costs["ring"].critical_path


def test_traced_document_ids_are_not_read_and_the_report_says_so():
  q = sd(1, 64, 8, 4)
  ids = documents(64, 4)
  order = {}

  def call(ids):
    order["plan"] = jattn.context_parallel_plan(q, q, q, mesh=seq(8), strategy="ring",
                                                is_causal=True, mask_mod=mods.document(ids))
  jax.eval_shape(call, ids)  # ids traced: the balance reads the causal mask alone
  assert order["plan"].order == balance.zigzag(8)
  assert "mask_mod Document depends on traced arrays" in order["plan"].notes[0]
  concrete = jattn.context_parallel_plan(q, q, q, mesh=seq(8), strategy="ring",
                                         is_causal=True, mask_mod=mods.document(ids))
  assert concrete.order != balance.zigzag(8) and concrete.notes == ()


def test_a_chunk_order_checks_itself():
  with raises(ValueError, "ChunkOrder.devices must give every device the same number"):
    balance.ChunkOrder(((0, 1), (2,)))
  with raises(ValueError, "hold each chunk 0..C-1 once"):
    balance.ChunkOrder(((0, 1), (1, 2)))
  q = sd(1, 16, 8, 4)
  with raises(ValueError, "load_balance is a ChunkOrder for 2 devices, but mesh axis 'seq' "
                          "has 8"):
    on_shapes(q, q, q, mesh=seq(8), strategy="ring", load_balance=balance.zigzag(2))


@pytest.mark.parametrize("order", [
    balance.zigzag(8), balance.contiguous(4, 3),
    balance.ChunkOrder(tuple(tuple(sorted(r)) for r in
                             np.random.default_rng(0).permutation(24).reshape(6, 4)))])
def test_the_chunk_moves_deal_the_order_and_undo_it(order):
  """The ppermute rounds of `relayout`, run in NumPy: each is a permutation of the devices,
  together they put chunk g where the order says, and reversed they bring it home."""
  P, c = order.P, order.c
  held = [[i * c + s for s in range(c)] for i in range(P)]  # contiguous: device-major
  dealt = [[None] * c for _ in range(P)]
  for r in relayout.rounds(order):
    assert sorted(r.to) == list(range(P))
    for i in range(P):
      dealt[r.to[i]][r.store[r.to[i]]] = held[i][r.send[i]]
  assert [list(d) for d in order.devices] == dealt
  back = [[None] * c for _ in range(P)]
  for r in relayout.rounds(order):
    for i in range(P):
      back[i][r.send[i]] = dealt[r.to[i]][r.store[r.to[i]]]
  assert back == held
  assert order.positions(2 * order.C).tolist() == [
      2 * g + t for chunks in order.devices for g in chunks for t in range(2)]


# ----------------------------------------------------------------- explain for meshes


def test_explain_with_a_mesh_reports_each_strategy():
  q, kv = sd(2, 4096, 8, 64), sd(2, 4096, 8, 64)
  report = jattn.explain(q, kv, kv, mesh=seq(8), local_window_size=(512, 0))
  text = str(report)
  for name in ("ring", "all_gather", "ulysses"):
    cost = report.costs[name]
    assert cost.refused is None and len(cost.work) == 8 and len(cost.bytes_sent) == 8
    assert f"  {name}" in text
  assert report.costs["ring"].critical_path is not None
  # Ulysses' equal share is no whole count: to a tenth, like the mean
  share = report.costs["ulysses"].max_work
  assert share != int(share) and f"ulysses    work max {share:.1f} / mean {share:.1f} " in text
  # all-gather holds all of S; ring and Ulysses a share linear in T / P
  assert report.costs["all_gather"].memory > report.costs["ring"].memory
  half = jattn.explain(sd(2, 2048, 8, 64), sd(2, 2048, 8, 64), sd(2, 2048, 8, 64),
                       mesh=seq(8), local_window_size=(512, 0))
  for name in ("ring", "ulysses"):
    assert report.costs[name].memory == 2 * half.costs[name].memory
  assert report.strategy in ("ring", "all_gather", "ulysses") and "chosen" in report.why


# ----------------------------------------------------------------- one device


def test_every_strategy_on_one_device_with_a_window():
  """P = 1: the same program, every key local; local_window_size, once refused, runs."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 8, 2, 4)).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  t_, s_ = np.arange(8)[:, None], np.arange(8)[None, :]
  want = reference_mods(q, q, q, allowed=(s_ <= t_) & (s_ >= t_ - 2))[0]
  for strategy in ("ring", "all_gather", "ulysses"):
    out = jattn.context_parallel_attention(q, q, q, mesh=mesh, strategy=strategy,
                                           is_causal=True, local_window_size=(2, 0))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=strategy)


def test_an_eager_call_compiles_once_per_mesh(caplog):
  """Called eagerly, a strategy's program is compiled once for its static description and
  then reused: new values (the query and the document ids the mask_mod reads) compile
  nothing. A second mesh of other axis types is a program of its own, with its sharding.
  Values against float64 NumPy."""
  import logging
  from jax.sharding import AxisType
  rng = np.random.default_rng(1)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  t_, s_ = np.arange(8)[:, None], np.arange(8)[None, :]

  def check(mesh, q, ids):
    out = jattn.ring_attention(q, q, q, mesh=mesh, is_causal=True,
                               mask_mod=mods.document(ids))
    allowed = (s_ <= t_) & (ids[:, None, :, None] == ids[:, None, None, :])
    np.testing.assert_allclose(out, reference_mods(q, q, q, allowed=allowed)[0], rtol=2e-5,
                               atol=2e-5)
    return out

  draw = lambda: rng.standard_normal((2, 8, 2, 4)).astype(np.float32)
  check(mesh, draw(), np.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2, np.int32))
  with caplog.at_level(logging.WARNING), jax.log_compiles():
    check(mesh, draw(), np.array([[0, 1, 1, 1, 1, 2, 2, 2]] * 2, np.int32))
  assert not [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
  explicit = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Explicit,))
  out = check(explicit, draw(), np.array([[0, 0, 1, 1, 1, 1, 1, 1]] * 2, np.int32))
  assert out.sharding.mesh.axis_types == (AxisType.Explicit,)


def test_implementation_context_parallel_runs_the_chosen_strategy_over_the_context_mesh():
  """dot_product_attention(implementation="context_parallel") inside jax.set_mesh (what the
  modules and the Transformer pass through): the strategy the plan chooses, over the "seq"
  axis; values against NumPy. Unsupported arguments and a mesh without "seq" are named."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 8, 2, 4)).astype(np.float32)
  kv = rng.standard_normal((2, 8, 1, 4)).astype(np.float32)  # K = 1: Ulysses refuses on P > 1
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  t_, s_ = np.arange(8)[:, None], np.arange(8)[None, :]
  want = reference_mods(q, kv, kv, allowed=s_ <= t_)[0]
  plan = jattn.context_parallel_plan(q, kv, kv, mesh=mesh, is_causal=True)
  with jax.set_mesh(mesh), jattn.explain_calls() as reports:
    out = jax.jit(lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=True, implementation="context_parallel"))(q, kv, kv)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  assert reports[0].implementation("cpu") == plan.strategy
  with raises(ValueError, "implementation='context_parallel' does not support .*mask"):
    jattn.dot_product_attention(q, q, q, mask=np.ones((8, 8), bool),
                                implementation="context_parallel")
  with raises(ValueError, "implementation='context_parallel' needs a mesh with a 'seq' axis"):
    jattn.dot_product_attention(q, q, q, implementation="context_parallel")
  # on 8 devices (shapes only): strategy=None's choice, which for K = 1 is not Ulysses
  with jax.sharding.use_abstract_mesh(seq(8)), jattn.explain_calls() as reports:
    jax.eval_shape(lambda q, k: jattn.dot_product_attention(
        q, k, k, is_causal=True, implementation="context_parallel"),
        sd(2, 64, 8, 4), sd(2, 64, 1, 4))
  want = jattn.context_parallel_plan(sd(2, 64, 8, 4), sd(2, 64, 1, 4), sd(2, 64, 1, 4),
                                     mesh=seq(8), is_causal=True).strategy
  assert reports[0].implementation("cpu") == want != "ulysses"
