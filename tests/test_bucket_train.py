"""Training runs with MODEL_DIR on a bucket (gs:// and s3://, real emulators on 127.0.0.1).

`t5forge train --gin.MODEL_DIR="s3://runs/a"` used to train into a local folder
`./s3:/runs/a` and exit 0. A bucket MODEL_DIR now stays a URL: its bucket is checked,
config.gin and model-info.txt are single objects, the files a run appends to
(metrics.jsonl, TensorBoard events, batch fingerprints) are written in a local working copy
and uploaded at each checkpoint and at the end, and the lock is an object.
"""
import json
import os
import socket
import subprocess
import threading
import time

import jax
import numpy as np
import pytest

from t5forge import convert, storage
from t5forge.convert import manifest, native
from t5forge.errors import UserError
from t5forge.train import loop, run_lock
from t5forge.train import metrics as metrics_lib
from train_helpers import (ROOT, cli, error_line, final_params, fingerprints, host_devices,
                           train_cmd, train_in_process, wait_all, write_gin)


def _lines(url):
  return [json.loads(line) for line in storage.read_text(url).splitlines() if line.strip()]


# ------------------------------------------------------------------ in-process, fast


def test_a_bucket_model_dir_stays_a_url(bucket_env, tmp_path, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.chdir(tmp_path)
  assert loop._prepare_model_dir(bucket + "//runs/a/") == storage.join(bucket, "runs", "a")
  assert os.listdir(tmp_path) == []  # no local ./gs:/ or ./s3:/ folder
  assert storage.walk_files(bucket) == {}  # the write probe was deleted
  with pytest.raises(UserError) as e:
    loop._prepare_model_dir(f"{emu.scheme}://no-such-bucket-here/run")
  assert str(e.value) == (f"{emu.scheme}://no-such-bucket-here: the bucket does not exist; "
                          f"create it or fix the name in {emu.scheme}://no-such-bucket-here/run")


def test_appended_files_reach_the_bucket_at_sync_and_continue_on_resume(bucket_env, cache):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  mirror = storage.AppendMirror(url, name="process-0")
  assert mirror.root.startswith(str(cache))  # the working copy honours T5FORGE_CACHE
  writer = metrics_lib.MetricWriter(url, mirror=mirror)
  writer.write_scalars(1, {"loss": 2.0}, subdir="train")
  assert not storage.exists(storage.join(url, "metrics.jsonl"))  # nothing sent before a sync
  mirror.sync()
  assert _lines(storage.join(url, "metrics.jsonl")) == [{"step": 1, "split": "train",
                                                        "loss": 2.0}]
  events = [n for n in storage.walk_files(url) if n.startswith("train/events.out.tfevents.")]
  assert len(events) == 1
  version = storage.info(storage.join(url, "metrics.jsonl"))["version"]
  mirror.sync()  # unchanged files are not sent again
  assert storage.info(storage.join(url, "metrics.jsonl"))["version"] == version
  writer.write_scalars(2, {"loss": float("nan")}, subdir="train")
  writer.close()
  mirror.close()
  assert not os.path.exists(mirror.root)
  assert [r["step"] for r in _lines(storage.join(url, "metrics.jsonl"))] == [1, 2]
  # A resumed run continues the bucket's file; a killed run's unsent lines are dropped.
  with open(os.path.join(storage.AppendMirror(url, name="process-0").root, "stale"), "w") as f:
    f.write("left by a killed run")
  again = storage.AppendMirror(url, name="process-0")
  assert os.listdir(again.root) == []
  writer = metrics_lib.MetricWriter(url, mirror=again)
  writer.write_scalars(3, {"loss": 1.0}, subdir="training_eval/task")
  writer.close()
  again.close()
  rows = _lines(storage.join(url, "metrics.jsonl"))
  assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train"),
                                                     (3, "training_eval/task")]
  assert rows[1]["loss"] == "nan"
  assert any(n.startswith("training_eval/task/events.out.tfevents.")
             for n in storage.walk_files(url))


def test_a_local_model_dir_is_written_in_place(tmp_path):
  mirror = storage.AppendMirror(str(tmp_path))
  assert mirror.path("metrics.jsonl", resume=True) == os.path.join(str(tmp_path), "metrics.jsonl")
  writer = metrics_lib.MetricWriter(str(tmp_path), mirror=mirror)
  writer.write_scalars(1, {"loss": 2.0})
  writer.close()
  mirror.close()
  assert os.path.isfile(tmp_path / "metrics.jsonl") and os.path.isdir(tmp_path / "train")


