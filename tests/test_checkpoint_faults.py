"""Damage is damage: a checkpoint is set aside only when its damage is verified. A read
that fails on the network, a time-out or memory is retried, then stops the run in one
line with exit status 75 (EX_TEMPFAIL) and nothing set aside or deleted; a rerun once the
cause is gone restores the newest checkpoint."""
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from t5forge import storage
from t5forge.cli import main as cli_main
from t5forge.convert import manifest, native
from t5forge.errors import Unavailable
from t5forge.train import checkpoint
from t5forge.train.checkpoint import Checkpointer
from t5forge.train.settings import SaveCheckpointConfig
from test_bucket_checkpoints import _abstract, _equal, _run, _state


@pytest.fixture(autouse=True)
def _own_cache(cache):
  """s3:// staging and the local copies of bucket objects go to this test's own cache."""
  return cache


def _oom():
  # What XLA raises when a device runs out of memory (the status code opens the message).
  return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                    "allocate 4294967296 bytes.")


# Each kind of error that may pass, as the layer under Orbax raises it.
PASSING = {
    "connection reset": lambda: ConnectionResetError(104, "Connection reset by peer"),
    "device out of memory": _oom,
    "TensorStore deadline": lambda: ValueError(
        "DEADLINE_EXCEEDED: Error reading \"params/ocdbt.process_0/d/1f2e\": timed out"),
    "read time-out": lambda: TimeoutError("The read operation timed out"),
}


def _failing_restore(monkeypatch, make_error, times):
  """Orbax's restore raises `make_error()` on its first `times` calls; -> the call count."""
  calls = []
  real = ocp.CheckpointManager.restore

  def restore(self, *a, **kw):
    calls.append(1)
    if len(calls) <= times:
      raise make_error()
    return real(self, *a, **kw)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  return calls


def _listing(model_dir):
  return sorted(os.listdir(model_dir))


@pytest.mark.parametrize("kind", sorted(PASSING))
def test_an_error_that_may_pass_stops_the_run_and_sets_nothing_aside(tmp_path, monkeypatch,
                                                                    kind):
  model_dir = _run(str(tmp_path / "run"))
  before = _listing(model_dir)
  monkeypatch.setattr(checkpoint, "RESTORE_TRIES", 2)
  calls = _failing_restore(monkeypatch, PASSING[kind], times=99)
  notes = []
  ck = Checkpointer(model_dir, SaveCheckpointConfig())
  with pytest.raises(manifest.CheckpointUnavailable) as info:
    ck.restore_latest(_abstract(_state(0)), log=notes.append)
  ck.close()
  assert len(calls) == 2  # retried once, then stopped: not the older checkpoint
  message = str(info.value)
  assert "\n" not in message and info.value.exit_code == 75
  assert message.startswith(f"{model_dir}/checkpoint_4: could not be read (")
  assert "after 2 tries" in message and "nothing was set aside" in message
  assert notes == [f"note: reading {model_dir}/checkpoint_4 failed "
                   f"({type(PASSING[kind]()).__name__}); trying again in 1 s"]
  assert _listing(model_dir) == before  # nothing renamed aside
  assert native.checkpoint_steps(model_dir) == [2, 4]


def test_a_passing_error_is_retried_and_the_newest_checkpoint_restored(tmp_path, monkeypatch):
  model_dir = _run(str(tmp_path / "run"))
  calls = _failing_restore(monkeypatch, _oom, times=1)
  notes = []
  ck = Checkpointer(model_dir, SaveCheckpointConfig())
  step, (params, opt_state, _) = ck.restore_latest(_abstract(_state(0)), log=notes.append)
  ck.close()
  assert step == 4 and len(calls) == 2 and len(notes) == 1, notes
  assert _equal(params, _state(4).params) and _equal(opt_state, _state(4).opt_state)


