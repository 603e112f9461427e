"""The host side of the engine: a queue, a worker thread, and continuous batching.

    engine = Engine(slots, max_queue=256, encode_budget=8)
    engine.start()                           # compiles, then sets engine.ready
    engine.submit([Row(ids, max_new_tokens=64, on_tokens=send, done=finish)])
    row.cancel()                             # the client left: its slot is freed
    engine.close(timeout=30)

The worker loops: drop waiting rows whose client left (never encoded) or that waited
longer than `max_queue_wait_s`; admit waiting rows into free slots, by priority (lower
first, as vLLM) then arrival, encoding at most `encode_budget` rows per loop while other
rows are decoding (all that fit when none are); run one `Slots.step` (k decode steps of
every slot); hand each row its new tokens; finish rows that generated a stop id, reached
`max_new_tokens`, asked to stop (`on_tokens` returned True: a stop string) or were
cancelled, and free their slots for the next loop. A request that arrives while others
decode waits at most one step for its slot, not for their whole batch.

Failures stay with the rows they belong to (`worker.QueueWorker` settles every row once):
a row whose `on_tokens` (or its share of a step's output) raises ends with an
`InternalError` (the traceback logged under its id); an insert that fails fails the rows
it encoded; a step that fails fails every row in flight, and the slot state is rebuilt
(`Slots.reset`: a failed call may have consumed its donated buffers). Only what fails
outside those (the loop's own bookkeeping, or a reset) ends the worker.

Closed-loop clients (each sends its next request when its last one is answered) would
come back just after the next step started, and their slots would sit empty for that
whole step. When recent rows did arrive that soon after rows ended, the loop that follows
rows ending waits a little (`max_wait_ms`, at most a quarter of a step) for as many rows
as ended before it encodes and steps, if the slot time it expects to save is more than
the wait can cost every slot; an open loop or `generate` (no row arrives that soon) never
waits.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np

from t5forge.engine.slots import InsertRow, Slots
from t5forge.engine.worker import Cancelled, QueueWorker, ShutDown
from t5forge.errors import InternalError, UserError, internal_error


class QueueTimeout(Exception):
  """The row waited longer than `max_queue_wait_s` for a slot."""



@dataclasses.dataclass
class RowOutput:
  """A finished row: its new tokens (the stop id included when it ended with one),
  their log-probs, and each position's TOP_LOGPROBS most likely tokens."""
  tokens: list[int]
  logprobs: list[float]
  top_ids: list[list[int]]
  top_logprobs: list[list[float]]
  finished: bool  # ended with a stop id (else max_new_tokens, or a stop string)


@dataclasses.dataclass(eq=False)
class Row:
  """One decode. `on_tokens(tokens, logprobs, top_ids, top_logprobs)` gets each step's
  new tokens (lists) and may return True to finish the row (a stop string was seen);
  `done(RowOutput | exception)` is called once. Both run on the worker thread.

  Attributes:
    ids: encoder tokens ending in EOS.
    seed: the sampling seed; rows with one seed and sample index draw the same tokens
      whatever else runs beside them.
    sample: which of a request's samples this row is (folded into its key).
    priority: lower is admitted first.
    min_tokens: the stop ids cannot be drawn before this many new tokens.
    ignore_eos: a stop id does not end the row: it writes max_new_tokens tokens.
    adapter: the stacked LoRA adapter it decodes with (0: the base model).
  """
  ids: list[int]
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  sample: int = 0
  priority: int = 0
  min_tokens: int = 0
  ignore_eos: bool = False
  adapter: int = 0
  on_tokens: Callable | None = None
  done: Callable = lambda result: None
  enqueued: float = dataclasses.field(default_factory=time.monotonic)
  cancelled: bool = False
  # Filled in by the worker.
  out: RowOutput | None = None
  first_token_at: float | None = None
  last_token_at: float | None = None

  def cancel(self) -> None:
    """Frees the row's slot within a step, or drops it from the queue (thread-safe)."""
    self.cancelled = True


