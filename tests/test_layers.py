"""The package's layers, checked on its import graph (read with `ast`, nothing imported).

Top to bottom; a module may import modules of lower layers, and of its own layer only where
`SAME_LAYER` allows it. Every import counts, at the top of a file or inside a function, and
importing `a.b.c` counts as importing the packages `a.b` and `a` too (Python runs them
first). docs/architecture.md explains the layers.
"""
import functools
import os

import pytest

import import_graph

ROOT = os.path.join(os.path.dirname(__file__), "..", "t5forge")

LAYERS = [
    {"__main__", "cli"},
    {"interactive", "testing"},
    {"serve", "train", "infer", "evaluate", "export"},
    {"generation", "predict", "engine"},
    {"models", "opener"},
    {"nn", "data", "convert", "decoding", "losses", "presets", "precision", "provenance"},
    {"sharding", "errors", "files", "metrics", "multihost", "host_memory", "storage",
     "sampling"},
]
# (importer, imported) pairs allowed inside one layer.
SAME_LAYER = {
    ("__main__", "cli"),
    ("convert", "data"), ("convert", "nn"), ("presets", "nn"), ("generation", "predict"),
    ("opener", "models"), ("nn", "sharding"), ("data", "metrics"), ("files", "errors"),
    ("metrics", "errors"), ("multihost", "errors"), ("sharding", "errors"),
    ("precision", "multihost"), ("files", "storage"), ("storage", "errors"),
}
# Pairs that must never appear, whatever the layers say.
FORBIDDEN = {("data", "convert")}


def _part(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else parts[0]


def _layer(part: str) -> int:
  for i, layer in enumerate(LAYERS):
    if part in layer:
      return i
  raise AssertionError(f"t5forge.{part} is in no layer of tests/test_layers.py: add it to one")


@functools.lru_cache(maxsize=None)
def _edges(root: str) -> tuple:
  return tuple(import_graph.edges(root))


def violations(root: str = ROOT) -> list[str]:
  """One line per import that breaks the layers, as `src:line -> dst (why)`."""
  out = []
  for e in import_graph.edges(root) if root != ROOT else _edges(root):
    if "." not in e.dst:
      continue  # the root package: its names are imported lazily (PEP 562)
    a, b = _part(e.src), _part(e.dst)
    if a == b:
      continue
    la, lb = _layer(a), _layer(b)
    if (a, b) in FORBIDDEN:
      out.append(f"{e.src}:{e.line} -> {e.dst} (t5forge.{a} must not import t5forge.{b})")
    elif la > lb or (la == lb and (a, b) not in SAME_LAYER):
      out.append(f"{e.src}:{e.line} -> {e.dst} (t5forge.{a} is not above t5forge.{b})")
  return sorted(set(out))


def test_every_module_is_in_a_layer():
  for mod in import_graph.module_names(ROOT):
    if "." in mod:
      _layer(_part(mod))


def test_imports_go_down_the_layers():
  bad = violations()
  assert not bad, "imports against the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles():
  cycles = import_graph.cycles(list(_edges(ROOT)))
  assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_reaching_into_other_modules_private_names():
  reach = import_graph.private_reach_ins(ROOT)
  assert not reach, "private names used from another module:\n" + "\n".join(
      f"{m}:{line} {name}" for m, line, name in reach)


@pytest.mark.parametrize("case", ["upward", "forbidden", "cycle"])
def test_the_checks_catch_a_planted_violation(tmp_path, case):
  """A copy of a tiny package with one bad import: the check that should fail does."""
  pkg = tmp_path / "t5forge"
  for sub in ("cli", "data", "convert"):
    (pkg / sub).mkdir(parents=True)
    (pkg / sub / "__init__.py").write_text("")
  (pkg / "__init__.py").write_text("")
  (pkg / "errors.py").write_text("")
  (pkg / "convert" / "hf.py").write_text("from t5forge.data import vocab\n")
  (pkg / "data" / "vocab.py").write_text("from t5forge import errors\n")
  (pkg / "cli" / "main.py").write_text("from t5forge.convert import hf\n")
  assert violations(str(pkg)) == []
  assert import_graph.cycles(import_graph.edges(str(pkg))) == []
  if case == "upward":
    (pkg / "errors.py").write_text("def f():\n  from t5forge.cli import main\n")
    assert any("t5forge.errors is not above t5forge.cli" in v for v in violations(str(pkg)))
  elif case == "forbidden":
    (pkg / "data" / "vocab.py").write_text("from t5forge.convert.hf import x\n")
    assert any("must not import t5forge.convert" in v for v in violations(str(pkg)))
  else:
    (pkg / "convert" / "__init__.py").write_text("from t5forge.convert import hf\n")
    (pkg / "data" / "vocab.py").write_text("def f():\n  import t5forge.convert\n")
    cycles = import_graph.cycles(import_graph.edges(str(pkg)))
    assert cycles and "t5forge.data.vocab" in cycles[0]
