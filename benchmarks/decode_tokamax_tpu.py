"""tokamax's ragged_paged_attention compiled for TPU v5e / v6e on the decode batches of
`decode_tpu.py` (deviceless; nothing runs on a TPU), its step estimated on the same
instrument as jattn's paged_tpu: max(DMA bytes / HBM bandwidth, bundles issued / clock).

tokamax (0.0.17, Python 3.12, jax >= 0.11.1) is no dependency of jattn. Installed
beside a venv without touching it:

  pip install --target DIR --no-deps tokamax einshape pydantic pydantic-core \\
      annotated-types typing-inspection qwix immutabledict tensorboardX xprof fire \\
      termcolor six
  JAX_PLATFORMS=cpu PYTHONPATH=DIR python benchmarks/decode_tokamax_tpu.py [v5e v6e]

Its cache is one array [P, page_size, 2 K, H] (keys and values of a head side by
side), donated as a server would; the call skips the cache update (attention only, as
jattn's estimate). One call runs three Mosaic kernels (decode, prefill, mixed), each
after a scheduling kernel that writes its run-time schedule. For each (generation,
batch) a child process compiles the call with libtpu dumping the final bundle schedules
(LIBTPU_INIT_ARGS=--xla_jf_dump_to) and:

1. captures each kernel's configuration (block sizes, lanes a step, buffers, the
   schedule's capacity) as tokamax's wrapper builds it, and runs tokamax's own
   scheduling kernel in interpret mode on the CPU with the batch's lengths: the
   schedule the decode kernel would read (its steps, each step's DMA rows);
2. finds the loops of each kernel's final bundles (`tpu_loops.py`) and names them from
   tokamax's source, checking the nest is the one the source implies (else it refuses):
   decode kernel: a loop over chunks of the schedule (kernel.py, `pl.loop` to
   cdiv(steps, max_steps_ub)); in it the pipeline's prologue lookahead fetches (jax's
   `fetch_with_lookahead`, one block each, for the query and the pages) and the grid
   loop over the chunk's steps (`emit_pipeline`), in which the same two lookahead loops
   fetch the blocks the prologue did not (each step's block index is new: one fetch a
   step in all, so chunk steps - (buffers - 1) iterations). Scheduling kernel
   (schedule.py): sequences > query blocks > key blocks (`seq_loop`, `q_loop`,
   `k_loop`), the flush's mask-out and wait-count loops inside the key-block loop's
   flush branch and once more after it;
3. issue = bundles outside loops + sum over loops of (own bundles x trips); a loop's
   own bundles are all counted on every iteration (the predicated copies run on every
   step here: each block index changes), except the key-block loop's flush branch,
   counted only on the iterations that flush;
4. the decode kernel's DMA bytes are the schedule's own wait counts (its key, value,
   query and output rows, 512-byte rows), plus its schedule reads; each kernel's time
   is max(DMA / bandwidth, issue / clock), clocks and bandwidths as `decode_tpu.py`.

The "call" adds the decode kernel's scheduling kernel and the prefill and mixed pairs,
which run with an empty schedule (their bundles outside loops). Left out: the XLA ops
around the kernels (padding, reshapes; their bytes are in `bytes_accessed`), stalls,
DMA issue limits, and all that `decode_tpu.py` leaves out.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks import decode_tpu, tpu_loops  # noqa: E402

RESULTS = ROOT / "benchmarks/results"


def _cdiv(a, b):
  return -(-a // b)


def _kernel_files(dump: pathlib.Path) -> dict:
  """{kernel name in the HLO: its final bundles file}."""
  out = {}
  for f in dump.iterdir():
    m = re.match(r"\d+-(.+?)-\d+-final_bundles\.txt$", f.name)
    if m and "schedule-analysis" not in f.name:
      out[m.group(1)] = f
  return out


def _scheduler_of(hlo: str, kernel: str) -> str:
  """The scheduling kernel whose outputs `kernel`'s custom call reads."""
  call = re.search(rf"%{re.escape(kernel)} = .*?custom-call\(([^)]*)\)", hlo).group(1)
  names = re.findall(r"%([\w.\-]+)", call)
  found = {m.group(1) for n in names for m in [re.search(
      rf"%{re.escape(n)} = [^\n]*?get-tuple-element\(%(rpa_metadata_schedule[\w.]*)\)", hlo)]
      if m}
  if len(found) != 1:
    raise RuntimeError(f"{kernel}: expected one scheduling kernel among its operands, {found}")
  return found.pop()


