"""Shared fixtures. Tests run on CPU with float32 matmuls at full precision."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ("buckets",)  # the bucket_env fixture: GCS and S3 emulators

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
