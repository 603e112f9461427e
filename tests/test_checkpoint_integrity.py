"""Damaged checkpoints: every checkpoint carries the checksums of its
files; a resumed run names a damaged one in one line, keeps it (renamed aside) and
resumes from the newest intact one; eval / infer / t5forge.load of a damaged checkpoint
give one line and no traceback."""
import glob
import json
import os
import shutil
import time

import pytest

import t5forge
from t5forge.convert import manifest, native
from t5forge.errors import UserError
from train_helpers import cli, train_in_process, write_gin

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """One 8-step run with checkpoints at 4 and 8; tests damage copies of it."""
  d = tmp_path_factory.mktemp("trained")
  gin = write_gin(d / "run.gin", steps=8, period=4)
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  return gin, str(d / "model")


def _copy(trained, tmp_path):
  dst = str(tmp_path / "model")
  shutil.copytree(trained[1], dst)
  return dst


def _largest(directory):
  files = [os.path.join(r, f) for r, _, names in os.walk(directory) for f in names]
  return max(files, key=os.path.getsize)


def _flip(path, n=4096):
  size = os.path.getsize(path)
  assert size > 2 * n, size
  with open(path, "r+b") as f:
    f.seek(size // 2)
    data = f.read(n)
    f.seek(size // 2)
    f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _damage(kind, ckpt):
  """Damages checkpoint dir ckpt; -> the words the one-line message must contain."""
  if kind == "flipped":
    path = _largest(os.path.join(ckpt, "params"))
    _flip(path)
    return [os.path.relpath(path, ckpt), "sha256 mismatch"]
  if kind == "truncated":
    path = _largest(os.path.join(ckpt, "params"))
    _truncate(path)
    return [os.path.relpath(path, ckpt), "truncated"]
  if kind == "orbax_manifest":  # the OCDBT manifest of the parameters
    os.remove(os.path.join(ckpt, "params", "manifest.ocdbt"))
    return ["params/manifest.ocdbt is missing"]
  if kind == "orbax_metadata":  # Orbax's step metadata
    os.remove(os.path.join(ckpt, "_CHECKPOINT_METADATA"))
    return ["_CHECKPOINT_METADATA", "missing"]
  raise ValueError(kind)


def test_each_checkpoint_has_a_manifest_that_verifies(trained):
  _, model_dir = trained
  assert native.checkpoint_steps(model_dir) == [4, 8]
  for step in (4, 8):
    ckpt = os.path.join(model_dir, f"checkpoint_{step}")
    assert manifest.verify(ckpt) is None
    with open(os.path.join(ckpt, manifest.MANIFEST)) as f:
      files = json.load(f)["files"]
    assert any(name.startswith("params/") for name in files)
    assert any(name.startswith("opt_state/") for name in files)
    assert not glob.glob(os.path.join(ckpt, "*.tmp"))


@pytest.mark.parametrize("kind", ["flipped", "truncated", "orbax_manifest", "orbax_metadata"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(trained, tmp_path, kind):
  gin, _ = trained
  model_dir = _copy(trained, tmp_path)
  ckpt8 = os.path.join(model_dir, "checkpoint_8")
  words = _damage(kind, ckpt8)
  before = sorted(os.path.relpath(os.path.join(r, f), ckpt8)
                  for r, _, names in os.walk(ckpt8) for f in names)
  r = train_in_process(gin, model_dir, "TRAIN_STEPS=12")
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  assert "Traceback" not in out
  lines = [x for x in out.splitlines() if "damaged:" in x]
  assert len(lines) == 1, lines
  assert "checkpoint_8: damaged:" in lines[0] and "resumed from checkpoint_4" in lines[0]
  for word in words:
    assert word in lines[0], (word, lines[0])
  assert f"resumed from {model_dir}/checkpoint_4" in out
  aside = glob.glob(ckpt8 + ".damaged-*")  # kept, out of Orbax's way
  assert len(aside) == 1, os.listdir(model_dir)
  assert sorted(os.path.relpath(os.path.join(r, f), aside[0])
                for r, _, names in os.walk(aside[0]) for f in names) == before
  assert native.checkpoint_steps(model_dir) == [4, 8, 12]
  for step in (8, 12):  # written anew by the resumed run
    assert manifest.verify(os.path.join(model_dir, f"checkpoint_{step}")) is None


def test_no_intact_checkpoint_refuses_in_one_line_and_moves_nothing(trained, tmp_path):
  gin, _ = trained
  model_dir = _copy(trained, tmp_path)
  for step in (4, 8):
    _damage("flipped", os.path.join(model_dir, f"checkpoint_{step}"))
  r = train_in_process(gin, model_dir, "TRAIN_STEPS=12")
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  errors = [x for x in r.stderr.splitlines() if x.startswith("t5forge: error:")]
  assert len(errors) == 1 and "every checkpoint is damaged" in errors[0], r.stderr[-2000:]
  assert "checkpoint_4: damaged:" in errors[0] and "checkpoint_8: damaged:" in errors[0]
  assert sorted(x for x in os.listdir(model_dir) if x.startswith("checkpoint")) == [
      "checkpoint_4", "checkpoint_8"]


@pytest.mark.parametrize("command", ["eval", "infer"])
def test_eval_and_infer_of_a_damaged_checkpoint_say_so_in_one_line(trained, tmp_path, command):
  model_dir = _copy(trained, tmp_path)
  ckpt8 = os.path.join(model_dir, "checkpoint_8")
  words = _damage("flipped", ckpt8)
  if command == "eval":
    args = ["--task", "bible_translate_en_es", "--num_examples", "2"]
  else:
    (tmp_path / "in.txt").write_text("In the beginning\n")
    args = ["--input", str(tmp_path / "in.txt")]
  r = cli(command, "--checkpoint", ckpt8, *args, "--output_dir", str(tmp_path / "out"))
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  errors = [x for x in r.stderr.splitlines() if x.startswith("t5forge: error:")]
  assert len(errors) == 1, r.stderr[-3000:]
  assert f"{ckpt8}: damaged:" in errors[0] and all(w in errors[0] for w in words), errors[0]


def test_eval_mode_all_skips_a_damaged_checkpoint_with_a_note(trained, tmp_path):
  model_dir = _copy(trained, tmp_path)
  _damage("flipped", os.path.join(model_dir, "checkpoint_4"))
  r = cli("eval", "--checkpoint", model_dir, "--mode", "all", "--task", "bible_translate_en_es",
          "--num_examples", "2", "--feature_lengths", "inputs=32,targets=4", "--batch_size", "2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "checkpoint_4: damaged:" in r.stdout and "skipped" in r.stdout, r.stdout
  assert "step 8: " in r.stdout and "(2 examples)" in r.stdout, r.stdout


def test_load_of_a_damaged_checkpoint_raises_and_a_model_dir_falls_back(trained, tmp_path,
                                                                         capsys):
  model_dir = _copy(trained, tmp_path)
  ckpt8 = os.path.join(model_dir, "checkpoint_8")
  _damage("truncated", ckpt8)
  with pytest.raises(UserError, match=r"checkpoint_8: damaged: params/.*\(truncated\)"):
    t5forge.load(ckpt8)
  capsys.readouterr()
  assert t5forge.load(model_dir).checkpoint.step == 4  # MODEL_DIR: the newest intact one, noted
  err = capsys.readouterr().err
  assert "note:" in err and "checkpoint_8: damaged:" in err and "checkpoint_4" in err


def test_a_deleted_manifest_is_damage_but_a_checkpoint_from_before_manifests_loads(
    trained, tmp_path, capsys):
  model_dir = _copy(trained, tmp_path)
  ckpt4, ckpt8 = (os.path.join(model_dir, f"checkpoint_{s}") for s in (4, 8))
  os.remove(os.path.join(ckpt8, manifest.MANIFEST))
  with pytest.raises(UserError, match=r"checkpoint_8: damaged: t5forge_manifest.json .*missing"):
    native.load(ckpt8)
  # As the previous version wrote it: no manifest, no record that there is one.
  os.remove(os.path.join(ckpt4, manifest.MANIFEST))
  config_file = os.path.join(ckpt4, "config", "metadata")
  with open(config_file) as f:
    item = json.load(f)
  del item[manifest.EXPECTED]
  with open(config_file, "w") as f:
    json.dump(item, f)
  capsys.readouterr()
  _, params, _ = native.load(ckpt4)
  assert params
  assert "are not verified" in capsys.readouterr().err


def test_convert_to_t5forge_writes_a_manifest_that_verifies(trained, tmp_path):
  _, model_dir = trained
  out = str(tmp_path / "converted")
  r = cli("convert", "--input", model_dir, "--output", out, "--to", "t5forge")
  assert r.returncode == 0, r.stderr[-3000:]
  assert manifest.verify(out) is None
  assert t5forge.load(out).params
  _flip(_largest(os.path.join(out, "params")))
  with pytest.raises(UserError, match="sha256 mismatch"):
    t5forge.load(out)


def test_a_checkpointer_closed_before_its_first_save_leaves_no_orbax_thread(tmp_path,
                                                                            monkeypatch):
  """Orbax cleans MODEL_DIR up in a thread from the moment its manager is made; a run that
  stops with an error before its first save (an adapter on another base) exited under that
  thread, which then printed `RuntimeError: cannot schedule new futures after shutdown`
  after the one-line error. close() waits for it: here the thread's file check is slowed
  down, and close() returns only after it ended."""
  from t5forge.train.checkpoint import Checkpointer
  from t5forge.train.settings import SaveCheckpointConfig
  (tmp_path / "model" / "checkpoint_3").mkdir(parents=True)  # something to check
  islink, done = os.path.islink, []

  def slow_islink(path):
    time.sleep(0.5)
    result = islink(path)
    done.append(path)
    return result

  monkeypatch.setattr(os.path, "islink", slow_islink)
  Checkpointer(str(tmp_path / "model"), SaveCheckpointConfig()).close()
  assert done, "close() returned while Orbax's clean-up thread was still running"
