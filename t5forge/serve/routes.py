"""The routes of `t5forge serve`, on one `APIRouter` (`router`); each reads the `Service`
from `request.app.state.service` (set by `app.create_app`).

    POST /v1/completions   OpenAI's legacy completions (+ top_k, num_beams, alpha)
    POST /v1/chat/completions  OpenAI's chat completions (the checkpoint's chat template)
    POST /tokenize         {prompt} or {messages} -> the encoder's ids (vLLM's shape)
    POST /detokenize       {tokens} -> the text
    POST /v1/score         {prompt, targets} -> summed log-likelihoods (T5X's score mode)
    POST /v1/embeddings    OpenAI's embeddings from the encoder (+ pooling, padding)
    GET  /v1/models        the served model and its --adapter LoRA adapters (+ max_input_tokens,
                           max_output_tokens; an adapter's `parent` is the base)
    GET  /health           503 until the buckets are compiled, while draining, and once a
                           worker died (the process then exits), else 200
    GET  /readyz           the same as /health (Kubernetes' readiness probe)
    GET  /livez            200 as soon as the app runs, compiling or draining (liveness)
    GET  /version          {"version": t5forge's version}
    GET  /metrics          Prometheus text format
    GET  /                 the page to try the model (page.html beside this file)
"""
from __future__ import annotations

import asyncio
import os
import time

import fastapi
from fastapi import responses

import t5forge
from t5forge.serve import api, batcher as batching, chat as chat_lib, completions as completions_lib
from t5forge.serve import embeddings as embeddings_lib, tokens as tokens_lib
from t5forge.serve.service import Service, error_response, resolver, worker_died

PAGE = os.path.join(os.path.dirname(__file__), "page.html")
ROUTES = ("/v1/completions", "/v1/score", "/v1/models", "/health", "/metrics", "/",
          "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings", "/readyz",
          "/livez", "/version")

router = fastapi.APIRouter()


def service_of(request: fastapi.Request) -> Service:
  """The `Service` the application serves."""
  return request.app.state.service


@router.get("/livez")
async def livez():
  return {"status": "alive"}


@router.get("/version")
async def version():
  return {"version": t5forge.__version__}


@router.get("/readyz")
@router.get("/health")
async def health(request: fastapi.Request):
  s = service_of(request)
  workers = s.workers()
  died = next((w.died for w in workers if w.died is not None), None)
  if died is not None:
    e = worker_died(died)
    return error_response(e.status, e.message, type_=e.type, code=e.code, headers=e.headers)
  if s.draining:
    return error_response(503, "draining: finishing the requests in flight",
                          type_="server_error", code="shutting_down",
                          headers={"Retry-After": "5"})
  if any(w.failed is not None for w in workers):
    # What failed is in the server's log, not for whoever asks.
    return error_response(503, "the warm-up failed; the server's log says why",
                          type_="server_error", code="failed")
  if any(w.ready.is_set() and not w.alive() for w in workers):
    return error_response(503, "a worker thread is gone; the server is exiting",
                          type_="server_error", code="worker_died")
  if not all(w.ready.is_set() for w in workers):
    return error_response(503, "compiling the buckets; not ready yet", type_="server_error",
                          code="loading", headers={"Retry-After": "2"})
  out = {"status": "ok", "model": s.model_name,
         "compiled_shapes": sum(w.compiled_shapes for w in workers),
         "queue_depth": sum(w.queue_depth() for w in workers),
         # from the last worker to be ready (the engine warms up after the batcher)
         "compiles_since_ready": (s.engine or s.batcher).compiles_since_ready()}
  if s.engine is not None:
    out.update(slots=s.engine.slots.num_slots, slots_in_use=s.engine.in_use())
  return out


@router.get("/metrics")
async def metrics(request: fastapi.Request):
  body, content_type = service_of(request).metrics.render()
  return responses.Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: fastapi.Request):
  s = service_of(request)
  # max_model_len as vLLM reports it: here the longest prompt (the encoder's input; an
  # encoder-decoder's answer has its own budget, max_output_tokens).
  card = {"object": "model", "created": s.created, "owned_by": "t5forge",
          "max_input_tokens": s.max_input_tokens, "max_output_tokens": s.limits.max_tokens,
          "max_model_len": s.max_input_tokens}
  # --adapter: one entry per LoRA adapter, its `parent` the base (as vLLM lists them).
  return {"object": "list", "data": [{"id": s.model_name, **card}] + [
      {"id": name, **card, "parent": s.model_name} for name in s.adapters]}


@router.get("/")
async def page():
  if not os.path.isfile(PAGE):
    raise api.ApiError(404, "this installation has no page (t5forge/serve/page.html)",
                       param="path", code="not_found")
  return responses.FileResponse(PAGE, media_type="text/html")


@router.post("/v1/score")
async def score(request: fastapi.Request):
  """Each (prompt, target) pair's summed log-likelihood, one batcher row per pair."""
  start = time.monotonic()
  s = service_of(request)
  req = api.parse(api.ScoreRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  adapter = s.check_model(req.model)
  if not s.can_score:
    raise api.ApiError(400, "scoring is not available from an exported model; serve the "
                       "checkpoint for /v1/score", param="targets", code="unsupported")
  prompts, targets = api.check_score(req, s.limits)
  loop = asyncio.get_running_loop()
  rows, futs, n_tokens = [], [], 0
  longest_target = s.batcher.buckets.decode[-1]
  for i, (p, t) in enumerate(zip(prompts, targets)):
    ids = s.encode(p, "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
    tids = s.vocabulary.encode(t) + [s.eos_id]
    if len(tids) > longest_target:
      raise api.ApiError(400, f"target {i} is {len(tids)} tokens, over the limit of "
                         f"{longest_target} (--decode_buckets)", param=f"targets[{i}]",
                         code="target_too_long")
    fut = loop.create_future()
    rows.append(batching.Row(group=batching.SCORE, ids=ids, target_ids=tids,
                             adapter=adapter, done=resolver(loop, fut)))
    futs.append(fut)
    n_tokens += len(ids) + len(tids)
  s.submit(rows)
  s.metrics.prompt_tokens.inc(n_tokens)
  s.charge(request, n_tokens)
  results = await s.await_rows(request, futs, rows, start=start)
  if results is None:
    return responses.Response(status_code=499)  # nobody reads it: the client left
  return {"object": "list", "model": s.served_name(req.model),
          "data": [{"object": "score", "index": i, "log_likelihood": r.score}
                   for i, r in enumerate(results)],
          "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


@router.post("/v1/completions")
async def completions(request: fastapi.Request):
  return await completions_lib.complete(service_of(request), request)


@router.post("/v1/chat/completions")
async def chat_completions(request: fastapi.Request):
  return await chat_lib.complete(service_of(request), request)


@router.post("/tokenize")
async def tokenize(request: fastapi.Request):
  return await tokens_lib.tokenize(service_of(request), request)


@router.post("/detokenize")
async def detokenize(request: fastapi.Request):
  return await tokens_lib.detokenize(service_of(request), request)


@router.post("/v1/embeddings")
async def embeddings(request: fastapi.Request):
  return await embeddings_lib.create(service_of(request), request)
