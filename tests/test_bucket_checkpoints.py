"""Checkpoints in a bucket MODEL_DIR (`gs://` straight through Orbax, `s3://` staged and
uploaded), against the local emulators of `tests/buckets.py`: saved and restored bitwise,
damaged objects found by the manifest and skipped with the same note as on disk, a save
the emulator's outage cuts short committed nowhere, and every reader opening bucket
checkpoints (a MODEL_DIR, an HF directory) to the same logits as their local copies."""
import collections
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from t5forge import storage
from t5forge.convert import manifest, native
from t5forge.errors import UserError
from t5forge.data import vocab_io
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.nn import init_params
from t5forge.train.checkpoint import Checkpointer, initial_params
from t5forge.train.settings import RestoreCheckpointConfig, SaveCheckpointConfig
from train_helpers import ROOT

BUNDLED = os.path.join(ROOT, "t5forge", "data", "bundled")

State = collections.namedtuple("State", "params opt_state")


@pytest.fixture(autouse=True)
def _own_cache(cache):
  """s3:// staging and the local copies of bucket objects go to this test's own cache."""
  return cache


def _state(seed):
  rng = np.random.default_rng(seed)
  params = {"encoder": {"kernel": rng.standard_normal((64, 48), dtype=np.float32)},
            "embedding": rng.standard_normal((128, 16), dtype=np.float32)}
  opt = {"mu": rng.standard_normal((64, 48), dtype=np.float32),
         "count": np.asarray(seed, np.int32)}
  return State(jax.tree.map(jax.numpy.asarray, params), jax.tree.map(jax.numpy.asarray, opt))


def _abstract(state):
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), state)


def _save(ck, step, **kw):
  ck.save(step, _state(step), config_item={"model": {"name": "tiny"}},
          data_state={"pos": step}, **kw)


def _equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _run(url, steps=(2, 4), **config):
  ck = Checkpointer(url, SaveCheckpointConfig(**config))
  for step in steps:
    _save(ck, step)
  ck.close()
  if ck._staging:  # s3://: the local staging copy is gone once uploaded
    assert not os.path.exists(ck._staging)
  return url


@pytest.mark.slow
def test_save_and_restore_on_a_bucket_bitwise(bucket_env):
  emu, bucket = bucket_env
  url = _run(bucket + "/run")
  assert native.checkpoint_steps(url) == [2, 4]
  for step in (2, 4):
    names = storage.walk_files(native.step_dir(url, step))
    assert manifest.MANIFEST in names and any(n.startswith("params/") for n in names)
    assert manifest.verify(native.step_dir(url, step)) is None
  ck = Checkpointer(url, SaveCheckpointConfig())
  assert ck.latest_step() == 4
  notes = []
  step, (params, opt_state, data) = ck.restore_latest(_abstract(_state(0)), log=notes.append)
  ck.close()
  assert step == 4 and not notes
  assert _equal(params, _state(4).params) and _equal(opt_state, _state(4).opt_state)
  assert data["states"] == [{"pos": 4}]


@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)
@pytest.mark.slow
def test_a_save_stopped_between_our_manifest_and_orbaxs_marker_is_resumed(bucket_env):
  """On gs:// Orbax writes its commit marker after our manifest. A run killed between the
  two left a whole checkpoint that the next run's Orbax took for an unfinished save and
  deleted, and training started over without a word. It is committed (the manifest, last
  of ours, says every object is there), Orbax's marker is written for it, with a note."""
  from orbax.checkpoint.path import atomicity_types
  _, bucket = bucket_env
  url = _run(bucket + "/run")
  marker = storage.join(native.step_dir(url, 4), atomicity_types.COMMIT_SUCCESS_FILE)
  storage.remove(marker)  # the state a SIGKILL between the two writes leaves
  assert native.checkpoint_steps(url) == [2, 4]
  notes = []
  ck = Checkpointer(url, SaveCheckpointConfig(), log=notes.append)
  assert ck.latest_step() == 4 and storage.exists(marker)
  assert notes == [f"note: {url}/checkpoint_4 was whole but its save was stopped before "
                   "Orbax marked it committed; marked it"], notes
  step, (params, _, _) = ck.restore_latest(_abstract(_state(0)))
  _save(ck, 6)
  ck.close()
  assert step == 4 and _equal(params, _state(4).params)
  assert native.checkpoint_steps(url) == [2, 4, 6]
  # A step whose manifest was never written is no checkpoint, marker or not.
  storage.remove(storage.join(native.step_dir(url, 6), manifest.MANIFEST))
  assert native.checkpoint_steps(url) == [2, 4]


