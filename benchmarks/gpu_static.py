"""Static figures of jattn's GPU kernels, compiled for an H100 (or H200) from this CPU.

    python benchmarks/gpu_static.py [--target h100] [--H 128] [--dtype bfloat16] [--T 1024]
        [--cases causal soft_cap documents] [--out benchmarks/results/gpu_static_h100.json]
    python benchmarks/gpu_static.py --smoke     # T = 128, H = 64, one case (the test)
    python benchmarks/gpu_static.py --implementations flex_mgpu_ws --ws-exp2-fma 16 ...
        # the fast forward with exp2 of 16 columns a kv tile on the FP32 pipe

For flex_gpu's three Triton kernels (forward, dq, dk/dv), flex_mgpu's three Mosaic GPU
kernels and flex_mgpu_ws's three warp-specialised ones (its forward, and the dq and dk/dv
kernels of `flex_mgpu.ws_dq()` / `ws_dkv()`), each case's `jax.grad` program is compiled
by `jattn._src.deviceless_cuda` (no GPU), and for paged_gpu's decode kernel (Triton) one
`decode_attention` step of benchmarks/decode.py's batch (B = 8 rows of up to 32k, pages
of 64, N = 16, K = 4, the --H and --dtype given; causal and soft_cap: it takes no
documents; the case int8: causal over int8 pages, --dtype queries, paged_gpu only); the
compilers' own output is read:
  registers per thread, spill stores / loads, barriers   ptxas -v (Mosaic GPU: its own
                                                         ptxas log, MOSAIC_GPU_DUMP_PTXAS;
                                                         Triton: ptxas -v -O3 run here on the
                                                         PTX XLA compiled, sm_90a)
  shared memory (dynamic) and threads per block          XLA's thunk sequence (Triton) /
                                                         Mosaic's resources and .maxntid
  the inner loop's instruction mix                       nvdisasm of the cubin: the
                                                         innermost loop (a backward branch)
                                                         that holds a tensor-core
                                                         instruction, counted by opcode
Each kernel gets `budgets` (issue 45, item 2), each True or False: no spills; registers
within the launch's share of the register file (64K / threads per block); for a
warp-specialised kernel, its `setmaxnreg` counts (read from the PTX) within the file
(2 consumers x 232 + 1 producer x 40, x 128 threads <= 64K) and honoured by ptxas; a
tensor-core instruction in the inner loop's SASS; shared memory within the card's 227
KiB. Mosaic GPU kernels get them twice: `budgets` from Mosaic's own ptxas run (on
2026-11-27's host jax 0.12's run ignored setmaxnreg, C7504; on 2026-11-28's it honoured
it: docs/gpu_kernel.md), `budgets_whole_program` from ptxas run here on the same PTX
without -c (setmaxnreg honoured, as jax 0.11.2's Mosaic GPU compiled on the H100). The
SASS is always the latter's.
Nothing runs and nothing is timed: these are budgets (does it spill, does it fit, is the
loop's work on the tensor cores), not speed. The loop's count covers every path of its
body (a FULL tile's and a PARTIAL tile's branch both count).

Needs jax's CUDA plugin (`pip install "jax[cuda13]"`) and, for SASS, nvdisasm
(`pip install nvidia-cuda-nvdisasm`, or --cuda-bin DIR holding it); without nvdisasm the
instruction mix is reported as missing, with the reason.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402
from jattn._src import deviceless_cuda  # noqa: E402
from benchmarks.gpu_kernels import CASES, SOFT_CAP, case_kwargs  # noqa: E402

KERNELS = {"flex_gpu": ("jattn_flex_gpu_fwd", "jattn_flex_gpu_dq", "jattn_flex_gpu_dkv"),
           "flex_mgpu": ("jattn_flex_mgpu_fwd", "jattn_flex_mgpu_dq", "jattn_flex_mgpu_dkv"),
           # the warp-specialised forward, dq and dk/dv (flex_mgpu.ws_dq, ws_dkv)
           "flex_mgpu_ws": ("jattn_flex_mgpu_ws_fwd", "jattn_flex_mgpu_ws_dq",
                            "jattn_flex_mgpu_ws_dkv"),
           "paged_gpu": ("jattn_paged_decode_gpu",)}
MOSAIC = ("flex_mgpu", "flex_mgpu_ws")
# A Hopper SM: 64K 32-bit registers, 227 KiB of shared memory per block (opt-in)
REGISTER_FILE = 65536
SMEM_LIMIT = 232448
# paged_gpu's decode step: benchmarks/decode.py's batch (B = 8 rows of up to 32k, pages of
# 64 in a pool of 600, N = 16, K = 4), one query a row (T = 1), no write
DECODE = dict(B=8, max_length=32768, page_size=64, num_pages=600, N=16, K=4)
DECODE_CASES = ("causal", "soft_cap", "int8")
_MOSAIC_DUMPS = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_RESOURCES")


# ---------------------------------------------------------------- the calls


def decode_program(case: str, *, H, dtype):
  """paged_gpu's forward decode step (it has no backward): causal, soft_cap (causal),
  int8 (causal over int8 pages, the queries in `dtype`)."""
  if case not in DECODE_CASES:
    raise ValueError(f"paged_gpu's decode step is compiled for {', '.join(DECODE_CASES)}; "
                     f"got case {case!r}")
  kw = dict(is_causal=True)
  if case == "soft_cap":
    kw["score_mod"] = mods.soft_cap(SOFT_CAP)
  d = DECODE
  cache = jax.eval_shape(lambda: jattn.paged.init_cache(
      d["B"], d["max_length"], num_kv_heads=d["K"], head_dim=H, page_size=d["page_size"],
      num_pages=d["num_pages"], dtype=jnp.int8 if case == "int8" else jnp.dtype(dtype)))
  q = jax.ShapeDtypeStruct((d["B"], 1, d["N"], H), jnp.dtype(dtype))  # [B, T, N, H]
  return (lambda q, c: jattn.decode_attention(q, c, implementation="paged_gpu", **kw)), (
      q, cache)


def program(implementation: str, case: str, *, B, T, N, H, dtype, K=None, kwargs=None):
  """(jax.grad of the call, its inputs); flex_mgpu_ws's must be traced inside
  `planned(implementation)` (its warp-specialised backward is opt-in). K: kv heads (N);
  kwargs: the call's keywords instead of `case_kwargs(case)` (the compile tier's cases).
  paged_gpu: its decode step (no backward)."""
  if implementation == "paged_gpu":
    return decode_program(case, H=H, dtype=dtype)
  kw = case_kwargs(case, B, T, N) if kwargs is None else kwargs
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.dtype(dtype))  # [B, T, N, H]
  kv = jax.ShapeDtypeStruct((B, T, K or N, H), jnp.dtype(dtype))

  def loss(q, k, v):
    out = jattn.dot_product_attention(q, k, v, implementation=implementation, **kw)
    return jnp.sum(out.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2)), (x, kv, kv)


@contextlib.contextmanager
def planned(implementation: str):
  """Plans made inside take flex_mgpu_ws's warp-specialised dq and dk/dv kernels."""
  if implementation != "flex_mgpu_ws":
    yield
    return
  from jattn._src.kernels import flex_mgpu
  with flex_mgpu.ws_dq(), flex_mgpu.ws_dkv():
    yield


