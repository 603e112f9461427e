"""A checkpoint named by a relative path works everywhere a user names one, from a working
directory other than the repository's (as `t5forge serve --checkpoint demo_run` right after
`make demo`): `t5forge.load`, eval, infer, serve, convert, export and INITIAL_CHECKPOINT_PATH.
And Orbax's own failures are reported as what they are, not as a config mismatch."""
import os
import subprocess
import sys

import jax
import pytest

import t5forge
from t5forge.testing import FAST_FLAGS, Server, request, tiny_checkpoint
from t5forge.convert import manifest, native
from t5forge.errors import UserError
from train_helpers import ROOT, error_line

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  """<work>/run/checkpoint_3: a MODEL_DIR as training leaves it, named 'run' from <work>."""
  d = tmp_path_factory.mktemp("work")
  tiny_checkpoint(str(d / "run" / "checkpoint_3"))
  return d


def _cli(work, *args):
  env = {**os.environ, "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, "-m", "t5forge", *args], capture_output=True,
                        text=True, cwd=work, env=env, timeout=600)


def test_python_load_of_a_relative_model_dir(work, monkeypatch):
  monkeypatch.chdir(work)
  model = t5forge.load("run")
  out = model.generate(["translate English to Spanish: God is love."], max_decode_steps=4)
  assert len(out) == 1
  model.save("copy")  # and a relative output
  assert native.is_native_checkpoint(str(work / "copy"))


def test_cli_commands_take_relative_paths(work):
  (work / "in.txt").write_text("translate English to Spanish: God is love.\n")
  r = _cli(work, "infer", "--checkpoint", "run", "--input", "in.txt", "--output_dir", "out",
           "--max_decode_length", "4")
  assert r.returncode == 0, r.stderr[-3000:]
  r = _cli(work, "eval", "--checkpoint", "run", "--task", "bible_translate_en_es",
           "--num_examples", "4", "--feature_lengths", "inputs=32,targets=8",
           "--max_decode_steps", "4", "--output_dir", "ev")
  assert r.returncode == 0, r.stderr[-3000:]
  r = _cli(work, "convert", "--input", "run", "--output", "hf", "--to", "hf")
  assert r.returncode == 0, r.stderr[-3000:]
  assert (work / "hf" / "config.json").exists()
  r = _cli(work, "export", "--checkpoint", "run", "--output", "exported", "--format", "jax")
  assert r.returncode == 0, r.stderr[-3000:]


def test_serve_takes_a_relative_model_dir(work):
  server = Server("run", *FAST_FLAGS, cwd=str(work))
  try:
    status, _, body = request(server.url, "/v1/completions",
                              {"prompt": "translate English to Spanish: God is love.",
                               "max_tokens": 4, "temperature": 0})
    assert status == 200, body
  finally:
    server.stop()


def test_initial_checkpoint_path_relative(work):
  vocab_size = native.load(str(work / "run" / "checkpoint_3"))[0].vocab_size
  (work / "ft.gin").write_text(f"""
include 'runs/finetune.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = 5
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
network.ModelConfig.vocab_size = {vocab_size}
INITIAL_CHECKPOINT_PATH = 'run'
""")
  r = _cli(work, "train", "--gin_file=ft.gin", '--gin.MODEL_DIR="ft_model"')
  assert r.returncode == 0, r.stderr[-3000:]
  assert "initialised from run (step 3)" in r.stdout
  assert native.checkpoint_steps(str(work / "ft_model")) == [5]


def test_an_orbax_failure_is_not_called_a_config_mismatch(work, tmp_path):
  import shutil
  ckpt = tmp_path / "ckpt"
  shutil.copytree(work / "run" / "checkpoint_3", ckpt)
  for p in (ckpt / "params").rglob("*"):
    if p.is_file() and p.stat().st_size > 1000:
      p.write_bytes(b"\0" * 16)  # an array file cut short
  manifest.write(str(ckpt))  # checksums of the damage: only Orbax meets it
  # In a process of its own: this one's tensorstore caches the (content-addressed) files.
  msg = error_line(_cli(tmp_path, "convert", "--input", "ckpt", "--output", "hf", "--to", "hf"))
  assert "do not match the config" not in msg and "Orbax could not read it" in msg, msg
  # A real mismatch still says which parameter differs.
  config = native.load(str(work / "run" / "checkpoint_3"))[0]
  wrong = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1,) + a.shape[1:], a.dtype),
                       t5forge.nn.abstract_params(config))
  with pytest.raises(UserError) as e:
    native.load(str(work / "run" / "checkpoint_3"), abstract_params=wrong)
  assert "do not match the config stored with them" in str(e.value)
  assert "stored (" in str(e.value) and "config (" in str(e.value)