def test_a_verified_checkpoint_orbax_cannot_read_is_not_called_damaged(tmp_path, monkeypatch):
  """Its files are the committed bytes (the manifest says so): setting it aside would
  throw away a good checkpoint for a fault elsewhere (a library, a mismatch of versions)."""
  model_dir = _run(str(tmp_path / "run"))
  before = _listing(model_dir)
  calls = _failing_restore(monkeypatch, lambda: KeyError("opt_state.mu"), times=99)
  ck = Checkpointer(model_dir, SaveCheckpointConfig())
  with pytest.raises(manifest.CheckpointUnavailable, match="its files match its manifest, so "
                     "it is not damaged") as info:
    ck.restore_latest(_abstract(_state(0)))
  ck.close()
  assert len(calls) == 1 and "after 1 try" in str(info.value)  # not a passing error: no retry
  assert _listing(model_dir) == before


def test_damage_is_still_set_aside(tmp_path):
  """The control: a truncated file is verified damage, set aside as before."""
  model_dir = _run(str(tmp_path / "run"))
  ckpt = os.path.join(model_dir, "checkpoint_4")
  path = max((os.path.join(r, f) for r, _, names in os.walk(os.path.join(ckpt, "params"))
              for f in names), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  notes = []
  ck = Checkpointer(model_dir, SaveCheckpointConfig())
  step, _ = ck.restore_latest(_abstract(_state(0)), log=notes.append)
  ck.close()
  assert step == 2 and len(notes) == 1 and "truncated" in notes[0], notes
  assert any(name.startswith("checkpoint_4.damaged-") for name in _listing(model_dir))


def test_the_cli_exits_75_in_one_line_on_an_unavailable_error(monkeypatch, capsys):
  """Exit status 75 (EX_TEMPFAIL) tells a supervisor the same command may be rerun as it
  is; 2 stays for input the user must fix."""
  def main(argv):
    raise manifest.CheckpointUnavailable("gs://b/run/checkpoint_4", _oom(), verified=True,
                                         tries=3)

  import t5forge.cli.eval
  monkeypatch.setattr(t5forge.cli.eval, "main", main)
  with pytest.raises(SystemExit) as info:
    cli_main.main(["eval", "--gin_file=x.gin"])
  err = capsys.readouterr().err.strip().splitlines()
  assert info.value.code == 75 and len(err) == 1, err
  assert err[0].startswith("t5forge: error: gs://b/run/checkpoint_4: could not be read "
                           "(JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory")
  assert issubclass(manifest.CheckpointUnavailable, Unavailable)
  assert issubclass(storage.StorageUnavailable, Unavailable)


@pytest.mark.slow
def test_a_paused_bucket_during_restore_stops_in_one_line_and_a_rerun_restores(
    private_bucket_env, monkeypatch):
  """The bucket stops answering (the emulator SIGSTOPped) as a resume starts reading the
  newest checkpoint: one line (exit status 75) within the storage time-outs, nothing
  copied aside or deleted; once it answers again the newest checkpoint is restored
  bitwise. (Before, a failure there could be taken for damage and the checkpoint set
  aside.)"""
  emu, bucket = private_bucket_env
  monkeypatch.setenv("T5FORGE_STORAGE_TIMEOUT_S", "2")
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "2")
  storage.reset_clients()
  url = _run(bucket + "/run")
  before = storage.walk_files(url)
  ck = Checkpointer(url, SaveCheckpointConfig())
  notes = []
  start = time.monotonic()
  emu.pause()
  try:
    with pytest.raises(Unavailable) as info:
      ck.restore_latest(_abstract(_state(0)), log=notes.append)
  finally:
    emu.resume()
  took = time.monotonic() - start
  message = str(info.value)
  assert "\n" not in message and info.value.exit_code == 75
  assert message.startswith(url) and "failed after 2 tries" in message, message
  assert not notes, notes  # no "damaged", no older checkpoint taken
  assert took < 60, took  # bounded by the storage time-outs, not a hang
  storage.reset_clients()
  assert storage.walk_files(url) == before  # nothing copied aside, nothing deleted
  step, (params, _, _) = ck.restore_latest(_abstract(_state(0)))
  ck.close()
  assert step == 4 and _equal(params, _state(4).params)
  assert np.asarray(params["embedding"]).shape == (128, 16)
