"""Faults around the bucket MODEL_DIR lock (gs:// and s3://, real emulators on 127.0.0.1).

Each fault is injected where it happens in the field: at `storage.clients.call`, the one place
every bucket request of the storage layer goes through (a rival's write landing between a run's look and
its write, a reply that times out after the object was written), or in the lock object
itself. None of these tests trains: the runs that stop or resume are in
tests/test_bucket_lock_runs.py.
"""
import json
import os
import re
import socket
import time

import pytest

from t5forge import storage
from t5forge.storage import clients
from t5forge.errors import UserError
from t5forge.train import run_lock
from train_helpers import dead_pid

HOST = socket.gethostname()


def _lock_url(url):
  return storage.join(url, run_lock.LOCK_NAME)


def _put_record(url, **record):
  data = json.dumps({"since": "2024-01-01 00:00:00 UTC", "command": "t5forge train",
                     **record}).encode()
  storage.write_bytes(_lock_url(url), data)
  return data


def _wait_for(cond, timeout=30, what="condition"):
  deadline = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > deadline:
      raise TimeoutError(f"timed out waiting for {what} ({timeout} s)")
    time.sleep(0.05)


def _intercept(monkeypatch, target, op, fault):
  """Wraps `storage.clients.call` for the requests of kind `op` ('write', 'delete', ...) on
  the object `target`: `fault(fn)` runs in place of the request `fn` the first time one is
  made (it may call `fn`, do something else first, raise); later ones and the fault's own
  requests pass through. -> a list that holds True once the fault ran."""
  real = clients.call
  state = {"inside": False}
  ran = []

  def call(url, what, fn):
    if ran or state["inside"] or url != target or what != op:
      return real(url, what, fn)
    state["inside"] = True
    ran.append(True)

    def faulty():
      try:
        return fault(fn)
      finally:
        state["inside"] = False

    return real(url, what, faulty)

  monkeypatch.setattr(clients, "call", call)
  return ran


# ------------------------------------------------------------ conditional renewal, deletion


def test_a_renewal_against_a_changed_object_is_lost_not_an_overwrite(bucket_env, monkeypatch):
  # A rival's write lands between this run's last look at the lock and its renewal: the
  # renewal is made on the version the run wrote, so it fails, and the run knows it lost.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1")  # a renewal every 0.25 s
  url = storage.join(bucket, "run")
  lock = run_lock.BucketLock(url)
  lock.acquire()
  theirs = json.dumps({"host": "another-host", "pid": 7, "token": "theirs"}).encode()

  def rival_first(fn):
    storage.write_bytes(_lock_url(url), theirs)
    return fn()

  ran = _intercept(monkeypatch, _lock_url(url), "write", rival_first)
  try:
    _wait_for(lambda: lock.lost is not None, timeout=20, what="the lock to be lost")
  finally:
    lock.release()
  assert ran
  assert "taken over by pid 7 on host another-host" in lock.lost
  assert storage.read_bytes(_lock_url(url)) == theirs  # neither renewed over nor deleted


def test_a_stale_lock_is_deleted_only_at_the_version_judged_stale(bucket_env, monkeypatch):
  # Two runs find the same stale lock; the other one deletes it and takes the lock first.
  # This run's delete must not remove the new holder's lock: it refuses instead.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1")
  url = storage.join(bucket, "run")
  _put_record(url, host="gone-host", pid=4242, token="old")
  _wait_for(lambda: time.time() - storage.info(_lock_url(url))["mtime"] > 1.5,
            what="the lock to go stale")
  rival = run_lock.BucketLock(url)

  def rival_takes_it_first(fn):
    rival.acquire()
    return fn()

  ran = _intercept(monkeypatch, _lock_url(url), "delete", rival_takes_it_first)
  mine = run_lock.BucketLock(url)
  try:
    with pytest.raises(UserError, match=f"in use by pid {os.getpid()} on host {HOST}"):
      mine.acquire()
    assert ran and rival.held and not mine.held
    record = json.loads(storage.read_bytes(_lock_url(url)))
    assert record["token"] == rival.token
  finally:
    mine.release()
    rival.release()
  assert not storage.exists(_lock_url(url))


# ---------------------------------------------------------------------- ambiguous create