@pytest.mark.slow
def test_keep_deletes_old_checkpoints_in_the_bucket(bucket_env):
  _, bucket = bucket_env
  url = _run(bucket + "/run", steps=(1, 2, 3, 4), keep=2)
  assert native.checkpoint_steps(url) == [3, 4]
  assert storage.listdir(url) == ["checkpoint_3", "checkpoint_4"]


def _largest_array_object(step_url):
  files = storage.walk_files(step_url)
  name = max((n for n in files if n.startswith("params/")), key=lambda n: files[n]["size"])
  return storage.join(step_url, name), name


def _flip(url):
  data = bytearray(storage.read_bytes(url))
  mid = len(data) // 2
  data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
  storage.write_bytes(url, bytes(data))


@pytest.mark.parametrize("kind", ["flipped", "deleted"])
@pytest.mark.slow
def test_a_damaged_checkpoint_falls_back_to_the_previous_one_with_a_note(bucket_env, kind):
  emu, bucket = bucket_env
  url = _run(bucket + "/run")
  step4 = native.step_dir(url, 4)
  target, name = _largest_array_object(step4)
  if kind == "flipped":
    _flip(target)
  else:
    storage.remove(target)
  before = sorted(storage.walk_files(step4))
  with pytest.raises(manifest.CheckpointDamaged, match=name):
    manifest.verify(step4)
  ck = Checkpointer(url, SaveCheckpointConfig())
  notes = []
  step, (params, _, data) = ck.restore_latest(_abstract(_state(0)), log=notes.append)
  assert step == 2 and _equal(params, _state(2).params) and data["states"] == [{"pos": 2}]
  assert len(notes) == 1, notes
  word = "changed after it was saved" if kind == "flipped" else "is missing"
  assert f"{step4}: damaged: {name} {word}" in notes[0], notes[0]
  assert "(kept) and resumed from checkpoint_2" in notes[0]
  aside = [n for n in storage.listdir(url) if n.startswith("checkpoint_4.damaged-")]
  assert len(aside) == 1 and f"moved it to {aside[0]} (kept)" in notes[0]
  assert sorted(storage.walk_files(storage.join(url, aside[0]))) == before
  assert native.checkpoint_steps(url) == [2]
  if emu.scheme == "gs":  # out of the sight of Orbax, which would refuse to save 4 again
    assert ck._mngr.all_steps() == [2]
  _save(ck, 4)  # the step is free again for the resumed run
  ck.close()
  assert native.checkpoint_steps(url) == [2, 4] and manifest.verify(step4) is None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
  """A local MODEL_DIR with checkpoint_3 of a tiny random t5.1.1 model (a training run's
  layout: params, opt_state, config, data_iter, manifest)."""
  config = _tiny_config()
  params = init_params(config, jax.random.key(7))
  model_dir = str(tmp_path_factory.mktemp("tiny") / "run")
  ck = Checkpointer(model_dir, SaveCheckpointConfig())
  ck.save(3, State(params, {"count": jax.numpy.zeros((), jax.numpy.int32)}),
          config_item={"model": config.to_dict(), "vocabulary": vocab_io.to_spec(_vocab())})
  ck.close()
  return model_dir


def _vocab():
  return SentencePieceVocabulary(os.path.join(BUNDLED, "bible_en_es_8k.model"), extra_ids=100)


def _tiny_config():
  import t5forge
  return t5forge.presets.get("t5_1_1.tiny", vocab_size=_vocab().vocab_size)


def _tokens():
  rng = np.random.default_rng(0)
  return rng.integers(2, 120, (2, 7)), rng.integers(2, 120, (2, 5))


def _logits(path):
  import t5forge
  return t5forge.load(path).logits(*_tokens())


@pytest.mark.slow
def test_load_a_bucket_model_dir_and_its_checkpoint_equals_the_local_copy(bucket_env,
                                                                          tiny_model_dir):
  from t5forge import convert
  from t5forge.convert import paths
  _, bucket = bucket_env
  url = bucket + "/run"
  storage.copy_tree(tiny_model_dir, url)
  want = _logits(tiny_model_dir)
  resolved = paths.resolve(url + "/")
  assert resolved.path == native.step_dir(url, 3) and resolved.step == 3
  assert resolved.model_dir == url
  assert [r.path for r in paths.resolve_all(url)] == [native.step_dir(url, 3)]
  assert convert.detect_format(url) == convert.T5FORGE
  for path in (url, native.step_dir(url, 3)):
    model = __import__("t5forge").load(path)
    assert model.checkpoint.step == 3
    np.testing.assert_array_equal(model.logits(*_tokens()), want)
  loaded = convert.load_checkpoint(url)
  assert loaded.step == 3 and loaded.format == convert.T5FORGE
  assert convert.from_checkpoint(url).vocab_size == _vocab().vocab_size
  # Written by a Checkpointer on the bucket itself (on gs:// a manifest of object
  # checksums, read in place), the same.
  saved = bucket + "/saved"
  ck = Checkpointer(saved, SaveCheckpointConfig())
  ck.save(5, State(init_params(_tiny_config(), jax.random.key(7)),
                   {"count": jax.numpy.zeros((), jax.numpy.int32)}),
          config_item={"model": _tiny_config().to_dict()})
  ck.close()
  model = __import__("t5forge").load(saved)
  assert model.checkpoint.step == 5 and model.checkpoint.format == convert.T5FORGE
  np.testing.assert_array_equal(model.logits(*_tokens()), want)
  with pytest.raises(UserError, match="no such file or directory"):
    paths.resolve(bucket + "/nothing-here")


