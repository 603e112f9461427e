"""What both schedulers share: a queue of rows and the one worker thread that serves them.

`scheduler.Engine` (continuous batching over slots) and `t5forge.serve.batcher.Batcher`
(static batches) subclass `QueueWorker` and implement `_warmup() -> shapes compiled` and
`_serve()` (the loop, returning once closed and empty). Callers `start()`, `submit(rows)`
(all or none; QueueFull / Closed), and read `ready`, `failed`, `died`, `alive()`,
`compiled_shapes`, `queue_depth()`. A row is any object with `enqueued`, `cancelled` and
`done(result)`. Setting `warm_after` to another worker's `ready` before `start()` makes
this one warm up after that one is ready (its own `ready` then comes last, so
compilations counted from it are those of requests only). `compiles_since_ready()` counts
every XLA compilation in the process after this worker's ready (a persistent-cache hit
included): a request that compiles shows up whichever worker's path it took.

Every row submitted is settled exactly once (`_settle`), whatever fails:

- a `done` that raises is logged (`errors.internal_error`: the traceback under an error
  id) and called again with that `InternalError`, so that its request fails rather than
  waits; the worker goes on with the other rows;
- an exception the subclass cannot pin on some rows ends `_serve`: the worker dies
  (`died`, a `WorkerDied` naming the logged error id), every row it still holds (queued,
  running, or finished but not yet settled) is settled with that `WorkerDied`, and
  `submit` refuses more with it. The server's /health then says 503 and the process
  exits (t5forge/cli/serve.py).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import jax

from t5forge.errors import internal_error

_COMPILES = [0]


def _count_compiles(event: str, _duration: float, **_kw) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_count() -> int:
  """XLA compilations in this process so far (all threads)."""
  return _COMPILES[0]


class QueueFull(Exception):
  """More rows wait than `max_queue`; the client should retry later."""


class Closed(Exception):
  """The server is shutting down and takes no new work."""


class Cancelled(Exception):
  """The row's client left before it finished."""


class ShutDown(Exception):
  """The row was still waiting or running when the shutdown timeout ended."""


class WorkerDied(Closed):
  """The worker thread stopped on an unexpected exception, logged under `error_id`: it
  serves nothing more (the server exits, for its supervisor to restart it)."""

  def __init__(self, error_id: str):
    super().__init__(f"the worker stopped on an internal error (id {error_id})")
    self.error_id = error_id


