"""The package's import graph runs one way: no cycle, and no layer imports one above it.

    compat (a leaf) · core -> masks -> kernels -> impl -> dispatch -> call
    -> (dot_product_attention, explain, lowering, decode, parallel) -> nn -> the public modules

Every `import` and `from ... import` statement in jattn/ is read with `ast`, those
inside functions and `if TYPE_CHECKING:` included (a lazy import is still an arrow).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The rank of each part of jattn._src; a module may import its own rank or below.
RANK = {"compat": 0, "core": 1, "masks": 2, "kernels": 3, "impl": 4, "dispatch": 5,
        "call": 6, "dot_product_attention": 7, "explain": 7, "lowering": 7, "deviceless": 7, "deviceless_cuda": 7, "decode": 7,
        "parallel": 7, "nn": 8}
PUBLIC = 9  # jattn/*.py, above everything in _src


def modules():
  found = {}
  for path in (ROOT / "jattn").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def imports(path, known):
  """The jattn modules `path` imports (`from a.b import c` is a.b.c when that is a module)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      subs = {f"{node.module}.{a.name}" for a in node.names} & known
      out |= subs or ({node.module} & known)
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names} & known
  return out


def rank(name):
  parts = name.split(".")
  if parts[:2] != ["jattn", "_src"]:
    return PUBLIC
  return RANK.get(parts[2]) if len(parts) > 2 else None  # None: the jattn._src package


def graph():
  found = modules()
  return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_part_of_src_has_a_rank():
  unranked = sorted({n.split(".")[2] for n in graph() if n.startswith("jattn._src.")} - set(RANK))
  assert not unranked, f"give these parts of jattn/_src a rank in RANK: {unranked}"


def test_no_module_imports_a_layer_above_it():
  upward = [f"{a} -> {b}" for a, targets in graph().items() for b in sorted(targets)
            if rank(a) is not None and rank(b) is not None and rank(b) > rank(a)]
  assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_the_import_graph_has_no_cycle():
  edges = graph()
  state, cycles = {}, []

  def visit(node, path):  # depth-first; a grey node met again closes a cycle
    state[node] = "grey"
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == "grey":
        cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = "black"

  for node in sorted(edges):
    if node not in state:
      visit(node, [node])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)