def test_initial_checkpoint_path_in_a_bucket(bucket_env, tiny_model_dir):
  _, bucket = bucket_env
  url = bucket + "/init/run"
  storage.copy_tree(tiny_model_dir, url)
  config = _tiny_config()
  params, step, scratch, notes = initial_params(
      RestoreCheckpointConfig(path=url), init_params(config, jax.random.key(0)),
      model_config=config)
  assert step == 3 and not scratch and not notes
  assert _equal(params, init_params(config, jax.random.key(7)))


@pytest.mark.slow  # a subprocess: this worker may have imported TensorFlow already
def test_a_bucket_checkpoint_is_read_without_tensorflow(bucket_env, tiny_model_dir):
  """etils' epath (Orbax's paths) sends gs:// and s3:// through TensorFlow's file system
  whenever TensorFlow is installed (the [tf] extra): that client ignores the emulator,
  our time-outs and retries. t5forge keeps Orbax on fsspec, and TensorFlow unloaded."""
  _, bucket = bucket_env
  url = bucket + "/init/run"
  storage.copy_tree(tiny_model_dir, url)
  code = ("import sys, t5forge; m = t5forge.load(sys.argv[1]); "
          "print(m.config.emb_dim, 'tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-1] == "False", out.stdout


def test_load_an_hf_directory_in_a_bucket_equals_the_local_copy(bucket_env, hf_dirs):
  from t5forge import convert
  _, bucket = bucket_env
  local = hf_dirs("t5_1_0")
  url = bucket + "/hf/t5-tiny"
  storage.copy_tree(local, url)
  assert convert.detect_format(url) == convert.HF
  np.testing.assert_array_equal(_logits(url), _logits(local))
  loaded = convert.load_checkpoint(url)
  assert loaded.format == convert.HF


@pytest.mark.slow  # the clients' own retries run out first (gcsfs: ~35 s)
def test_an_outage_during_a_save_commits_nothing_and_a_resume_reads_the_previous(
    private_bucket_env, monkeypatch):
  emu, bucket = private_bucket_env
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "1")
  monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
  url = _run(bucket + "/run", steps=(2,))
  ck = Checkpointer(url, SaveCheckpointConfig(async_save=False))
  # GCS: the emulator killed (its data stays on disk). moto keeps its buckets in memory
  # only, and one stopped (SIGSTOP) leaves each request to run through minutes of client
  # read timeouts; so for S3 the client is pointed at a closed port: connections refused,
  # as by a killed emulator, while the bucket lives on.
  if emu.scheme == "gs":
    emu.stop()
  else:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
  try:
    with pytest.raises(storage.StorageError) as e:
      _save(ck, 4)
  finally:
    if emu.scheme == "gs":
      emu.start()
    else:
      monkeypatch.setenv("AWS_ENDPOINT_URL", emu.endpoint)
  line = str(e.value)
  assert "\n" not in line and f"{native.step_dir(url, 4)}" in line, line
  # (the failed Checkpointer is dropped, as the run that held it exits)
  assert native.checkpoint_steps(url) == [2]  # nothing of step 4 committed
  assert not storage.exists(storage.join(native.step_dir(url, 4), manifest.MANIFEST))
  resumed = Checkpointer(url, SaveCheckpointConfig())
  step, (params, _, _) = resumed.restore_latest(_abstract(_state(0)))
  assert step == 2 and _equal(params, _state(2).params)
  _save(resumed, 4)
  resumed.close()
  assert native.checkpoint_steps(url) == [2, 4] and manifest.verify(native.step_dir(url, 4)) is None


def test_a_t5x_checkpoint_in_a_bucket_reads_as_the_local_file(bucket_env):
  from conftest import T5X_FIXTURE
  from t5forge import convert
  _, bucket = bucket_env
  url = bucket + "/t5x/" + os.path.basename(T5X_FIXTURE)
  storage.upload(T5X_FIXTURE, url)
  assert convert.detect_format(url) == convert.T5X
  remote, local = convert.load_checkpoint(url), convert.load_checkpoint(T5X_FIXTURE)
  assert remote.format == convert.T5X and remote.step == local.step
  assert _equal(remote.params, local.params)
