"""What both schedulers share: a queue of rows and the one worker thread that serves them.

`scheduler.Engine` (continuous batching over slots) and `t5forge.serve.batcher.Batcher`
(static batches) subclass `QueueWorker` and implement `_warmup() -> shapes compiled` and
`_serve()` (the loop, returning once closed and empty). Callers `start()`, `submit(rows)`
(all or none; QueueFull / Closed), and read `ready`, `failed`, `compiled_shapes`,
`queue_depth()`. A row is any object with `enqueued`, `cancelled` and `done(result)`.
Setting `warm_after` to another worker's `ready` before `start()` makes this one warm up
after that one is ready (its own `ready` then comes last, so compilations counted from it
are those of requests only). `compiles_since_ready()` counts every XLA compilation in the
process after this worker's ready (a persistent-cache hit included): a request that
compiles shows up whichever worker's path it took.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import jax

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


class QueueWorker:
  """A queue and its worker thread (see the module docstring).

  Args:
    name: the thread's name.
    max_queue: rows that may wait; more is QueueFull.
    metrics: a `t5forge.serve.metrics.Metrics`-like object, or None.
    on_ready: called on the worker thread once warm-up ended (or failed).
  """

  def __init__(self, *, name: str, max_queue: int, metrics=None,
               on_ready: Callable | None = None):
    self.max_queue, self.metrics, self._on_ready = max_queue, metrics, on_ready
    self._waiting: list = []
    self._cond = threading.Condition()
    self._closing = False
    self.ready = threading.Event()
    self.failed: BaseException | None = None
    self.compiled_shapes = 0
    self.compiles_at_ready = 0
    self.warm_after: threading.Event | None = None
    self._thread = threading.Thread(target=self._main, name=name, daemon=True)

  def start(self) -> None:
    self._thread.start()

  def submit(self, rows: list) -> None:
    """Queues a request's rows together (all or none)."""
    with self._cond:
      if self._closing:
        raise Closed()
      if len(self._waiting) + len(rows) > self.max_queue:
        raise QueueFull()
      now = time.monotonic()
      for r in rows:
        r.enqueued = now
      self._waiting.extend(rows)
      self._gauges()
      self._cond.notify()

  def compiles_since_ready(self) -> int:
    """XLA compilations in this process since this worker's warm-up ended."""
    return compile_count() - self.compiles_at_ready if self.ready.is_set() else 0

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
      r.done(exc)

  def _main(self) -> None:
    if self.warm_after is not None:
      self.warm_after.wait()  # set on success and on failure alike
    try:
      self.compiled_shapes = self._warmup()
    except BaseException as e:  # noqa: BLE001
      # Reported by /health and the CLI; queued rows fail rather than hang.
      self.failed = e
      with self._cond:
        self._closing = True
        rows, self._waiting = self._waiting, []
      for r in rows:
        r.done(e)
      self._announce()
      return
    self._announce()
    self._serve()

  def _announce(self) -> None:
    self.compiles_at_ready = compile_count()
    self.ready.set()
    if self._on_ready:
      self._on_ready()

  def _warmup(self) -> int:
    raise NotImplementedError

  def _serve(self) -> None:
    raise NotImplementedError
