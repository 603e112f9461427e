"""Flags that would change nothing or crash, and gin paths.

Each case ends in the right result or one `t5forge: error:` line naming the flag and the
fix, never a traceback: a command-line macro no gin file uses, an unquoted relative
path, a gin syntax error, a malformed --feature_lengths, an unimportable --module or
`import tasks`, a model gin of another size than the checkpoint (T5X-style infer), an
unknown task; and package gin files resolve from any working directory, also one that
holds a `runs/` folder."""
import os
import subprocess
import sys
import textwrap

import pytest

from t5forge.cli import gin_flags
from t5forge.errors import UserError
from train_helpers import ROOT, cli, error_line, train_in_process, write_gin

EXAMPLE = "t5forge/configs/examples/bible_translate_from_scratch.gin"


def _cli(*args, cwd=ROOT):
  return cli(*args, cwd=cwd)


def test_command_line_macro_that_no_gin_uses_is_refused_with_the_closest_name():
  files = [os.path.join(ROOT, EXAMPLE)]
  with pytest.raises(UserError, match=r"TRAIN_STEPZ.*did you mean --gin\.TRAIN_STEPS"):
    gin_flags.parse(files, ['MODEL_DIR="/tmp/unused"', "TRAIN_STEPZ=10"])
  # pretrain.gin has no INITIAL_CHECKPOINT_PATH: setting it would silently do nothing.
  run = os.path.join(gin_flags.CONFIGS_DIR, "runs", "pretrain.gin")
  model = os.path.join(gin_flags.CONFIGS_DIR, "models", "t5_1_1", "tiny.gin")
  with pytest.raises(UserError, match="no gin file uses the macro INITIAL_CHECKPOINT_PATH"):
    gin_flags.parse([run, model], ['MODEL_DIR="/tmp/x"', "MIXTURE_OR_TASK_NAME='t'",
                                   "TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 8}",
                                   "TRAIN_STEPS=1", "INITIAL_CHECKPOINT_PATH='/tmp/ckpt'"])
  # A macro that is used is accepted, also through --gin_bindings.
  gin_flags.parse(files, ['MODEL_DIR="/tmp/unused"', "TRAIN_STEPS=10"])
  import gin
  assert gin.query_parameter("TRAIN_STEPS/macro.value") == 10


def test_unquoted_relative_path_and_gin_syntax_error_are_one_line(tmp_path):
  files = [os.path.join(ROOT, EXAMPLE)]
  with pytest.raises(UserError, match=r'strings need quotes: write --gin.MODEL_DIR=\\"runs/x\\"'):
    gin_flags.parse(files, ["MODEL_DIR=runs/x"])
  bad = tmp_path / "bad.gin"
  bad.write_text(f"include '{EXAMPLE}'\nTRAIN_STEPS = [3\n")
  msg = error_line(_cli("train", f"--gin_file={bad}", f'--gin.MODEL_DIR="{tmp_path}/m"'))
  assert "gin syntax error" in msg and "bad.gin" in msg


def test_malformed_feature_lengths_is_one_line(tmp_path):
  msg = error_line(_cli("eval", "--checkpoint", str(tmp_path), "--task",
                         "bible_translate_en_es", "--feature_lengths", "inputs512"))
  assert "--feature_lengths" in msg and "inputs=512,targets=128" in msg


def test_unimportable_module_names_the_flag_and_pythonpath(tmp_path):
  msg = error_line(_cli("infer", "--checkpoint", str(tmp_path), "--task", "my_task",
                         "--module", "no_such_tasks_module", "--output_dir", str(tmp_path / "o")))
  assert "--module no_such_tasks_module" in msg and "PYTHONPATH" in msg
  # A tasks.py that imports SeqIO: say what to change, not "put it on PYTHONPATH".
  (tmp_path / "seqio_tasks.py").write_text("import seqio\n")
  msg = error_line(_cli("infer", "--checkpoint", str(tmp_path), "--task", "my_task",
                         "--module", "seqio_tasks", "--output_dir", str(tmp_path / "o"),
                         cwd=str(tmp_path)))
  assert "'seqio'" in msg and "t5forge.data" in msg
  # T5X style: MIXTURE_OR_TASK_MODULE in a training gin.
  gin = write_gin(tmp_path / "run.gin", steps=1)
  msg = error_line(train_in_process(gin, tmp_path / "m",
                                   'MIXTURE_OR_TASK_MODULE="no_such_tasks_mod"'))
  assert "no_such_tasks_mod" in msg and "PYTHONPATH" in msg


