"""What a user sees: progress lines when there is no terminal, the final
summary's loss per target token, and where the caches go (XDG_CACHE_HOME, T5FORGE_CACHE=off).
"""
import functools
import gzip
import os
import re
import subprocess
import sys
import tempfile

import pytest

import t5forge.data as data
from t5forge.data import files, sources, vocab_io
from t5forge.data.bundled_tasks import VOCAB_PATH
from t5forge.data.vocab import SentencePieceVocabulary
from train_helpers import ROOT, train_cmd, write_gin

LINE = re.compile(r"^step (\d+)/(\d+): loss per target token (\d+\.\d+), ([\d,]+) tok/s, "
                  r"ETA (\d+h\d\dm|\d+m\d\ds|\d+s)$")


def _env(**changes):
  env = {k: v for k, v in os.environ.items() if k not in ("T5FORGE_PROGRESS", "T5FORGE_CACHE_TEMP")}
  env.update(changes)
  return env


@pytest.mark.slow
def test_training_without_a_terminal_prints_a_line_per_report(tmp_path):
  gin = write_gin(tmp_path / "run.gin", steps=6, period=6, stats_period=2)
  # capture_output: stderr is a pipe, not a terminal, so there is no progress bar.
  r = subprocess.run(train_cmd(gin, tmp_path / "model"), capture_output=True, text=True,
                     cwd=ROOT, timeout=600, env=_env())
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [LINE.match(l) for l in r.stdout.splitlines() if l.startswith("step ")]
  assert all(lines), r.stdout
  assert [(int(m.group(1)), int(m.group(2))) for m in lines] == [(2, 6), (4, 6), (6, 6)]
  assert all(0 < float(m.group(3)) < 20 for m in lines)  # per token: ~ln(8000) at most
  assert all(int(m.group(4).replace(",", "")) > 0 for m in lines)
  assert lines[-1].group(5) == "0s"
  # The summary shows the same per-token loss as the last progress line, not T5X's sum.
  summary = re.search(r"train loss per target token (\d+\.\d+), accuracy (\d\.\d+)", r.stdout)
  assert summary, r.stdout
  assert summary.group(1) == lines[-1].group(3)
  assert "train loss " not in r.stdout.replace("train loss per target token", "")


def test_cache_root_honours_xdg_cache_home(tmp_path, monkeypatch):
  monkeypatch.delenv("T5FORGE_CACHE", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  assert files.cache_root() == str(tmp_path / "home" / ".cache" / "t5forge")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert files.cache_root() == str(tmp_path / "xdg" / "t5forge")
  monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the spec: ignore relative paths
  assert files.cache_root() == str(tmp_path / "home" / ".cache" / "t5forge")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.setenv("T5FORGE_CACHE", str(tmp_path / "mine"))  # still wins
  assert files.cache_root() == str(tmp_path / "mine")


def _gz_and_vocab_load(data_dir):
  """Reads a .gz source, loads a checkpoint's vocabulary and reads a `cache=True` task:
  each writes to the cache dir."""
  path = os.path.join(data_dir, "lines.txt.gz")
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write("one\ntwo\nthree\n")
  src = sources.LineSource(path)
  assert [src[i]["text"] for i in range(len(src))] == ["one", "two", "three"]
  spec = vocab_io.to_spec(SentencePieceVocabulary(VOCAB_PATH, extra_ids=100))
  vocab = vocab_io.from_spec(spec)
  assert vocab.decode(vocab.encode("In the beginning")) == "In the beginning"
  features = {"targets": data.Feature(data.PassThroughVocabulary(100))}
  data.TaskRegistry.remove("t_user_output_cached")
  data.TaskRegistry.add("t_user_output_cached",
                        data.InMemoryDataSource({"train": [{"targets": [5, 1]}] * 3}),
                        preprocessors=[functools.partial(data.preprocessors.rekey,
                                                         key_map={"targets": "targets"}),
                                       data.CacheDatasetPlaceholder()],
                        output_features=features, cache=True)
  assert len(data.get_dataset("t_user_output_cached", "train", {"targets": 4})) == 3


def _all_files(root):
  return sorted(os.path.relpath(os.path.join(d, n), root)
                for d, _, names in os.walk(root) for n in names)


@pytest.mark.parametrize("value", ["off", "none"])
def test_cache_off_writes_nothing_persistent(tmp_path, monkeypatch, value):
  home, xdg, data, cwd = (tmp_path / n for n in ("home", "xdg", "data", "cwd"))
  for d in (home, xdg, data, cwd):
    d.mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
  monkeypatch.setenv("T5FORGE_CACHE", value)
  monkeypatch.chdir(cwd)
  _gz_and_vocab_load(str(data))
  assert _all_files(home) == [] and _all_files(xdg) == [] and _all_files(cwd) == []
  assert _all_files(data) == ["lines.txt.gz"]  # no line index beside the data either
  # Where they went instead: a temporary directory of this process.
  assert os.path.dirname(files.cache_root()) == tempfile.gettempdir()
  cached = _all_files(files.cache_root())
  assert any(n.endswith(".model") for n in cached)
  assert any(n.startswith("tasks/t_user_output_cached/") for n in cached)


def test_cache_off_temporary_directory_is_removed_at_exit(tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  code = ("import sys; sys.path.insert(0, 'tests'); from test_user_output import "
          "_gz_and_vocab_load; from t5forge.data import files; "
          f"_gz_and_vocab_load({str(data)!r}); print(files.cache_root())")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=300, env=_env(T5FORGE_CACHE="off", HOME=str(tmp_path / "home"),
                                           XDG_CACHE_HOME=str(tmp_path / "xdg")))
  assert r.returncode == 0, r.stderr[-3000:]
  temp = r.stdout.strip().splitlines()[-1]
  assert os.path.basename(temp).startswith("t5forge-cache-")
  assert not os.path.exists(temp)
  assert not os.path.exists(tmp_path / "home") and not os.path.exists(tmp_path / "xdg")
