"""The FastAPI application of `t5forge serve`: a `Service` wired to its routes (routes.py),
OpenAI-shaped errors, auth, draining and the request metrics.

Requests are parsed and tokenized on the event loop, queued to the `Batcher` (one worker
thread runs the model) and awaited; streamed completions receive the worker's chunks
through an asyncio queue and send OpenAI's Server-Sent Events (completions.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import fastapi
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException

from t5forge.serve import api, auth, routes
from t5forge.serve.service import Service, client_error, error_response

__all__ = ["Service", "create_app"]

# answered while draining: /health and /readyz say 503 themselves, /livez stays 200
_WHILE_DRAINING = ("/health", "/livez", "/readyz")


def create_app(service: Service) -> fastapi.FastAPI:
  """The application for one `Service` (kept as `app.state.service`); its batcher and
  engine are started and closed by its lifespan (closing finishes the queued rows, or
  fails what still runs after `service.shutdown_timeout`)."""

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    for w in service.workers():
      w.start()
    yield
    await asyncio.gather(*(asyncio.to_thread(w.close, service.shutdown_timeout or None)
                           for w in service.workers()))

  app = fastapi.FastAPI(title="t5forge serve", lifespan=lifespan, docs_url=None,
                        redoc_url=None, openapi_url=None)
  app.state.service = service
  if service.keys is None and service.api_key is not None:
    service.keys = auth.Keys({auth.DEFAULT_NAME: service.api_key})
  app.add_exception_handler(api.ApiError, _api_error)
  app.add_exception_handler(StarletteHTTPException, _http_error)
  app.add_exception_handler(Exception, _internal)
  app.middleware("http")(_guard)
  app.include_router(routes.router)
  return app


# -- errors as OpenAI shapes them ---------------------------------------------------------
async def _api_error(_request, e: api.ApiError):
  return responses.JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request, e):
  if e.status_code == 404:
    return error_response(404, f"no route {request.url.path}; routes: "
                          f"{', '.join(routes.ROUTES)}", param="path", code="not_found")
  return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        param="method",
                        code="method_not_allowed" if e.status_code == 405 else None)


async def _internal(_request, e: Exception):
  # The id only: the traceback is logged under it (client_error).
  return await _api_error(_request, client_error(e))


# -- every request --------------------------------------------------------------------------
async def _guard(request: fastapi.Request, call_next):
  """Draining, auth (every route not on `auth.OPEN` needs a key once keys are
  configured), the per-key rate limits, and the request counters."""
  s: Service = request.app.state.service
  start = time.monotonic()
  path = request.url.path
  route = path if path in routes.ROUTES else "other"
  guarded = path not in auth.OPEN
  # The caller's key NAME (None: no keys configured, or none of them was sent).
  name = s.keys.identify(request.headers.get("authorization")) if (
      guarded and s.keys is not None) else None
  if s.draining and path not in _WHILE_DRAINING:
    resp = error_response(503, "the server is shutting down", type_="server_error",
                          code="shutting_down",
                          headers={"Retry-After": "5", "Connection": "close"})
  elif guarded and s.keys is not None and name is None:
    resp = _unauthorized(request.headers.get("authorization"))
  else:
    try:
      if guarded:
        request.state.key_name = name
        if name is not None:
          s.metrics.key_requests.labels(name).inc()
        if s.limiter is not None:
          s.limiter.admit(name)
      resp = await call_next(request)
    except api.ApiError as e:  # a 429 of the limiter
      resp = error_response(e.status, e.message, param=e.param, type_=e.type, code=e.code,
                            headers=e.headers)
    except Exception as e:  # noqa: BLE001 (any bug: an id'd 500, its traceback in the log)
      err = client_error(e)
      resp = error_response(err.status, err.message, param=err.param, type_=err.type,
                            code=err.code, headers=err.headers)
  s.metrics.requests.labels(route, str(resp.status_code)).inc()
  # A stream observes its own latency when it ends (completions.py).
  if not getattr(request.state, "streaming", False):
    s.metrics.latency.labels(route).observe(time.monotonic() - start)
  return resp


def _unauthorized(got: str | None):
  """The 401 of a request without a configured key (the key it sent is never repeated)."""
  scheme = (got or "").strip().partition(" ")[0]
  message = ("missing bearer key: send Authorization: Bearer <key>" if not (got or "").strip()
             else "the Authorization header must be `Bearer <key>`" if scheme.lower() != "bearer"
             else "wrong API key in the Authorization header")
  return error_response(401, message, param="Authorization", code="invalid_api_key")