# ---------------------------------------------------------------- the tools


def find_tool(name: str, cuda_bin: str | None) -> str | None:
  """A CUDA tool from --cuda-bin, the nvidia wheels jax uses, or PATH."""
  from jax._src import lib
  for folder in (cuda_bin, lib.cuda_path and os.path.join(lib.cuda_path, "bin")):
    if folder and os.path.exists(os.path.join(folder, name)):
      return os.path.join(folder, name)
  return shutil.which(name)


@contextlib.contextmanager
def captured_stdout(path: pathlib.Path):
  """Everything written to file descriptor 1 (C++ and Python) goes to `path`."""
  sys.stdout.flush()
  saved = os.dup(1)
  with open(path, "wb") as f:
    os.dup2(f.fileno(), 1)
    try:
      yield
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)


def ptxas_figures(log: str, kernel: str) -> dict:
  """Registers, spills, barriers and static smem of `kernel` in a ptxas -v log."""
  at = log.find(f"Compiling entry function '{kernel}")
  if at < 0:
    return {}
  block = log[at:].split("Compile time", 1)[0]
  # the notes ptxas prints for this compile before its entry (C7504: setmaxnreg ignored)
  before = log[log.rfind("Compile time", 0, at) + 1:at]
  number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, block)) else 0
  return {"registers": number(r"Used (\d+) registers"),
          "spill_stores_bytes": number(r"(\d+) bytes spill stores"),
          "spill_loads_bytes": number(r"(\d+) bytes spill loads"),
          "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
          "barriers": number(r"used (\d+) barriers"),
          "static_smem_bytes": number(r"(\d+) bytes smem"),
          "ptxas_notes": sorted(set(re.findall(r"\((C\d+)\) ([^\n]*?) in the function '"
                                               + kernel + "'", log))
                                | set(re.findall(r"\((C\d+)\) ([^\n]*)", before))),
          "setmaxnreg_ignored": "'setmaxnreg' ignored" in before + block}


