"""Mutation testing of jattn's numerical core with cosmic-ray, one file at a time.

    python tools/mutation/run.py [FILE ...]     # default: every file in TARGETS
    python tools/mutation/run.py --retest FILE  # survivors again, against today's tests
    python tools/mutation/run.py --report       # the summary only
    python tools/mutation/run.py --workers 2 FILE  # two mutants at a time (one per core)

For each file: a cosmic-ray session (tools/mutation/sessions/<file>.sqlite) with
the operators a reviewer plants by hand (off-by-one numbers, + <-> -, * <-> /,
< <-> <=, == <-> !=, & <-> |, is <-> is not, True <-> False, and <-> or, a
dropped minus or `not`), each mutant tested by the targeted test selection of
TARGETS (stopping at the first failure), one mutant at a time, or one per worker
with --workers N (cosmic-ray's http distributor; each worker mutates its own
copy of the tree). Mutants inside annotations are skipped: every target file has
`from __future__ import annotations`, so they are strings nothing evaluates (earlier
rounds counted them, as survivors listed "annotation"). Then a summary
per file and every surviving mutant, with the equivalent ones' reasons from
tests/mutation_survivors.md. Re-running continues an interrupted session.

Slow (minutes per file, hours for all): the slow tier, not CI; docs/testing.md.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sqlite3
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = ROOT / "tools" / "mutation"
SESSIONS = HERE / "sessions"
SURVIVORS = ROOT / "tests" / "mutation_survivors.md"
WORK = pathlib.Path(os.environ.get("JATTN_MUTATION_DIR",
                                   pathlib.Path(tempfile.gettempdir()) / "jattn-mutation"))
COPIED = ("jattn", "tests", "examples", "configs", "pyproject.toml")
PY = sys.executable
# A mutant that leaves a function's HLO unchanged reuses its compilation.
CACHE = dict(JAX_COMPILATION_CACHE_DIR=str(WORK.parent / "jattn-mutation-jax-cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JATTN_FAIL_FAST="1")  # the multi-device scripts stop at their first failure
PYTEST = f"{PY} -m pytest -x -q -p no:cacheprovider"

# file -> the tests that exercise it (fast, default tier, deterministic)
TARGETS = {
    "jattn/_src/masks/block_plan.py": "tests/core/test_edges.py tests/kernels/test_blockwise.py -k 'edges or offsets or skipped'",
    "jattn/_src/core/softmax.py": "tests/core/test_single_head.py tests/core/test_edges.py "
                         "tests/core/test_dtypes.py::test_float64_stays_float64 -k 'not script'",
    "jattn/_src/core/attend.py": "tests/core/test_single_head.py tests/core/test_dtypes.py::test_float64_stays_float64 "
                        "tests/impl/test_dot_product_attention.py::test_dropout_drops_weights_with_inverted_scaling "
                        "-k 'not script'",
    "jattn/_src/nn/kv_cache.py": "tests/nn/test_kv_cache_unit.py tests/decode/test_decode.py",
    # the nnx module as a whole: its decoding paths (init_cache in both protocols,
    # set_view, the decode branch) and the rest of the module, linen's tests left out
    # (the edge tests written from the survivors first: they take seconds)
    "jattn/nnx.py": "tests/nn/test_nnx_edges.py tests/decode/test_decode.py tests/nn/test_dropin_flax.py "
                    "tests/nn/test_nnx.py tests/nn/test_module_mods.py tests/nn/test_module_explain.py "
                    "-k 'not linen and not Linen'",
    # what both modules share: projections, input checks, batch axes, the attention step
    "jattn/_src/nn/heads.py": "tests/nn/test_nnx_edges.py tests/nn/test_linen_edges.py tests/nn/test_nnx.py "
                              "tests/nn/test_linen.py tests/nn/test_dropin_flax.py tests/decode/test_decode.py "
                              "tests/nn/test_flax_attention_fn.py -k 'not transformer and not gemma'",
    "jattn/_src/nn/attend_step.py": "tests/nn/test_nnx_edges.py tests/nn/test_linen_edges.py "
                                    "tests/nn/test_nnx.py tests/nn/test_linen.py tests/nn/test_dropin_flax.py "
                                    "tests/nn/test_module_mods.py tests/decode/test_decode.py "
                                    "-k 'not transformer and not gemma'",
    # the linen module likewise, thorough twins of its decoding tests included (-m '')
    "jattn/linen.py": "tests/nn/test_linen_edges.py tests/nn/test_linen.py tests/decode/test_decode.py "
                      "tests/nn/test_dropin_flax.py tests/nn/test_module_mods.py "
                      "tests/nn/test_module_explain.py tests/nn/test_flax_attention_fn.py -m '' "
                      "-k 'linen or Linen or batch_axes or lengths_reach or complex "
                      "or precision_reaches or use_sinks_adds or equals_the_function'",
    "jattn/_src/impl/dense.py": "tests/impl/test_dot_product_attention.py tests/core/test_dtypes.py -k 'dropout or reference or masked or twice'",
    "jattn/rope.py": "tests/core/test_rope.py tests/nn/test_transformer_reference.py -k 'rope or Rope'",
    "jattn/_src/masks/structural.py": "tests/masks/test_masks.py tests/core/test_edges.py",
    "jattn/_src/impl/xla.py": "tests/impl/test_dot_product_attention.py tests/masks/test_mods.py::test_everything_at_once_in_order "
                     "tests/masks/test_mods.py::test_return_weights_with_mods tests/impl/test_dropin_jax.py "
                     "tests/core/test_dtypes.py -k 'xla or reference'",
    "jattn/_src/core/attention.py": "tests/core/test_single_head.py tests/masks/test_mods.py::test_layouts "
                           "tests/impl/test_dot_product_attention.py::test_dropout_drops_weights_with_inverted_scaling "
                           "-k 'not script'",
    "jattn/transformer.py": "tests/decode/test_decode.py::test_transformer_decoding_equals_full_pass_and_layouts_agree "
                            "tests/decode/test_decode.py::test_transformer_row_that_skips_a_call_keeps_its_previous_token "
                            "tests/nn/test_transformer_reference.py -m ''",  # -m '': thorough ones too
    # float64 references at block edges first (they kill most mutants, and soonest)
    "jattn/_src/kernels/blockwise_loop.py": "tests/core/test_edges.py tests/kernels/test_blockwise.py tests/masks/test_mods.py "
                           "tests/masks/test_mod_grads.py tests/masks/test_block_mask.py "
                           "tests/masks/test_closed_form_blocks.py tests/core/test_dtypes.py "
                           "-k '(blockwise or block_mask or closed_form) and not memory and not random_shapes and not default "
                           "and not errors and not refused and not cudnn and not honoured "
                           "and not is_an_error'",
    "jattn/_src/masks/closed_form_blocks.py": "tests/masks/test_closed_form_blocks.py tests/masks/test_block_mask.py "
                                    "tests/masks/test_mods.py -k 'closed_form or skipped or "
                                    "(blockwise and mask_mods)'",
    "jattn/_src/masks/block_mask.py": "tests/masks/test_block_mask.py tests/masks/test_closed_form_blocks.py "
                            "tests/masks/test_mods.py -k 'not vmap and not xla'",
    "jattn/_src/parallel/ring_loop.py": "tests/multidevice/test_ring.py tests/multidevice/test_ring_mods.py",
    # fourth round (issue 21 item 8)
    "jattn/mods.py": "tests/masks/test_mods_entries.py tests/masks/test_mods.py::test_mask_mods_match_reference "
                     "tests/masks/test_mods.py::test_score_mods_match_reference -k 'not blockwise and not vmap'",
    "jattn/_src/masks/programmable.py": "tests/masks/test_programmable.py tests/masks/test_mods.py tests/masks/test_mod_grads.py "
                                        "tests/impl/test_residual_with_mods.py tests/masks/test_mods_jit_cache.py "
                                        "tests/masks/test_block_mask.py::test_mask_mod_is_not_called_on_full_blocks "
                                        "-k 'not dropout and not bfloat16 and not cudnn and not flax_module "
                                        "and not attention_fn and not vmap'",
    "jattn/_src/impl/splash_mask.py": "tests/masks/test_splash_mask.py",
    "jattn/_src/impl/kernel_plans.py": "tests/kernels/test_kernel_plans.py",
    # in-process checks and one-device values first, then the 8-device quick sets
    "jattn/_src/parallel/ring.py": "tests/multidevice/test_ring_checks.py tests/multidevice/test_ring.py tests/multidevice/test_ring_mods.py "
                               "-m 'not (thorough and slow)' -k 'not every_dtype'",
    "jattn/_src/dispatch.py": "tests/impl/test_dispatch.py tests/impl/test_lowering.py tests/masks/test_mods_jit_cache.py "
                              "-k 'not export_carries'",
}

# Everything but the hand-planted kinds of bug (cosmic-ray also swaps + for **, <<,
# %, ... : thousands of mutants that any test kills, at ~20 s each here).
KEEP = ("NumberReplacer", "AddNot", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue",
        "ReplaceAndWithOr", "ReplaceOrWithAnd", "ReplaceUnaryOperator_Delete_USub",
        "ReplaceUnaryOperator_Delete_Not", "ZeroIterationForLoop",
        *(f"ReplaceBinaryOperator_{a}_{b}" for a, b in (
            ("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"),
            ("FloorDiv", "Div"), ("BitAnd", "BitOr"), ("BitOr", "BitAnd"))),
        *(f"ReplaceComparisonOperator_{a}_{b}" for a, b in (
            ("Lt", "LtE"), ("LtE", "Lt"), ("Gt", "GtE"), ("GtE", "Gt"), ("Eq", "NotEq"),
            ("NotEq", "Eq"), ("Is", "IsNot"), ("IsNot", "Is"), ("Lt", "Gt"), ("Gt", "Lt"))))
EXCLUDE = "core/(?!(" + "|".join(KEEP) + ")$)"


def copy_tree(work: pathlib.Path) -> None:
  """The checkout's code and tests in `work`: cosmic-ray mutates files in place, so
  it runs there and the checkout stays clean (tests run in it meanwhile see no mutant)."""
  shutil.rmtree(work, ignore_errors=True)
  for part in COPIED:
    if (ROOT / part).is_dir():
      shutil.copytree(ROOT / part, work / part, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(ROOT / part, work / part)


def config(path: str, ports) -> pathlib.Path:
  name = pathlib.Path(path).stem
  toml = SESSIONS / f"{name}.toml"
  if ports:
    urls = json.dumps([f"http://localhost:{p}" for p in ports])
    distributor = f'name = "http"\n\n[cosmic-ray.distributor.http]\nworker-urls = {urls}'
  else:
    distributor = 'name = "local"'
  toml.write_text(f"""[cosmic-ray]
