"""`t5forge serve`'s application in the test's own process, asked over httpx's ASGI
transport (no socket, no subprocess): the `Service` the CLI would build from the same flags
(`t5forge.cli.serve.build_service`), whose workers and state a test can reach.

    srv = InProcess("--checkpoint", ckpt, *testing.FAST_FLAGS)
    srv.start()                                   # the workers compile; ready
    status, headers, body = srv.ask("/v1/completions", {"prompt": "God is love."})
    srv.close()

Every call has a deadline: a request that hangs fails the test with TimeoutError.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx2 as httpx

from t5forge.cli import serve as serve_cli
from t5forge.serve import app as app_lib

DEADLINE_S = 60.0  # one request of a tiny model takes well under a second


class InProcess:
  """`.service` (workers not started until `start`), `.app`."""

  def __init__(self, *argv: str):
    self.service = serve_cli.build_service(list(argv))
    self.app = app_lib.create_app(self.service)

  def start(self, wait: bool = True, timeout: float = 300) -> None:
    """Starts the workers (the application's lifespan does under uvicorn); with `wait`,
    until they are warm."""
    for w in self.service.workers():
      w.start()
    if wait:
      deadline = time.monotonic() + timeout
      for w in self.service.workers():
        assert w.ready.wait(max(0.0, deadline - time.monotonic())), "not warm in time"
        assert w.failed is None, w.failed

  def close(self, timeout: float = 30) -> None:
    for w in self.service.workers():
      w.close(timeout)

  async def call(self, path: str, body=None, *, method: str | None = None,
                 headers: dict | None = None, deadline_s: float = DEADLINE_S):
    """One request; -> (status, headers, parsed JSON or text). A streamed response is
    read whole (the transport collects it)."""
    transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://in-process") as c:
      r = await asyncio.wait_for(
          c.request(method or ("GET" if body is None else "POST"), path, json=body,
                    headers=headers), deadline_s)
    try:
      return r.status_code, r.headers, r.json()
    except ValueError:
      return r.status_code, r.headers, r.text

  def ask(self, path: str, body=None, **kw):
    """`call` from synchronous code."""
    return asyncio.run(self.call(path, body, **kw))

  def ask_all(self, calls: list) -> list:
    """[(path, body)] sent at once; -> their answers in order."""
    async def all_():
      return await asyncio.gather(*(self.call(p, b) for p, b in calls))
    return asyncio.run(all_())


def events(text: str) -> list:
  """The JSON objects of a Server-Sent Events body (`data: [DONE]` left out)."""
  return [json.loads(line[6:]) for line in text.splitlines()
          if line.startswith("data: {")]


async def poll(predicate, timeout: float, what: str, interval: float = 0.02) -> float:
  """Awaits `predicate()` true, polling; -> the seconds it took; TimeoutError after
  `timeout`."""
  start = time.monotonic()
  while not predicate():
    if time.monotonic() - start > timeout:
      raise TimeoutError(f"timed out waiting for {what} ({timeout:g} s)")
    await asyncio.sleep(interval)
  return time.monotonic() - start
