"""The MODEL_DIR lock on a bucket (gs:// and s3://, real emulators on 127.0.0.1).

A bucket has no flock: the lock is the object MODEL_DIR/.lock, created only if absent,
renewed while its run lives and deleted at the end; one not renewed for the timeout is a
dead run's and is taken over with a note naming it.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from t5forge import storage
from t5forge.errors import UserError
from t5forge.train import run_lock
from train_helpers import ROOT

HOST = socket.gethostname()


def _record(url):
  return json.loads(storage.read_text(storage.join(url, ".lock")))


def test_a_second_holder_is_refused_in_one_line_naming_the_first(bucket_env):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  first = run_lock.BucketLock(url + "/", command="t5forge train")
  assert first.acquire() is None and first.held
  record = _record(url)
  assert record["host"] == HOST and record["pid"] == os.getpid()
  assert record["command"] == "t5forge train" and record["since"] and record["argv"]
  assert record["token"] == first.token
  with pytest.raises(UserError) as e:
    run_lock.BucketLock(url, command="t5forge train").acquire()
  msg = str(e.value)
  assert "\n" not in msg
  # The wording of the lock on disk, with the URL as MODEL_DIR.
  assert msg.startswith(f"MODEL_DIR {url} is in use by pid {os.getpid()} on host {HOST} since ")
  assert msg.endswith("(t5forge train); wait for it, or use another MODEL_DIR")
  first.release()
  first.release()  # idempotent
  assert not first.held
  assert not storage.exists(storage.join(url, ".lock"))
  again = run_lock.BucketLock(url)
  assert again.acquire() is None  # a clean end leaves nothing to take over
  again.release()


@pytest.mark.slow
def test_the_lock_is_renewed_while_held(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "2")
  url = storage.join(bucket, "run")
  with run_lock.BucketLock(url) as lock:
    lock_url = storage.join(url, ".lock")
    first = storage.info(lock_url)["mtime"]
    time.sleep(5)  # more than twice the timeout
    assert storage.info(lock_url)["mtime"] > first
    with pytest.raises(UserError, match=f"is in use by pid {os.getpid()}"):
      run_lock.BucketLock(url).acquire()
    assert lock.lost is None
  assert not storage.exists(lock_url)


def _acquire_once_stale(url, timeout=60):
  """-> (lock, note): polls acquire() until the holder's lock has gone stale (it refuses with
  "in use" until then); TimeoutError after `timeout` s."""
  deadline = time.monotonic() + timeout
  while True:
    lock = run_lock.BucketLock(url)
    try:
      return lock, lock.acquire()
    except UserError as e:
      if "in use" not in str(e) or time.monotonic() > deadline:
        raise
    time.sleep(0.2)


def test_a_stale_lock_is_taken_over_with_a_note_naming_its_holder(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  # A timeout no loaded machine outlasts while the lock is fresh, then 1.5 s for the
  # take-over (with 1.5 s throughout, a slow emulator made the fresh lock stale first).
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  url = storage.join(bucket, "run")
  storage.write_bytes(storage.join(url, ".lock"), json.dumps(
      {"host": "another-host", "pid": 4242, "since": "2024-01-01 00:00:00 UTC",
       "command": "t5forge train", "token": "theirs"}).encode())
  # Fresh: another host's run, alive as far as anyone here can tell (not waited for here).
  with pytest.raises(UserError, match="in use by pid 4242 on host another-host since "
                     r"2024-01-01 00:00:00 UTC \(t5forge train\); wait for it"):
    run_lock.BucketLock(url, wait_s=0).acquire()
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1.5")
  lock, note = _acquire_once_stale(url)
  assert note.startswith("note: took over the lock of pid 4242 on host another-host "
                         "(t5forge train since 2024-01-01 00:00:00 UTC), which has not renewed "
                         f"{url}/.lock for ")
  assert note.endswith(f" s ({run_lock.TIMEOUT_ENV}=1.5)")
  assert _record(url)["token"] == lock.token
  lock.release()


def test_a_killed_holder_on_this_host_is_taken_over_at_once(bucket_env, monkeypatch):
  # Its lock is fresh (600 s), but its pid is gone on this host: nothing to wait for.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  url = storage.join(bucket, "run")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import time; from t5forge.train import run_lock; "
       f"run_lock.BucketLock({url!r}).acquire(); print('held', flush=True); time.sleep(600)"],
      cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"in use by pid {holder.pid} on host {HOST}"):
      run_lock.BucketLock(url).acquire()
  finally:
    holder.kill()
    holder.wait()
  lock = run_lock.BucketLock(url, wait_s=0)
  note = lock.acquire()
  assert f"took over the lock of pid {holder.pid} on host {HOST}" in note
  assert note.endswith(", which is no longer running")
  lock.release()


def test_a_lock_taken_from_its_holder_is_left_to_the_new_one(bucket_env, monkeypatch):
  # A run that could not renew for the timeout (a network outage) has lost its lock: it
  # says so and does not delete the new holder's.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1")
  url = storage.join(bucket, "run")
  lock = run_lock.BucketLock(url)
  lock.acquire()
  theirs = json.dumps({"host": "another-host", "pid": 7, "token": "theirs"}).encode()
  storage.write_bytes(storage.join(url, ".lock"), theirs)
  deadline = time.time() + 10
  while lock.lost is None and time.time() < deadline:
    time.sleep(0.1)
  assert "taken over by pid 7 on host another-host" in lock.lost
  lock.release()
  assert storage.read_bytes(storage.join(url, ".lock")) == theirs


def test_two_runs_starting_together_one_holds(bucket_env):
  # The bucket's create-if-absent decides (the token read back, where a service ignores it).
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  locks = [run_lock.BucketLock(url) for _ in range(2)]
  results = [None, None]
  barrier = threading.Barrier(2)

  def take(i):
    barrier.wait()
    try:
      results[i] = locks[i].acquire() or "held"
    except UserError as e:
      results[i] = str(e)

  threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(r == "held" for r in results) == [False, True], results
  winner = locks[results.index("held")]
  assert _record(url)["token"] == winner.token
  assert "is in use by pid" in [r for r in results if r != "held"][0]
  for lk in locks:
    lk.release()
  assert not storage.exists(storage.join(url, ".lock"))


def test_a_rival_that_overwrote_the_new_lock_wins(bucket_env, monkeypatch):
  # Where a service ignores the create-if-absent precondition, a rival that
  # checked a moment before this run may overwrite its fresh lock object: the token read
  # back shows it, and this run refuses instead of both running.
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  rival = json.dumps({"host": "rival-host", "pid": 99, "since": "now", "command": "t5forge train",
                      "token": "rival"}).encode()
  real_write = storage.write_if

  def write_then_rival(path, data, *, version):
    out = real_write(path, data, version=version)
    if version is None:
      storage.write_bytes(path, rival)  # the rival's write lands just after this run's
    return out

  monkeypatch.setattr(run_lock.storage, "write_if", write_then_rival)
  lock = run_lock.BucketLock(url, wait_s=0)
  with pytest.raises(UserError, match="in use by pid 99 on host rival-host"):
    lock.acquire()
  assert not lock.held
  assert storage.read_bytes(storage.join(url, ".lock")) == rival


def test_bad_input_is_one_line(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  with pytest.raises(UserError, match=r"nope-no-bucket: the bucket does not exist"):
    run_lock.BucketLock(f"{emu.scheme}://nope-no-bucket/run").acquire()
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "soon")
  with pytest.raises(UserError, match=r"T5FORGE_BUCKET_LOCK_TIMEOUT_S='soon': expected a "
                     "number of seconds above 0"):
    run_lock.BucketLock(storage.join(bucket, "run"))


def test_lock_for_job_takes_the_bucket_lock(bucket_env):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  notes = []
  lock = run_lock.lock_for_job(url, log=notes.append)
  assert isinstance(lock, run_lock.BucketLock) and lock.held and notes == []
  with pytest.raises(UserError, match="is in use by pid"):
    run_lock.lock_for_job(url)
  lock.release()