@pytest.mark.parametrize("retries", ["4", "1"])
def test_a_create_whose_reply_was_lost_recognises_its_own_token(bucket_env, monkeypatch,
                                                                retries):
  # The create reached the bucket but its reply timed out: with retries the second try
  # finds the object there; with none the request fails outright. Either way the run reads
  # the object back and finds its own token instead of refusing itself.
  emu, bucket = bucket_env
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", retries)
  url = storage.join(bucket, "run")

  def written_then_timed_out(fn):
    fn()
    raise TimeoutError("the reply did not come in time")

  ran = _intercept(monkeypatch, _lock_url(url), "write", written_then_timed_out)
  lock = run_lock.BucketLock(url)
  try:
    assert lock.acquire() is None and lock.held and ran
    assert json.loads(storage.read_bytes(_lock_url(url)))["token"] == lock.token
  finally:
    lock.release()
  assert not storage.exists(_lock_url(url))


# -------------------------------------------------------------- errors by type and status


def test_412_in_a_name_is_not_already_exists(bucket_env):
  # A create refused for another reason (here: no such bucket) whose text holds "412" in
  # an object or bucket name is that reason, not "already exists".
  emu, bucket = bucket_env
  url = f"{emu.scheme}://t5forge-gone-4120/runs/checkpoint_4120/.lock"
  with pytest.raises(storage.StorageError, match="t5forge-gone-4120: the bucket does not exist"):
    storage.write_bytes(url, b"x", exclusive=True)


def test_status_is_read_from_the_error_not_its_text():
  from botocore.exceptions import ClientError
  from gcsfs.retry import HttpError
  assert storage.status_of(HttpError({"code": 503, "message": "b/checkpoint_4120 busy"})) == 503
  assert storage.status_of(OSError("upload of run/checkpoint_4120 failed, 412")) is None
  boto = ClientError({"Error": {"Code": "NoSuchKey", "Message": "checkpoint_4120 (412)"},
                      "ResponseMetadata": {"HTTPStatusCode": 404}}, "PutObject")
  assert storage.status_of(boto) == 404
  wrapped = OSError(5, "checkpoint_4120")
  wrapped.__cause__ = boto  # as s3fs raises it
  assert storage.status_of(wrapped) == 404


# ------------------------------------------------------------ missing metadata, a clear rule


