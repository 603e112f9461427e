"""Real text that ships with CPython: stdlib docstrings and `pydoc_data` help topics.

Built at first use from the running interpreter's standard library, by reading
the `.py` files with `ast` (nothing is imported), and cached in the cache dir
(`files.cache_root()`) with atomic writes. The splits are fixed by a hash of each
item's name (or text), so they do not move when the stdlib gains a function.

* `docstring_split_files()`: JSONL `{"name", "document", "summary"}` per
  function or method whose docstring has a one-line summary and a body: the
  document is the signature plus the body, the summary the first paragraph.
* `english_split_files(bible_path)`: text lines from the World English Bible,
  the help topics and all docstrings (for span-corruption pretraining).
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from t5forge.data import files

_FORMAT = 1  # bump when the extraction changes: the cache key includes it
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "lib2to3", "turtledemo", "ensurepip", "venv"}
_MAX_SUMMARY_WORDS = 40


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> list[str]:
  root = stdlib_dir()
  out = []
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
    out.extend(os.path.join(d, f) for f in sorted(names) if f.endswith(".py"))
  return out


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, stdlib_dir())[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _parse(path: str) -> ast.Module | None:
  try:
    with open(path, "rb") as f:
      return ast.parse(f.read(), filename=path)
  except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
    return None  # a few stdlib files are templates or deliberately broken


def _walk_defs(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
  """(qualified name, node) of every class and function, in source order."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      name = f"{prefix}.{child.name}"
      yield name, child
      yield from _walk_defs(child, name)


def _squash(text: str) -> str:
  return " ".join(text.split())


def _signature(name: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  sig = f"{name}({ast.unparse(node.args)})"
  if node.returns is not None:
    sig += f" -> {ast.unparse(node.returns)}"
  return sig


def docstring_examples() -> Iterator[dict]:
  """Summarisation examples from the stdlib, in a deterministic order."""
  seen = set()
  for path in _stdlib_files():
    tree = _parse(path)
    if tree is None:
      continue
    module = _module_name(path)
    for name, node in _walk_defs(tree, module):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      doc = ast.get_docstring(node, clean=True)
      if not doc:
        continue
      paragraphs = [p for p in doc.strip().split("\n\n") if p.strip()]
      if len(paragraphs) < 2:
        continue  # no body: nothing to summarise
      summary, body = _squash(paragraphs[0]), _squash(" ".join(paragraphs[1:]))
      n_words = len(summary.split())
      # Skip the trivial ones: one-word summaries and bodies shorter than a sentence.
      if not 3 <= n_words <= _MAX_SUMMARY_WORDS or len(body.split()) < 6:
        continue
      document = f"{_signature(name, node)}: {body}"
      if document in seen:
        continue
      seen.add(document)
      yield {"name": name, "document": document, "summary": summary}


def _docstring_texts() -> Iterator[str]:
  for path in _stdlib_files():
    tree = _parse(path)
    if tree is None:
      continue
    nodes = [tree] + [n for _, n in _walk_defs(tree, "")]
    for node in nodes:
      doc = ast.get_docstring(node, clean=True)
      if doc:
        for para in doc.split("\n\n"):
          if len(para.split()) >= 4:
            yield _squash(para)


def _topic_texts() -> Iterator[str]:
  path = os.path.join(stdlib_dir(), "pydoc_data", "topics.py")
  tree = _parse(path)
  if tree is None:
    return
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "topics" for t in node.targets):
      topics = ast.literal_eval(node.value)
      for key in sorted(topics):
        for para in topics[key].split("\n\n"):
          if len(para.split()) >= 4:
            yield _squash(para)


def _bucket(key: str) -> int:
  return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % 100


def _cache_dir(kind: str, extra: str = "") -> str:
  key = hashlib.sha1(f"{_FORMAT}|{sys.version}|{stdlib_dir()}|{extra}".encode()).hexdigest()[:12]
  return os.path.join(files.cache_root(), kind, key)


def docstring_split_files() -> dict[str, str]:
  """{"train": path, "validation": path} of the docstring task, built once."""
  d = _cache_dir("python_docstrings")
  paths = {s: os.path.join(d, f"{s}.jsonl") for s in ("train", "validation")}
  if not all(os.path.exists(p) for p in paths.values()):
    lines = {"train": [], "validation": []}
    for ex in docstring_examples():
      # 10% validation by a hash of the qualified name: stable across versions.
      split = "validation" if _bucket(ex["name"]) < 10 else "train"
      lines[split].append(json.dumps(ex, ensure_ascii=False))
    for split, path in paths.items():
      files.atomic_write_bytes(path, ("\n".join(lines[split]) + "\n").encode("utf-8"))
  return paths


def english_split_files(bible_path: str) -> dict[str, str]:
  """{"train": path, "validation": path} of English text, a paragraph a line.

  Validation is 1% of the lines by a hash of their text.
  """
  size = os.path.getsize(bible_path)
  d = _cache_dir("english_text", f"{os.path.abspath(bible_path)}|{size}")
  paths = {s: os.path.join(d, f"{s}.txt") for s in ("train", "validation")}
  if not all(os.path.exists(p) for p in paths.values()):
    out = {"train": [], "validation": []}

    def texts():
      with gzip.open(bible_path, "rt", encoding="utf-8") as f:
        for line in f:
          yield line.strip()
      yield from _topic_texts()
      yield from _docstring_texts()

    for text in texts():
      if text:
        out["validation" if _bucket(text) < 1 else "train"].append(text)
    for split, path in paths.items():
      files.atomic_write_bytes(path, ("\n".join(out[split]) + "\n").encode("utf-8"))
  return paths
