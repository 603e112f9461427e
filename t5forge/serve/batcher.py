"""Dynamic batching: requests from many HTTP clients become a few model calls.

One worker thread owns the model. It takes the oldest waiting row, then waits at most
`max_wait_ms` (counted from that row's arrival) for more rows of the same group, up to
`max_batch_size`, and runs them as one `Generator.generate` (or `score`) call. Rows that
arrive while a batch runs are waiting when it ends, so under load batches fill without
waiting at all.

Shapes are bucketed so a few compiled functions serve every request: the batch is padded
to the smallest `batch_buckets` size that holds it (padding rows are a lone EOS with one
new token), the inputs to the smallest `length_buckets` length, the output to the
smallest `decode_buckets` length >= the largest max_tokens in the batch. Per-row
max_tokens, temperature and top_p travel as [b] arrays, so rows with different values
share a batch.

Groups (what may share a batch): rows of one `generation.Kind` (method, samples or beams,
top_k, top_logprobs); beam rows also by alpha; score rows together; embedding rows
together, whatever their lengths and options (one `Generator.encode` call; each row
attends to its own keys only, so its hidden states do not depend on its batch). A sampled row with an
explicit `seed` batches only with the other rows of its own request, padded to the batch
bucket of that request's size: its output then depends on the request and the seed only,
never on which other requests happened to arrive with it. Rows for different LoRA
adapters (`t5forge serve --adapter`) share batches: each row carries its adapter index,
passed per row to the model of stacked adapters (beams and samples take their row's).

Shape letters: b batch rows (bucketed), i input length, l output length, n decodes per
row (docs/shapes.md).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
import time
from typing import Any, Callable

import numpy as np

from t5forge.engine import Cancelled, QueueWorker, ShutDown
from t5forge.errors import internal_error


@dataclasses.dataclass
class Row:
  """One prompt of a request. `done(result_or_exception)` and `on_chunk` are called from
  the worker thread; one that raises fails its own row only (`worker.QueueWorker`).

  Attributes:
    group: what the row may batch with (see the module docstring).
    ids: encoder tokens ending in EOS (decoder-only: [0, prompt...]).
    target_ids: score rows only: the target tokens ending in EOS.
    attended: embedding rows only: how many leading positions of `ids` are attended to
      as keys (its real tokens, or all of `ids` when its padding is content).
    on_chunk: streaming rows: called with (tokens [n, l], lengths [n], finished [n]) as
      decoding goes on (copies, the caller may keep them).
    adapter: the stacked LoRA adapter it runs with (0: the base model).
  """
  group: Any
  ids: list[int]
  kind: Any = None
  max_new_tokens: int = 16
  temperature: float = 0.0
  topp: float = 1.0
  alpha: float = 0.6
  min_log_prob: float | None = None  # beam rows: stop below this (None: never)
  seed: int | None = None
  target_ids: list[int] | None = None
  attended: int | None = None
  adapter: int = 0
  on_chunk: Callable | None = None
  done: Callable = lambda result: None
  enqueued: float = dataclasses.field(default_factory=time.monotonic)
  cancelled: bool = False

  def cancel(self) -> None:
    """The client left: the row is dropped if it has not started (a running batch ends)."""
    self.cancelled = True


@dataclasses.dataclass
class RowResult:
  """One row's share of `generation.Generated` (the row axis removed): tokens [n, l],
  scores [n], token_logprobs [n, l] | None, top_ids / top_logprobs [n, l, k] | None,
  lengths [n], finished [n]; for score rows only `score`; for embedding rows only
  `hidden`, the encoder's last hidden states [len(ids), e] (float32)."""
  tokens: np.ndarray | None = None
  scores: np.ndarray | None = None
  token_logprobs: np.ndarray | None = None
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None
  lengths: np.ndarray | None = None
  finished: np.ndarray | None = None
  score: float | None = None
  hidden: np.ndarray | None = None


def bucket(buckets: list[int], size: int) -> int:
  """The smallest bucket >= size (buckets sorted); ValueError if none is."""
  i = bisect.bisect_left(buckets, size)
  if i == len(buckets):
    raise ValueError(f"{size} is larger than the largest bucket {buckets[-1]}")
  return buckets[i]


@dataclasses.dataclass(frozen=True)
class Buckets:
  batch: tuple[int, ...]
  length: tuple[int, ...]     # input lengths (tokens incl. EOS / BOS)
  decode: tuple[int, ...]     # output lengths (new tokens; score: target lengths)


SCORE = "score"
EMBED = "embed"


