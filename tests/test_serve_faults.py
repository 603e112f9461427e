"""A server that never hangs silently (docs/serving.md, "When things go wrong"):

- a row's `done` or `on_tokens` callback that raises fails that row's request only: a 500
  whose message carries an error id (the log has the traceback under it), while the
  requests beside it answer as they do alone, /health stays 200 and the workers live on;
- a decode step that fails fails the rows in flight (500 with an id) and serving goes on;
- a worker that dies (its slot state cannot be rebuilt) answers its running and queued
  requests at once, /health and /readyz say 503 within a second, and `t5forge serve`
  exits 70 (a subprocess: the only test here that needs one);
- --request_timeout_s: a request past it gets 504 (a stream: an error event) and its rows
  leave the queue and the slots;
- --shutdown_timeout: rows still waiting for the static batcher after it fail;
- no internal error's text reaches a client.

Faults are injected by patching a worker's callbacks or its `Slots` methods on the
instance. One in-process server (tests/serve_inprocess.py) serves the module; the worker
that dies has its own. Every wait has a deadline.
"""
import asyncio
import json
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

import serve_fault_hook
from serve_inprocess import InProcess, events, poll
from t5forge import engine as engine_lib
from t5forge import testing as sh
from t5forge.cli import serve as serve_cli
from t5forge.errors import UserError
from t5forge.serve import batcher as batching
from train_helpers import ROOT

SECRET = "secret-fault-text-4e1b"  # in every injected exception; never in a response
ID = re.compile(r"internal error \(id ([0-9a-f]{12})\)")
PROMPTS = [f"God is love {i}." for i in range(6)]


def greedy(prompt, **kw):
  return {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}


def beam(prompt):
  return {"prompt": prompt, "max_tokens": 6, "num_beams": 2, "n": 2, "temperature": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sh.tiny_checkpoint(str(tmp_path_factory.mktemp("serve_faults") / "tiny"))


@pytest.fixture(scope="module")
def served(ckpt):
  srv = InProcess("--checkpoint", ckpt, *sh.FAST_FLAGS)
  srv.start()
  yield srv
  srv.close()


@pytest.fixture(scope="module")
def alone(served):
  """{(prompt, beam?): the texts of its choices} asked one at a time."""
  out = {}
  for p in PROMPTS:
    for is_beam, body in ((False, greedy(p)), (True, beam(p))):
      status, _, got = served.ask("/v1/completions", body)
      assert status == 200, got
      out[p, is_beam] = [c["text"] for c in got["choices"]]
  return out


def _internal(status, body) -> str:
  """Checks a 500 that names an error id and nothing else; -> the id."""
  assert status == 500, (status, body)
  err = body["error"]
  m = ID.fullmatch(err["message"])
  assert m, err
  assert err["type"] == "server_error" and err["code"] == "internal_error", err
  assert SECRET not in json.dumps(body)
  return m.group(1)


def _stream_error(status, text) -> dict:
  """The error event that ended a stream (200: its headers were sent)."""
  assert status == 200, (status, text)
  assert SECRET not in text
  errors = [e["error"] for e in events(text) if "error" in e]
  assert len(errors) == 1, text
  return errors[0]


def _logged(caplog, error_id: str) -> None:
  """The log holds the traceback of the injected exception under `error_id`."""
  hits = [r for r in caplog.records if error_id in r.getMessage() and r.exc_info]
  assert hits, [r.getMessage() for r in caplog.records]
  assert SECRET in caplog.text and "Traceback" in caplog.text


def _raise_on_results(done):
  """A `done` that fails while handling a result (its error path is left working)."""
  def wrapped(result):
    if not isinstance(result, BaseException):
      raise RuntimeError(f"{SECRET}: done")
    return done(result)
  return wrapped


def _raise(*_):
  raise RuntimeError(f"{SECRET}: on_tokens")


def test_a_raising_callback_fails_only_its_request(served, alone, monkeypatch, caplog):
  s = served.service
  ids = lambda p: tuple(s.encode(p, "prompt"))
  bad_done, bad_tokens = {ids(PROMPTS[1]), ids(PROMPTS[4])}, {ids(PROMPTS[3])}

  def faulty(submit):
    def wrapped(rows):
      for r in rows:
        if tuple(r.ids) in bad_done:
          r.done = _raise_on_results(r.done)
        if tuple(r.ids) in bad_tokens:
          r.on_tokens = _raise
      return submit(rows)
    return wrapped

  monkeypatch.setattr(s.engine, "submit", faulty(s.engine.submit))
  monkeypatch.setattr(s.batcher, "submit", faulty(s.batcher.submit))
  calls = [greedy(PROMPTS[0]), greedy(PROMPTS[1]), greedy(PROMPTS[2], stream=True),
           greedy(PROMPTS[3]), beam(PROMPTS[4]), beam(PROMPTS[0]), greedy(PROMPTS[5]),
           greedy(PROMPTS[1], stream=True)]
  got = served.ask_all([("/v1/completions", c) for c in calls])
  # Each failed request: a 500 with its own id, logged with the traceback.
  ids_seen = {_internal(*got[i][::2]) for i in (1, 3, 4)}
  assert len(ids_seen) == 3
  err = _stream_error(got[7][0], got[7][2])
  ids_seen.add(ID.fullmatch(err["message"]).group(1))
  for error_id in ids_seen:
    _logged(caplog, error_id)
  # The others: what each gives alone.
  for i, key in ((0, (PROMPTS[0], False)), (5, (PROMPTS[0], True)), (6, (PROMPTS[5], False))):
    status, _, body = got[i]
    assert status == 200 and [c["text"] for c in body["choices"]] == alone[key], (i, body)
  streamed = "".join(e["choices"][0]["text"] for e in events(got[2][2]))
  assert [streamed] == alone[PROMPTS[2], False]
  assert served.ask("/health")[0] == 200
  assert s.engine.alive() and s.batcher.alive()


def _chaos_calls() -> list:
  """40 distinct requests: greedy, seeded sampling, beam, embeddings and streamed
  log-probs."""
  calls = []
  for i in range(8):
    p = f"God is love {i}."
    calls += [("/v1/completions", greedy(p)),
              ("/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0.9,
                                   "top_p": 0.9, "top_k": 20, "seed": i}),
              ("/v1/completions", beam(p)),
              ("/v1/embeddings", {"input": p}),
              ("/v1/completions", greedy(p, stream=True, logprobs=2))]
  return calls


