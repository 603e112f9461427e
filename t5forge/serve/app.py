"""The FastAPI application of `t5forge serve`: routes, auth, limits, streaming, metrics.

    POST /v1/completions   OpenAI's legacy completions (+ top_k, num_beams, alpha)
    POST /v1/score         {prompt, targets} -> summed log-likelihoods (T5X's score mode)
    GET  /v1/models        the one served model
    GET  /health           503 until the buckets are compiled (and while draining), then 200
    GET  /metrics          Prometheus text format
    GET  /                 the page to try the model (page.html beside this file)

Requests are parsed and tokenized on the event loop, queued to the `Batcher` (one worker
thread runs the model) and awaited; streamed completions receive the worker's chunks
through an asyncio queue and send OpenAI's Server-Sent Events.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import os
import time
import uuid
from typing import Any

import fastapi
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException

from t5forge.serve import api, batcher as batching
from t5forge.serve.metrics import Metrics

PAGE = os.path.join(os.path.dirname(__file__), "page.html")
ROUTES = ("/v1/completions", "/v1/score", "/v1/models", "/health", "/metrics", "/")
_OPEN = ("/health", "/")  # no key needed: liveness, and the static page (it asks for the key)


@dataclasses.dataclass
class Service:
  """What the routes need. `kind_cls` is `generation.Kind` (or the exported backend's,
  with `check_kind` refusing what an export cannot run and `can_score` False)."""
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
  draining: bool = False
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _error(status: int, message: str, **kw) -> responses.JSONResponse:
  e = api.ApiError(status, message, **kw)
  return responses.JSONResponse(e.body(), status_code=status, headers=e.headers)


# -- text ---------------------------------------------------------------------------------
def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
  """Cuts text before the earliest stop sequence; -> (text, whether one was found)."""
  hits = [i for i in (text.find(s) for s in stops) if i >= 0]
  return (text[:min(hits)], True) if hits else (text, False)


def _token_texts(vocab, ids: list[int]) -> tuple[list[str], list[int]]:
  """Each token's text as the difference of the decoded prefixes (SentencePiece joins
  pieces, so a piece alone decodes differently), and its offset in the completion."""
  texts, offsets, prev = [], [], ""
  for k in range(len(ids)):
    cur = vocab.decode(ids[:k + 1])
    texts.append(cur[len(prev):] if cur.startswith(prev) else cur)
    offsets.append(len(prev))
    prev = cur
  return texts, offsets


def _logprobs(vocab, ids, token_lp, top_ids, top_lp, keep_chars: int) -> dict:
  """OpenAI's legacy logprobs object for one choice (tokens up to keep_chars of text)."""
  texts, offsets = _token_texts(vocab, ids)
  n = sum(1 for o in offsets if o < keep_chars) if keep_chars < sum(map(len, texts)) else len(ids)
  tops = None
  if top_ids is not None:
    tops = []
    for k in range(n):
      prefix = vocab.decode(ids[:k])
      entry = {}
      for t, lp in zip(top_ids[k].tolist(), top_lp[k].tolist()):
        s = vocab.decode(ids[:k] + [t])
        entry.setdefault(s[len(prefix):] if s.startswith(prefix) else s, float(lp))
      tops.append(entry)
  return {"tokens": texts[:n], "token_logprobs": [float(x) for x in token_lp[:n]],
          "top_logprobs": tops, "text_offset": offsets[:n]}


class _Plan:
  """How a completion request runs: its Kind, its batching group, which decodes are its
  choices. Greedy with n > 1 runs once and repeats the text (OpenAI's n at temperature 0)."""

  def __init__(self, req: api.CompletionRequest, kind_cls):
    lp = req.logprobs or 0
    self.repeat = 1
    if req.num_beams > 1:
      self.kind = kind_cls(method="beam", num_decodes=req.num_beams)
      self.group = ("beam", self.kind, req.alpha)
      # beams come best last; the choices are the n best, best first
      self.sources = list(range(req.num_beams - 1, req.num_beams - 1 - req.n, -1))
    elif req.temperature == 0:
      self.kind = kind_cls(method="greedy", top_logprobs=lp)
      self.group = self.kind
      self.sources = [0] * req.n
    else:
      self.kind = kind_cls(method="sample", num_decodes=req.n, topk=req.top_k, top_logprobs=lp)
      # An explicit seed: a batch of this request alone (see batcher's docstring).
      self.group = self.kind if req.seed is None else ("seeded", self.kind, uuid.uuid4().hex)
      self.sources = list(range(req.n))