class QueueWorker:
  """A queue and its worker thread (see the module docstring).

  Args:
    name: the worker's (and its thread's) name.
    max_queue: rows that may wait; more is QueueFull.
    metrics: a `t5forge.serve.metrics.Metrics`-like object, or None.
    on_ready: called on the worker thread once warm-up ended (or failed).
  """

  def __init__(self, *, name: str, max_queue: int, metrics=None,
               on_ready: Callable | None = None):
    self.name, self.max_queue, self.metrics = name, max_queue, metrics
    self._on_ready = on_ready
    self._waiting: list = []
    # id(row) -> row: submitted, not yet settled (whatever dies, these get an answer).
    self._owned: dict[int, object] = {}
    self._cond = threading.Condition()
    self._closing = False
    self._deadline: float | None = None  # shutdown: fail what still waits after this
    self.ready = threading.Event()
    self.failed: BaseException | None = None  # the warm-up's exception
    self.died: WorkerDied | None = None  # set the moment the serving loop fails
    self.compiled_shapes = 0
    self.compiles_at_ready = 0
    self.warm_after: threading.Event | None = None
    self._thread = threading.Thread(target=self._main, name=name, daemon=True)

  def start(self) -> None:
    self._thread.start()

  def alive(self) -> bool:
    """Whether the worker thread runs (False before `start`, after `close`, and once it
    died)."""
    return self._thread.is_alive()

  def submit(self, rows: list) -> None:
    """Queues a request's rows together (all or none)."""
    with self._cond:
      if self._closing:
        raise WorkerDied(self.died.error_id) if self.died is not None else Closed()
      if len(self._waiting) + len(rows) > self.max_queue:
        raise QueueFull()
      now = time.monotonic()
      for r in rows:
        r.enqueued = now
        self._owned[id(r)] = r
      self._waiting.extend(rows)
      self._gauges()
      self._cond.notify()

  def compiles_since_ready(self) -> int:
    """XLA compilations in this process since this worker's warm-up ended."""
    return compile_count() - self.compiles_at_ready if self.ready.is_set() else 0

  def drain(self, timeout: float | None = None) -> None:
    """Starts the shutdown deadline (SIGTERM): with `timeout` (> 0), rows still waiting
    after it fail with ShutDown (the engine's running rows too). Rows are still taken
    until `close`: a request the HTTP layer accepted before the signal must be served.
    Returns at once."""
    with self._cond:
      if timeout and self._deadline is None:
        self._deadline = time.monotonic() + timeout
      self._cond.notify()

  def queue_depth(self) -> int:
    with self._cond:
      return len(self._waiting)

  def _gauges(self) -> None:
    """Called with the lock held whenever the queue changes."""
    if self.metrics is not None:
      self.metrics.queue_depth.set(len(self._waiting))

  def _drop_cancelled(self) -> list:
    """Takes the waiting rows whose client left out of the queue (lock held); the
    caller fails them with `Cancelled` once the lock is released."""
    gone = [r for r in self._waiting if r.cancelled]
    if gone:
      self._waiting = [r for r in self._waiting if not r.cancelled]
      self._gauges()
    return gone

  def _fail(self, rows, exc: BaseException, stage: str) -> None:
    """Settles rows that will not run (outside the lock), counted by stage."""
    for r in rows:
      if self.metrics is not None:
        self.metrics.cancelled.labels(stage).inc()
      self._settle(r, exc)

  def _settle(self, r, result) -> None:
    """Calls `r.done(result)` unless the row was settled already; called without the
    lock held. A `done` that raises fails only its own row: the exception is logged under
    an error id and `done` gets that `InternalError` instead (its request's error path);
    if that raises too, the request is left to its deadline (--request_timeout_s)."""
    with self._cond:
      if self._owned.pop(id(r), None) is None:
        return
    try:
      r.done(result)
      return
    except Exception as e:  # noqa: BLE001 (one row's callback never stops the worker)
      err = internal_error(e, "a row's done callback raised")
    try:
      r.done(err)
    except Exception as e:  # noqa: BLE001 (as above)
      internal_error(e, f"the done callback of {err.error_id} raised on its error too")

  def _main(self) -> None:
    if self.warm_after is not None:
      self.warm_after.wait()  # set on success and on failure alike
    try:
      self.compiled_shapes = self._warmup()
    except BaseException as e:  # noqa: BLE001
      # Reported by /health and the CLI; queued rows fail rather than hang.
      self.failed = e
      err = internal_error(e, f"the warm-up of {self.name} failed")
      with self._cond:
        self._closing = True
        self._waiting = []
        rows = list(self._owned.values())
      for r in rows:
        self._settle(r, err)
      self._announce()
      return
    self._announce()
    try:
      self._serve()
    except BaseException as e:  # noqa: BLE001 (whatever ends the loop, no row may hang)
      self._die(e)

  def _die(self, exc: BaseException) -> None:
    """The serving loop failed where no row could be blamed: refuse new rows, and settle
    every row still held with `WorkerDied` (its id names the logged traceback)."""
    err = internal_error(exc, f"{self.name} stopped")
    self.died = WorkerDied(err.error_id)
    with self._cond:
      self._closing = True
      self._waiting = []
      rows = list(self._owned.values())
      self._forget_rows()
      self._gauges()
    for r in rows:
      self._settle(r, WorkerDied(err.error_id))

  def _forget_rows(self) -> None:
    """(Lock held.) Drops the subclass's own references to rows in flight, once dead."""

  def _announce(self) -> None:
    self.compiles_at_ready = compile_count()
    self.ready.set()
    if self._on_ready:
      self._on_ready()

  def _warmup(self) -> int:
    raise NotImplementedError

  def _serve(self) -> None:
    raise NotImplementedError