module-path = "{path}"
timeout = 280.0
excluded-modules = []
test-command = "{PYTEST} {TARGETS[path]}"

[cosmic-ray.distributor]
{distributor}

[cosmic-ray.filters.operators-filter]
exclude-operators = [{json.dumps(EXCLUDE)}]
""")
  return toml


BIN = pathlib.Path(PY).parent


def start_workers(n: int):
  """n http workers, each in its own copy of the tree (work/w0, w1, ...)."""
  ports = [9876 + i for i in range(n)]
  procs = []
  for i, port in enumerate(ports):
    tree = WORK / f"w{i}"
    copy_tree(tree)
    procs.append(subprocess.Popen(
        [BIN / "cosmic-ray", "http-worker", "--port", str(port)], cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree), **CACHE),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
  time.sleep(3)  # let them listen
  return ports, procs


def annotation_spans(path: str) -> list:
  """((row, col), (end_row, end_col)) of every annotation in `path`, when the file
  has `from __future__ import annotations` (they are then strings nothing evaluates:
  a mutant inside one, `X | None` -> `X & None`, cannot change any value)."""
  tree = ast.parse((ROOT / path).read_text())
  postponed = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                  and any(a.name == "annotations" for a in node.names) for node in tree.body)
  if not postponed:
    return []
  notes = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      notes.append(node.returns)
    elif isinstance(node, (ast.arg, ast.AnnAssign)):
      notes.append(node.annotation)
  return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
          for n in notes if n is not None]


def skip_annotations(path: str, db: pathlib.Path) -> int:
  """Marks the session's mutants inside annotations as skipped (as cosmic-ray's own
  operator filter marks the operators it drops); returns how many."""
  from cosmic_ray.work_db import use_db
  from cosmic_ray.work_item import WorkerOutcome, WorkResult

  spans = annotation_spans(path)
  inside = lambda m: any(a <= tuple(m.start_pos) and tuple(m.end_pos) <= b for a, b in spans)
  skipped = 0
  with use_db(str(db)) as work_db:
    for item in list(work_db.work_items):
      if item.mutations and all(inside(m) for m in item.mutations):
        work_db.set_result(item.job_id, WorkResult(output="inside an annotation",
                                                   worker_outcome=WorkerOutcome.SKIPPED))
        skipped += 1
  return skipped


def run(path: str, ports=()) -> None:
  toml, db = config(path, ports), SESSIONS / f"{pathlib.Path(path).stem}.sqlite"
  if not db.exists():
    subprocess.run([BIN / "cosmic-ray", "init", toml, db], check=True, cwd=WORK)
    subprocess.run([BIN / "cr-filter-operators", db, toml], check=True, cwd=WORK)
  # (also for a session begun before this filter)
  print(f"{path}: {skip_annotations(path, db)} mutants inside annotations marked skipped "
        "(of any operator, the ones the operator filter dropped included)")
  subprocess.run([BIN / "cosmic-ray", "exec", toml, db], check=True, cwd=WORK,
                 env=dict(os.environ, PYTHONPATH=str(WORK), **CACHE))


def summary(paths) -> str:
  lines = ["| file | mutants | killed | survived | timeouts | score |",
           "|---|---|---|---|---|---|"]
  survivors = []
  for path in paths:
    db = SESSIONS / f"{pathlib.Path(path).stem}.sqlite"
    if not db.exists():
      lines.append(f"| {path} | not run | | | | |")
      continue
    c = sqlite3.connect(db)
    rows = c.execute(
        "select s.job_id, s.module_path, s.operator_name, s.occurrence, s.start_pos_row, "
        "r.test_outcome, r.diff from mutation_specs s left join work_results r "
        "on s.job_id = r.job_id where r.worker_outcome is null or r.worker_outcome != 'SKIPPED'"
    ).fetchall()
    done = [r for r in rows if r[5] is not None]
    killed = sum(r[5] == "KILLED" for r in done)
    timeouts = sum(r[5] == "INCOMPETENT" for r in done)
    alive = [r for r in done if r[5] == "SURVIVED"]
    survivors += alive
    score = f"{100 * (len(done) - len(alive)) / len(done):.0f}%" if done else "-"
    pending = f" ({len(rows) - len(done)} pending)" if len(done) < len(rows) else ""
    lines.append(f"| {path} | {len(rows)}{pending} | {killed} | {len(alive)} | {timeouts} "
                 f"| {score} |")
  lines.append("")
  for job, module, op, occ, row, _, diff in survivors:
    lines.append(f"SURVIVED {module}:{row} {op} #{occ} ({job})")
    lines.extend("    " + d for d in (diff or "").splitlines()
                 if d.startswith(("+", "-")) and not d.startswith(("+++", "---")))
  return "\n".join(lines)


def forget_survivors(path: str) -> None:
  """Marks a session's survivors as not yet run, so `exec` tests them again."""
  db = SESSIONS / f"{pathlib.Path(path).stem}.sqlite"
  c = sqlite3.connect(db)
  c.execute("delete from work_results where test_outcome = 'SURVIVED'")
  c.commit()


def main(argv):
  SESSIONS.mkdir(exist_ok=True)
  workers = 1
  if "--workers" in argv:
    at = argv.index("--workers")
    workers = int(argv[at + 1])
    argv = argv[:at] + argv[at + 2:]
  flags = {a for a in argv if a.startswith("--")}
  paths = [a for a in argv if not a.startswith("--")] or list(TARGETS)
  if "--report" not in flags:
    copy_tree(WORK)
    ports, procs = start_workers(workers) if workers > 1 else ((), [])
    try:
      for path in paths:
        if "--retest" in flags:
          forget_survivors(path)
        run(path, ports)
    finally:
      for proc in procs:
        proc.terminate()
  print(summary(paths))
  print(f"\nEquivalent mutants and why: {SURVIVORS}")


if __name__ == "__main__":
  main(sys.argv[1:])