def create_app(service: Service) -> fastapi.FastAPI:
  """The application for one `Service`; `service.batcher` is started and closed by its
  lifespan (closing finishes the queued rows)."""
  s = service
  limits = s.limits

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    s.batcher.start()
    yield
    await asyncio.to_thread(s.batcher.close)

  app = fastapi.FastAPI(title="t5forge serve", lifespan=lifespan, docs_url=None,
                        redoc_url=None, openapi_url=None)

  # -- errors as OpenAI shapes them -------------------------------------------------------
  @app.exception_handler(api.ApiError)
  async def _api_error(_request, e: api.ApiError):
    return responses.JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e):
    if e.status_code == 404:
      return _error(404, f"no route {request.url.path}; routes: {', '.join(ROUTES)}",
                    param="path", code="not_found")
    return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                  param="method", code="method_not_allowed" if e.status_code == 405 else None)

  @app.exception_handler(Exception)
  async def _internal(_request, e: Exception):
    return _error(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")

  @app.middleware("http")
  async def _guard(request: fastapi.Request, call_next):
    """Draining, auth, and the request counters."""
    start = time.monotonic()
    path = request.url.path
    route = path if path in ROUTES else "other"
    if s.draining and path != "/health":
      resp = _error(503, "the server is shutting down", type_="server_error",
                    code="shutting_down", headers={"Retry-After": "5", "Connection": "close"})
    elif s.api_key is not None and path not in _OPEN and not _authorized(request, s.api_key):
      got = request.headers.get("authorization")
      resp = _error(401, "missing bearer key: send Authorization: Bearer <key>" if not got else
                    "wrong API key in the Authorization header", param="Authorization",
                    code="invalid_api_key")
    else:
      try:
        resp = await call_next(request)
      except Exception as e:  # pylint: disable=broad-except
        resp = _error(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")
    s.metrics.requests.labels(route, str(resp.status_code)).inc()
    if not getattr(request.state, "streaming", False):
      s.metrics.latency.labels(route).observe(time.monotonic() - start)
    return resp

  # -- helpers ------------------------------------------------------------------------------
  async def read_body(request: fastapi.Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
      raise api.ApiError(413, f"request body of {declared} bytes is over the limit of "
                         f"{limits.max_body_bytes}", param="body", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limits.max_body_bytes:
        raise api.ApiError(413, f"request body is over the limit of {limits.max_body_bytes} "
                           "bytes", param="body", code="body_too_large")
      chunks.append(chunk)
    return b"".join(chunks)

  def check_model(name: str | None) -> None:
    if name is not None and name != s.model_name:
      raise api.ApiError(404, f"model {name!r} is not served here; this server serves "
                         f"{s.model_name!r} (GET /v1/models)", param="model",
                         code="model_not_found")

  def encode(text: str, param: str) -> list[int]:
    ids = s.vocabulary.encode(text)
    ids = ids + [s.eos_id] if s.is_encoder_decoder else [0] + ids
    longest = min(limits.max_prompt_tokens, s.batcher.buckets.length[-1])
    if len(ids) > longest:
      raise api.ApiError(400, f"{param} is {len(ids)} tokens, over the limit of {longest} "
                         "(--max_prompt_tokens / --length_buckets)", param=param,
                         code="prompt_too_long")
    return ids

  def submit(rows: list[batching.Row]) -> None:
    try:
      s.batcher.submit(rows)
    except batching.QueueFull:
      raise api.ApiError(503, f"the queue is full ({s.batcher.max_queue} rows wait); retry "
                         "later", type_="server_error", code="queue_full",
                         headers={"Retry-After": "1"}) from None
    except batching.Closed:
      raise api.ApiError(503, "the server is shutting down", type_="server_error",
                         code="shutting_down", headers={"Retry-After": "5"}) from None

  def resolver(loop, fut):
    def done(result):
      def put():
        if fut.done():
          return
        if isinstance(result, BaseException):
          fut.set_exception(result)
        else:
          fut.set_result(result)
      loop.call_soon_threadsafe(put)
    return done

  # -- routes -------------------------------------------------------------------------------
  @app.get("/health")
  async def health():
    if s.draining:
      return _error(503, "draining: finishing the requests in flight", type_="server_error",
                    code="shutting_down", headers={"Retry-After": "5"})
    if s.batcher.failed is not None:
      return _error(503, f"warm-up failed: {s.batcher.failed}", type_="server_error",
                    code="failed")
    if not s.batcher.ready.is_set():
      return _error(503, "compiling the buckets; not ready yet", type_="server_error",
                    code="loading", headers={"Retry-After": "2"})
    return {"status": "ok", "model": s.model_name, "compiled_shapes": s.batcher.compiled_shapes,
            "queue_depth": s.batcher.queue_depth()}

  @app.get("/metrics")
  async def metrics():
    body, content_type = s.metrics.render()
    return responses.Response(body, media_type=content_type)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": s.model_name, "object": "model",
                                        "created": s.created, "owned_by": "t5forge"}]}

  @app.get("/")
  async def page():
    if not os.path.isfile(PAGE):
      raise api.ApiError(404, "this installation has no page (t5forge/serve/page.html)",
                         param="path", code="not_found")
    return responses.FileResponse(PAGE, media_type="text/html")

  @app.post("/v1/score")
  async def score(request: fastapi.Request):
    req = api.parse(api.ScoreRequest, await read_body(request), request.headers.get("content-type"))
    check_model(req.model)
    if not s.can_score:
      raise api.ApiError(400, "scoring is not available from an exported model; serve the "
                         "checkpoint for /v1/score", param="targets", code="unsupported")
    prompts, targets = api.check_score(req, limits)
    loop = asyncio.get_running_loop()
    rows, futs, n_tokens = [], [], 0
    longest_target = s.batcher.buckets.decode[-1]
    for i, (p, t) in enumerate(zip(prompts, targets)):
      ids = encode(p, "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
      tids = s.vocabulary.encode(t) + [s.eos_id]
      if len(tids) > longest_target:
        raise api.ApiError(400, f"target {i} is {len(tids)} tokens, over the limit of "
                           f"{longest_target} (--decode_buckets)", param=f"targets[{i}]",
                           code="target_too_long")
      fut = loop.create_future()
      rows.append(batching.Row(group=batching.SCORE, ids=ids, target_ids=tids,
                               done=resolver(loop, fut)))
      futs.append(fut)
      n_tokens += len(ids) + len(tids)
    submit(rows)
    s.metrics.prompt_tokens.inc(n_tokens)
    results = await asyncio.gather(*futs)
    return {"object": "list", "model": s.model_name,
            "data": [{"object": "score", "index": i, "log_likelihood": r.score}
                     for i, r in enumerate(results)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    start = time.monotonic()
    req = api.parse(api.CompletionRequest, await read_body(request),
                    request.headers.get("content-type"))
    api.check_completion(req, limits)
    check_model(req.model)
    if req.stream and req.logprobs is not None:
      raise api.ApiError(400, "logprobs are not sent with stream=true on this server; ask "
                         "without streaming", param="logprobs", code="unsupported")
    prompts = api.as_list(req.prompt)
    ids = [encode(p, "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
           for i, p in enumerate(prompts)]
    plan = _Plan(req, s.kind_cls)
    if s.check_kind is not None:
      try:
        s.check_kind(plan.kind)
      except ValueError as e:
        k = plan.kind
        param = ("num_beams" if k.method == "beam" else "n" if k.num_decodes > 1 else
                 "top_k" if k.topk else "logprobs" if k.top_logprobs else "temperature")
        raise api.ApiError(400, str(e), param=param, code="unsupported") from None
    stops = [] if req.stop is None else api.as_list(req.stop)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue | None = asyncio.Queue() if req.stream else None
    rows, futs = [], []
    for p, x in enumerate(ids):
      fut = loop.create_future()
      on_chunk = None
      if events is not None:
        on_chunk = (lambda p: lambda *a: loop.call_soon_threadsafe(
            events.put_nowait, ("chunk", p, a)))(p)
        fut.add_done_callback((lambda p: lambda f: events.put_nowait(("done", p, f)))(p))
      rows.append(batching.Row(group=plan.group, kind=plan.kind, ids=x,
                               max_new_tokens=req.max_tokens, temperature=req.temperature,
                               topp=req.top_p, alpha=req.alpha, seed=req.seed,
                               on_chunk=on_chunk, done=resolver(loop, fut)))
      futs.append(fut)
    submit(rows)
    prompt_tokens = sum(map(len, ids))
    s.metrics.prompt_tokens.inc(prompt_tokens)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = len(plan.sources)

    def decode(tokens, length) -> str:
      ids = tokens[:int(length)].tolist()
      if s.stop_ids is not None:
        from t5forge.decoding import text_ids  # pylint: disable=import-outside-toplevel
        ids = text_ids(ids, s.stop_ids)  # <end_of_turn> ends the text, not part of it
      return s.vocabulary.decode(ids)

    if events is not None:
      request.state.streaming = True
      return responses.StreamingResponse(
          _stream(s, events, plan, stops, len(prompts), rid, created, start, decode),
          media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    results = await asyncio.gather(*futs)
    choices, completion_tokens = [], 0
    for p, r in enumerate(results):
      for j, src in enumerate(plan.sources):
        length = int(r.lengths[src])
        text, stopped = _cut_at_stop(decode(r.tokens[src], length), stops)
        completion_tokens += length
        lp = None
        if req.logprobs is not None:
          tok = r.tokens[src][:length].tolist()
          lp = _logprobs(s.vocabulary, tok, r.token_logprobs[src][:length],
                         None if r.top_ids is None else r.top_ids[src][:length],
                         None if r.top_logprobs is None else r.top_logprobs[src][:length],
                         len(text))
        choices.append({"text": text, "index": p * n + j, "logprobs": lp,
                        "finish_reason": "stop" if stopped or bool(r.finished[src]) else "length"})
    s.metrics.completion_tokens.inc(completion_tokens)
    return {"id": rid, "object": "text_completion", "created": created, "model": s.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}

  return app


def _authorized(request: fastapi.Request, key: str) -> bool:
  got = request.headers.get("authorization", "")
  scheme, _, token = got.partition(" ")
  return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _stream(s: Service, events: asyncio.Queue, plan: _Plan, stops: list[str],
                  num_prompts: int, rid: str, created: int, start: float, decode):
  """OpenAI's SSE: one `data: {...}` per text delta of a choice, its finish_reason in a
  last chunk, then `data: [DONE]`. Text that could be the start of a stop sequence (or an
  incomplete UTF-8 piece) is held back until it is decided."""
  n = len(plan.sources)
  sent = {}            # choice index -> text sent
  finished = set()     # choice indices that sent their finish_reason
  hold = max((len(x) for x in stops), default=1) - 1
  completion_tokens = 0

  def chunk(index: int, text: str, reason: str | None) -> str:
    return "data: " + json.dumps({
        "id": rid, "object": "text_completion", "created": created, "model": s.model_name,
        "choices": [{"text": text, "index": index, "logprobs": None,
                     "finish_reason": reason}]}) + "\n\n"

  def deltas(p: int, tokens, lengths, final: bool, done_flags=None):
    out = []
    for j, src in enumerate(plan.sources):
      index = p * n + j
      if index in finished:
        continue
      text, stopped = _cut_at_stop(decode(tokens[src], lengths[src]), stops)
      have = sent.get(index, "")
      if not (final or stopped):
        text = text[:max(len(have), len(text) - hold)]
        text = text.rstrip("\ufffd")
      if len(text) > len(have) and text.startswith(have):
        out.append(chunk(index, text[len(have):], None))
        sent[index] = text
      if final or stopped:
        finished.add(index)
        out.append(chunk(index, "", "stop" if stopped or bool(done_flags[src]) else "length"))
    return out

  done_prompts = 0
  try:
    while done_prompts < num_prompts:
      what, p, payload = await events.get()
      if what == "chunk":
        tokens, lengths, fin = payload
        for c in deltas(p, tokens, lengths, False, fin):
          yield c
        continue
      done_prompts += 1
      if payload.exception() is not None:
        e = payload.exception()
        yield "data: " + json.dumps({"error": {"message": f"{type(e).__name__}: {e}",
                                               "type": "server_error", "param": None,
                                               "code": None}}) + "\n\n"
        return
      r = payload.result()
      completion_tokens += sum(int(r.lengths[src]) for src in plan.sources)
      for c in deltas(p, r.tokens, r.lengths, True, r.finished):
        yield c
    yield "data: [DONE]\n\n"
  finally:
    s.metrics.completion_tokens.inc(completion_tokens)
    s.metrics.latency.labels("/v1/completions").observe(time.monotonic() - start)
