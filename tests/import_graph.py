"""The import graph of a package, read from its source with `ast` (nothing is imported).

Used by tests/test_layers.py (the layer contract) and runnable as a report:

  python tests/import_graph.py [PACKAGE_DIR]

prints the cycles (strongly connected components of the module graph, every import counted,
top-level or inside a function), the imports placed inside functions, and the reach-ins to
another module's private (underscore) names.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import sys


@dataclasses.dataclass(frozen=True)
class Edge:
  """`src` imports `dst` (dotted module names) at `line`; `inner` if inside a function."""
  src: str
  dst: str
  line: int
  inner: bool
  names: tuple[str, ...]


def module_names(root: str) -> dict[str, str]:
  """{dotted module name: file path} for every .py file under the package dir `root`."""
  pkg = os.path.basename(os.path.normpath(root))
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
    for f in sorted(filenames):
      if not f.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(os.path.normpath(root)))
      mod = rel[:-3].replace(os.sep, ".")
      if mod.endswith(".__init__"):
        mod = mod[: -len(".__init__")]
      out[mod] = os.path.join(dirpath, f)
  assert pkg in out, f"{root} has no __init__.py"
  return out


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
  if level == 0:
    return target or ""
  parts = mod.split(".")
  base = parts if is_pkg else parts[:-1]
  base = base[: len(base) - (level - 1)]
  return ".".join(base + ([target] if target else []))


def _parsed(mods: dict[str, str]):
  """(module name, is a package __init__, its ast) for every module of `mods`."""
  for mod, path in mods.items():
    with open(path, encoding="utf-8") as f:
      yield mod, path.endswith("__init__.py"), ast.parse(f.read(), path)


def edges(root: str) -> list[Edge]:
  """Every import inside the package, as edges between its own modules."""
  mods = module_names(root)
  out = []
  for mod, is_pkg, tree in _parsed(mods):
    inner_nodes = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for sub in ast.walk(node):
          if isinstance(sub, (ast.Import, ast.ImportFrom)):
            inner_nodes.add(id(sub))
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          dst = _longest(a.name, mods)
          if dst:
            out.append(Edge(mod, dst, node.lineno, id(node) in inner_nodes, ()))
      elif isinstance(node, ast.ImportFrom):
        base = _resolve(mod, is_pkg, node.level, node.module)
        for a in node.names:
          full = f"{base}.{a.name}" if base else a.name
          if full in mods:
            out.append(Edge(mod, full, node.lineno, id(node) in inner_nodes, ()))
          else:
            dst = _longest(base, mods)
            if dst:
              out.append(Edge(mod, dst, node.lineno, id(node) in inner_nodes, (a.name,)))
  return out


def _longest(name: str, mods: dict[str, str]) -> str | None:
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    cand = ".".join(parts[:i])
    if cand in mods:
      return cand
  return None


def cycles(es: list[Edge]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan), each sorted.

  A submodule is never counted as importing the packages that hold it (they are loaded
  before it), so a package `__init__` that re-exports its submodules is not a cycle.
  """
  graph: dict[str, set[str]] = {}
  for e in es:
    # Importing a.b.c runs a/__init__ and a/b/__init__ first: those count as imported too,
    # except the packages that hold the importer (loaded before it) and the root package.
    parts = e.dst.split(".")
    for i in range(2, len(parts) + 1):
      dst = ".".join(parts[:i])
      if dst == e.src or e.src.startswith(dst + "."):
        continue
      graph.setdefault(e.src, set()).add(dst)
      graph.setdefault(dst, set())
  index, low, on, stack, comps = {}, {}, set(), [], []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  sys.setrecursionlimit(10000)
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(comps)


def private_reach_ins(root: str) -> list[tuple[str, int, str]]:
  """(module, line, 'other.module._name') for each use of another module's private name.

  Counts `from m import _x` and `m._x` where `m` is a name bound to one of the package's
  modules by an import in that file.
  """
  mods = module_names(root)
  out = []
  for mod, is_pkg, tree in _parsed(mods):
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        base = _resolve(mod, is_pkg, node.level, node.module)
        for a in node.names:
          full = f"{base}.{a.name}"
          if full in mods:
            bound[a.asname or a.name] = full
          elif (a.name.startswith("_") and not a.name.startswith("__")
                and _longest(base, mods) and _longest(base, mods) != mod):
            out.append((mod, node.lineno, f"{base}.{a.name}"))
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name in mods and a.asname:
            bound[a.asname] = a.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
          and node.value.id in bound and bound[node.value.id] != mod):
        out.append((mod, node.lineno, f"{bound[node.value.id]}.{node.attr}"))
  return sorted(out)


def inner_imports(root: str) -> list[tuple[str, int, str]]:
  """(module, line, imported name) for each import statement inside a function body."""
  out = []
  for mod, _, tree in _parsed(module_names(root)):
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for sub in ast.walk(node):
          if isinstance(sub, ast.Import):
            out.append((mod, sub.lineno, ", ".join(a.name for a in sub.names)))
          elif isinstance(sub, ast.ImportFrom):
            out.append((mod, sub.lineno, "." * sub.level + (sub.module or "")))
  return sorted(set(out))


def main(argv: list[str]) -> None:
  root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "t5forge")
  es = edges(root)
  cs = cycles(es)
  print(f"cycles: {len(cs)}")
  for c in cs:
    print("  " + " <-> ".join(c))
  inner = inner_imports(root)
  print(f"imports inside functions: {len(inner)}")
  for m, line, what in inner:
    print(f"  {m}:{line} {what}")
  priv = private_reach_ins(root)
  print(f"private reach-ins: {len(priv)}")
  for m, line, what in priv:
    print(f"  {m}:{line} {what}")


if __name__ == "__main__":
  main(sys.argv)
