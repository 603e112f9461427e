"""Bad input: a ported `tasks.py` naming a metric or preprocessor t5forge does not
have gets one line (file:line, the name, the closest names), from `--module` and from a gin
file's `import tasks`, instead of an AttributeError traceback."""
import os
import subprocess
import sys

import pytest

from t5forge.cli import gin_flags
from t5forge.errors import UserError
from train_helpers import ROOT, error_line

TASKS = """\
import functools
from t5forge import data as seqio
from t5forge import metrics
from t5forge.data import bundled_tasks, preprocessors

seqio.TaskRegistry.add(
    "{task}",
    source=seqio.TsvDataSource({{"validation": bundled_tasks.BIBLE_VALIDATION}},
                               field_names=("en", "es")),
    preprocessors=[{preprocessor}, preprocessors.tokenize],
    output_features=bundled_tasks.OUTPUT_FEATURES,
    metric_fns=[{metric}])
"""


def _write(dirname, module, *, task, preprocessor="preprocessors.tokenize",
           metric="metrics.bleu"):
  os.makedirs(dirname, exist_ok=True)
  path = os.path.join(dirname, f"{module}.py")
  with open(path, "w") as f:
    f.write(TASKS.format(task=task, preprocessor=preprocessor, metric=metric))
  return path


def test_unknown_metric_in_tasks_py_is_one_line_from_module_flag(tmp_path):
  path = _write(str(tmp_path), "ported_tasks_metric", task="ported_metric",
                metric="metrics.sequence_accurracy")
  r = subprocess.run([sys.executable, "-m", "t5forge", "infer", "--checkpoint", str(tmp_path),
                      "--task", "ported_metric", "--module", "ported_tasks_metric",
                      "--output_dir", str(tmp_path / "o")],
                     capture_output=True, text=True, cwd=str(tmp_path), timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  msg = error_line(r)
  assert f"{path}:12" in msg and "'sequence_accurracy'" in msg, msg
  assert "sequence_accuracy" in msg and "t5forge.metrics" in msg, msg


def test_unknown_preprocessor_in_tasks_py_is_one_line_from_gin_import(tmp_path, monkeypatch):
  user = tmp_path / "user"
  path = _write(str(user), "ported_tasks_pre", task="ported_pre",
                preprocessor="preprocessors.translat")
  (user / "my.gin").write_text(
      "from __gin__ import dynamic_registration\nimport ported_tasks_pre\n"
      "include 't5forge/configs/examples/bible_translate_from_scratch.gin'\n")
  with pytest.raises(UserError, match=r"ported_tasks_pre.py:10: .*'translat'.*did you mean "
                                      r".*translate"):
    gin_flags.parse(["my.gin"], ['MODEL_DIR="/tmp/unused"'], [str(user)])
  del path