# ------------------------------------------------------- t5forge train, end to end (slow)

HOST = socket.gethostname()


def _env(tmp_path, devices=1, **extra):
  """A subprocess's environment: this process's (pointed at the emulator by bucket_env),
  its own T5FORGE_CACHE, t5forge importable from any working directory."""
  return {**host_devices(devices), "T5FORGE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT,
          **extra}


def _train(tmp_path, gin, model_dir, *bindings, env=None, extra=()):
  # cwd is tmp_path: the old bug's local ./gs:/ or ./s3:/ folder would show there.
  return subprocess.run(train_cmd(gin, model_dir, *bindings) + list(extra), cwd=tmp_path,
                        env=env or _env(tmp_path), capture_output=True, text=True, timeout=600)


def _committed(url, step) -> bool:
  """checkpoint_<step> of a bucket MODEL_DIR is whole: its manifest is written last."""
  return storage.exists(storage.join(url, f"checkpoint_{step}", manifest.MANIFEST))


def _bucket_fingerprints(url, process=0):
  return {r["step"]: r["crc"]
          for r in _lines(storage.join(url, f"batch_fingerprints.{process}.jsonl"))}


def _bucket_params(url):
  """(path, numpy params) of the latest checkpoint of a bucket MODEL_DIR, read as every
  reader does (`convert.readable`: gs:// in place, s3:// through a local copy)."""
  path = native.latest_checkpoint(url)
  _, params, _ = native.load(convert.readable(path))
  return path, jax.tree.map(np.asarray, params)


def _wait_for(cond, timeout=300, every=0.2):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if cond():
      return True
    time.sleep(every)
  return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """20 steps into a local MODEL_DIR without interruption: the reference."""
  d = tmp_path_factory.mktemp("uninterrupted")
  gin = write_gin(d / "run.gin", steps=20, period=5, eval_period=10, stats_period=5)
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  return gin, d / "model"


