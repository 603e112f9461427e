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
token. Every write and delete of it is conditional, decided by the bucket (GCS generation
preconditions, S3 `If-Match` / `If-None-Match`; `storage.write_if`, `storage.remove_if`):
it is created only if absent, renewed by a daemon thread every quarter of the timeout only
if still at the version the run last wrote, deleted at exit likewise, and a dead run's is
deleted only at the version judged dead. So no run ever overwrites or deletes another's.
A request whose reply was lost may have been made: the run then reads the object and
recognises its own token (a create retried after a timeout is not refused as "in use" by
its own pid).

Who holds a lock found there decides what a new run does:
- a process on this host (same `hostname()`, T5FORGE_HOSTNAME or the system's) that is
  running: refused at once, in one line naming it;
- a process on this host that is gone (its pid is dead, or now another process's): taken
  over at once with a note, so a job restarted after a crash resumes (T5X has no lock);
- another host's: its processes cannot be seen, so the run waits (a line every 30 s) until
  the lock is not renewed for the timeout, then takes it over with a note; `wait_s`
  (`--lock_wait_s`) bounds the wait (0: refuse at once), by default the timeout and a margin.
The age of a lock is the bucket's clock (the object's last-modified time) against this
host's; a lock whose bucket gives no last-modified time is stale once this run has seen it
unchanged for the timeout. The timeout is T5FORGE_BUCKET_LOCK_TIMEOUT_S seconds, default
300; every host of the runs that share a bucket must use the same value, and their clocks
must agree with the bucket's to well within it (NTP does).

A run whose lock is taken over while it runs (it could not renew for the timeout, or a
same-named host judged it dead) or deleted learns it at its next renewal, and asks the
bucket again before each checkpoint and evaluation (`check`): it stops there with
LockLost (exit status 3), one line naming the new holder, writing nothing more.
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
HOST_ENV = "T5FORGE_HOSTNAME"
WAIT_LOG_EVERY_S = 30.0  # a run waiting for another host's lock says so this often


def hostname() -> str:
  """This machine's name in lock records: T5FORGE_HOSTNAME when set, else the system's
  host name. Set it where machines share a host name (containers started with a fixed
  one), or to play another host in a test."""
  return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


def _log_info(message: str) -> None:
  log.info(message)


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
      _write_record(fd, {"host": hostname(), "pid": os.getpid(),
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

  lost = None  # a flock is held until this process ends: never taken from it

  def check(self) -> str | None:
    """As BucketLock.check: None, as a flock cannot be lost."""
    return None



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
  if record.get("host") != hostname():
    return True
  try:
    pid = int(record.get("pid"))
  except (TypeError, ValueError):
    return False
  return pid == os.getpid() or _pid_alive(pid)  # this process: through another RunLock


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  except (OverflowError, ValueError):
    return False  # not a pid this system has
  return True


def _takeover_note(record: dict | None) -> str | None:
  if not record:
    return None
  return (f"note: took over the lock of pid {record.get('pid', '?')} on host "
          f"{record.get('host', '?')}, which is no longer running")


def lock_for_job(directory: str, *, command: str = "t5forge train",
                 log=log.info, wait_s: float | None = None) -> "RunLock | BucketLock | None":
  """The lock of a (possibly multi-process) job: process 0 takes it, every process
  learns the outcome and raises the same UserError when it was refused.

  Args:
    log: where the notes (a take-over) and the lines of a wait go.
    wait_s: a bucket MODEL_DIR only: how long to wait for a lock held from another host
      (BucketLock's `wait_s`; None: its default).

  Returns:
    the held RunLock (BucketLock for a bucket MODEL_DIR) on process 0, None on the others.
  """
  lock, error = None, None
  if multihost.is_chief():
    if storage.is_remote(directory):
      lock = BucketLock(directory, command=command, wait_s=wait_s, log=log)
    else:
      lock = RunLock(directory, command=command)
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


def default_wait_s(timeout: float) -> float:
  """How long a run waits by default for a lock held from another host: until that lock
  would go stale, plus a margin for the clocks, the polling and the holder's last renewal."""
  return timeout + max(timeout / 4, 10.0)


class LockLost(UserError):
  """This run's MODEL_DIR lock was taken over by another run (or deleted): the run stopped
  before writing anything more into MODEL_DIR. `t5forge` exits with status 3."""

  exit_code = 3


# The tokens of the bucket locks this process holds: a record with this process's pid but
# another token is a previous process's that had the same pid (a restarted container).
_held_tokens: set[str] = set()


class BucketLock(_Held):
  """The lock of a run on a bucket MODEL_DIR: the object `MODEL_DIR/.lock`.

  Args:
    directory: the MODEL_DIR URL (`gs://bucket/run`, `s3://bucket/run`); its bucket must
      exist.
    command: what holds it, as the refusal names it.
    wait_s: how long `acquire()` waits for a lock held from another host to go stale (0:
      refuse at once); default `default_wait_s(timeout)`.
    host: this machine's name in the record (default `hostname()`: T5FORGE_HOSTNAME or the
      system's).
    log: where the lines of a wait go (default this module's logger).

  As RunLock: `acquire()` returns None, or a note when it took over a dead run's lock, and
  raises UserError (one line, naming the holder) when a live run holds it; `release()`
  is idempotent. While held, a daemon thread renews the object; `check()` asks the bucket
  whether it is still this run's, and `lost` says why not once it is not.
  """

  def __init__(self, directory: str, *, command: str = "t5forge train",
               wait_s: float | None = None, host: str | None = None, log=None):
    self.directory = storage.normalize(directory)
    self.path = storage.join(self.directory, LOCK_NAME)
    self.command = command
    self.timeout = bucket_lock_timeout()
    try:
      self.wait_s = default_wait_s(self.timeout) if wait_s is None else float(wait_s)
    except (TypeError, ValueError):
      self.wait_s = -1.0
    if not self.wait_s >= 0:
      raise UserError(f"lock_wait_s={wait_s!r} (--lock_wait_s, train_script.train.lock_wait_s):"
                      " expected seconds >= 0 (0: refuse at once when another host holds the "
                      "MODEL_DIR lock)")
    self.host = host or hostname()
    self._log = log or _log_info
    self.token = uuid.uuid4().hex
    self.lost: str | None = None  # why the lock stopped being ours while held
    self.lost_to: str | None = None  # who has it now ("pid 7 on host h (...)"), if anyone
    self._record = {"host": self.host, "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
                    "argv": shlex.join(sys.argv), "token": self.token}
    self._version: str | None = None  # of the object as this run last wrote it
    self._mutex = threading.Lock()  # renewal, check and release, one at a time
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # -- taking it ----------------------------------------------------------------------------
  def acquire(self) -> str | None:
    storage.check_bucket(self.path)
    # From before the create: another lock of this process that reads the record meanwhile
    # must find its holder alive, not the leftover of a previous process with this pid.
    _held_tokens.add(self.token)
    try:
      return self._acquire()
    except BaseException:
      if self._thread is None:
        _held_tokens.discard(self.token)
      raise

  def _acquire(self) -> str | None:
    start = time.monotonic()
    seen: tuple[str, float] | None = None  # (version, when first seen) of the lock there
    logged = None
    races = 0  # times another run changed the lock between this run's look and its write
    while races < 50:  # each pass reads the lock again; a wait ends at its deadline
      current = self._read()
      if current is None:
        if self._create():
          return None
        races += 1
        continue  # another run created it first: judge that one
      record, meta = current
      version = meta["version"]
      if version is None:
        raise UserError(f"{self.path}: the bucket gives no generation or ETag for the lock "
                        "object, so it cannot be renewed or taken over safely; use a GCS or "
                        "S3 bucket (or a service compatible with their conditional requests)")
      now = time.monotonic()
      if seen is None or seen[0] != version:
        seen = (version, now)
      age = None if meta["mtime"] is None else time.time() - meta["mtime"]
      holder = self._holder(record)
      if holder == "alive":
        raise UserError(self._refusal(record))
      why = None
      if holder == "dead":
        why = "which is no longer running"
      elif age is not None and age > self.timeout:
        why = f"which has not renewed {self.path} for {age:.0f} s ({TIMEOUT_ENV}={self.timeout:g})"
      elif age is None and now - seen[1] > self.timeout:
        why = (f"whose lock {self.path} stayed unchanged for {now - seen[1]:.0f} s while this run "
               f"watched it (its last-modified time is unknown; {TIMEOUT_ENV}={self.timeout:g})")
      if why:
        try:
          # Only the version judged: another run may have taken it over since.
          storage.remove_if(self.path, version)
        except storage.PreconditionFailed:
          races += 1
          continue
        if self._create():
          return f"note: took over the lock of {_who(record)}, {why}"
        races += 1
        continue
      # Held from another host, not stale yet: wait for it to go stale, up to wait_s.
      waited = now - start
      if waited >= self.wait_s:
        raise UserError(self._refusal(record, age=age, waited=waited if self.wait_s else None))
      if logged is None or now - logged >= WAIT_LOG_EVERY_S:
        logged = now
        renewed = ("its last-modified time is unknown" if age is None
                   else f"last renewed {age:.0f} s ago")
        self._log(f"waiting for the MODEL_DIR lock {self.path}: held by {_who(record)}, "
                  f"{renewed}; taken over when not renewed for {self.timeout:g} s "
                  f"({TIMEOUT_ENV}); giving up in {self.wait_s - waited:.0f} s "
                  f"(--lock_wait_s={self.wait_s:g})")
      time.sleep(min(max(self.timeout / 8, 0.05), 5.0, self.wait_s - waited + 0.01))
    raise UserError(f"{self.path}: the MODEL_DIR lock kept changing while this run tried to "
                    "take it; another run is starting on this MODEL_DIR: use another one")

  def _create(self) -> bool:
    """Creates the lock object where there is none; True when it is this run's (then
    renewed from here on). A create whose reply was lost may have been made: the object
    then holds this run's token, which the read after a failure recognises."""
    try:
      version = storage.write_if(self.path, self._data(), version=None)
    except storage.PreconditionFailed:
      version = None  # one is there: another run's, or ours after a retry
    except Exception:  # the network, after every try: the create may have been made
      try:
        version = self._own_version()
      except Exception:  # noqa: BLE001 (still unreachable: the first error says it)
        version = None
      if version is None:
        raise
    if version is None:
      version = self._own_version()
      if version is None:
        return False
    # Where a service does not enforce the create's precondition, a rival's write may land
    # over this one: the token read back decides.
    mine = self._read()
    if mine is None or mine[0].get("token") != self.token:
      return False
    self._version = mine[1]["version"] or version
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew_loop, name="t5forge-bucket-lock",
                                    daemon=True)
    self._thread.start()
    return True

  def _holder(self, record: dict) -> str:
    """'alive': a process on this host that runs; 'dead': one on this host that does not;
    'remote': another host's, whose processes cannot be seen from here."""
    if record.get("host") != self.host:
      return "remote"
    try:
      pid = int(record.get("pid"))
    except (TypeError, ValueError):
      return "dead"  # a record that names no process: nobody can be running it
    if pid == os.getpid():
      return "alive" if record.get("token") in _held_tokens else "dead"
    if not _pid_alive(pid):
      return "dead"
    start = record.get("pid_start")
    if start is not None and _process_start(pid) not in (None, start):
      return "dead"  # the pid now belongs to another process
    return "alive"

  def _refusal(self, record: dict, *, age: float | None = None,
               waited: float | None = None) -> str:
    holder = (f"MODEL_DIR {self.directory} is in use by pid {record.get('pid', '?')} on host "
              f"{record.get('host', '?')} since {record.get('since', '?')} "
              f"({record.get('command', '?')})")
    if self._holder(record) == "alive":
      return f"{holder}; wait for it, or use another MODEL_DIR"
    if waited is not None:
      return (f"{holder}; waited {waited:.0f} s (--lock_wait_s={self.wait_s:g}) and it is "
              "still renewed; wait longer, or use another MODEL_DIR")
    when = ("its age is unknown (the bucket gave no last-modified time): it is taken over "
            f"once seen unchanged for {self.timeout:g} s" if age is None else
            f"it is taken over when not renewed for {self.timeout:g} s, "
            f"{max(self.timeout - age, 0):.0f} s from now")
    return (f"{holder}; wait for it (--lock_wait_s=SECONDS waits here; {when}), or use "
            "another MODEL_DIR")

  # -- holding it ---------------------------------------------------------------------------
  def _data(self) -> bytes:
    record = {**self._record, "renewed": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    return (json.dumps(record) + "\n").encode("utf-8")

  def _read(self) -> tuple[dict, dict] | None:
    """(record, info) of the lock object; None when there is none. A record that is not
    ours to parse (torn, foreign) reads as {}. The info is read first: the record is then
    of that version or a later one, and what is done on the info's version is conditional
    on it."""
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

  def _own_version(self) -> str | None:
    """The lock object's version when it holds this run's token, else None."""
    current = self._read()
    if current is not None and current[0].get("token") == self.token:
      return current[1]["version"]
    return None

  def renew(self) -> bool:
    """Rewrites the lock object now, only if it is still the version this run wrote;
    False (and `lost` says why) when it is not this run's any more."""
    with self._mutex:
      if self.lost:
        return False
      try:
        self._version = storage.write_if(self.path, self._data(), version=self._version)
        return True
      except storage.PreconditionFailed:
        pass
      # Another version: this run's own write whose reply was lost, or another run's.
      mine = self._own_version()
      if mine is not None:
        self._version = mine
        return True
      self._lose(self._read())
      return False

  def check(self) -> str | None:
    """Asks the bucket whether the lock is still this run's (the renewal thread looks only
    every quarter of the timeout): None, or why not (kept in `lost`). When the bucket
    cannot be reached the answer is the renewal thread's."""
    with self._mutex:
      if self.lost or self._thread is None:
        return self.lost
      try:
        try:
          if storage.info(self.path)["version"] == self._version:
            return None
        except FileNotFoundError:
          pass
        mine = self._own_version()
        if mine is not None:
          self._version = mine
          return None
        self._lose(self._read())
      except Exception as e:  # noqa: BLE001 (the network: the write that follows meets it too)
        log.warning("warning: could not check the MODEL_DIR lock %s (%s)", self.path,
                    " ".join(str(e).split())[:200])
      return self.lost

  def _lose(self, current: tuple[dict, dict] | None) -> None:
    if current is None:
      self.lost = f"the MODEL_DIR lock {self.path} was deleted by someone else"
    else:
      self.lost_to = _who(current[0])
      self.lost = f"the MODEL_DIR lock {self.path} was taken over by {self.lost_to}"
    log.error("error: %s; this run stops before it writes to MODEL_DIR again", self.lost)

  def lost_error(self, *, before: str) -> str:
    """The first part of the line a run that lost its lock stops with."""
    to = f" to {self.lost_to}" if self.lost_to else " (it was deleted by someone else)"
    return f"lost the MODEL_DIR lock {self.path}{to}; stopped before {before}"

  def _renew_loop(self) -> None:
    interval = self.timeout / 4
    while not self._stop.wait(interval):
      try:
        if not self.renew():
          return
      except Exception as e:  # noqa: BLE001 (the network: retried at the next interval)
        log.warning("warning: could not renew the MODEL_DIR lock %s (%s); trying again in "
                    "%.0f s", self.path, " ".join(str(e).split())[:200], interval)

  def release(self) -> None:
    """Stops renewing and deletes the lock object, if it is still this run's version."""
    if self._thread is None:
      return
    thread, self._thread = self._thread, None
    self._stop.set()
    thread.join()
    _held_tokens.discard(self.token)
    with self._mutex:
      if self.lost:
        return  # another run's now: left to it
      try:
        try:
          storage.remove_if(self.path, self._version)
        except storage.PreconditionFailed:
          mine = self._own_version()  # a renewal whose reply was lost
          if mine is not None:
            storage.remove_if(self.path, mine)
      except Exception as e:  # noqa: BLE001 (the run itself is over: its result stands)
        log.warning("warning: could not delete the MODEL_DIR lock %s (%s); the next run takes "
                    "it over %g s after its last renewal", self.path,
                    " ".join(str(e).split())[:200], self.timeout)

  @property
  def held(self) -> bool:
    return self._thread is not None


def _who(record: dict) -> str:
  return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')} "
          f"({record.get('command', '?')} since {record.get('since', '?')})")


def _process_start(pid: int) -> int | None:
  """When process `pid` started (clock ticks after boot, /proc), None where unknown: with
  its pid, it tells a live holder from a new process that was given the same pid."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rpartition(b")")[2].split()
    return int(fields[19])  # field 22 of stat(5); 20 after the command's closing ")"
  except (OSError, ValueError, IndexError):
    return None
