"""One training run per MODEL_DIR.

Two runs on one MODEL_DIR used to both exit 0 with every step twice in metrics.jsonl and
checkpoints from one model beside the other's config.gin. A run now holds a lock on
MODEL_DIR/.lock; a second run refuses with one line naming the holder, and the lock of a
process that died is taken over with a note.
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from t5forge.errors import UserError
from t5forge.train import run_lock
from train_helpers import (ROOT, dead_pid, error_line, host_devices, read_jsonl, run_train,
                           train_cmd, write_gin)

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

HOST = socket.gethostname()


def _write_record(model_dir, **record):
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, ".lock"), "w", encoding="utf-8") as f:
    json.dump({"host": HOST, "since": "2024-01-01 00:00:00", "command": "t5forge train",
               **record}, f)


# ------------------------------------------------------------------------ the lock, in-process


def test_a_second_holder_is_refused_with_who_holds_it(tmp_path):
  first = run_lock.RunLock(str(tmp_path), command="t5forge train")
  assert first.acquire() is None
  with pytest.raises(UserError) as e:
    run_lock.RunLock(str(tmp_path), command="t5forge train").acquire()
  msg = str(e.value)
  assert "\n" not in msg
  assert f"MODEL_DIR {tmp_path} is in use by pid {os.getpid()} on host {HOST} since " in msg
  assert "(t5forge train); wait for it, or use another MODEL_DIR" in msg
  first.release()
  # A clean release leaves nothing to take over: no note.
  again = run_lock.RunLock(str(tmp_path))
  assert again.acquire() is None
  again.release()


def test_the_lock_records_host_pid_time_and_command(tmp_path):
  with run_lock.RunLock(str(tmp_path), command="t5forge train"):
    with open(tmp_path / ".lock", encoding="utf-8") as f:
      record = json.load(f)
  assert record["host"] == HOST and record["pid"] == os.getpid()
  assert record["command"] == "t5forge train" and record["since"] and record["argv"]


def test_the_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path):
  pid = dead_pid()
  _write_record(str(tmp_path), pid=pid)
  lock = run_lock.RunLock(str(tmp_path))
  note = lock.acquire()
  assert note == f"note: took over the lock of pid {pid} on host {HOST}, which is no longer running"
  lock.release()


def test_a_killed_holder_releases_the_lock(tmp_path):
  # The kernel drops a flock when its process dies, whatever the pid file says.
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from t5forge.train import run_lock; "
       f"run_lock.RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); "
       "time.sleep(600)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"in use by pid {holder.pid} on host"):
      run_lock.RunLock(str(tmp_path)).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock = run_lock.RunLock(str(tmp_path))
  assert f"took over the lock of pid {holder.pid}" in lock.acquire()
  lock.release()


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
  # File systems where flock fails (some network / FUSE mounts): a live pid on this host
  # holds the lock, a dead one is taken over, another host's is respected.
  def no_flock(fd, op):
    raise OSError(37, "No locks available")  # ENOLCK
  monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  try:
    _write_record(str(tmp_path), pid=sleeper.pid)
    with pytest.raises(UserError, match=f"in use by pid {sleeper.pid} on host {HOST}"):
      run_lock.RunLock(str(tmp_path)).acquire()
  finally:
    sleeper.kill()
    sleeper.wait()
  lock = run_lock.RunLock(str(tmp_path))
  assert f"took over the lock of pid {sleeper.pid}" in lock.acquire()
  lock.release()
  _write_record(str(tmp_path), pid=dead_pid(), host="another-host")
  with pytest.raises(UserError, match="on host another-host"):
    run_lock.RunLock(str(tmp_path)).acquire()


# ---------------------------------------------------------------------------- t5forge train


def test_train_refuses_a_model_dir_in_use(tmp_path):
  model_dir = tmp_path / "model"
  gin = write_gin(tmp_path / "run.gin", steps=4, period=4)
  with run_lock.RunLock(str(model_dir), command="t5forge train"):
    msg = error_line(run_train(gin, model_dir))
  assert f"is in use by pid {os.getpid()} on host {HOST}" in msg
  assert "wait for it, or use another MODEL_DIR" in msg
  # Refused before writing anything into MODEL_DIR.
  assert sorted(os.listdir(model_dir)) == [".lock"]


def test_train_takes_over_the_lock_of_a_dead_run(tmp_path):
  model_dir = tmp_path / "model"
  pid = dead_pid()
  _write_record(str(model_dir), pid=pid)
  gin = write_gin(tmp_path / "run.gin", steps=2, period=2, stats_period=2)
  r = run_train(gin, model_dir)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"note: took over the lock of pid {pid} on host {HOST}, which is no longer running" \
      in r.stdout
  assert (model_dir / "checkpoint_2").exists()


def test_two_concurrent_runs_one_refused(tmp_path):
  model_dir = tmp_path / "model"
  gin = write_gin(tmp_path / "run.gin", steps=8, period=4, stats_period=2)
  procs = [subprocess.Popen(train_cmd(gin, model_dir), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
  codes = sorted(r.returncode for r in results)
  assert codes == [0, 2], [(r.returncode, r.stderr[-2000:]) for r in results]
  loser = next(r for r in results if r.returncode == 2)
  winner = next(r for r in results if r.returncode == 0)
  winner_pid = procs[results.index(winner)].pid
  assert f"in use by pid {winner_pid} on host {HOST}" in error_line(loser)
  steps = [row["step"] for row in read_jsonl(model_dir / "metrics.jsonl")
           if row["split"] == "train"]
  assert steps == [2, 4, 6, 8]


def test_a_refused_multi_process_job_fails_on_every_process(tmp_path):
  # Process 0 takes the job's lock; process 1 must learn of the refusal and fail too,
  # not wait in a collective for a process that has gone.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  model_dir = tmp_path / "model"
  gin = write_gin(tmp_path / "run.gin", steps=4, period=4)
  env = host_devices(1)
  with run_lock.RunLock(str(model_dir)):
    procs = [subprocess.Popen(
        train_cmd(gin, model_dir) + [f"--coordinator_address=127.0.0.1:{port}",
                                     "--process_count=2", f"--process_index={i}",
                                     "--heartbeat_timeout_seconds=10"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    results = []
    try:
      for p in procs:
        out, err = p.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
  for i, r in enumerate(results):
    assert f"in use by pid {os.getpid()} on host {HOST}" in error_line(r), i
  assert sorted(os.listdir(model_dir)) == [".lock"]
