"""The decode step on TPU v5e and v6e, estimated from the TPU compiler's own output on a
host without a TPU (`python benchmarks/decode.py --tpu`, in a venv with libtpu).

Nothing here ran on a TPU. For each generation and batch it compiles one
decode_attention call (no write) with the TPU compiler (deviceless, `topologies`)
and reports, bfloat16 pages of 64 tokens, N = 16, K = 4, H = D = 128, causal:

  roofline       bytes of the keys and values each row needs (its length x K x
                 (H + D) x 2) / the generation's HBM bandwidth;
  paged_tpu      the kernel (named): its DMA volume, U pages a loop step
                 (the last step of a row repeats its last page: ceil(pages / U) x U
                 pages a row) / bandwidth, and its issue time from the final bundle
                 schedule the compiler dumps (LIBTPU_INIT_ARGS=--xla_jf_dump_to): the
                 bundles of an unmasked step (every key below the row's length) and of
                 a masked one (`bundles`) x the row's steps of each kind + the rest of
                 the program x programs, at one bundle a cycle with no stall, at the
                 clock below; the estimate is the larger of the two (perfect overlap of
                 DMA and compute: a lower bound);
  split          the pure-JAX path compiled for the same TPU: XLA's
                 `cost_analysis()["bytes accessed"]` counts its while loop's body
                 once (the trip count is data-dependent), so the body's bytes are
                 taken as the difference between two compiles at W and 2W pages per
                 step, and the program's bytes = (outside) + steps x (body), steps =
                 ceil(needed pages / W); / bandwidth;
  xla            the dense reference (every row's whole table), bytes accessed / bandwidth.

`--int8` (`main_int8`) compiles the kernel over int8 pages beside bfloat16 ones
(bfloat16 queries, a pool of INT8_POOL_FACTOR x the pages needed for both) and
reports the roofline (1 byte an entry, plus each page's float32 scales per kv
head, keys and values) and the kernel's DMA and issue time, as above;
benchmarks/results/tpu_decode_int8_estimates.json.

HBM bandwidth: v5e 819 GB/s (cloud.google.com/tpu/docs/v5e; jax's
jax/_src/tpu_info.py has 8.20e11), v6e 1640 GB/s (cloud.google.com/tpu/docs/v6e;
tpu_info 1.64e12). Clocks are NOT published figures: derived as peak bf16
FLOP/s / (MXUs x MXU cells x 2): v5e 1.97e14 / (4 x 128^2 x 2) = 1.5 GHz (4
MXUs as tpu_info lists); v6e 9.2e14 / (4 x 256^2 x 2) = 1.75 GHz, assuming 4
MXUs a core: tpu_info lists 2, which would make it 3.5 GHz and halve v6e's
issue times. Take the v6e issue time as uncertain by that factor of 2.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np

GENERATIONS = {  # HBM bytes/s, clock Hz (see the module docstring)
    "v5e": (819e9, 1.5e9),
    "v6e": (1640e9, 1.75e9),
}
ROOT = pathlib.Path(__file__).resolve().parents[1]
N, K, H, D, PAGE = 16, 4, 128, 128, 64
BATCHES = {
    "B=8, 256..32k": ((256, 320, 384, 448, 512, 640, 768, 32512), 32768),
    "B=1, 128k": ((131072,), 131072),
}


def kernel_bundles(generation: str, lengths, max_length, step_pages=None, cache_dtype="bfloat16",
                   pool_factor=1):
  """`bundles` of the kernel for this batch (step_pages: U, else the kernel's default),
  from a compile in a subprocess whose libtpu dumps its schedules (a dump of every
  compile is slow), or None."""
  with tempfile.TemporaryDirectory(prefix="jattn_tpu_dump_") as dump:
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", LIBTPU_INIT_ARGS=(os.environ.get("LIBTPU_INIT_ARGS", "")
                                             + f" --xla_jf_dump_to={dump}").strip())
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}]; from benchmarks import decode_tpu; "
            f"from jax.experimental import topologies; "
            f"decode_tpu._compile(topologies.get_topology_desc({generation + '=1x1'!r}, 'tpu')"
            f".devices, {list(map(int, lengths))}, {int(max_length)}, 'paged_tpu', {step_pages}, "
            f"{cache_dtype!r}, {int(pool_factor)})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"the kernel's compile failed: {done.stderr[-2000:]}")
    return bundles(pathlib.Path(dump))


def bundles(dump: pathlib.Path, kernel: str = "jattn_paged_decode_tpu"):
  """(bundles of the kernel, of its page loop's body, of one unmasked step, of one masked
  step) from the final bundle schedule; None if the compiler wrote none.

  The loop body holds both paths of a step, each behind a forward branch on the same
  predicate (`sbr.rel (p)` over the unmasked path, `sbr.rel (!p)` over the masked one):
  an unmasked step runs the body less the masked path, a masked step the body less the
  unmasked path. Without that pair (the mods' calls: every step masked) both are the body."""
  files = [f for f in dump.iterdir() if kernel in f.name
           and f.name.endswith("-final_bundles.txt") and "schedule" not in f.name]
  if not files:
    return None
  total, starts, ends, at_region, branches = 0, [], {}, {}, []
  for line in max(files, key=lambda f: f.stat().st_mtime).read_text().splitlines():
    m = re.match(r"\s*(0x[0-9a-f]+|\d+)\s+(LB:)?", line)
    if not m:
      continue
    address = int(m.group(1), 0)
    total += 1
    region = re.search(r"Start region (\d+)", line)
    if m.group(2) and region:
      starts.append((address, region.group(1)))
    for r in re.findall(r"region (\d+)", line.split("/*", 1)[1] if "/*" in line else ""):
      at_region.setdefault(r, address)  # the first bundle of region r (a branch target)
    for predicate, target in re.findall(r"sbr\.rel \(([^)]*)\) target = \$region(\d+)", line):
      ends[target] = address
      branches.append((address, predicate, target))
  loops = [(start, ends[r]) for start, r in starts if r in ends]
  if not loops:
    return total, 0, 0, 0
  first, last = max(loops)
  body = last - first + 1
  skips = {p: at_region[r] - a - 1 for a, p, r in branches
           if first <= a <= last and r in at_region and at_region[r] > a}
  pair = [p for p in skips if p.startswith("!") and p[1:] in skips]
  if not pair:
    return total, body, body, body
  unmasked, masked = skips[pair[0][1:]], skips[pair[0]]
  return total, body, body - masked, body - unmasked


def _compile(devices, lengths, max_length, implementation, pages_per_step=None,
             cache_dtype="bfloat16", pool_factor=1):
  """The compiled call (bfloat16 queries; pages of cache_dtype: bfloat16 or int8; a pool
  of pool_factor x the pages the lengths need) and the plan explain_decode reports for TPU."""
  import jax
  import jax.numpy as jnp
  import jattn
  mesh = jax.sharding.Mesh(devices, ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.P())
  B = len(lengths)
  num_pages = pool_factor * int(sum(-(-(n + 1) // PAGE) for n in lengths))
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      B, max_length, num_kv_heads=K, head_dim=H, page_size=PAGE, num_pages=num_pages,
      dtype=jnp.dtype(cache_dtype)))
  cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard), cache)
  q = jax.ShapeDtypeStruct((B, 1, N, H), jnp.bfloat16, sharding=shard)
  f = jax.jit(lambda q, c: jattn.decode_attention(q, c, is_causal=True,
                                                  implementation=implementation,
                                                  pages_per_step=pages_per_step))
  with jattn.lowering_for("tpu"):
    compiled = f.trace(q, cache).lower(lowering_platforms=("tpu",)).compile()
  report = jattn.explain_decode(q, cache, is_causal=True, implementation=implementation,
                                pages_per_step=pages_per_step)
  return compiled, report.choices["tpu"].plan


def estimate(generation: str, lengths, max_length, counted) -> dict:
  """counted: `kernel_bundles` of this batch (before this process loads libtpu: two
  processes cannot hold it at once)."""
  from jax.experimental import topologies
  bandwidth, clock = GENERATIONS[generation]
  devices = topologies.get_topology_desc(f"{generation}=1x1", "tpu").devices
  lengths = np.asarray(lengths)
  pages = -(-lengths // PAGE)
  kernel = kernel_estimate(generation, lengths, max_length, counted, "bfloat16", devices)
  out = {"generation": generation, "lengths": lengths.tolist(), "hbm_bytes_per_s": bandwidth,
         "clock_hz_derived": clock, "roofline_bytes": kernel.pop("roofline_bytes"),
         "roofline_us": kernel.pop("roofline_us")}
  for shared in ("generation", "lengths", "cache_dtype"):
    del kernel[shared]
  out["paged_tpu"] = kernel

  W = 16  # the split path's default at pages of 64 (1024 keys a step)
  one = _compile(devices, lengths, max_length, "split", W)[0].cost_analysis()["bytes accessed"]
  two = _compile(devices, lengths, max_length, "split", 2 * W)[0].cost_analysis()[
      "bytes accessed"]
  body = two - one  # W pages' bytes in one step
  steps = -(-int(pages.sum()) // W)
  split_bytes = (one - body) + steps * body
  out["split"] = {"bytes_accessed_loop_once": one, "body_bytes_per_step": body,
                  "steps": steps, "bytes": split_bytes, "estimate_us": 1e6 * split_bytes / bandwidth}
  dense = _compile(devices, lengths, max_length, "xla")[0].cost_analysis()["bytes accessed"]
  out["xla"] = {"bytes": dense, "estimate_us": 1e6 * dense / bandwidth}
  return out


def kernel_estimate(generation: str, lengths, max_length, counted, cache_dtype: str,
                    devices=None, pool_factor=1) -> dict:
  """The roofline and paged_tpu's estimate (DMA volume, issue time from `counted`, the
  kernel's `kernel_bundles`) for pages of cache_dtype, bfloat16 queries, a pool of
  pool_factor x the pages the lengths need. int8 pages move 1 byte an entry and their
  scales: float32 per (page, kv head), keys and values."""
  from jax.experimental import topologies
  bandwidth, clock = GENERATIONS[generation]
  if devices is None:
    devices = topologies.get_topology_desc(f"{generation}=1x1", "tpu").devices
  lengths = np.asarray(lengths)
  itemsize = 1 if cache_dtype == "int8" else 2
  token_bytes = K * (H + D) * itemsize
  page_extra = 2 * K * 4 if cache_dtype == "int8" else 0  # the scales of a page
  pages = -(-lengths // PAGE)
  roofline_bytes = int(lengths.sum()) * token_bytes + int(pages.sum()) * page_extra
  compiled, plan = _compile(devices, lengths, max_length, "paged_tpu", None, cache_dtype,
                            pool_factor)
  assert "jattn_paged_decode_tpu" in compiled.as_text(), "paged_tpu did not take the call"
  assert plan.splits == 1, "the step count below assumes one split per row"
  U = plan.step_pages
  # a row's steps of U pages (the last one short: it repeats its last page); a step is
  # unmasked when all its keys lie below the row's length (causal, T = 1, no mods)
  steps = -(-pages // U)
  whole = lengths // (U * PAGE)
  # the scales come with the work list (scalar prefetch): once per listed page
  dma_bytes = int(steps.sum()) * U * PAGE * token_bytes + int(pages.sum()) * page_extra
  out = {"generation": generation, "cache_dtype": cache_dtype, "lengths": lengths.tolist(),
         "roofline_bytes": roofline_bytes, "roofline_us": 1e6 * roofline_bytes / bandwidth,
         "plan": str(plan), "step_pages": U, "dma_bytes": dma_bytes,
         "dma_us": 1e6 * dma_bytes / bandwidth,
         "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
  if counted is not None:
    total, body, unmasked, masked = counted
    cycles = (int(whole.sum()) * unmasked + int((steps - whole).sum()) * masked
              + len(lengths) * (total - body))
    out.update(bundles_total=total, bundles_loop_body=body, bundles_unmasked_step=unmasked,
               bundles_masked_step=masked, steps_unmasked=int(whole.sum()),
               steps_masked=int((steps - whole).sum()),
               bundles_per_page=round(cycles / int(pages.sum()), 1),
               issue_us=1e6 * cycles / clock)
  out["estimate_us"] = max(out["dma_us"], out.get("issue_us", 0.0))
  return out


# The int8 comparison's pools: 4x the pages the lengths need, for both dtypes. At 1x the
# TPU compiler put the int8 pools of the B = 8 batch (2 x 18 MiB) in VMEM (XLA's choice
# for an operand in memory space ANY; pltpu.HBM did not change it), and the kernel's page
# DMAs became vector copy loops: not the HBM-bound step measured here. A serving pool is
# sized for more than one batch's tokens anyway.
INT8_POOL_FACTOR = 4


def main_int8(out_path=None):
  """int8 pages against bfloat16 ones: the roofline and paged_tpu's estimate, same batches."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  dtypes = ("bfloat16", "int8")
  counted = {(g, name, d): kernel_bundles(g, *batch, None, d, INT8_POOL_FACTOR)
             for g in GENERATIONS
             for name, batch in BATCHES.items() for d in dtypes}
  results = []
  print(f"jax {jax.__version__}; deviceless TPU compiles (estimates, no TPU ran)")
  print(f"{'gen':<4} {'batch':<14} {'pages':<8} {'roofline':>9} {'dma':>8} {'issue':>8} "
        f"{'bundles/page':>12} {'estimate':>9} {'est/roof':>8} {'bf16/int8':>9}")
  for g in GENERATIONS:
    for name, (lengths, max_length) in BATCHES.items():
      r = {d: kernel_estimate(g, lengths, max_length, counted[g, name, d], d,
                              pool_factor=INT8_POOL_FACTOR) for d in dtypes}
      for d in dtypes:
        k = r[d]
        k["batch"] = name
        results.append(k)
        print(f"{g:<4} {name:<14} {d:<8} {k['roofline_us']:8.1f}u {k['dma_us']:7.1f}u "
              f"{k.get('issue_us', float('nan')):7.1f}u {k.get('bundles_per_page', 0):12.1f} "
              f"{k['estimate_us']:8.1f}u {k['estimate_us'] / k['roofline_us']:7.2f}x "
              f"{r['bfloat16']['estimate_us'] / k['estimate_us']:8.2f}x", flush=True)
  if out_path is not None:
    out_path.write_text(json.dumps({"jax": jax.__version__, "N": N, "K": K, "H": H, "D": D,
                                    "page_size": PAGE, "query_dtype": "bfloat16",
                                    "pool_factor": INT8_POOL_FACTOR,
                                    "results": results}, indent=1) + "\n")
  return results


def main(out_path=None):
  # deviceless compiles need no exclusive TPU: other processes on the host may hold libtpu
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  results = []
  print(f"jax {jax.__version__}; deviceless TPU compiles (estimates, no TPU ran)")
  print(f"{'generation':<5} {'batch':<16} {'roofline':>9} {'kernel':>9} {'dma':>8} "
        f"{'issue':>8} {'bundles/page':>12} {'split':>9} {'xla':>9} {'kernel/roof':>11} "
        f"{'split/kernel':>12}")
  # the page loop's cost at one page a step (the kernel before it took U pages a step)
  one_page = {g: kernel_bundles(g, *BATCHES["B=8, 256..32k"], 1) for g in GENERATIONS}
  counted = {(g, name): kernel_bundles(g, *batch) for g in GENERATIONS
             for name, batch in BATCHES.items()}
  for generation in GENERATIONS:
    for name, (lengths, max_length) in BATCHES.items():
      r = estimate(generation, lengths, max_length, counted[generation, name])
      if name == "B=8, 256..32k" and one_page[generation] is not None:
        total, body, unmasked, masked = one_page[generation]
        r["paged_tpu"]["one_page_a_step"] = {  # the same batch at U = 1, for comparison
            "bundles_unmasked_step": unmasked, "bundles_masked_step": masked,
            "bundles_total": total}
      r["batch"] = name
      results.append(r)
      k = r["paged_tpu"]
      print(f"{generation:<5} {name:<16} {r['roofline_us']:8.1f}u {k['estimate_us']:8.1f}u "
            f"{k['dma_us']:7.1f}u {k.get('issue_us', float('nan')):7.1f}u "
            f"{k.get('bundles_per_page', 0):12.1f} {r['split']['estimate_us']:8.1f}u "
            f"{r['xla']['estimate_us']:8.1f}u {k['estimate_us'] / r['roofline_us']:10.2f}x "
            f"{r['split']['estimate_us'] / k['estimate_us']:11.2f}x", flush=True)
  if out_path is not None:
    out_path.write_text(json.dumps({"jax": jax.__version__, "N": N, "K": K, "H": H, "D": D,
                                    "page_size": PAGE, "dtype": "bfloat16",
                                    "results": results}, indent=1) + "\n")
  return results
