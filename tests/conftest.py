"""Shared fixtures. Tests run on CPU with float32 matmuls at full precision.

One persistent JAX compilation cache serves the whole run: the pytest workers, every
`python -m t5forge` subprocess and every server the tests start compile the same tiny
models again and again, and each compile after the first is a read from the cache. It lives
in a directory made for this run (removed at the end) unless JAX_COMPILATION_CACHE_DIR is
set already, which keeps a developer's own cache across runs. No size limit: with one, JAX
locks the directory and lists every entry on each write (thousands here: minutes over a
run). Without the lock a read racing the write of the same entry can fail; JAX then warns
and compiles. Compile counters count cache hits as compiles (t5forge.engine.compile_count),
so "nothing compiles after ready" still means what it says.

The suite compiles as users do, at XLA's default optimisation level. LLVM at -O0 would cut
XLA:CPU's compile time by ~40%, but it changes float32 results: T5Gemma's logits against
float64 truth drift 5.4x transformers' float32 error there, against 1.3x at the default.
"""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller, or a run without xdist
  _JAX_CACHE = tempfile.mkdtemp(prefix="t5forge-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE  # inherited by workers, subprocesses
  atexit.register(shutil.rmtree, _JAX_CACHE, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ("buckets",)  # the bucket_env fixtures: GCS and S3 emulators

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
T5X_FIXTURE = os.path.join(SHARED, "testdata", "t5x", "test_t5_tiny.checkpoint_0")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """Builds each HF reference variant once per session, on first use."""
  from hf_reference import build_hf_dir
  cache = {}

  def get(name: str) -> str:
    if name not in cache:
      cache[name] = build_hf_dir(name, str(tmp_path_factory.mktemp(f"hf_{name}")))
    return cache[name]

  return get


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A fresh T5FORGE_CACHE for one test; the path."""
  monkeypatch.setenv("T5FORGE_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
  """One T5FORGE_CACHE for a whole test file (and the session's other users of it), for
  files whose tests reuse what an earlier test cached; the path."""
  path = tmp_path_factory.getbasetemp() / "t5forge_cache"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("T5FORGE_CACHE", str(path))
    yield path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """With `--dist loadgroup` (make test): the tests that share a module-scoped fixture of
  their file (a server, a trained run) form one xdist group and run in one worker, so that
  fixture is built once; every other test is scheduled on its own, to whichever worker is
  free. (Grouping whole files instead left one worker finishing the heaviest file alone.)"""
  # (an xdist worker sees dist "no" and its own loadgroup flag)
  if not (config.getoption("dist", "no") == "loadgroup"
          or getattr(config.option, "loadgroup", False)):
    return
  parent: dict = {}

  def find(x):
    while parent.setdefault(x, x) != x:
      x = parent[x]
    return x

  uses = {}
  for item in items:
    module = item.nodeid.split("::")[0]
    names = [(module, name) for name, defs in getattr(item, "_fixtureinfo").name2fixturedefs.items()
             if defs and defs[-1].scope in ("module", "class") and defs[-1].baseid == module]
    uses[item] = names
    for a, b in zip(names, names[1:]):
      parent[find(a)] = find(b)
  for item, names in uses.items():
    if names:
      module, name = find(names[0])
      item.add_marker(pytest.mark.xdist_group(f"{module}::{name}"))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """Under `make coverage`, a pytest-xdist worker saves its measurements when its tests are
  done: xdist kills a worker that takes over 10 s to exit, and coverage.py saves at exit,
  after every other exit handler, so a slow exit lost the worker's whole in-process data
  (one such run read 86.9% with t5forge/metrics.py at 0%, 97% when its tests ran alone)."""
  coverage = sys.modules.get("coverage")
  current = coverage and coverage.Coverage.current()
  if current and os.environ.get("PYTEST_XDIST_WORKER"):
    current.save()