def _decode_trips(listing, cfgs, steps):
  """(trips per loop, names) of the decode kernel's loops, from kernel.py and jax's
  pipeline: chunks of max_steps_ub steps, each with its prologue lookahead loops and the
  grid loop with its lookahead loops. Raises if the nest is not that one."""
  loops, n_buf, batch = listing.loops, cfgs["n_buffer"], cfgs["batch_size"]
  top = listing.children(None)
  if len(top) != 1:
    raise RuntimeError(f"decode kernel: expected one chunk loop at the top, got {len(top)}")
  chunk = top[0]
  inner = listing.children(chunk)
  grid = [i for i in inner if listing.count(i, r"vmatmul") > 0]
  if len(grid) != 1 or listing.children(grid[0]) == []:
    raise RuntimeError("decode kernel: no single grid loop (with the matmuls) in the chunk loop")
  grid = grid[0]
  prologue = [i for i in inner if i != grid]
  per_ref = {"query": batch, "pages": batch * (cfgs["bkv_p_cache"] + 1)}  # bref_override.py

  def ref(i):
    n = listing.count(i, r"dma\.hbm_to_vmem")
    names = [k for k, v in per_ref.items() if v == n]
    if len(names) != 1 or listing.children(i):
      raise RuntimeError(f"decode kernel: loop at {loops[i].start} issues {n} DMAs, not a "
                         f"lookahead loop of {per_ref}")
    return names[0]

  if sorted(map(ref, prologue)) != sorted(list(per_ref) * (n_buf - 2)):
    raise RuntimeError(f"decode kernel: expected {n_buf - 2} prologue lookahead loop(s) per "
                       f"ref, got {[ref(i) for i in prologue]}")
  if sorted(map(ref, listing.children(grid))) != sorted(per_ref):
    raise RuntimeError("decode kernel: the grid loop holds no lookahead loop per ref")
  ub = cfgs["max_steps_ub"]
  chunks = [min(ub, steps - c * ub) for c in range(_cdiv(steps, ub))]
  chunks = [n + (c * ub) % 128 for c, n in enumerate(chunks)]  # + prefix_steps (kernel.py)
  trips, names = [0] * len(loops), [""] * len(loops)
  trips[chunk], names[chunk] = len(chunks), "chunk loop (pl.loop over the schedule)"
  trips[grid], names[grid] = sum(chunks), "grid loop (emit_pipeline, one schedule step)"
  seen = {}
  for i in prologue:  # the k-th prologue step of a ref fetches once if the chunk has k + 1 steps
    k = seen[ref(i)] = seen.get(ref(i), 0) + 1
    trips[i] = sum(n > k for n in chunks)
    names[i] = f"prologue lookahead fetch of the {ref(i)}, step {k}"
  for i in listing.children(grid):
    trips[i] = sum(max(n - (n_buf - 1), 0) for n in chunks)
    names[i] = f"lookahead fetch of the {ref(i)} (in the grid loop)"
  return trips, names