@pytest.mark.slow
def test_sigkill_mid_run_resumes_bitwise_on_a_bucket(bucket_env, uninterrupted, tmp_path, cache):
  emu, bucket = bucket_env
  gin, ref_dir = uninterrupted
  url = storage.join(bucket, "runs", "a")
  proc = subprocess.Popen(train_cmd(gin, url), cwd=tmp_path, env=_env(tmp_path),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    caught = _wait_for(lambda: proc.poll() is not None or _committed(url, 5), every=0.1)
    assert caught and proc.poll() is None, (proc.poll(), proc.stderr.read()[-3000:]
                                            if proc.poll() is not None else "")
    proc.kill()
  finally:
    proc.kill()
    proc.wait()
  assert not _committed(url, 20)
  assert storage.exists(storage.join(url, ".lock"))  # left by the killed run
  # Restarted at once on the same host (as Kubernetes or a VM's start-up script would): the
  # lock is fresh, but its pid is visibly gone, so it is taken over without waiting for it
  # to go stale (600 s here) and without --lock_wait_s.
  r = _train(tmp_path, gin, url, env=_env(tmp_path, T5FORGE_BUCKET_LOCK_TIMEOUT_S="600"))
  assert r.returncode == 0, r.stderr[-3000:]
  assert (f"note: took over the lock of pid {proc.pid} on host {HOST} (t5forge train since "
          in r.stdout + r.stderr)
  assert "which is no longer running" in r.stdout + r.stderr
  assert "waiting for the MODEL_DIR lock" not in r.stdout + r.stderr
  assert f"resumed from {url}/checkpoint_" in r.stdout + r.stderr
  assert not any(n.endswith(":") for n in os.listdir(tmp_path))  # no ./gs: or ./s3: folder
  names = storage.walk_files(url)
  for name in ("config.gin", "model-info.txt", "metrics.jsonl", "batch_fingerprints.0.jsonl",
               f"checkpoint_20/{manifest.MANIFEST}"):
    assert name in names, name
  assert ".lock" not in names  # released at the end
  assert any(n.startswith("train/events.out.tfevents.") for n in names)
  assert any(n.startswith("training_eval/bible_translate_en_es/events.out.") for n in names)
  assert "MODEL_DIR" in storage.read_text(storage.join(url, "config.gin"))
  steps = sorted({row["step"] for row in _lines(storage.join(url, "metrics.jsonl"))
                  if row["split"] == "train"})
  assert steps == [5, 10, 15, 20]
  path, params = _bucket_params(url)
  ref_path, ref = final_params(ref_dir)
  assert path.endswith("checkpoint_20") and ref_path.endswith("checkpoint_20")
  jax.tree.map(np.testing.assert_array_equal, params, ref)
  assert _bucket_fingerprints(url) == fingerprints(ref_dir)


@pytest.mark.slow
@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)  # the lock's storage: test_bucket_lock
def test_two_runs_on_one_bucket_model_dir_and_a_killed_runs_lock(bucket_env, tmp_path,
                                                                monkeypatch):
  emu, bucket = bucket_env
  url = storage.join(bucket, "runs", "b")
  gin = write_gin(tmp_path / "run.gin", steps=4, period=4, stats_period=2)
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "10")  # here and in the runs
  env = _env(tmp_path)
  first = subprocess.Popen(train_cmd(gin, url, "TRAIN_STEPS=100000", "utils.SaveCheckpointConfig."
                                     "period=100000"), cwd=tmp_path, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    assert _wait_for(lambda: first.poll() is not None
                     or storage.exists(storage.join(url, "model-info.txt")))
    assert first.poll() is None, first.stderr.read()[-3000:]
    second = _train(tmp_path, gin, url, env=env)
    msg = error_line(second)
    assert f"MODEL_DIR {url} is in use by pid {first.pid} on host {HOST} since " in msg
    assert msg.endswith("(t5forge train); wait for it, or use another MODEL_DIR")
  finally:
    first.kill()
    first.wait()
  # Killed: its lock is still fresh, but its pid is gone on this host: taken over at once.
  lock_url = storage.join(url, ".lock")
  assert storage.exists(lock_url)
  third = _train(tmp_path, gin, url, env=env)
  assert third.returncode == 0, third.stderr[-3000:]
  assert (f"note: took over the lock of pid {first.pid} on host {HOST} (t5forge train since "
          in third.stdout + third.stderr)
  assert "training stopped at step 4" in third.stdout
  assert not storage.exists(lock_url)


def _until_committed(proc, url, step):
  """Waits (with a deadline) until checkpoint_<step> of the running `proc` is committed."""
  caught = _wait_for(lambda: proc.poll() is not None or _committed(url, step), every=0.1)
  assert caught and proc.poll() is None, (proc.poll(), proc.stderr.read()[-3000:]
                                          if proc.poll() is not None else "")


@pytest.mark.slow
def test_a_run_that_lost_its_lock_stops_before_its_next_save(bucket_env, tmp_path):
  # Another run took the lock (a run that judged this one dead, or a user who deleted the
  # lock and started again): this run must not write one more checkpoint beside it.
  emu, bucket = bucket_env
  url = storage.join(bucket, "runs", "lost")
  gin = write_gin(tmp_path / "run.gin", steps=100000, period=2, stats_period=2)
  proc = subprocess.Popen(train_cmd(gin, url), cwd=tmp_path, env=_env(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _until_committed(proc, url, 2)
    theirs = json.dumps({"host": "rival-host", "pid": 4242, "since": "2024-01-01 00:00:00 UTC",
                         "command": "t5forge train", "token": "theirs"}).encode()
    storage.write_bytes(storage.join(url, ".lock"), theirs)
    out, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == run_lock.LockLost.exit_code == 3, (proc.returncode, err[-3000:])
  lines = [line for line in err.splitlines() if line.startswith("t5forge: error:")]
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  line = lines[0]
  assert (f"t5forge: error: lost the MODEL_DIR lock {url}/.lock to pid 4242 on host rival-host "
          "(t5forge train since 2024-01-01 00:00:00 UTC)") in line
  stopped = int(line.split("stopped before saving checkpoint_")[1].split()[0].rstrip(";,"))
  steps = native.checkpoint_steps(url)
  assert steps and max(steps) < stopped, (steps, line)
  assert max(native.bucket_steps(url)) < stopped  # not even part of a later one
  assert f"checkpoint_{max(steps)} is the last committed checkpoint" in line
  manifest.verify(native.step_dir(url, max(steps)))  # intact
  assert storage.read_bytes(storage.join(url, ".lock")) == theirs  # left to its holder
  # Nothing after the loss: the metrics stop at the last checkpoint's.
  train_steps = [r["step"] for r in _lines(storage.join(url, "metrics.jsonl"))
                 if r["split"] == "train"]
  assert train_steps and max(train_steps) <= max(steps) < stopped


@pytest.mark.slow
@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)  # the lock's storage: test_bucket_lock*
def test_a_restart_on_another_host_waits_for_the_lock_then_resumes(bucket_env, tmp_path):
  # A run killed on one host, restarted on another (a rescheduled pod): its pid cannot be
  # seen from there, so the new run waits until the lock goes stale, then resumes.
  emu, bucket = bucket_env
  url = storage.join(bucket, "runs", "moved")
  lock_url = storage.join(url, ".lock")
  gin = write_gin(tmp_path / "run.gin", steps=8, period=4, stats_period=4)
  timeout = {run_lock.TIMEOUT_ENV: "4"}
  proc = subprocess.Popen(train_cmd(gin, url), cwd=tmp_path,
                          env=_env(tmp_path, T5FORGE_HOSTNAME="node-a", **timeout),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _until_committed(proc, url, 4)
  finally:
    proc.kill()
    proc.wait()
  record = storage.read_bytes(lock_url)
  assert json.loads(record)["host"] == "node-a"
  restart = subprocess.Popen(train_cmd(gin, url), cwd=tmp_path,
                             env=_env(tmp_path, T5FORGE_HOSTNAME="node-b", **timeout),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(restart.stdout), daemon=True)
  reader.start()
  try:
    # node-a's lock is kept fresh, as a run still alive there would, until the restart
    # says it waits (its start-up may take longer than the 4 s timeout on a loaded machine);
    # then it goes stale and is taken over.
    deadline = time.monotonic() + 300
    while restart.poll() is None and not any("waiting for the MODEL_DIR lock" in line
                                             for line in lines):
      assert time.monotonic() < deadline, "".join(lines)[-3000:]
      storage.write_bytes(lock_url, record)
      time.sleep(0.5)
    restart.wait(timeout=300)
  finally:
    restart.kill()
    restart.wait()
  reader.join(timeout=30)
  out = "".join(lines)
  assert restart.returncode == 0, out[-3000:]
  assert (f"waiting for the MODEL_DIR lock {url}/.lock: held by pid {proc.pid} on host node-a"
          in out)
  assert f"note: took over the lock of pid {proc.pid} on host node-a" in out
  assert out.index("waiting for the MODEL_DIR lock") < out.index("note: took over the lock")
  assert f"resumed from {url}/checkpoint_" in out
  assert "training stopped at step 8" in out
  assert not storage.exists(lock_url)


@pytest.mark.slow
@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)
def test_two_processes_into_one_bucket_model_dir_agree_with_one(bucket_env, tmp_path, cache):
  emu, bucket = bucket_env
  url = storage.join(bucket, "runs", "two")
  gin = write_gin(tmp_path / "run.gin", steps=4, period=2)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(
      train_cmd(gin, url) + [f"--coordinator_address=127.0.0.1:{port}", "--process_count=2",
                             f"--process_index={i}", "--heartbeat_timeout_seconds=10"],
      cwd=tmp_path, env=_env(tmp_path, devices=2), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = wait_all(procs)
  assert "training stopped at step 4" in outs[0]
  fp = [_lines(storage.join(url, f"batch_fingerprints.{i}.jsonl")) for i in (0, 1)]
  assert fp[0] == fp[1] and len(fp[0]) == 4  # both processes read the same global batches
  assert not storage.exists(storage.join(url, ".lock"))
  one = _train(tmp_path, gin, tmp_path / "one", env=_env(tmp_path, devices=4))
  assert one.returncode == 0, one.stderr[-3000:]

  # As tests/test_multihost.py: sums in another order, Adafactor's ~0-gradient columns.
  def close(a, b):
    off = ~np.isclose(a, b, rtol=1e-4, atol=1e-5)
    assert off.mean() < 1e-3 and np.abs(a - b).max() < 0.05, (off.mean(), np.abs(a - b).max())

  _, two = _bucket_params(url)
  _, ref = final_params(tmp_path / "one")
  jax.tree.map(close, two, ref)


def test_train_into_a_missing_bucket_is_one_line(bucket_env, tmp_path):
  emu, bucket = bucket_env
  gin = write_gin(tmp_path / "run.gin", steps=2, period=2)
  url = f"{emu.scheme}://no-such-bucket-here/runs/a"
  msg = error_line(cli(*train_cmd(gin, url)[3:], cwd=tmp_path))
  assert msg == (f"t5forge: error: {emu.scheme}://no-such-bucket-here: the bucket does not "
                 f"exist; create it or fix the name in {url}")
  assert os.listdir(tmp_path) == ["run.gin"]  # nothing written locally either