def run_ptxas(ptx: pathlib.Path, ptxas: str, arch: str) -> tuple[str, pathlib.Path]:
  cubin = ptx.with_suffix(".cubin")
  done = subprocess.run([ptxas, "-v", "-O3", f"-arch={arch}", str(ptx), "-o", str(cubin)],
                        capture_output=True, text=True, check=True)
  return done.stdout + done.stderr, cubin


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)"
                          r"(\.[A-Za-z0-9_.]+)?\s*([^;]*);")
TENSOR_CORE = re.compile(r"^[A-Z]*G?MMA$")  # HGMMA, HMMA, IMMA, QGMMA, ...
CLASSES = (("tensor_core", TENSOR_CORE),
           ("exp_and_special", re.compile(r"^MUFU$")),
           ("fp32_alu", re.compile(r"^F(ADD|MUL|FMA|MNMX|SEL|SETP|SET|CHK|RND)$")),
           ("convert_and_pack", re.compile(r"^(F2F|F2FP|F2I|I2F|I2FP)$")),
           ("shared_memory", re.compile(r"^(LDS|STS|LDSM|STSM|LDGSTS)$")),
           ("global_memory_and_tma", re.compile(r"^(LDG|STG|UBLKCP|UTMALDG|UTMASTG|UTMAPF|"
                                                r"RED|ATOM|ATOMG|REDG|UTMACCTL)$")),
           ("synchronisation", re.compile(r"^(BAR|SYNCS|WARPGROUP|DEPBAR|ARRIVES|WARPSYNC|"
                                          r"MEMBAR|ERRBAR|NANOSLEEP|FENCE)$")),
           ("control", re.compile(r"^(BRA|BSSY|BSYNC|EXIT|CALL|RET|JMP|BREAK|YIELD)$")))


def sass_of(cubin: pathlib.Path, nvdisasm: str) -> dict[str, list]:
  """kernel -> [(address, opcode, modifiers, operands or branch target label)], labels."""
  text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                        check=True).stdout
  kernels, current, pending = {}, None, []
  for line in text.splitlines():
    if m := re.match(r"//-+ \.text\.(\w+)", line):
      current = kernels.setdefault(m.group(1), {"code": [], "labels": {}})
    elif current is None:
      continue
    elif m := re.match(r"^(\.L_x_\d+):", line):
      pending.append(m.group(1))
    elif m := _INSTRUCTION.search(line):
      address = int(m.group(1), 16)
      for label in pending:
        current["labels"][label] = address
      pending = []
      current["code"].append((address, m.group(2), m.group(3) or "", m.group(4)))
  return kernels


