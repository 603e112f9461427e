"""Shared fixtures. Tests run on CPU with float32 matmuls at full precision."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
T5X_FIXTURE = os.path.join(SHARED, "testdata", "t5x", "test_t5_tiny.checkpoint_0")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """Builds each HF reference variant once per session, on first use."""
  from hf_reference import build_hf_dir  # pylint: disable=import-outside-toplevel
  cache = {}

  def get(name: str) -> str:
    if name not in cache:
      cache[name] = build_hf_dir(name, str(tmp_path_factory.mktemp(f"hf_{name}")))
    return cache[name]

  return get