def _scheduler_trips(listing, cfgs, seqs, q_blocks, tasks):
  """(trips, names, own bundles of the key-block loop's flush branch) of a scheduling
  kernel's loops (schedule.py): seq > q > k > {mask-out, waits} (the flush inside
  advance_carry), then mask-out and waits once after compute()."""
  loops = listing.loops
  parents = [l.parent for l in loops]
  if parents != [None, 0, 1, 2, 2, None, None]:
    raise RuntimeError(f"scheduling kernel: loop nest {parents} is not schedule.py's")
  per = cfgs["max_steps_ub"] * cfgs["batch_size"]
  flushes = tasks // per
  rest = tasks - flushes * per
  last = _cdiv(rest, cfgs["batch_size"]) * cfgs["batch_size"]
  trips = [seqs, q_blocks, tasks, 0, flushes * cfgs["max_steps_ub"], last - rest,
           last // cfgs["batch_size"]]
  names = ["seq_loop", "q_loop", "k_loop", "mask-out (in the k_loop's flush)",
           "compute_waits (in the k_loop's flush)", "mask-out (final flush)",
           "compute_waits (final flush)"]
  own = set(listing._own_addresses(2))
  around = [(b, a) for b, a in listing.forward if b in own
            and b < loops[3].start and loops[4].end < a]
  if len(around) != 1:
    raise RuntimeError("scheduling kernel: no single flush branch around the flush loops")
  b, a = around[0]
  flush_own = sum(1 for x in range(b + 1, a) if x in own)
  return trips, names, flush_own, flushes


def _child(generation, batch, out):
  dump = tempfile.mkdtemp(prefix="jattn_tokamax_dump_")
  try:
    _estimate(generation, batch, out, dump)
  finally:
    shutil.rmtree(dump, ignore_errors=True)  # hundreds of MB a compile


def _estimate(generation, batch, out, dump):
  os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={dump}"
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  sys.argv[1:] = ["--tokamax_cross_compile"]  # tokamax reads its --tokamax_* flags from argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import tokamax
  from importlib.metadata import version
  from jax.experimental import topologies
  from jax.experimental.pallas import tpu as pltpu
  from tokamax._src.ops.batched_rpa.kernel import configs, kernel, schedule

  captured = {}
  rpa_kernel = kernel.rpa_kernel

  def spy(*args, cfgs, **kwargs):  # the configuration tokamax's wrapper built, by mode
    captured[cfgs.mode] = cfgs
    return rpa_kernel(*args, cfgs=cfgs, **kwargs)

  kernel.rpa_kernel = spy
  lengths, max_length = decode_tpu.BATCHES[batch]
  N, K, H, ps = decode_tpu.N, decode_tpu.K, decode_tpu.H, decode_tpu.PAGE
  B = len(lengths)
  devices = topologies.get_topology_desc(f"{generation}=1x1", "tpu").devices
  mesh = jax.sharding.Mesh(devices, ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.P())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shard)
  num_pages = sum(_cdiv(n, ps) for n in lengths) + B
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
    traced = jax.jit(attend, donate_argnames=("kv_cache",)).trace(**args)
  compiled = traced.lower(lowering_platforms=("tpu",)).compile()
  seconds = time.perf_counter() - start
  hlo = compiled.as_text()

  # the schedule tokamax's scheduling kernel writes for this batch: every row decodes one
  # token (q_len 1) over its length; the wrapper's FULL-scope lengths (wrapper.py)
  kv_lens = np.asarray(lengths, np.int32)
  q_lens = np.ones(B, np.int32)
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  distribution = np.full(3, B, np.int32)  # all B rows decode; prefill and mixed empty
  cache_lens = kv_lens - q_lens
  schedules, cfg = {}, {}
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lanes = pltpu.get_tpu_info().num_lanes
    for mode, c in captured.items():
      fn = jax.jit(lambda *a, c=c: schedule.generate_rpa_metadata(*a, cfgs=c, interpret=True))
      run = fn.trace(cu_q_lens, cache_lens, cache_lens, q_lens, distribution).lower(
          lowering_platforms=("cpu",)).compile()
      smem = schedule.BaseMetadataComputer.get_rpa_schedule(c)
      cfg[mode] = dict(batch_size=c.batch_size, bkv_sz=c.bkv_sz, bq_sz=c.bq_sz,
                       bkv_p_cache=c.bkv_p_cache, n_buffer=c.n_buffer,
                       max_steps_ub=c.max_steps_ub, name=kernel.get_kernel_name(c),
                       smem_words=[int(np.prod(x.shape)) for x in jax.tree.leaves(smem)])
      schedules[mode] = run
  results = {}
  for mode, run in schedules.items():
    s = jax.device_get(run(cu_q_lens, cache_lens, cache_lens, q_lens, distribution))
    steps = int(np.asarray(s.actual_steps)[0])
    b = cfg[mode]["batch_size"]
    s_idx = np.asarray(s.s_idx.data)[:steps * b]
    waits = sum(np.asarray(getattr(s, f).data)[:steps].astype(np.int64) for f in (
        "total_wait_kv_in", "total_wait_kv_out", "total_wait_q_in", "total_wait_o_out",
        "total_wait_lse_out"))
    results[mode] = dict(steps=steps, tasks=int((s_idx != -1).sum()),
                         dma_rows=int(waits.sum()) if steps else 0)
  files = _kernel_files(pathlib.Path(dump))
  bandwidth, clock = decode_tpu.GENERATIONS[generation]
  kernels = {}
  rows = {configs.RpaCase.DECODE: B, configs.RpaCase.PREFILL: 0, configs.RpaCase.MIXED: 0}
  for mode, c in cfg.items():
    name = next(n for n in files if n.startswith(c["name"] + "."))
    sched_name = _scheduler_of(hlo, name)
    steps, tasks = results[mode]["steps"], results[mode]["tasks"]
    listing = tpu_loops.parse(files[name].read_text())
    if steps == 0:
      trips, names = [0] * len(listing.loops), ["(no schedule step)"] * len(listing.loops)
    elif mode == configs.RpaCase.DECODE:
      trips, names = _decode_trips(listing, c, steps)
    else:
      raise RuntimeError(f"{mode}: {steps} steps; this batch was to decode only")
    issue = tpu_loops.issued(listing, trips)
    # if every bundle a forward branch can skip were skipped (the source rules it out:
    # the copies run on every step): how much of the issue time rests on that reading
    skipped = listing.skippable(None) + sum(listing.skippable(i) * t for i, t in enumerate(trips))
    # schedule reads at each chunk: each field's words for the chunk's steps, aligned to
    # 1024 (kernel.py's execute_schedule_chunk); the HBM fields are the multi-word ones
    ub = c["max_steps_ub"]
    chunk_steps = [min(ub, steps - i * ub) for i in range(_cdiv(steps, ub))]
    read_words = sum(min(_cdiv(w // ub * n, 1024) * 1024, w) for n in chunk_steps
                     for w in c["smem_words"] if w > 1)
    # the wait counts are in rows of `lanes` 32-bit words (schedule.py's _compute_waits)
    dma_bytes = results[mode]["dma_rows"] * lanes * 4 + 4 * read_words
    kernels[name] = _timed(dict(
        role=f"{mode.name.lower()} kernel", steps=steps, tasks=tasks, **c,
        bundles=listing.total, bundles_outside_loops=listing.own(None),
        loops=_loops(listing, trips, names), issue_bundles=issue,
        issue_bundles_all_skips_taken=issue - skipped, dma_bytes=dma_bytes,
        bundles_per_page=round(issue / max(sum(_cdiv(n, ps) for n in lengths), 1), 1)),
        bandwidth, clock)

    s_listing = tpu_loops.parse(files[sched_name].read_text())
    seqs = rows[mode]
    q_blocks = seqs * _cdiv(1, c["bq_sz"])  # each row's one query token
    s_trips, s_names, flush_own, flushes = _scheduler_trips(s_listing, c, seqs, q_blocks, tasks)
    s_issue = (tpu_loops.issued(s_listing, s_trips) - flush_own * (tasks - flushes))
    # every flush writes the whole SMEM schedule to HBM (schedule.py's _write_schedule_to_hbm)
    kernels[sched_name] = _timed(dict(
        role=f"{mode.name.lower()} scheduling kernel", bundles=s_listing.total,
        bundles_outside_loops=s_listing.own(None), loops=_loops(s_listing, s_trips, s_names),
        flush_branch_bundles=flush_own, flushes_in_k_loop=flushes, issue_bundles=s_issue,
        dma_bytes=4 * (flushes + 1) * sum(c["smem_words"])), bandwidth, clock)

  token_bytes = K * (decode_tpu.H + decode_tpu.D) * 2
  roofline = int(np.sum(lengths)) * token_bytes
  decode = next(k for k in kernels.values() if k["role"] == "decode kernel")
  result = {
      "generation": generation, "batch": batch, "lengths": list(map(int, lengths)),
      "tokamax": version("tokamax"), "jax": jax.__version__, "libtpu": version("libtpu"),
      "compile_s": round(seconds, 1), "hbm_bytes_per_s": bandwidth, "clock_hz_derived": clock,
      "roofline_bytes": roofline, "roofline_us": 1e6 * roofline / bandwidth,
      "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
      "bytes_accessed": compiled.cost_analysis().get("bytes accessed"),
      "custom_calls": hlo.count("tpu_custom_call"), "kernels": kernels,
      "decode_kernel_us": decode["estimate_us"],
      "call_us": sum(k["estimate_us"] for k in kernels.values())}
  pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")


def _loops(listing, trips, names):
  return [dict(name=n, start=l.start, end=l.end, parent=l.parent, own_bundles=listing.own(i),
               skippable_bundles=listing.skippable(i), trips=int(t))
          for i, (l, t, n) in enumerate(zip(listing.loops, trips, names))]


def _timed(k, bandwidth, clock):
  k.update(issue_us=1e6 * k["issue_bundles"] / clock, dma_us=1e6 * k["dma_bytes"] / bandwidth)
  if "issue_bundles_all_skips_taken" in k:
    k["issue_us_all_skips_taken"] = 1e6 * k["issue_bundles_all_skips_taken"] / clock
  k["estimate_us"] = max(k["issue_us"], k["dma_us"])
  return k


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    return _child(*argv[1:4])
  gens = [a for a in argv if a in decode_tpu.GENERATIONS] or list(decode_tpu.GENERATIONS)
  paged = {(r["generation"], r["batch"]): r for r in json.loads(
      (RESULTS / "tpu_decode_estimates.json").read_text())["results"]}
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  print("deviceless TPU compiles (estimates, no TPU ran); paged_tpu from "
        "benchmarks/results/tpu_decode_estimates.json")
  print(f"{'gen':<4} {'batch':<15} {'roofline':>9} {'paged_tpu':>9} {'tokamax':>9} "
        f"{'dma':>8} {'issue':>8} {'/paged':>7} {'/roof':>6} {'call':>8} {'call/paged':>10} "
        f"{'bundles/page':>12} {'(paged_tpu)':>11}")
  for generation in gens:
    rows = []
    for batch in decode_tpu.BATCHES:
      with tempfile.NamedTemporaryFile(suffix=".json") as f:
        done = subprocess.run([sys.executable, __file__, "--child", generation, batch, f.name],
                              capture_output=True, text=True)
        if done.returncode:
          raise RuntimeError(f"{generation} {batch}: {done.stderr[-3000:]}")
        r = json.loads(pathlib.Path(f.name).read_text())
      p = paged[generation, batch]["paged_tpu"]["estimate_us"]
      d = next(k for k in r["kernels"].values() if k["role"] == "decode kernel")
      r.update(date=date, paged_tpu_us=p, decode_kernel_over_paged_tpu=d["estimate_us"] / p,
               decode_kernel_over_roofline=d["estimate_us"] / r["roofline_us"],
               call_over_paged_tpu=r["call_us"] / p,
               command="JAX_PLATFORMS=cpu PYTHONPATH=<tokamax dir> python "
                       "benchmarks/decode_tokamax_tpu.py " + " ".join(argv))
      rows.append(r)
      print(f"{generation:<4} {batch:<15} {r['roofline_us']:8.1f}u {p:8.1f}u "
            f"{d['estimate_us']:8.1f}u {d['dma_us']:7.1f}u {d['issue_us']:7.1f}u "
            f"{d['estimate_us'] / p:6.2f}x {d['estimate_us'] / r['roofline_us']:5.2f}x "
            f"{r['call_us']:7.1f}u {r['call_us'] / p:9.2f}x {d['bundles_per_page']:12.1f} "
            f"{paged[generation, batch]['paged_tpu'].get('bundles_per_page', float('nan')):11.1f}",
            flush=True)
    (RESULTS / f"tpu_decode_tokamax_{generation}.json").write_text(
        json.dumps({"results": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