def inner_loop_mix(kernel: dict) -> dict:
  """The innermost loop (a backward branch's range) holding a tensor-core instruction,
  counted by opcode and class; or the reason there is none.

  A range holding the kernel's EXIT is no loop body: ptxas lays the retries of a barrier
  wait out of line, after the exit, and their branch back into the loop spans everything
  between (in flex_mgpu_ws's forward such a range, 302 instructions with the first
  matmul alone, was taken for its loop until 2026-11-28)."""
  code, labels = kernel["code"], kernel["labels"]
  exits = [address for address, opcode, _, _ in code if opcode == "EXIT"]
  loops = []
  for address, opcode, _, operands in code:
    target = re.search(r"\(\s*(\.L_x_\d+)\s*\)", operands)
    if opcode == "BRA" and target and labels.get(target.group(1), address + 1) <= address:
      lo = labels[target.group(1)]
      if not any(lo <= e <= address for e in exits):
        loops.append((lo, address))
  body = lambda lo, hi: [c for c in code if lo <= c[0] <= hi]
  with_mma = [(hi - lo, lo, hi) for lo, hi in loops
              if any(TENSOR_CORE.match(c[1]) for c in body(lo, hi))]
  if not with_mma:
    return {"error": f"no loop holds a tensor-core instruction ({len(loops)} loops)"}
  _, lo, hi = min(with_mma)
  opcodes = collections.Counter(c[1] for c in body(lo, hi))
  classes = collections.Counter()
  for opcode, count in opcodes.items():
    name = next((n for n, pattern in CLASSES if pattern.match(opcode)), "other")
    classes[name] += count
  mma = sorted({c[1] + c[2] for c in body(lo, hi) if TENSOR_CORE.match(c[1])})
  total = sum(opcodes.values())
  return {"instructions": total, "tensor_core": classes["tensor_core"],
          "tensor_core_share": round(classes["tensor_core"] / total, 4),
          "tensor_core_forms": mma, "classes": dict(classes.most_common()),
          "opcodes": dict(opcodes.most_common()),
          "address_range": [f"{lo:#06x}", f"{hi:#06x}"],
          "kernel_instructions": len(code)}


@contextlib.contextmanager
def _named_resources():
  """Mosaic GPU prints each kernel's Resources (shared memory) without its name: while
  compiling, its dump helper prefixes the dump's name (`RESOURCES <kernel>_<n>: ...`)."""
  from jax.experimental.mosaic.gpu import utils
  plain = utils.dump_to_file_or_stdout

  def named(content, name, path):
    if not path and name.endswith(".resources.txt"):
      print(f"RESOURCES {name[:-len('.resources.txt')]}: {content}", flush=True)
    else:
      plain(content, name, path)

  utils.dump_to_file_or_stdout = named
  try:
    yield
  finally:
    utils.dump_to_file_or_stdout = plain


# ---------------------------------------------------------------- one compile