class Engine(QueueWorker):
  """Continuous batching over `Slots` on one worker thread (`worker.QueueWorker`).

  Args:
    slots: the compiled slot state.
    max_queue: rows that may wait; more is QueueFull.
    max_queue_wait_s: a row waiting longer fails with QueueTimeout (None: no limit).
    encode_budget: rows encoded per loop while others decode (default half the slots).
    max_wait_ms: how long the loop after rows ended may wait for their clients' next rows
      (at most a quarter of the last step; only while clients come back that soon).
    metrics: a `t5forge.serve.metrics.Metrics`-like object, or None.
  """

  def __init__(self, slots: Slots, *, max_queue: int = 256,
               max_queue_wait_s: float | None = None, encode_budget: int | None = None,
               max_wait_ms: float = 30.0, metrics=None, on_ready: Callable | None = None):
    self.slots = slots
    self._running: dict[int, Row] = {}  # slot -> row
    self._release: set[int] = set()  # slots freed on the host, still active on the device
    self.max_wait = max_wait_ms / 1000.0
    self._step_s = 0.0  # the last step call's seconds
    self._ended_at = collections.deque(maxlen=4)  # when the last steps that ended rows did
    self._ended = 0  # rows the last step ended, whose clients may be sending their next
    # Moving share of admitted rows that arrived within the wait after rows ended.
    self._returning = 0.0
    super().__init__(name="t5forge-engine", max_queue=max_queue, metrics=metrics,
                     on_ready=on_ready)
    self.max_queue_wait_s = max_queue_wait_s
    self.encode_budget = encode_budget or max(1, slots.num_slots // 2)

  # -- callers' side ----------------------------------------------------------------------------
  def in_use(self) -> int:
    with self._cond:
      return len(self._running)


  def close(self, timeout: float | None = None) -> None:
    """`drain(timeout)` (rows still waiting or running after it fail with ShutDown),
    stops taking rows, then joins the worker once the queue and the slots are empty."""
    self.drain(timeout)
    with self._cond:
      self._closing = True
      self._cond.notify()
    if self._thread.is_alive():
      self._thread.join()

  def generate(self, rows: list[Row]) -> list[RowOutput]:
    """Runs rows to the end (the Python API and `t5forge infer`): they are fed to the
    slots as slots free up. Raises the first row's exception (for an internal error, the
    exception logged under its id)."""
    results: list = [None] * len(rows)
    left = threading.Semaphore(0)
    for i, r in enumerate(rows):
      def done(res, i=i):
        results[i] = res
        left.release()
      r.done = done
    for start in range(0, len(rows), self.max_queue):
      part = rows[start:start + self.max_queue]
      self.submit(part)
      for _ in part:
        left.acquire()
    for res in results:
      if isinstance(res, InternalError) and res.__cause__ is not None:
        raise res.__cause__
      if isinstance(res, BaseException):
        raise res
    return results

  # -- the worker -------------------------------------------------------------------------------
  def _gauges(self) -> None:
    super()._gauges()
    m = self.metrics
    if m is not None:
      m.running.set(len(self._running))
      m.slots_in_use.set(len(self._running) / self.slots.num_slots)

  def _forget_rows(self) -> None:
    self._running.clear()
    self._release.clear()

  def _warmup(self) -> int:
    return self.slots.warmup()

  def _serve(self) -> None:
    while True:
      admitted, dropped = self._admit()
      if admitted is None:
        return
      for r, exc, stage in dropped:
        self._fail([r], exc, stage)
      if admitted:
        self._insert(admitted)
      if self._running:
        self._step()

  def _admit(self):
    """Blocks until there is work; -> (rows placed in slots, [(row, exception, stage)]
    to fail), or (None, []) when closed and empty."""
    with self._cond:
      while not self._waiting and not self._running:
        if self._closing:
          return None, []
        self._cond.wait()
      self._wait_for_returns()
      now = time.monotonic()
      dropped = [(r, Cancelled(), "queued") for r in self._drop_cancelled()]
      keep = []
      expired = self._deadline is not None and now >= self._deadline
      for r in self._waiting:
        if expired:
          dropped.append((r, ShutDown("the server shut down before this row started"),
                          "shutdown"))
        elif self.max_queue_wait_s is not None and now - r.enqueued > self.max_queue_wait_s:
          dropped.append((r, QueueTimeout(), "queue_timeout"))
        else:
          keep.append(r)
      if expired:
        for slot, r in list(self._running.items()):
          dropped.append((r, ShutDown("the server shut down before this row finished"),
                          "shutdown"))
          del self._running[slot]
          self._release.add(slot)
      free = [s for s in range(self.slots.num_slots) if s not in self._running]
      budget = len(free) if not self._running else min(len(free), self.encode_budget)
      keep.sort(key=lambda r: (r.priority, r.enqueued))
      admitted, self._waiting = keep[:budget], keep[budget:]
      wait = self._wait_s()
      for r, slot in zip(admitted, free):
        self._running[slot] = r
        self._release.discard(slot)
        back = any(0.0 <= r.enqueued - t <= wait for t in self._ended_at)
        self._returning += 0.1 * (back - self._returning)
      self._gauges()
      return [(r, s) for r, s in zip(admitted, free)], dropped

  def _wait_s(self) -> float:
    """How long a loop may wait for returning clients: `max_wait`, at most a quarter of
    the last step (where steps are short, so is the time a slot would sit empty)."""
    return min(self.max_wait, 0.25 * self._step_s) if self._step_s else self.max_wait

  def _wait_for_returns(self) -> None:
    """(Lock held.) Right after a step ended rows, waits until as many rows wait as
    ended (or as slots are free), or the wait is over, when recent rows came back that
    soon (closed-loop clients): a row that arrives just after the next step started
    leaves its slot empty for that whole step. Waits only if the expected saving (the
    share of rows that arrive within the wait x rows ended x a step) is more than the
    wait x every slot."""
    expect, self._ended = self._ended, 0
    wait = self._wait_s()
    if not self._ended_at or (self._returning * expect * self._step_s
                              <= wait * self.slots.num_slots):
      return
    until = self._ended_at[-1] + wait
    while not self._closing and self._deadline is None:
      free = self.slots.num_slots - len(self._running)
      left = until - time.monotonic()
      if len(self._waiting) >= min(free, expect) or left <= 0:
        return
      self._cond.wait(left)

  def _insert(self, admitted) -> None:
    start = time.monotonic()
    if self.metrics is not None:
      for r, _ in admitted:
        self.metrics.queue_time.observe(start - r.enqueued)
    rows = [InsertRow(ids=r.ids, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                      top_k=r.top_k, top_p=r.top_p, seed=r.seed, sample=r.sample,
                      min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, adapter=r.adapter)
            for r, _ in admitted]
    try:
      self.slots.insert(rows, [s for _, s in admitted])
      if self.metrics is not None:
        # Only to time the encoder: the step after it waits for the insert anyway.
        jax.block_until_ready(self.slots.state.token)
        self.metrics.encode_seconds.observe(time.monotonic() - start)
    except Exception as e:  # noqa: BLE001
      # A failed insert fails its rows (HTTP 500, or 400 for bad input); the worker goes
      # on serving.
      err = e if isinstance(e, UserError) else internal_error(
          e, f"encoding {len(admitted)} row(s) into their slots failed")
      with self._cond:
        for r, slot in admitted:
          self._running.pop(slot, None)
          self._release.add(slot)
      for r, _ in admitted:
        self._settle(r, err)
      if not self.slots.sound():
        # The call consumed the donated state: the other rows' caches are gone too.
        self._restart_slots(err if isinstance(err, InternalError) else internal_error(
            e, "encoding left the slot state unusable"))

  def _step(self) -> None:
    with self._cond:
      free = np.zeros((self.slots.num_slots,), bool)
      free[list(self._release)] = True
      self._release.clear()
      running = dict(self._running)
    start = time.monotonic()
    try:
      out = self.slots.step(free)
    except Exception as e:  # noqa: BLE001 (no row to blame: all in flight fail, with one id)
      self._restart_slots(internal_error(e, f"a decode step of {len(running)} row(s) failed"))
      return
    now = time.monotonic()
    self._step_s = now - start
    m = self.metrics
    if m is not None:
      m.step_seconds.observe(now - start)
      m.batch_size.observe(len(running))
    finished = []
    for slot, r in running.items():
      if r.cancelled:
        finished.append((slot, r, Cancelled()))
        continue
      try:
        result = self._take_tokens(r, out, slot, now)
      except Exception as e:  # noqa: BLE001 (this row's callback or output: it alone fails)
        result = internal_error(e, "handing a row its new tokens (on_tokens) failed")
      if result is not None:
        finished.append((slot, r, result))
    with self._cond:
      for slot, _, _ in finished:
        self._running.pop(slot, None)
        self._release.add(slot)
      self._gauges()
    for _, r, result in finished:
      if isinstance(result, Cancelled) and m is not None:
        m.cancelled.labels("running").inc()
      self._settle(r, result)
    answered = sum(1 for _, _, result in finished if isinstance(result, RowOutput))
    if answered:  # the answers are out: their clients' next rows may follow
      self._ended_at.append(time.monotonic())
      self._ended = answered

  def _restart_slots(self, err: InternalError) -> None:
    """Fails every row in flight with `err` and rebuilds the slot state (every slot
    free). A reset that fails ends the worker (`QueueWorker._die`)."""
    with self._cond:
      rows = list(self._running.values())
      self._running.clear()
      self._release.clear()
      self._gauges()
    for r in rows:
      self._settle(r, err)
    self.slots.reset()

  def _take_tokens(self, r: Row, out, slot: int, now: float) -> RowOutput | None:
    """Hands row `r` its tokens of the step's `StepOut` `out` (arrays [slots, k]: slot
    `slot`'s row); -> its `RowOutput` once it ended (a stop id, max_new_tokens, a stop
    string or no token), else None."""
    m = self.metrics
    emitted = out.emitted[slot]
    n = int(emitted.sum())
    if r.out is None:
      r.out = RowOutput([], [], [], [], False)
    toks = out.tokens[slot, :n].tolist()
    stop = False
    if n:
      lps = out.logprobs[slot, :n].tolist()
      tids = out.top_ids[slot, :n].tolist()
      tlps = out.top_logprobs[slot, :n].tolist()
      r.out.tokens += toks
      r.out.logprobs += lps
      r.out.top_ids += tids
      r.out.top_logprobs += tlps
      if m is not None:
        if r.first_token_at is None:
          m.time_to_first_token.observe(now - r.enqueued)
        else:
          m.inter_token_latency.observe((now - r.last_token_at) / n)
      if r.first_token_at is None:
        r.first_token_at = now
      r.last_token_at = now
      if r.on_tokens is not None:
        stop = bool(r.on_tokens(toks, lps, tids, tlps))
    ended = bool(n) and not r.ignore_eos and self._is_stop(toks[-1])
    if ended or stop or len(r.out.tokens) >= r.max_new_tokens or (not n):
      r.out.finished = ended
      return r.out
    return None

  def _is_stop(self, token: int) -> bool:
    stops = self.slots.stop_ids
    return token in stops if isinstance(stops, tuple) else token == stops
