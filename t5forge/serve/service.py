"""What the routes of `t5forge serve` share: the `Service` (model, batcher, limits, metrics)
and the steps every request goes through (read the body, check the model name, tokenize,
queue the rows, await their results).

A request's rows are queued to the `Engine` (greedy and sampled completions, continuous
batching) or to the `Batcher` (beam search, scoring, and everything with --scheduler
static). Their worker threads call `resolver`'s callback with each row's result; the
callback hands it to the request's asyncio future on the event loop. `await_rows` awaits
them until the client leaves or --request_timeout_s ends.

What a client is told of a failure is `client_error`'s: our own refusals as they are, and
for anything unexpected only `internal error (id ID)`, the traceback going to the log
under that id (`t5forge.errors.internal_error`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import fastapi
from fastapi import responses

from t5forge import engine as engine_lib
from t5forge.errors import InternalError, UserError, internal_error
from t5forge.serve import api, batcher as batching
from t5forge.serve.metrics import Metrics


def error_response(status: int, message: str, **kw) -> responses.JSONResponse:
  """OpenAI's error body `{"error": {...}}` with `status`; kw as `api.ApiError`'s."""
  e = api.ApiError(status, message, **kw)
  return responses.JSONResponse(e.body(), status_code=status, headers=e.headers)


def client_error(e: BaseException) -> api.ApiError:
  """What the client is told of `e` (a row's result or a handler's exception): our own
  refusals with their message, and for anything else a 500 naming only the error id its
  traceback is logged under (logged here unless a worker did already)."""
  if isinstance(e, api.ApiError):
    return e
  if isinstance(e, engine_lib.Cancelled):  # nobody reads it: the client left
    return api.ApiError(499, "the client left before the answer", code="cancelled")
  if isinstance(e, engine_lib.QueueTimeout):
    return api.ApiError(503, "no decode slot came free within --max_queue_wait_s; retry "
                        "later", type_="server_error", code="queue_timeout",
                        headers={"Retry-After": "1"})
  if isinstance(e, engine_lib.ShutDown):
    return api.ApiError(503, str(e), type_="server_error", code="shutting_down",
                        headers={"Retry-After": "5"})
  if isinstance(e, engine_lib.WorkerDied):
    return worker_died(e)
  if isinstance(e, UserError):  # bad input found late: its one line, as at start-up
    return api.ApiError(400, str(e).splitlines()[0], code="invalid_value")
  if not isinstance(e, InternalError):
    e = internal_error(e, "a request failed")
  return api.ApiError(500, str(e), type_="server_error", code="internal_error")


def worker_died(e: engine_lib.WorkerDied) -> api.ApiError:
  """The 503 of a request a dead worker cannot serve: the process is exiting, to be
  restarted by its supervisor."""
  return api.ApiError(503, f"{e}; the server is exiting to be restarted, retry shortly",
                      type_="server_error", code="worker_died", headers={"Retry-After": "5"})


def call_soon(loop, fn, *args) -> None:
  """`loop.call_soon_threadsafe(fn, *args)` from a worker thread, dropped once the loop
  is closed (an in-process application's requests and their clients are gone then)."""
  if not loop.is_closed():
    try:
      loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed between the check and the call
      pass


@dataclasses.dataclass
class Service:
  """What the routes need. `kind_cls` is `generation.Kind` (or the exported backend's,
  with `check_kind` refusing what an export cannot run and `can_score`, `can_embed` False).
  `engine` is None with --scheduler static (and for exports and decoder-only models)."""
  batcher: batching.Batcher
  vocabulary: Any
  kind_cls: Any
  model_name: str
  limits: api.Limits
  metrics: Metrics
  is_encoder_decoder: bool = True
  eos_id: int = 1
  stop_ids: Any = None  # several ids that end a row (ModelConfig.eos_token_ids), or None
  api_key: str | None = None
  check_kind: Any = None      # callable(kind) raising ValueError: what the backend cannot run
  can_score: bool = True
  can_embed: bool = True      # False: an export, which holds no encoder function
  draining: bool = False
  engine: Any = None
  shutdown_timeout: float = 0.0  # SIGTERM: fail what still runs after this (0: finish all)
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))
  chat_template: Any = None  # a chat_template.ChatTemplate, or None (chat is a 400)
  keys: Any = None            # auth.Keys (--api_key, --api_key_file), or None: open
  limiter: Any = None         # auth.Limiter (--requests_per_second, --tokens_per_minute)
  body_timeout_s: float = 30.0  # a body not read whole by then is a 408 (--body_timeout_s)
  request_timeout_s: float = 0.0  # a request running longer is a 504 (0: no limit)
  # --adapter: {name: index in the stacked LoRA weights, >= 1}; 0 is the base model.
  adapters: dict = dataclasses.field(default_factory=dict)

  def charge(self, request: fastapi.Request, tokens: int) -> None:
    """Takes `tokens` (prompt, then output) from the caller's --tokens_per_minute bucket;
    the guard (app.py) put the caller's key NAME in `request.state.key_name`."""
    if self.limiter is not None:
      self.limiter.charge(getattr(request.state, "key_name", None), tokens)

  async def read_body(self, request: fastapi.Request) -> bytes:
    """The body, refused (413) as soon as it is over `limits.max_body_bytes`, and (408,
    the connection closed) when it has not all arrived within `body_timeout_s`: a client
    that sends slowly only ever holds its own connection, never the event loop."""
    try:
      async with asyncio.timeout(self.body_timeout_s):
        return await self._read_body(request)
    except TimeoutError:
      raise api.ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} "
                         "s (--body_timeout_s); send it whole", param="body",
                         code="body_timeout", headers={"Connection": "close"}) from None

  async def _read_body(self, request: fastapi.Request) -> bytes:
    limit = self.limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
      raise api.ApiError(413, f"request body of {declared} bytes is over the limit of "
                         f"{limit}", param="body", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise api.ApiError(413, f"request body is over the limit of {limit} bytes",
                           param="body", code="body_too_large")
      chunks.append(chunk)
    return b"".join(chunks)

  def check_model(self, name: str | None) -> int:
    """The adapter the request's `model` names: 0 for the base model (or no name), its
    index for an --adapter; a 404 for any other name."""
    if name is None or name == self.model_name:
      return 0
    if name in self.adapters:
      return self.adapters[name]
    served = ", ".join(repr(n) for n in [self.model_name, *self.adapters])
    raise api.ApiError(404, f"model {name!r} is not served here; this server serves "
                       f"{served} (GET /v1/models)", param="model", code="model_not_found")

  def served_name(self, name: str | None) -> str:
    """The `model` a response names: the one asked for (an adapter), else the base."""
    return self.model_name if name is None else name

  def encode(self, text: str, param: str) -> list[int]:
    """`text` as the model takes it: pieces + EOS (encoder-decoder) or BOS 0 + pieces
    (decoder-only); a 400 naming `param` when it is over the prompt limit."""
    ids = self.vocabulary.encode(text)
    ids = ids + [self.eos_id] if self.is_encoder_decoder else [0] + ids
    return self._fit(ids, param)

  def encode_ids(self, ids: list[int], param: str) -> list[int]:
    """A token-id prompt as the model takes it: EOS appended (encoder-decoder) or BOS 0
    prepended (decoder-only) unless it is there already (ids from /tokenize have it); a
    400 naming `param[j]` for an id outside the vocabulary."""
    size = self.vocabulary.vocab_size
    bad = next((j for j, t in enumerate(ids) if not 0 <= t < size), None)
    if bad is not None:
      raise api.ApiError(400, f"{param}[{bad}] is token id {ids[bad]}, outside the vocabulary "
                         f"[0, {size})", param=f"{param}[{bad}]", code="invalid_token_id")
    if self.is_encoder_decoder and ids[-1] != self.eos_id:
      ids = ids + [self.eos_id]
    elif not self.is_encoder_decoder and ids[0] != 0:
      ids = [0] + ids
    return self._fit(ids, param)

  @property
  def max_input_tokens(self) -> int:
    """The longest prompt accepted, in tokens (EOS included)."""
    return min(self.limits.max_prompt_tokens, self.batcher.buckets.length[-1])

  def _fit(self, ids: list[int], param: str) -> list[int]:
    longest = self.max_input_tokens
    if len(ids) > longest:
      raise api.ApiError(400, f"{param} is {len(ids)} tokens, over the limit of {longest} "
                         "(--max_prompt_tokens / --length_buckets)", param=param,
                         code="prompt_too_long")
    return ids

  def submit(self, rows: list[batching.Row]) -> None:
    """Queues `rows` to the batcher together; a full queue or a closing server is a 503 +
    Retry-After."""
    self._submit(self.batcher, rows)

  def submit_engine(self, rows: list) -> None:
    """Queues engine rows together, as `submit`."""
    self._submit(self.engine, rows)

  @staticmethod
  def _submit(worker, rows) -> None:
    try:
      worker.submit(rows)
    except engine_lib.QueueFull:
      raise api.ApiError(503, f"the queue is full ({worker.max_queue} rows wait); "
                         "retry later", type_="server_error", code="queue_full",
                         headers={"Retry-After": "1"}) from None
    except engine_lib.WorkerDied as e:
      raise worker_died(e) from None
    except engine_lib.Closed:
      raise api.ApiError(503, "the server is shutting down", type_="server_error",
                         code="shutting_down", headers={"Retry-After": "5"}) from None

  def workers(self) -> list:
    """The worker threads' owners: the batcher, and the engine when there is one."""
    return [self.batcher] + ([self.engine] if self.engine is not None else [])

  def deadline(self, start: float) -> float | None:
    """The monotonic time a request that arrived at `start` must be answered by (None:
    no --request_timeout_s)."""
    return start + self.request_timeout_s if self.request_timeout_s else None

  def timed_out(self) -> api.ApiError:
    """The 504 of a request past --request_timeout_s (its rows are cancelled)."""
    return api.ApiError(504, f"the request ran past {self.request_timeout_s:g} s "
                        "(--request_timeout_s); ask for fewer tokens or retry later",
                        type_="server_error", code="request_timeout")

  async def await_rows(self, request: fastapi.Request, futs, rows, *,
                       start: float) -> list | None:
    """The futures' results; None (and the rows cancelled) if the client leaves first;
    the 504 of `timed_out` (the rows cancelled: they leave the queue, or their slots
    within a step) once the request that arrived at `start` is past
    --request_timeout_s.

    A task waits on the connection's next ASGI message, which is `http.disconnect` once
    the body has been read: the rows are cancelled as soon as the client goes."""
    async def left():
      while (await request.receive())["type"] != "http.disconnect":
        pass

    gathered = asyncio.gather(*futs)
    watcher = asyncio.ensure_future(left())
    deadline = self.deadline(start)
    try:
      await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED,
                         timeout=None if deadline is None else
                         max(0.0, deadline - time.monotonic()))
    finally:
      if not watcher.done():
        watcher.cancel()
    if gathered.done():
      return gathered.result()
    for r in rows:
      r.cancel()
    gathered.cancel()
    if watcher.done() and not watcher.cancelled():
      return None
    raise self.timed_out()


def resolver(loop, fut):
  """A row's `done` callback (called on a worker thread) that settles `fut` on `loop`
  with the result, or with `client_error` of the exception, unless the request already
  went away."""
  def done(result):
    def put():
      if fut.done():
        return
      if isinstance(result, BaseException):
        fut.set_exception(client_error(result))
      else:
        fut.set_result(result)
    call_soon(loop, put)
  return done
