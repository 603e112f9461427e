"""POST /v1/completions: OpenAI's legacy completions (+ top_k, num_beams, alpha).

    request body -> checks (api) -> Plan (the Kind and batching group: greedy, sample or
    beam) -> one batcher Row per prompt -> texts cut at the stop sequences -> OpenAI's JSON,
    or its Server-Sent Events when stream=true

Streamed completions receive the worker's chunks through an asyncio queue; the text of a
chunk that could still turn into a stop sequence is held back until it is decided.

Shape letters: n decodes per prompt (the batcher's result rows), l the decode length,
k top log-probs.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import fastapi
from fastapi import responses

from t5forge.decoding import text_ids
from t5forge.serve import api
from t5forge.serve import batcher as batching
from t5forge.serve.service import Service, resolver


# -- text ---------------------------------------------------------------------------------
def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
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


def logprobs(vocab, ids, token_lp, top_ids, top_lp, keep_chars: int) -> dict:
  """OpenAI's legacy logprobs object for one choice (tokens up to keep_chars of text).

  Args:
    ids: the choice's l tokens; token_lp [l]: their log-probs.
    top_ids, top_lp: [l, k] the most likely tokens and their log-probs, or None.
    keep_chars: the length of the choice's text (after a stop sequence cut it).
  """
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


class Plan:
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


async def complete(s: Service, request: fastapi.Request):
  """Answers one POST /v1/completions: the response dict, or a StreamingResponse of SSE."""
  start = time.monotonic()
  req = api.parse(api.CompletionRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  api.check_completion(req, s.limits)
  s.check_model(req.model)
  if req.stream and req.logprobs is not None:
    raise api.ApiError(400, "logprobs are not sent with stream=true on this server; ask "
                       "without streaming", param="logprobs", code="unsupported")
  prompts = api.as_list(req.prompt)
  ids = [s.encode(p, "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
         for i, p in enumerate(prompts)]
  plan = Plan(req, s.kind_cls)
  _check_kind(s, plan)
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
  s.submit(rows)
  prompt_tokens = sum(map(len, ids))
  s.metrics.prompt_tokens.inc(prompt_tokens)
  rid = f"cmpl-{uuid.uuid4().hex}"
  created = int(time.time())
  n = len(plan.sources)

  def decode(tokens, length) -> str:
    ids = tokens[:int(length)].tolist()
    if s.stop_ids is not None:
      ids = text_ids(ids, s.stop_ids)  # <end_of_turn> ends the text, not part of it
    return s.vocabulary.decode(ids)

  if events is not None:
    # The middleware leaves the latency to the stream, which observes it when it ends.
    request.state.streaming = True
    return responses.StreamingResponse(
        _stream(s, events, plan, stops, len(prompts), rid, created, start, decode),
        media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

  results = await asyncio.gather(*futs)
  choices, completion_tokens = [], 0
  for p, r in enumerate(results):
    for j, src in enumerate(plan.sources):
      length = int(r.lengths[src])
      text, stopped = cut_at_stop(decode(r.tokens[src], length), stops)
      completion_tokens += length
      lp = None
      if req.logprobs is not None:
        tok = r.tokens[src][:length].tolist()
        lp = logprobs(s.vocabulary, tok, r.token_logprobs[src][:length],
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


async def _stream(s: Service, events: asyncio.Queue, plan: Plan, stops: list[str],
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
      text, stopped = cut_at_stop(decode(tokens[src], lengths[src]), stops)
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