def _answer(path, body, status, text):
  """What a client compares: the texts (and log-probs) or the embedding."""
  assert status == 200, (path, body, status, text)
  if path == "/v1/embeddings":
    return np.asarray(text["data"][0]["embedding"])
  if body.get("stream"):
    evs = [e for e in events(text) if e.get("choices")]
    lps = [t for e in evs for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    return "".join(e["choices"][0]["text"] for e in evs), lps
  return [c["text"] for c in text["choices"]]


@pytest.mark.slow
def test_chaos_200_requests_with_5_percent_faulty_rows(served, monkeypatch, caplog):
  """200 concurrent requests of every kind while 10 of them (5%) have a callback that
  raises: those 10 get a 500 (a stream: an error event) with an error id; every other
  answers exactly as it does alone; /health stays 200 and both workers live."""
  s = served.service
  calls = _chaos_calls()
  alone = [_answer(p, b, *served.ask(p, b)[::2]) for p, b in calls]
  faulty = [("/v1/completions", greedy(f"Fault {i}.")) for i in range(4)]
  faulty += [("/v1/completions", greedy(f"Fault {i}.", stream=True)) for i in range(4, 7)]
  faulty += [("/v1/completions", beam("Fault 7.")), ("/v1/embeddings", {"input": "Fault 8."}),
             ("/v1/completions", greedy("Fault 9.", stream=True, logprobs=2))]
  bad = {tuple(s.encode(b.get("prompt", b.get("input")), "prompt")) for _, b in faulty}

  def faulty_rows(submit):
    def wrapped(rows):
      for r in rows:
        if tuple(r.ids) in bad:
          r.done = _raise_on_results(r.done)
          if getattr(r, "on_tokens", None) is not None:
            r.on_tokens = _raise
      return submit(rows)
    return wrapped

  monkeypatch.setattr(s.engine, "submit", faulty_rows(s.engine.submit))
  monkeypatch.setattr(s.batcher, "submit", faulty_rows(s.batcher.submit))
  order = list(range(len(calls))) * 4 + [None] * len(faulty)
  np.random.default_rng(0).shuffle(order)
  crowd, k = [], 0
  for i in order:
    if i is None:
      crowd.append(faulty[k])
      k += 1
    else:
      crowd.append(calls[i])
  assert len(crowd) == 170 and k == 10
  crowd = crowd + [calls[i % len(calls)] for i in range(30)]  # 200 in all
  got = served.ask_all(crowd)
  failed = 0
  for (path, body), (status, _, text) in zip(crowd, got):
    if (path, body) in faulty:
      failed += 1
      if body.get("stream"):
        err = _stream_error(status, text)
        assert ID.fullmatch(err["message"]), err
      else:
        _logged(caplog, _internal(status, text))
      continue
    want = alone[calls.index((path, body))]
    have = _answer(path, body, status, text)
    if path == "/v1/embeddings":
      np.testing.assert_allclose(have, want, atol=1e-5)
    else:
      assert have == want, (body, have, want)
  assert failed == 10
  assert served.ask("/health")[0] == 200
  assert s.engine.alive() and s.batcher.alive()


def test_a_failed_step_fails_the_rows_in_flight_and_serving_goes_on(served, alone,
                                                                     monkeypatch, caplog):
  s = served.service
  real = s.engine.slots.step
  fail = [2]  # the next two steps raise

  def step(free=None):
    if fail[0]:
      fail[0] -= 1
      raise RuntimeError(f"{SECRET}: step")
    return real(free)

  monkeypatch.setattr(s.engine.slots, "step", step)
  status, _, body = served.ask("/v1/completions", greedy(PROMPTS[0]))
  _logged(caplog, _internal(status, body))
  status, _, text = served.ask("/v1/completions", greedy(PROMPTS[0], stream=True))
  err = _stream_error(status, text)
  assert ID.fullmatch(err["message"]) and err["code"] == "internal_error", err
  status, _, body = served.ask("/v1/completions", greedy(PROMPTS[2]))
  assert status == 200 and [body["choices"][0]["text"]] == alone[PROMPTS[2], False]
  assert served.ask("/health")[0] == 200 and s.engine.alive()


def test_internal_error_text_never_reaches_the_client(served, monkeypatch, caplog):
  s = served.service

  def encode(text, param):
    raise RuntimeError(f"{SECRET}: encode")

  monkeypatch.setattr(s, "encode", encode)
  for path, body in (("/v1/completions", greedy("x")), ("/v1/score",
                                                         {"prompt": "x", "targets": "y"})):
    status, _, got = served.ask(path, body)
    _logged(caplog, _internal(status, got))
  # Bad input keeps its one-line message naming the field.
  monkeypatch.undo()
  status, _, got = served.ask("/v1/completions", {"prompt": "x", "max_tokens": 0})
  assert status == 400 and got["error"]["param"] == "max_tokens", got


def test_request_timeout_frees_the_rows(served, monkeypatch):
  s = served.service
  monkeypatch.setattr(s, "request_timeout_s", 1.0, raising=False)
  entered, release = threading.Event(), threading.Event()
  real = s.engine.slots.step

  def held(free=None):
    entered.set()
    release.wait(30)  # the test sets it; the deadline only bounds a failing test
    return real(free)

  monkeypatch.setattr(s.engine.slots, "step", held)

  async def go():
    start = time.monotonic()
    running = asyncio.ensure_future(served.call("/v1/completions", greedy(PROMPTS[0]),
                                                deadline_s=20))
    await poll(entered.is_set, 30, "the first row's step")
    queued = asyncio.ensure_future(served.call("/v1/completions",
                                               greedy(PROMPTS[1], stream=True), deadline_s=20))
    await poll(lambda: s.engine.queue_depth() == 1, 30, "the second row queued")
    answers = await asyncio.gather(running, queued)
    took = time.monotonic() - start
    release.set()
    await poll(lambda: s.engine.in_use() == 0 and s.engine.queue_depth() == 0, 30,
               "the rows to leave the slots and the queue")
    return answers, took

  try:
    (running, queued), took = asyncio.run(go())
  finally:
    release.set()
  assert took < 10, took
  status, _, body = running
  assert status == 504, (status, body)
  err = body["error"]
  assert err["code"] == "request_timeout" and "--request_timeout_s" in err["message"], err
  assert "\n" not in err["message"]
  err = _stream_error(queued[0], queued[2])
  assert err["code"] == "request_timeout", err
  monkeypatch.undo()
  assert served.ask("/v1/completions", greedy(PROMPTS[2]))[0] == 200


def test_a_bad_request_timeout_is_one_line():
  with pytest.raises(UserError, match=r"--request_timeout_s must be >= 0 seconds"):
    serve_cli.build_service(["--checkpoint", "unused", "--request_timeout_s", "-1"])


def test_a_dead_worker_answers_everyone_and_health_says_503(ckpt, monkeypatch, caplog):
  srv = InProcess("--checkpoint", ckpt, *sh.FAST_FLAGS)
  srv.start()
  s = srv.service
  entered, release = threading.Event(), threading.Event()

  def step(free=None):
    entered.set()
    release.wait(30)  # the test sets it; the deadline only bounds a failing test
    raise RuntimeError(f"{SECRET}: step")

  def reset():
    raise RuntimeError(f"{SECRET}: reset")

  # A failed step fails the rows in flight, then the slot state is rebuilt: here that
  # fails too, and the worker cannot go on.
  monkeypatch.setattr(s.engine.slots, "step", step)
  monkeypatch.setattr(s.engine.slots, "reset", reset)

  async def go():
    running = asyncio.ensure_future(srv.call("/v1/completions", greedy(PROMPTS[0])))
    await poll(entered.is_set, 30, "the first row's step")
    queued = [asyncio.ensure_future(srv.call("/v1/completions", greedy(PROMPTS[1]))),
              asyncio.ensure_future(srv.call("/v1/completions",
                                             greedy(PROMPTS[2], stream=True)))]
    await poll(lambda: s.engine.queue_depth() == 2, 30, "two rows queued")
    assert (await srv.call("/health"))[0] == 200
    release.set()
    took = {}
    for path in ("/health", "/readyz"):
      async def unready(path=path):
        return (await srv.call(path))[0] == 503
      start = time.monotonic()
      while not await unready():
        assert time.monotonic() - start < 1.0, f"{path} still 200 after 1 s"
        await asyncio.sleep(0.02)
      took[path] = time.monotonic() - start
    answers = await asyncio.wait_for(asyncio.gather(running, *queued), 10)
    return answers, took, await srv.call("/health"), await srv.call("/v1/completions",
                                                                    greedy(PROMPTS[3]))

  try:
    (running, queued, streamed), took, health, after = asyncio.run(go())
    _logged(caplog, _internal(running[0], running[2]))  # failed by the step
    for status, headers, body in (queued, after, health):
      assert status == 503, (status, body)
      err = body["error"]
      assert err["code"] == "worker_died" and ID.search(err["message"]), err
      assert SECRET not in json.dumps(body)
    assert queued[1].get("retry-after"), queued[1]
    err = _stream_error(streamed[0], streamed[2])
    assert err["code"] == "worker_died", err
    assert not s.engine.alive() and s.engine.died is not None
    _logged(caplog, s.engine.died.error_id)
  finally:
    release.set()
    srv.close()


HOOK = ("import sys; sys.path.insert(1, 'tests'); import serve_fault_hook; "
        "serve_fault_hook.main(sys.argv[1:])")


@pytest.mark.slow  # a subprocess
def test_the_process_exits_70_when_a_worker_dies(ckpt):
  srv = sh.Server(ckpt, *sh.FAST_FLAGS, command=[sys.executable, "-c", HOOK], cwd=ROOT)
  try:
    status, _, body = sh.request(srv.url, "/v1/completions", greedy(PROMPTS[0]))
    assert status == 200, body
    status, _, body = sh.request(srv.url, "/v1/completions",
                                 greedy([serve_fault_hook.MARKER, 5, 6]), timeout=30)
    assert status == 500 and serve_fault_hook.FAULT not in json.dumps(body), body
    error_id = ID.fullmatch(body["error"]["message"]).group(1)

    def unready():
      try:
        return sh.request(srv.url, "/health", timeout=1)[0] == 503
      except OSError:
        return srv.proc.poll() is not None  # already gone
    sh.wait_for(unready, 1.0, "/health to say 503", interval=0.02)
    assert srv.proc.wait(60) == 70, srv.output()[-3000:]
    out = srv.output()
    assert error_id in out and serve_fault_hook.FAULT in out and "Traceback" in out, out[-3000:]
  finally:
    srv.stop()


class _HeldGenerator:
  """A stand-in model whose `generate` (one batch) runs until `release` is set."""
  eos_id, is_encoder_decoder, adapter_count = 1, True, 0

  def __init__(self):
    self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

  def generate(self, kind, inputs, *, decode_length, **_):
    self.calls += 1
    self.entered.set()
    self.release.wait(30)  # the test sets it; the deadline only bounds a failing test
    b = inputs.shape[0]
    return types.SimpleNamespace(
        tokens=np.full((b, 1, decode_length), 5, np.int32), scores=np.zeros((b, 1)),
        token_logprobs=None, top_ids=None, top_logprobs=None,
        lengths=np.ones((b, 1), np.int32), finished=np.zeros((b, 1), bool))


def test_shutdown_timeout_fails_what_still_waits_for_the_static_batcher():
  gen = _HeldGenerator()
  b = batching.Batcher(gen, batching.Buckets(batch=(1,), length=(8,), decode=(4,)),
                       max_batch_size=1, max_wait_ms=0)
  b.start()
  assert b.ready.wait(30) and b.failed is None
  got = {}
  settled = threading.Semaphore(0)

  def row(name):
    def done(result):
      got[name] = result
      settled.release()
    return batching.Row(group="greedy", ids=[5, 1], max_new_tokens=2, done=done)

  try:
    b.submit([row("running")])
    assert gen.entered.wait(30)
    b.submit([row("waiting")])
    b.drain(1e-6)  # the deadline passes while the first batch still runs
    gen.release.set()
    for _ in range(2):
      assert settled.acquire(timeout=30)
  finally:
    gen.release.set()
    b.close(10)
  assert isinstance(got["running"], batching.RowResult), got  # its call had started
  assert isinstance(got["waiting"], engine_lib.ShutDown), got
  assert gen.calls == 1 and not b.alive()