def measure(implementation, case, *, target, B, T, N, H, dtype, tools, work: pathlib.Path,
            K=None, kwargs=None):
  """The figures of one case's kernels (see the module doc); K, kwargs: as `program`."""
  fn, args = program(implementation, case, B=B, T=T, N=N, H=H, dtype=dtype, K=K,
                     kwargs=kwargs)
  dump = work / f"{implementation}_{case}"
  dump.mkdir(parents=True)
  names = KERNELS[implementation]
  started = time.perf_counter()
  if implementation in MOSAIC:  # Mosaic GPU compiles its kernels and logs to stdout
    os.environ.update({name: "1" for name in _MOSAIC_DUMPS})
    try:
      with captured_stdout(dump / "mosaic.log"), _named_resources(), planned(implementation):
        compiled = deviceless_cuda.compile_for(target, fn, *args,
                                               options={"xla_dump_to": str(dump)})
    finally:
      for name in _MOSAIC_DUMPS:
        os.environ.pop(name, None)
  else:  # Triton kernels are compiled by XLA: its PTX dump, then ptxas here
    compiled = deviceless_cuda.compile_for(
        target, fn, *args, options={"xla_dump_to": str(dump), "xla_dump_emitter_re": "ptx"})
  seconds = time.perf_counter() - started
  text = compiled.as_text()
  kernels = {name: {} for name in names if name in text}
  missing = sorted(set(names) - set(kernels))
  if missing:
    raise RuntimeError(f"the compiled program lacks {missing}")
  thunks = "\n".join(p.read_text() for p in dump.glob("*thunk_sequence.txt"))
  ptx = {}  # kernel -> the PTX file that defines it
  if implementation in MOSAIC:
    log = (dump / "mosaic.log").read_text(errors="replace")
    # each kernel's PTX, as LLVM printed it, then ptxas's log of it
    chunks = ["//\n// Generated by LLVM NVPTX" + c.split("\nptxas ", 1)[0]
              for c in log.split("//\n// Generated by LLVM NVPTX")[1:]]
    for name in names:
      entry = f"{name}_mosaic_gpu_kernel"
      kernels[name].update(ptxas_figures(log, entry))
      kernels[name]["ptxas"] = "Mosaic GPU's own (MOSAIC_GPU_DUMP_PTXAS)"
      resources = re.search(r"^RESOURCES " + name + r"_\d+: Resources\(smem_scratch_bytes=(\d+)",
                            log, re.M)
      kernels[name]["dynamic_smem_bytes"] = int(resources.group(1)) if resources else None
      body = [c for c in chunks if re.search(r"\.entry\s+" + entry + r"\(", c)]
      if body:
        path = dump / f"{name}.ptx"
        path.write_text(body[0])
        ptx[name] = (path, entry)
        threads = re.search(r"\.(?:maxntid|reqntid)\s+(\d+),\s*(\d+),\s*(\d+)", body[0])
        kernels[name]["threads_per_block"] = (int(threads.group(1)) * int(threads.group(2))
                                              * int(threads.group(3)) if threads else None)
        kernels[name]["setmaxnreg"] = setmaxnreg_of(body[0])
  else:
    for path in dump.glob("*.ptx"):
      for name in names:
        if re.search(r"\.entry\s+" + name + r"\(", path.read_text()):
          ptx[name] = (path, name)
    for name in names:
      launch = re.search(name + r" grid: \[[^\]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+"
                         r"shared_memory: (\d+) bytes", thunks)
      if launch:
        kernels[name]["threads_per_block"] = (int(launch.group(1)) * int(launch.group(2))
                                              * int(launch.group(3)))
        kernels[name]["dynamic_smem_bytes"] = int(launch.group(4))
  for name, (path, entry) in ptx.items():
    log, cubin = run_ptxas(path, tools["ptxas"], "sm_90a")
    mine = ptxas_figures(log, entry)
    if implementation in MOSAIC:  # the same PTX through the pinned ptxas: agree?
      kernels[name]["registers_ptxas_here"] = mine.get("registers")
      # a whole-program compile (no -c): setmaxnreg honoured, as jax 0.11.2's Mosaic did
      kernels[name]["ptxas_here"] = mine
    else:
      kernels[name].update(mine)
      kernels[name]["ptxas"] = "ptxas -v -O3 -arch=sm_90a on XLA's PTX, here"
    if tools.get("nvdisasm"):
      sass = sass_of(cubin, tools["nvdisasm"])
      kernels[name]["inner_loop"] = (inner_loop_mix(sass[entry]) if entry in sass
                                     else {"error": f"no SASS for {entry}"})
    else:
      kernels[name]["inner_loop"] = {"error": "nvdisasm not found (pip install "
                                              "nvidia-cuda-nvdisasm, or --cuda-bin)"}
  for name in names:
    if name not in ptx:
      kernels[name]["error"] = "no PTX found for this kernel"
    kernels[name]["budgets"] = budgets(kernels[name])
    if "ptxas_here" in kernels[name]:
      kernels[name]["budgets_whole_program"] = budgets({**kernels[name],
                                                        **kernels[name]["ptxas_here"]})
  return {"implementation": implementation, "case": case, "compile_seconds": round(seconds, 1),
          "kernels": kernels}


