"""One training run per MODEL_DIR: a lock on `MODEL_DIR/.lock`.

Two runs writing one MODEL_DIR interleave their steps in metrics.jsonl and leave
checkpoints of one model beside the other's config.gin, and both exit 0. A run holds
an exclusive `flock` on `MODEL_DIR/.lock` for as long as it runs; the file records who
holds it (host, pid, start time, command) so that a second run can refuse with one line
that says who. The kernel drops a flock when its process dies, however it dies, so on a
local file system a lock left by a killed run is told from a live one with certainty;
such a leftover record is taken over with a note. On file systems where flock fails
(some network and FUSE mounts), the recorded pid decides: a live process on this host
holds the lock, a dead one is taken over, and another host's record is respected (there
is no way to see its processes; delete the file when that run is known to be over).

A multi-process job takes one lock, on process 0 (`lock_for_job`); every process learns
the outcome, so a refused job fails on all of them instead of leaving some waiting in a
collective. Evaluation (`t5forge eval`) takes no lock: evaluating a MODEL_DIR while it
trains is T5X's continuous evaluation, and it writes only under `inference_eval/`.

A bucket MODEL_DIR (`gs://`, `s3://`) has no flock and no visible processes, so the lock
is an object, `MODEL_DIR/.lock` (`BucketLock`), holding the same record plus a random
token. It is created only if absent (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`);
as some GCS emulators ignore that precondition, the run also checks first that no lock is
there and reads its own token back after writing. A daemon thread rewrites the object
every quarter of the timeout while the run lives (after checking that the token is still
its own), and the run deletes it at exit. A lock object not rewritten for longer than
the timeout (the object's last-modified time, the bucket's clock) belongs to a run that
died: the next run takes it over with a note naming the old holder. The timeout is
T5FORGE_BUCKET_LOCK_TIMEOUT_S seconds, default 300; every host of the runs that share a
bucket must use the same value, and their clocks must agree with the bucket's to well
within it (NTP does).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid

import jax

from t5forge import multihost, storage
from t5forge.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
TIMEOUT_ENV = "T5FORGE_BUCKET_LOCK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


class _Held:
  """Both locks as context managers: `acquire()` on entry (its note logged), `release()`
  on exit."""

  def __enter__(self):
    note = self.acquire()
    if note:
      log.info(note)
    return self

  def __exit__(self, *exc) -> None:
    self.release()


class RunLock(_Held):
  """An exclusive lock on a directory for one run.

  Args:
    directory: the MODEL_DIR (created if missing).
    command: what holds it, as the refusal names it (e.g. "t5forge train").

  `acquire()` returns None, or a note when it took over the lock of a dead process;
  it raises UserError when a live run holds the lock. Use as a context manager, or call
  `release()` (idempotent) when the run ends.
  """

  def __init__(self, directory: str, *, command: str = "t5forge train"):
    self.directory = os.path.abspath(directory)
    self.path = os.path.join(self.directory, LOCK_NAME)
    self.command = command
    self._fd: int | None = None

  def acquire(self) -> str | None:
    try:
      os.makedirs(self.directory, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise UserError(f"cannot create the lock file {self.path} ({e.strerror}); MODEL_DIR must "
                      "be a directory you can write to") from None
    try:
      locked = _flock(fd)
      if locked is False:
        raise UserError(self._refusal(_read_record(fd, wait=True)))
      previous = _read_record(fd)
      if locked is None and previous and _holder_alive(previous):
        raise UserError(self._refusal(previous))
      # Locked (the kernel says nobody else holds it), or no flock here and the recorded
      # process is gone: any record left is a dead run's.
      note = _takeover_note(previous)
      _write_record(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                         "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                         "command": self.command, "argv": shlex.join(sys.argv)})
    except BaseException:
      os.close(fd)  # closing drops the flock too
      raise
    self._fd = fd
    return note

  def _refusal(self, record: dict | None) -> str:
    record = record or {}
    orphan = ""
    if record and not _holder_alive(record):
      # The flock outlived the recorded process: a child it forked still has the file.
      orphan = f"; pid {record.get('pid')} is gone but a process it started holds the lock"
    return (f"MODEL_DIR {self.directory} is in use by pid {record.get('pid', '?')} on host "
            f"{record.get('host', '?')} since {record.get('since', '?')} "
            f"({record.get('command', '?')}){orphan}; wait for it, or use another MODEL_DIR")

  def release(self) -> None:
    """Empties the record (a clean end leaves nothing to take over), then unlocks."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    except OSError:
      pass  # the lock still goes with the close below
    os.close(fd)

  @property
  def held(self) -> bool:
    return self._fd is not None