class Batcher(QueueWorker):
  """Static batches over a `generation.Generator`, on one worker thread
  (`t5forge.engine.QueueWorker`).

  Args:
    generator: the model (`t5forge.generation.Generator` or an exported backend).
    buckets: the compiled shapes.
    max_batch_size: rows per model call at most (<= the largest batch bucket).
    max_wait_ms: how long the oldest row waits for company.
    max_queue: rows that may wait; more is QueueFull (HTTP 503 + Retry-After).
    metrics: a `metrics.Metrics`, or None.
    warmup_kinds, warmup_score, warmup_embed: what is compiled before `ready` is set.
  """

  def __init__(self, generator, buckets: Buckets, *, max_batch_size: int = 16,
               max_wait_ms: float = 10.0, max_queue: int = 256, metrics=None,
               warmup_kinds=(), warmup_score: bool = False, warmup_embed: bool = False,
               on_ready: Callable | None = None):
    super().__init__(name="t5forge-batcher", max_queue=max_queue, metrics=metrics,
                     on_ready=on_ready)
    self.generator, self.buckets = generator, buckets
    self.max_batch_size, self.max_wait = max_batch_size, max_wait_ms / 1000.0
    self._warmup_kinds, self._warmup_score = tuple(warmup_kinds), warmup_score
    self._warmup_embed = warmup_embed
    self._free_since = 0.0  # monotonic time the last batch finished
    self._seeds = itertools.count(random.SystemRandom().randrange(2 ** 30))

  def close(self, timeout: float | None = None) -> None:
    """`drain(timeout)` (rows still waiting after it fail with ShutDown; a batch already
    running finishes its call), stops taking rows, joins the worker (at most `timeout`
    s)."""
    self.drain(timeout)
    with self._cond:
      self._closing = True
      self._cond.notify()
    if self._thread.is_alive():
      self._thread.join(timeout)

  # -- the worker ---------------------------------------------------------------------------
  def _serve(self) -> None:
    while True:
      rows = self._take()
      if rows is None:
        return
      self._execute(rows)
      self._free_since = time.monotonic()

  def _warmup(self) -> int:
    b = self.buckets
    n = 0
    if self._warmup_kinds:
      n += self.generator.warmup(list(self._warmup_kinds), list(b.batch), list(b.length),
                                 list(b.decode))
    if self._warmup_score:
      for size in b.batch:
        for i in b.length:
          for t in b.decode:
            self.generator.score(np.ones((size, i), np.int32), np.ones((size, t), np.int32))
            n += 1
    if self._warmup_embed:
      for size in b.batch:
        for i in b.length:
          self.generator.encode(np.ones((size, i), np.int32), np.ones((size, i), bool))
          n += 1
    return n

  def _take(self) -> list[Row] | None:
    """Blocks for the next batch: rows of the oldest row's group (None: closed and empty).
    Rows whose client left are dropped, never run; so are those still waiting after the
    shutdown deadline (`drain`)."""
    while True:
      with self._cond:
        gone = self._drop_cancelled()
        late = []
        if self._deadline is not None and time.monotonic() >= self._deadline:
          late, self._waiting = self._waiting, []
          self._gauges()
        if not gone and not late:
          while not self._waiting:
            if self._closing:
              return None
            self._cond.wait()
          break
      self._fail(gone, Cancelled(), "queued")
      self._fail(late, ShutDown("the server shut down before this row started"), "shutdown")
    with self._cond:
      group = self._waiting[0].group
      # The wait counts from when the model became free, not from when the oldest row
      # arrived: rows queued during the last batch have waited longer than max_wait,
      # and starting at once would leave out the clients whose answers were just sent
      # (under steady load the batches then alternate between two half-full ones, each
      # padded to the full bucket: 0.46x the offline tokens/s at concurrency 16).
      deadline = max(self._waiting[0].enqueued, self._free_since) + self.max_wait
      while not self._closing:
        same = sum(1 for r in self._waiting if r.group == group)
        left = deadline - time.monotonic()
        if same >= self.max_batch_size or left <= 0:
          break
        self._cond.wait(left)
      rows, rest = [], []
      for r in self._waiting:
        (rows if r.group == group and len(rows) < self.max_batch_size else rest).append(r)
      self._waiting = rest
      self._gauges()
      return rows

  def _execute(self, rows: list[Row]) -> None:
    start = time.monotonic()
    if self.metrics is not None:
      self.metrics.batch_size.observe(len(rows))
      for r in rows:
        self.metrics.queue_time.observe(start - r.enqueued)
    try:
      if rows[0].group == SCORE:
        results = self._score(rows)
      elif rows[0].group == EMBED:
        results = self._embed(rows)
      else:
        results = self._generate(rows)
    except Exception as e:  # noqa: BLE001
      # One failed call fails its rows (HTTP 500, one error id); the worker goes on.
      err = internal_error(e, f"a batch of {len(rows)} row(s) failed")
      for r in rows:
        self._settle(r, err)
      return
    for r, res in zip(rows, results):
      self._settle(r, res)

  def _inputs(self, rows: list[Row], size: int) -> np.ndarray:
    eos = self.generator.eos_id
    width = bucket(list(self.buckets.length), max(len(r.ids) for r in rows))
    x = np.zeros((size, width), np.int32)
    for i, r in enumerate(rows):
      x[i, :len(r.ids)] = r.ids
    pad = [eos] if self.generator.is_encoder_decoder else [0, eos]
    x[len(rows):, :len(pad)] = pad
    return x

  def _adapters(self, rows: list[Row], size: int) -> dict:
    """{"adapters": [size] int32} for a model of stacked adapters (padding rows: the
    base), else {} (an export or a plain model takes no such argument)."""
    if not getattr(self.generator, "adapter_count", 0):
      return {}
    ids = np.zeros((size,), np.int32)
    ids[:len(rows)] = [r.adapter for r in rows]
    return {"adapters": ids}

  def _generate(self, rows: list[Row]) -> list:
    b = len(rows)
    size = bucket(list(self.buckets.batch), b)
    inputs = self._inputs(rows, size)
    length = bucket(list(self.buckets.decode), max(r.max_new_tokens for r in rows))
    max_new = np.ones((size,), np.int32)
    temperature = np.zeros((size,), np.float32)
    topp = np.ones((size,), np.float32)
    for i, r in enumerate(rows):
      max_new[i], temperature[i], topp[i] = r.max_new_tokens, r.temperature, r.topp
    # Per row, so that beam requests with different thresholds share a batch.
    min_log_prob = None
    if any(r.min_log_prob is not None for r in rows):
      min_log_prob = np.full((size,), -np.inf, np.float32)
      for i, r in enumerate(rows):
        min_log_prob[i] = -np.inf if r.min_log_prob is None else r.min_log_prob
    seed = rows[0].seed if rows[0].seed is not None else next(self._seeds)
    streaming = [(i, r.on_chunk) for i, r in enumerate(rows) if r.on_chunk is not None]
    broken = {}  # row -> the InternalError its on_chunk raised: it alone fails

    def on_chunk(tokens, lengths, finished):
      for i, fn in streaming:
        if i in broken:
          continue
        try:
          fn(np.array(tokens[i]), np.array(lengths[i]), np.array(finished[i]))
        except Exception as e:  # noqa: BLE001 (one row's callback never fails the batch)
          broken[i] = internal_error(e, "a row's on_chunk callback raised")

    g = self.generator.generate(rows[0].kind, inputs, decode_length=length,
                                max_new_tokens=max_new, temperature=temperature, topp=topp,
                                alpha=rows[0].alpha, min_log_prob=min_log_prob, seed=seed,
                                stream=bool(streaming),
                                on_chunk=on_chunk if streaming else None,
                                **self._adapters(rows, size))
    pick = lambda a, i: None if a is None else np.asarray(a[i])
    return [broken.get(i) or RowResult(
        tokens=np.asarray(g.tokens[i]), scores=np.asarray(g.scores[i]),
        token_logprobs=pick(g.token_logprobs, i), top_ids=pick(g.top_ids, i),
        top_logprobs=pick(g.top_logprobs, i), lengths=np.asarray(g.lengths[i]),
        finished=np.asarray(g.finished[i])) for i in range(b)]

  def _score(self, rows: list[Row]) -> list[RowResult]:
    size = bucket(list(self.buckets.batch), len(rows))
    inputs = self._inputs(rows, size)
    width = bucket(list(self.buckets.decode), max(len(r.target_ids) for r in rows))
    targets = np.zeros((size, width), np.int32)
    for i, r in enumerate(rows):
      targets[i, :len(r.target_ids)] = r.target_ids
    targets[len(rows):, 0] = self.generator.eos_id
    scores = np.asarray(self.generator.score(inputs, targets, **self._adapters(rows, size)))
    return [RowResult(score=float(scores[i])) for i in range(len(rows))]

  def _embed(self, rows: list[Row]) -> list[RowResult]:
    size = bucket(list(self.buckets.batch), len(rows))
    width = bucket(list(self.buckets.length), max(len(r.ids) for r in rows))
    inputs = np.zeros((size, width), np.int32)
    valid = np.zeros((size, width), bool)
    for i, r in enumerate(rows):
      inputs[i, :len(r.ids)] = r.ids
      valid[i, :r.attended] = True
    # Padding rows: a lone EOS (one key, so that their softmax rows have support).
    inputs[len(rows):, 0] = self.generator.eos_id
    valid[len(rows):, 0] = True
    hidden = self.generator.encode(inputs, valid, **self._adapters(rows, size))
    return [RowResult(hidden=np.asarray(hidden[i, :len(r.ids)])) for i, r in enumerate(rows)]
