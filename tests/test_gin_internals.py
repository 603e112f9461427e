"""gin's private names t5forge relies on (t5forge/cli/gin_internals.py), pinned to the gin
version in pyproject.toml: an upgrade that moves them fails here."""
import importlib.metadata
import os
import re

import gin

from t5forge.cli import gin_internals

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_installed_gin_is_the_pinned_one():
  with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
    pinned = re.search(r'"gin-config==([^"]+)"', f.read()).group(1)
  assert importlib.metadata.version("gin-config") == pinned == gin_internals.GIN_VERSION


def test_bindings_lists_scoped_configurables_and_macros():
  gin.clear_config()

  @gin.configurable("t5forge_gin_internals_probe")
  def probe(x=0):
    return x

  gin.parse_config(["STEPS = 7", "t5forge_gin_internals_probe.x = %STEPS",
                    "eval/t5forge_gin_internals_probe.x = 2"])
  # A configurable's selector is its full name: module.name.
  got = {(scope, selector.rsplit(".", 1)[-1]): dict(values)
         for scope, selector, values in gin_internals.bindings()}
  assert got[("STEPS", "macro")] == {"value": 7}
  assert got[("eval", "t5forge_gin_internals_probe")] == {"x": 2}
  ref = got[("", "t5forge_gin_internals_probe")]["x"]
  assert isinstance(ref, gin.config.ConfigurableReference) and ref.selector == "gin.macro"
  assert probe() == 7
  gin.clear_config()


def test_search_paths_reset_and_extend(tmp_path):
  gin_internals.reset_search_paths()
  assert gin_internals.search_paths() == [""]
  gin.add_config_file_search_path(str(tmp_path))
  assert gin_internals.search_paths() == ["", str(tmp_path)]
  gin_internals.reset_search_paths()
  assert gin_internals.search_paths() == [""]


def test_file_readers_is_gins_own_mutable_list_of_pairs(tmp_path):
  readers = gin_internals.file_readers()
  assert readers is gin_internals.file_readers()
  assert readers and all(len(pair) == 2 and all(map(callable, pair)) for pair in readers)
  (tmp_path / "a.gin").write_text("")
  assert any(exists(str(tmp_path / "a.gin")) for _, exists in readers)