def setmaxnreg_of(ptx: str) -> dict:
  """{"inc": [counts], "dec": [counts]}: the kernel's setmaxnreg instructions."""
  found = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
  return {kind: sorted({int(n) for k, n in found if k == kind}) for kind in ("inc", "dec")}


def budgets(k: dict) -> dict:
  """Issue 45 item 2's budgets of one kernel's figures: name -> True / False (None where a
  figure is missing). "setmaxnreg_honoured": False where ptxas ignored setmaxnreg (C7504,
  as jax 0.12's Mosaic GPU run did on one host), so the consumers get only the launch's
  share of registers."""
  threads, regs = k.get("threads_per_block"), k.get("registers")
  smem = (k.get("dynamic_smem_bytes") or 0) + k.get("static_smem_bytes", 0)
  loop = k.get("inner_loop", {})
  out = {"no_spills": (k.get("spill_stores_bytes") == 0 and k.get("spill_loads_bytes") == 0)
         if "spill_stores_bytes" in k else None,
         "registers_within_launch": (regs <= REGISTER_FILE // threads)
         if regs and threads else None,
         "tensor_core_in_inner_loop": loop.get("tensor_core", 0) >= 1
         if "error" not in loop else None,
         "smem_within_card": (0 < smem <= SMEM_LIMIT) if smem else None}
  nreg = k.get("setmaxnreg")
  if nreg and (nreg["inc"] or nreg["dec"]) and threads:
    # the consumers' warpgroups raise to inc, the last one (the producer) lowers to dec
    groups = threads // 128
    inc, dec = max(nreg["inc"], default=0), min(nreg["dec"], default=0)
    out["setmaxnreg_within_file"] = 128 * ((groups - 1) * inc + dec) <= REGISTER_FILE
    out["setmaxnreg_honoured"] = not k.get("setmaxnreg_ignored", False)
  return out


# ---------------------------------------------------------------- the table


def table(results) -> str:
  head = ("kernel", "case", "regs", "spill st/ld", "smem KiB", "bar", "threads",
          "loop instr", "MMA", "MMA %", "MUFU", "FP32", "other", "budgets",
          "whole-program spills, budgets")
  rows = [head]
  for r in results:
    for name, k in r["kernels"].items():
      loop = k.get("inner_loop", {})
      c = loop.get("classes", {})
      smem = (k.get("dynamic_smem_bytes") or 0) + k.get("static_smem_bytes", 0)
      rows.append((name, r["case"], k.get("registers", "?"),
                   f"{k.get('spill_stores_bytes', '?')}/{k.get('spill_loads_bytes', '?')}",
                   f"{smem / 1024:.1f}", k.get("barriers", "?"), k.get("threads_per_block", "?"),
                   loop.get("instructions", "-"), loop.get("tensor_core", "-"),
                   f"{100 * loop['tensor_core_share']:.1f}" if "tensor_core_share" in loop
                   else "-", c.get("exp_and_special", "-"), c.get("fp32_alu", "-"),
                   (loop["instructions"] - loop["tensor_core"] - c.get("exp_and_special", 0)
                    - c.get("fp32_alu", 0)) if "instructions" in loop else "-",
                   _budget_word(k.get("budgets", {})),
                   (f"{k['ptxas_here'].get('spill_stores_bytes')}/"
                    f"{k['ptxas_here'].get('spill_loads_bytes')} "
                    + _budget_word(k["budgets_whole_program"]))
                   if "budgets_whole_program" in k else "-"))
  widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
  return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)


