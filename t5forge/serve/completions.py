"""POST /v1/completions: OpenAI's legacy completions (+ top_k, num_beams, alpha).

    request body -> checks (api) -> Plan (greedy, sample or beam) -> rows: the engine's
    (greedy and sampling: continuous batching, one row per prompt or per sample) or the
    batcher's (beam search, and --scheduler static) -> each choice's text, decoded
    incrementally and cut at the stop sequences -> OpenAI's JSON, or its Server-Sent
    Events when stream=true

`run` is the path from encoder ids on, shared with chat (chat.py): `Shape` writes the
choices as `text_completion` or as `chat.completion`.

The worker threads turn tokens into text deltas (`text.ChoiceText`); a row whose text
hit a stop sequence is finished at once. Streamed deltas reach the response through an
asyncio queue. A client that leaves (streaming or not) cancels its rows: a queued row is
never encoded, a running one frees its slot; so does a request past --request_timeout_s
(a 504, or a stream's last event). A failed row is `service.client_error`'s answer (a
stream: its error object as the last event), never the exception's own text.

Shape letters: n decodes per prompt, l the decode length, k top log-probs.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

import fastapi
from fastapi import responses

from t5forge import engine as engine_lib
from t5forge.serve import api, compat
from t5forge.serve import batcher as batching
from t5forge.serve.service import Service, call_soon, client_error, resolver
from t5forge.serve.text import Choice, ChoiceText, LogprobStream, logprobs


class Plan:
  """How a completion request runs: its Kind, its batching group, which decodes are its
  choices. Greedy with n > 1 runs once and repeats the text (OpenAI's n at temperature 0)."""

  def __init__(self, req: api.CompletionRequest, kind_cls):
    lp = req.logprobs or 0
    if req.num_beams > 1:
      self.kind = kind_cls(method="beam", num_decodes=req.num_beams, top_logprobs=lp)
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


def _check_kind(s: Service, plan: Plan) -> None:
  """A 400 naming the option when the backend (an export) cannot run the plan's Kind."""
  if s.check_kind is None:
    return
  try:
    s.check_kind(plan.kind)
  except ValueError as e:
    k = plan.kind
    param = ("num_beams" if k.method == "beam" else "n" if k.num_decodes > 1 else
             "top_k" if k.topk else "logprobs" if k.top_logprobs else "temperature")
    raise api.ApiError(400, str(e), param=param, code="unsupported") from None


def encode_capped(s: Service, req: api.CompletionRequest) -> list[list[int]]:
  """A completion's prompt (a string, strings, token ids or lists of them) -> the encoder
  ids of each prompt, tokenized one at a time and refused (400) as soon as the request's
  tokens (the prompts so far plus n completions of max_tokens each) are over
  --max_request_tokens: a request over the cap costs no more tokenizing than it took to
  see that. A prompt too long or an id outside the vocabulary is a 400 naming `prompt` /
  `prompt[i]`."""
  cap = s.limits.max_request_tokens
  choices = max(req.n, req.num_beams)
  prompts = api.prompt_list(req.prompt)
  ids, cost = [], 0
  for i, p in enumerate(prompts):
    param = api.prompt_param(req.prompt, i)
    x = s.encode(p, param) if isinstance(p, str) else s.encode_ids(p, param)
    ids.append(x)
    cost += len(x) + choices * req.max_tokens
    if cap is not None and cost > cap:
      more = "" if i == len(prompts) - 1 else f" by prompt {i} of {len(prompts)}"
      raise api.ApiError(400, f"the request may use {cost} tokens{more} (prompts + n x "
                         f"max_tokens), over the limit of {cap} (--max_request_tokens); lower "
                         "max_tokens, n or the number of prompts", param="max_tokens",
                         code="request_too_large")
  return ids


class _Choices:
  """The choices of one request as their tokens arrive (on a worker thread): each has a
  `ChoiceText`; text deltas and endings go to the event loop's `events` queue when
  streaming, and each choice's `Choice` (or exception) settles its future. With
  `logprobs` (k, streaming on the engine) each event also carries its tokens' piece of
  the logprobs object (`LogprobStream`); `counts` are the tokens each choice decoded."""

  def __init__(self, s: Service, loop, count: int, stops: list[str], stream: bool,
               logprobs_k: int | None = None, ignore_eos: bool = False):
    self.loop = loop
    stop_ids = s.eos_id if s.stop_ids is None else s.stop_ids
    self.texts = [ChoiceText(s.vocabulary, stops, stop_ids, skip_stop_ids=ignore_eos)
                  for _ in range(count)]
    self.futs = [loop.create_future() for _ in range(count)]
    self.events: asyncio.Queue | None = asyncio.Queue() if stream else None
    self.lps = (None if logprobs_k is None or not stream else
                [LogprobStream(s.vocabulary, logprobs_k) for _ in range(count)])
    self.counts = [0] * count

  def _emit(self, index: int, delta: str, reason: str | None, lp=None) -> None:
    if self.events is not None and (delta or reason or (lp and lp["tokens"])):
      call_soon(self.loop, self.events.put_nowait, (index, delta, reason, lp))

  def tokens(self, indices: list[int], new_ids: list[int], lp_parts=None) -> bool:
    """New tokens of the choices `indices` (one decode), with (log-probs, top ids, top
    log-probs) when streaming logprobs; -> True once the text stopped."""
    text = self.texts[indices[0]]
    delta = text.feed(new_ids)
    lp = None
    if self.lps is not None:
      stream = self.lps[indices[0]]
      stream.add(new_ids, *lp_parts)
      lp = stream.release(text.sent)
    for i in indices:
      self.counts[i] += len(new_ids)
      self._emit(i, delta, None, lp)
    return text.stopped or text.closed

  def done(self, indices: list[int], result) -> None:
    """Settles the choices with a `Choice` or an exception (a stream reads its events
    only, not the futures)."""
    if isinstance(result, BaseException):
      if self.events is not None:
        call_soon(self.loop, self.events.put_nowait, (indices[0], result, "error", None))
        return
    else:
      text = self.texts[indices[0]]
      delta = text.finish()
      reason = text.finish_reason(result.finished)
      lp = (None if self.lps is None else
            self.lps[indices[0]].finish(len(text.final_text)))
      for i in indices:
        self._emit(i, delta, reason, lp)
    if self.events is None:
      for i in indices:
        resolver(self.loop, self.futs[i])(result)


def _engine_rows(s: Service, req, plan: Plan, ids, ch: _Choices, adapter: int) -> list:
  """One engine row per prompt (greedy: its n choices share it) or per sample, each
  with the request's `adapter` (0: the base model)."""
  n = len(plan.sources)
  seed = req.seed if req.seed is not None else secrets.randbelow(2 ** 31)
  rows = []
  for p, x in enumerate(ids):
    groups = ([list(range(p * n, p * n + n))] if plan.kind.method == "greedy"
              else [[p * n + j] for j in range(n)])
    for j, indices in enumerate(groups):
      for i in indices[1:]:  # greedy n > 1: one decode, its text n times
        ch.texts[i] = ch.texts[indices[0]]
      def on_tokens(toks, lps, tids, tlps, indices=indices):
        return ch.tokens(indices, toks, (lps, tids, tlps))

      def done(result, indices=indices):
        if not isinstance(result, BaseException):
          result = Choice(ids=result.tokens, token_logprobs=result.logprobs,
                          top_ids=result.top_ids, top_logprobs=result.top_logprobs,
                          finished=result.finished)
        ch.done(indices, result)

      rows.append(engine_lib.Row(
          ids=x, max_new_tokens=req.max_tokens,
          temperature=0.0 if plan.kind.method == "greedy" else req.temperature,
          top_k=req.top_k, top_p=req.top_p, seed=seed, sample=j, priority=req.priority,
          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, adapter=adapter,
          on_tokens=on_tokens, done=done))
  return rows


def _batcher_rows(s: Service, req, plan: Plan, ids, ch: _Choices, adapter: int) -> list:
  """One batcher row per prompt (beam search, or the static scheduler); its chunks are
  turned into each choice's new tokens."""
  n = len(plan.sources)
  rows = []
  for p, x in enumerate(ids):
    seen = [0] * n

    def on_chunk(tokens, lengths, finished, p=p, seen=seen):
      del finished
      for j, src in enumerate(plan.sources):
        new = tokens[src][seen[j]:int(lengths[src])].tolist()
        seen[j] = int(lengths[src])
        if new:
          ch.tokens([p * n + j], new)

    def done(result, p=p, seen=seen):
      for j, src in enumerate(plan.sources):
        if isinstance(result, BaseException):
          ch.done([p * n + j], result)
          continue
        length = int(result.lengths[src])
        new = result.tokens[src][seen[j]:length].tolist()
        if new:
          ch.tokens([p * n + j], new)
        pick = lambda a: None if a is None else a[src][:length].tolist()
        ch.done([p * n + j], Choice(
            ids=result.tokens[src][:length].tolist(), token_logprobs=pick(result.token_logprobs),
            top_ids=pick(result.top_ids), top_logprobs=pick(result.top_logprobs),
            finished=bool(result.finished[src])))

    rows.append(batching.Row(group=plan.group, kind=plan.kind, ids=x,
                             max_new_tokens=req.max_tokens, temperature=req.temperature,
                             topp=req.top_p, alpha=req.alpha, min_log_prob=req.min_log_prob,
                             seed=req.seed, adapter=adapter,
                             on_chunk=on_chunk if ch.events is not None else None, done=done))
  return rows


async def complete(s: Service, request: fastapi.Request):
  """Answers one POST /v1/completions: the response dict, or a StreamingResponse of SSE."""
  start = time.monotonic()
  req = api.parse(api.CompletionRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  api.check_completion(req, s.limits)
  adapter = s.check_model(req.model)
  compat.check(req, on_engine=s.engine is not None and req.num_beams == 1)
  ids = encode_capped(s, req)
  usage = bool(req.stream_options and req.stream_options.include_usage)
  return await run(s, request, req, ids, Shape(s.served_name(req.model), chat=False,
                                               include_usage=usage, adapter=adapter),
                   start=start)


class Shape:
  """How a request's choices are written: OpenAI's `text_completion` (`text` per choice)
  or its `chat.completion` (a `message`, and streamed `delta`s whose first names the
  role)."""

  def __init__(self, model: str, chat: bool, include_usage: bool = False, adapter: int = 0):
    self.model, self.chat, self.include_usage = model, chat, include_usage
    self.adapter = adapter  # the LoRA adapter `model` names (0: the base)
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())
    self.route = "/v1/chat/completions" if chat else "/v1/completions"

  def _head(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def response(self, choices: list[dict], usage: dict) -> dict:
    return {**self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices, "usage": usage}

  def choice(self, index: int, text: str, lp, reason: str) -> dict:
    if self.chat:
      return {"index": index, "message": {"role": "assistant", "content": text},
              "logprobs": lp, "finish_reason": reason}
    return {"text": text, "index": index, "logprobs": lp, "finish_reason": reason}

  def chunk(self, index: int, text: str | None, reason: str | None, lp=None) -> str:
    """One SSE event (with its tokens' piece of the logprobs object `lp`, if any); chat:
    text None is the first delta (the role)."""
    if self.chat:
      delta = ({"role": "assistant", "content": ""} if text is None else
               {"content": text} if text else {})
      choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
      head = self._head("chat.completion.chunk")
    else:
      choice = {"text": text or "", "index": index, "logprobs": lp, "finish_reason": reason}
      head = self._head("text_completion")
    body = {**head, "choices": [choice]}
    if self.include_usage:
      body["usage"] = None  # OpenAI: null on every chunk but the last
    return "data: " + json.dumps(body) + "\n\n"

  def usage_chunk(self, usage: dict) -> str:
    head = self._head("chat.completion.chunk" if self.chat else "text_completion")
    return "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


async def run(s: Service, request: fastapi.Request, req, ids: list[list[int]], shape: Shape,
              *, start: float):
  """Decodes the encoder inputs `ids` (one list per prompt, checked and tokenized) as the
  checked request `req` asks (max_tokens, temperature, n, stop, stream...); -> the
  response `shape` writes, or a StreamingResponse of its SSE. Completions and chat both
  end here."""
  plan = Plan(req, s.kind_cls)
  _check_kind(s, plan)
  stops = [] if req.stop is None else api.as_list(req.stop)
  n = len(plan.sources)
  ch = _Choices(s, asyncio.get_running_loop(), len(ids) * n, stops, req.stream,
                req.logprobs, req.ignore_eos)
  if s.engine is not None and plan.kind.method != "beam":
    rows = _engine_rows(s, req, plan, ids, ch, shape.adapter)
    s.submit_engine(rows)
  else:
    rows = _batcher_rows(s, req, plan, ids, ch, shape.adapter)
    s.submit(rows)
  prompt_tokens = sum(map(len, ids))
  s.metrics.prompt_tokens.inc(prompt_tokens)
  s.charge(request, prompt_tokens)

  if req.stream:
    # The middleware leaves the latency to the stream, which observes it when it ends.
    request.state.streaming = True
    return responses.StreamingResponse(
        _stream(s, ch, rows, shape, prompt_tokens, start, lambda n: s.charge(request, n)),
        media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

  try:
    results = await s.await_rows(request, ch.futs, rows, start=start)
  except BaseException:
    s.metrics.finish([])
    raise
  if results is None:
    s.metrics.finish([])
    s.charge(request, sum(len(t.ids) for t in ch.texts))
    return responses.Response(status_code=499)  # nobody reads it: the client left
  choices, completion_tokens = [], 0
  for i, (c, text) in enumerate(zip(results, ch.texts)):
    completion_tokens += len(c.ids)
    lp = None
    if req.logprobs is not None:
      k = req.logprobs
      lp = logprobs(s.vocabulary, c.ids, c.token_logprobs,
                    None if not k or c.top_ids is None else [t[:k] for t in c.top_ids],
                    None if not k or c.top_logprobs is None else [t[:k] for t in c.top_logprobs],
                    len(text.final_text))
    choices.append(shape.choice(i, text.final_text, lp, text.finish_reason(c.finished)))
  s.metrics.completion_tokens.inc(completion_tokens)
  s.charge(request, completion_tokens)
  s.metrics.finish([c["finish_reason"] for c in choices])
  return shape.response(choices, _usage(prompt_tokens, completion_tokens))


def _generated(ch: _Choices) -> int:
  """The tokens the choices decoded, as the unstreamed usage counts them: a stop id that
  ended a text (<end_of_turn>, left out of it) is one of them, and so are those that
  `ignore_eos` decoded past."""
  return sum(ch.counts)


async def _stream(s: Service, ch: _Choices, rows, shape: Shape, prompt_tokens: int,
                  start: float, charge):
  """OpenAI's SSE: (chat: a first delta with the role per choice) one `data: {...}` per
  text delta of a choice (with its tokens' logprobs when asked), its finish_reason in a
  last chunk, (stream_options.include_usage: a chunk with the usage and no choices) then
  `data: [DONE]`. A failed row, or --request_timeout_s, ends it with one `data:
  {"error": ...}` event instead. A client that leaves cancels the rows still running.
  `charge(tokens)` takes the output tokens from the caller's rate limit at the end."""
  left = len(ch.texts)
  reasons = []
  deadline = s.deadline(start)
  try:
    if shape.chat:
      for i in range(left):
        yield shape.chunk(i, None, None)
    while left:
      try:
        async with asyncio.timeout(None if deadline is None else
                                   max(0.0, deadline - time.monotonic())):
          index, delta, reason, lp = await ch.events.get()
      except TimeoutError:
        yield "data: " + json.dumps(s.timed_out().body()) + "\n\n"
        return
      if reason == "error":
        yield "data: " + json.dumps(client_error(delta).body()) + "\n\n"
        return
      if reason is not None:
        left -= 1
        reasons.append(reason)
        if delta or (lp and lp["tokens"]):
          yield shape.chunk(index, delta, None, lp)
          lp = None
        yield shape.chunk(index, "", reason, lp)
      else:
        yield shape.chunk(index, delta, None, lp)
    if shape.include_usage:
      yield shape.usage_chunk(_usage(prompt_tokens, _generated(ch)))
    yield "data: [DONE]\n\n"
  finally:
    for r in rows:
      r.cancel()
    generated = _generated(ch)
    s.metrics.completion_tokens.inc(generated)
    charge(generated)
    s.metrics.finish(reasons if not left else [])
    s.metrics.latency.labels(shape.route).observe(time.monotonic() - start)