def test_an_object_without_time_or_version_says_so(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  url = storage.join(bucket, "o")
  storage.write_bytes(url, b"x")
  fs = storage.filesystem(url)
  real = fs.info
  keep = {"name", "size", "type"}
  monkeypatch.setattr(fs, "info", lambda p, **kw: {k: v for k, v in real(p, **kw).items()
                                                   if k in keep})
  meta = storage.info(url)
  assert meta == {"size": 1, "version": None, "mtime": None}


def test_a_lock_of_unknown_age_is_stale_once_seen_unchanged_for_the_timeout(bucket_env,
                                                                           monkeypatch):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  _put_record(url, host="another-host", pid=5, token="theirs")
  real = storage.info

  def no_time(path):
    return {**real(path), "mtime": None}

  monkeypatch.setattr(storage, "info", no_time)
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  with pytest.raises(UserError, match="its age is unknown"):
    run_lock.BucketLock(url, wait_s=0).acquire()
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1")
  lines = []
  lock = run_lock.BucketLock(url, wait_s=30, log=lines.append)
  start = time.monotonic()
  note = lock.acquire()
  try:
    assert time.monotonic() - start >= 1.0
    assert "took over the lock of pid 5 on host another-host" in note
    assert re.search(r"stayed unchanged for \d+ s while this run watched it", note), note
  finally:
    lock.release()


def test_a_lock_without_a_version_is_refused_in_one_line(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  _put_record(url, host="another-host", pid=5, token="theirs")
  real = storage.info
  monkeypatch.setattr(storage, "info", lambda path: {**real(path), "version": None})
  with pytest.raises(UserError) as e:
    run_lock.BucketLock(url, wait_s=0).acquire()
  assert "\n" not in str(e.value)
  assert "no generation or ETag" in str(e.value)


# ------------------------------------------------------------- who holds it: host and pid


def test_a_dead_holder_on_this_host_is_taken_over_at_once(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")  # fresh: only the pid can tell
  url = storage.join(bucket, "run")
  pid = dead_pid()
  _put_record(url, host=HOST, pid=pid, token="old")
  lock = run_lock.BucketLock(url)
  start = time.monotonic()
  note = lock.acquire()
  try:
    assert time.monotonic() - start < 30
    assert note.startswith(f"note: took over the lock of pid {pid} on host {HOST} "
                           "(t5forge train since 2024-01-01 00:00:00 UTC), which is no "
                           "longer running")
    assert json.loads(storage.read_bytes(_lock_url(url)))["token"] == lock.token
  finally:
    lock.release()


def test_a_pid_given_to_another_process_is_not_taken_for_the_holder(bucket_env, monkeypatch):
  # A restarted container runs the new process under the old one's pid, or gives that pid
  # to something else: the token, and the process's start time, tell them apart.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  url = storage.join(bucket, "run")
  _put_record(url, host=HOST, pid=os.getpid(), token="a-previous-process")
  lock = run_lock.BucketLock(url)
  assert f"pid {os.getpid()} on host {HOST}" in lock.acquire()
  lock.release()
  parent = os.getppid()  # alive: the process that started this one
  with open(f"/proc/{parent}/stat", "rb") as f:
    started = int(f.read().rpartition(b")")[2].split()[19])
  _put_record(url, host=HOST, pid=parent, pid_start=started, token="theirs")
  with pytest.raises(UserError, match=f"in use by pid {parent} on host {HOST}"):
    run_lock.BucketLock(url).acquire()
  _put_record(url, host=HOST, pid=parent, pid_start=started + 1, token="theirs")
  lock = run_lock.BucketLock(url)
  note = lock.acquire()
  lock.release()
  assert f"took over the lock of pid {parent} on host {HOST}" in note


def test_the_host_name_can_be_set_for_containers_and_tests(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  monkeypatch.setenv(run_lock.HOST_ENV, "node-a")
  url = storage.join(bucket, "run")
  pid = dead_pid()
  _put_record(url, host="node-a", pid=pid, token="old")
  lock = run_lock.BucketLock(url)
  note = lock.acquire()
  try:
    assert f"took over the lock of pid {pid} on host node-a" in note
    assert json.loads(storage.read_bytes(_lock_url(url)))["host"] == "node-a"
  finally:
    lock.release()
  _put_record(url, host="node-b", pid=pid, token="old")
  with pytest.raises(UserError, match=f"in use by pid {pid} on host node-b"):
    run_lock.BucketLock(url, wait_s=0).acquire()
  assert run_lock.BucketLock(url, host="node-b").host == "node-b"


def test_another_hosts_lock_is_waited_for_then_taken_over(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1.5")
  url = storage.join(bucket, "run")
  _put_record(url, host="another-host", pid=4242, token="theirs")
  with pytest.raises(UserError) as e:
    run_lock.BucketLock(url, wait_s=0).acquire()  # as before: refused at once
  assert "in use by pid 4242 on host another-host" in str(e.value)
  assert "--lock_wait_s" in str(e.value)
  lines = []
  lock = run_lock.BucketLock(url, wait_s=60, log=lines.append)
  note = lock.acquire()
  try:
    assert lines and lines[0].startswith(f"waiting for the MODEL_DIR lock {_lock_url(url)}: "
                                         "held by pid 4242 on host another-host")
    assert note.startswith("note: took over the lock of pid 4242 on host another-host")
  finally:
    lock.release()


def test_a_wait_ends_at_its_bound(bucket_env, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  url = storage.join(bucket, "run")
  _put_record(url, host="another-host", pid=4242, token="theirs")
  start = time.monotonic()
  with pytest.raises(UserError, match=r"in use by pid 4242 on host another-host .*waited 1 s "
                     r"\(--lock_wait_s=1\)"):
    run_lock.BucketLock(url, wait_s=1).acquire()
  assert 1 <= time.monotonic() - start < 30


def test_the_default_wait_outlasts_the_timeout():
  assert run_lock.default_wait_s(300) > 300
  assert run_lock.default_wait_s(2) > 2


def test_a_check_sees_a_lost_lock_at_once(bucket_env, monkeypatch):
  # The run checks its lock before each save: the renewal thread may not have looked yet.
  emu, bucket = bucket_env
  monkeypatch.setenv(run_lock.TIMEOUT_ENV, "600")
  url = storage.join(bucket, "run")
  lock = run_lock.BucketLock(url)
  lock.acquire()
  try:
    assert lock.check() is None
    _put_record(url, host="another-host", pid=7, token="theirs")
    lost = lock.check()
    assert lost and "taken over by pid 7 on host another-host" in lost
    assert lock.lost == lost
  finally:
    lock.release()
  assert json.loads(storage.read_bytes(_lock_url(url)))["token"] == "theirs"