def _budget_word(b: dict) -> str:
  failed = [name for name, ok in b.items() if ok is False]
  return ("over: " + ",".join(failed)) if failed else "ok"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="h100", choices=sorted(deviceless_cuda.TARGETS))
  parser.add_argument("--implementations", nargs="+", default=list(KERNELS),
                      choices=list(KERNELS))
  # benchmarks/gpu_kernels.py's calls; int8: paged_gpu's decode over int8 pages
  parser.add_argument("--cases", nargs="+", default=["causal", "soft_cap", "documents"],
                      choices=CASES + ("int8",))
  parser.add_argument("--B", type=int, default=1)
  parser.add_argument("--T", type=int, default=1024)
  parser.add_argument("--N", type=int, default=4)
  parser.add_argument("--H", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--cuda-bin", default=None, help="a folder with ptxas and nvdisasm")
  parser.add_argument("--out", default=None, help="write the results here (JSON)")
  parser.add_argument("--smoke", action="store_true", help="T = 128, H = 64, causal only")
  parser.add_argument("--ws-exp2-fma", type=int, default=0, metavar="COLUMNS",
                      help="flex_mgpu_ws's forward computes exp2 of COLUMNS of each kv tile "
                           "on the FP32 pipe (flex_mgpu.ws_exp2_fma; default 0)")
  args = parser.parse_args(argv)
  from jattn._src.kernels import flex_mgpu
  try:
    exp2_fma = flex_mgpu.ws_exp2_fma(args.ws_exp2_fma)
  except ValueError as e:
    parser.error(f"--ws-exp2-fma: {e}")
  if args.smoke:
    args.T, args.H, args.cases = 128, 64, ["causal"]
  reason = deviceless_cuda.missing()
  if reason:
    print(f"gpu_static: no deviceless CUDA compile: {reason}", file=sys.stderr)
    return 2
  tools = {name: find_tool(name, args.cuda_bin) for name in ("ptxas", "nvdisasm")}
  if tools["ptxas"] is None:
    print("gpu_static: ptxas not found (pip install nvidia-cuda-nvcc, or --cuda-bin)",
          file=sys.stderr)
    return 2
  results, errors = [], []
  with tempfile.TemporaryDirectory(prefix="gpu_static_") as work, exp2_fma:
    for implementation in args.implementations:
      for case in args.cases:
        if implementation == "paged_gpu" and case not in DECODE_CASES:
          continue  # a decode step's cases only (documents: a per-token array, refused)
        if implementation != "paged_gpu" and case == "int8":
          continue  # int8 pages: a decode cache's, paged_gpu's case only
        try:
          results.append(measure(implementation, case, target=args.target, B=args.B,
                                 T=args.T, N=args.N, H=args.H, dtype=args.dtype, tools=tools,
                                 work=pathlib.Path(work)))
        except Exception as e:  # reported, and the run goes on
          errors.append({"implementation": implementation, "case": case,
                         "error": f"{type(e).__name__}: {e}"[:2000]})
  device = deviceless_cuda.cuda_devices(args.target)[0].device_kind
  versions = {"jax": jax.__version__,
              "ptxas": subprocess.run([tools["ptxas"], "--version"], capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]}
  print(f"{device} (compile-only, {args.target}), jax {versions['jax']}, {versions['ptxas']}; "
        f"B={args.B} T=S={args.T} N=K={args.N} H=D={args.H} {args.dtype}, jax.grad programs"
        + ("; paged_gpu: one decode step, B=8 rows of up to 32k, pages of 64, N=16 K=4, "
           f"H=D={args.H}" if "paged_gpu" in args.implementations else ""))
  print(table(results))
  for e in errors:
    print(f"error: {e['implementation']} {e['case']}: {e['error'][:300]}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {"target": args.target, "device_kind": device, "versions": versions,
         "args": {k: v for k, v in vars(args).items() if k not in ("out", "cuda_bin")},
         "command": "python benchmarks/gpu_static.py " + " ".join(argv or sys.argv[1:]),
         "nvdisasm": tools["nvdisasm"] is not None, "results": results, "errors": errors},
        indent=1) + "\n")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