_TASKS_PY = """
from t5forge import data as seqio
from t5forge.data import bundled_tasks
seqio.TaskRegistry.add(
    "{name}",
    source=seqio.TsvDataSource({{"train": bundled_tasks.BIBLE_VALIDATION}}, field_names=("en", "es")),
    preprocessors=[seqio.preprocessors.tokenize],
    output_features=bundled_tasks.OUTPUT_FEATURES)
"""


def test_gin_import_of_user_tasks_uses_gin_search_paths(tmp_path):
  user = tmp_path / "user_dir"
  user.mkdir()
  (user / "gin_path_user_tasks.py").write_text(_TASKS_PY.format(name="gin_path_user_task"))
  (user / "my.gin").write_text(textwrap.dedent(f"""\
      from __gin__ import dynamic_registration
      import gin_path_user_tasks
      include '{EXAMPLE}'
      MIXTURE_OR_TASK_NAME = 'gin_path_user_task'
      """))
  # Without the directory on the path: one line that says how to make it importable.
  with pytest.raises(UserError, match=r"gin_path_user_tasks.*PYTHONPATH.*--gin_search_paths"):
    gin_flags.parse([str(user / "my.gin")], ['MODEL_DIR="/tmp/unused"'])
  # With --gin_search_paths (T5X's user-directory recipe) the module imports and registers.
  gin_flags.parse(["my.gin"], ['MODEL_DIR="/tmp/unused"'], [str(user)])
  from t5forge import data
  assert data.get_mixture_or_task("gin_path_user_task").name == "gin_path_user_task"


def test_unknown_task_says_how_user_tasks_are_registered():
  from t5forge import data
  with pytest.raises(UserError, match=r"unknown task.*--module tasks.*MIXTURE_OR_TASK_MODULE"):
    data.get_mixture_or_task("my_wmt_task")


def test_model_gin_of_another_size_in_t5x_style_infer_is_one_line(tmp_path):
  import jax
  from t5forge import nn, presets
  from t5forge.convert import native
  config = presets.get("t5_1_1.tiny", vocab_size=8000)
  native.save(str(tmp_path / "ckpt"), config, nn.init_params(config, jax.random.key(0)))
  msg = error_line(_cli(
      "infer", "--gin_file=models/t5_1_1/small.gin", "--gin_file=runs/infer.gin",
      f'--gin.CHECKPOINT_PATH="{tmp_path}/ckpt"', f'--gin.INFER_OUTPUT_DIR="{tmp_path}/out"',
      "--gin.MIXTURE_OR_TASK_NAME='bible_translate_en_es'", "--gin.BATCH_SIZE=2"))
  assert "ckpt" in msg and "shape" in msg and "model gin" in msg
  assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


_PARSE = ("import sys; from t5forge.cli import gin_flags; "
          "gin_flags.parse([sys.argv[1]], ['MODEL_DIR=\"/tmp/unused\"']); print('parsed')")


@pytest.mark.slow
@pytest.mark.parametrize("with_runs_folder", [False, True])
def test_package_gin_files_resolve_from_any_directory(tmp_path, with_runs_folder):
  """`--gin_file=t5forge/configs/examples/...` from another directory, also one holding a
  `runs/` folder (gin used to resolve it as a Python namespace package and crash)."""
  if with_runs_folder:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("a user's own runs folder")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  r = subprocess.run([sys.executable, "-c", _PARSE, EXAMPLE], capture_output=True, text=True,
                     cwd=str(tmp_path), env=env, timeout=300)
  assert r.returncode == 0 and "parsed" in r.stdout, r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-c", _PARSE, "t5forge/configs/examples/nope.gin"],
                     capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
  assert "not found (searched" in r.stderr and "TypeError" not in r.stderr, r.stderr[-2000:]