def _flock(fd: int) -> bool | None:
  """True: locked now; False: another open file holds it; None: flock does not work here."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # EACCES: some NFS clients
      return False
    return None  # ENOLCK, EOPNOTSUPP, EINVAL: no working flock on this file system


def _read_record(fd: int, *, wait: bool = False) -> dict | None:
  """The holder's record; {} when unreadable, None when empty. With `wait`, gives a holder
  that has just taken the lock up to a second to write its record."""
  deadline = time.monotonic() + (1.0 if wait else 0.0)
  while True:
    raw = os.pread(fd, 1 << 16, 0)
    if raw.strip() or time.monotonic() >= deadline:
      break
    time.sleep(0.05)
  if not raw.strip():
    return None
  try:
    record = json.loads(raw.decode("utf-8"))
    return record if isinstance(record, dict) else {}
  except (UnicodeDecodeError, ValueError):
    return {}  # a torn or foreign file: nobody we can name


def _write_record(fd: int, record: dict) -> None:
  data = (json.dumps(record) + "\n").encode("utf-8")
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  os.fsync(fd)


def _holder_alive(record: dict) -> bool:
  """Whether the recorded holder may still run: its pid lives on this host, or it is on
  another host (whose processes cannot be seen from here)."""
  if record.get("host") != socket.gethostname():
    return True
  try:
    pid = int(record.get("pid"))
  except (TypeError, ValueError):
    return False
  if pid == os.getpid():
    return True  # this process, through another RunLock
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _takeover_note(record: dict | None) -> str | None:
  if not record:
    return None
  return (f"note: took over the lock of pid {record.get('pid', '?')} on host "
          f"{record.get('host', '?')}, which is no longer running")


def lock_for_job(directory: str, *, command: str = "t5forge train",
                 log=log.info) -> "RunLock | BucketLock | None":
  """The lock of a (possibly multi-process) job: process 0 takes it, every process
  learns the outcome and raises the same UserError when it was refused.

  Returns:
    the held RunLock (BucketLock for a bucket MODEL_DIR) on process 0, None on the others.
  """
  lock, error = None, None
  if multihost.is_chief():
    lock = (BucketLock if storage.is_remote(directory) else RunLock)(directory, command=command)
    try:
      note = lock.acquire()
      if note:
        log(note)
    except UserError as e:
      lock, error = None, str(e)
  if jax.process_count() > 1:
    error = multihost.gather_json(error)[0]
  if error:
    raise UserError(error)
  return lock


# ---------------------------------------------------------------- a bucket MODEL_DIR


def bucket_lock_timeout() -> float:
  """Seconds without renewal after which a bucket lock is stale (T5FORGE_BUCKET_LOCK_TIMEOUT_S)."""
  raw = os.environ.get(TIMEOUT_ENV, "").strip()
  if not raw:
    return DEFAULT_TIMEOUT_S
  try:
    value = float(raw)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise UserError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds above 0, e.g. "
                    f"{DEFAULT_TIMEOUT_S:g}")
  return value


class BucketLock(_Held):
  """The lock of a run on a bucket MODEL_DIR: the object `MODEL_DIR/.lock`.

  Args:
    directory: the MODEL_DIR URL (`gs://bucket/run`, `s3://bucket/run`); its bucket must
      exist.
    command: what holds it, as the refusal names it.

  As RunLock: `acquire()` returns None, or a note when it took over a stale lock, and
  raises UserError (one line, naming the holder) when a live run holds it; `release()`
  is idempotent. While held, a daemon thread renews the object.
  """

  def __init__(self, directory: str, *, command: str = "t5forge train"):
    self.directory = storage.normalize(directory)
    self.path = storage.join(self.directory, LOCK_NAME)
    self.command = command
    self.timeout = bucket_lock_timeout()
    self.token = uuid.uuid4().hex
    self.lost: str | None = None  # why the lock stopped being ours while held
    self._record = {"host": socket.gethostname(), "pid": os.getpid(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
                    "argv": shlex.join(sys.argv), "token": self.token}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def acquire(self) -> str | None:
    storage.check_bucket(self.path)
    current = None
    for _ in range(3):  # a lost race re-reads: the winner's record is then refused
      current = self._read()
      note = None
      if current is not None:
        record, meta = current
        age = time.time() - meta["mtime"]
        if age <= self.timeout:
          raise UserError(self._refusal(record, age))
        # Stale: delete it, but only the version judged stale (another run may have
        # taken it over since we looked).
        if self._version() != meta["version"]:
          continue
        storage.remove(self.path)
        note = (f"note: took over the lock of pid {record.get('pid', '?')} on host "
                f"{record.get('host', '?')} ({record.get('command', '?')} since "
                f"{record.get('since', '?')}), which has not renewed {self.path} for "
                f"{age:.0f} s ({TIMEOUT_ENV}={self.timeout:g})")
      try:
        storage.write_bytes(self.path, self._data(), exclusive=True)
      except FileExistsError:
        continue
      # Where the precondition is not enforced, a run that wrote at the same time as
      # this one overwrote it (or is about to): only the token read back decides.
      time.sleep(min(0.2, self.timeout / 20))
      mine = self._read()
      if mine is None or mine[0].get("token") != self.token:
        continue
      self._start_renewing()
      return note
    current = self._read() or current
    raise UserError(self._refusal(current[0] if current else {}, 0.0))

  def _data(self) -> bytes:
    record = {**self._record, "renewed": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    return (json.dumps(record) + "\n").encode("utf-8")

  def _version(self) -> str | None:
    try:
      return storage.info(self.path)["version"]
    except FileNotFoundError:
      return None

  def _read(self) -> tuple[dict, dict] | None:
    """(record, info) of the lock object; None when there is none. A record that is not
    ours to parse (torn, foreign) reads as {}."""
    try:
      meta = storage.info(self.path)
      raw = storage.read_bytes(self.path)
    except FileNotFoundError:
      return None
    try:
      record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
      record = {}
    return (record if isinstance(record, dict) else {}), meta

  def _refusal(self, record: dict, age: float) -> str:
    gone = ""
    if record.get("host") == socket.gethostname() and record.get("pid") != os.getpid() \
        and not _holder_alive(record):
      # A run killed on this host: say when its lock goes stale instead of leaving the
      # user to guess.
      gone = (f"; pid {record.get('pid')} is gone: its lock is taken over when not renewed "
              f"for {self.timeout:g} s ({max(self.timeout - age, 0):.0f} s from now)")
    return (f"MODEL_DIR {self.directory} is in use by pid {record.get('pid', '?')} on host "
            f"{record.get('host', '?')} since {record.get('since', '?')} "
            f"({record.get('command', '?')}){gone}; wait for it, or use another MODEL_DIR")

  def _start_renewing(self) -> None:
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew, name="t5forge-bucket-lock",
                                    daemon=True)
    self._thread.start()

  def _renew(self) -> None:
    interval = self.timeout / 4
    while not self._stop.wait(interval):
      try:
        current = self._read()
        if current is None or current[0].get("token") != self.token:
          holder = current[0] if current else {}
          self.lost = (f"the MODEL_DIR lock {self.path} was taken over by pid "
                       f"{holder.get('pid', '?')} on host {holder.get('host', '?')} "
                       f"(this run did not renew it for over {self.timeout:g} s)"
                       if current else f"the MODEL_DIR lock {self.path} was deleted")
          log.error("error: %s; another run may now write this MODEL_DIR", self.lost)
          return
        storage.write_bytes(self.path, self._data())
      except Exception as e:  # noqa: BLE001 (the network: retried at the next interval)
        log.warning("warning: could not renew the MODEL_DIR lock %s (%s); trying again in "
                    "%.0f s", self.path, " ".join(str(e).split())[:200], interval)

  def release(self) -> None:
    """Stops renewing and deletes the lock object, if it is still ours."""
    if self._thread is None:
      return
    thread, self._thread = self._thread, None
    self._stop.set()
    thread.join()
    try:
      current = self._read()
      if current is not None and current[0].get("token") == self.token:
        storage.remove(self.path)
    except Exception as e:  # noqa: BLE001 (the run itself is over: its result stands)
      log.warning("warning: could not delete the MODEL_DIR lock %s (%s); the next run takes "
                  "it over %g s after its last renewal", self.path,
                  " ".join(str(e).split())[:200], self.timeout)

  @property
  def held(self) -> bool:
    return self._thread is not None

