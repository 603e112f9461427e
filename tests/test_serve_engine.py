"""`t5forge serve` on the continuous-batching engine, over real HTTP: clients that leave
free their slots (slot use read from /metrics), a request that would wait too long is a
503 with Retry-After, `priority` and the request-cost cap are checked, beam search (the
batcher's compiled path) returns what it returns alone while greedy traffic runs beside
it, and --shutdown_timeout ends streams that cannot finish with an error event."""
import http.client
import json
import threading
import time

import numpy as np
import pytest

from t5forge import testing as sh

pytestmark = pytest.mark.slow  # servers in subprocesses: make test, not test-fast

LONG = 2048  # new tokens: a row that holds its slot for seconds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sh.tiny_checkpoint(str(tmp_path_factory.mktemp("serve_engine") / "tiny"))


def _metric(url: str, name: str) -> float:
  text = sh.request(url, "/metrics")[2]
  return sum(float(line.split()[-1]) for line in text.splitlines()
             if line.startswith(name + " ") or line.startswith(name + "{"))


def _stream_open(url: str, body: dict) -> http.client.HTTPConnection:
  """Sends a streamed completion and reads its first event; the caller closes it."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
               {"Content-Type": "application/json"})
  resp = conn.getresponse()
  assert resp.status == 200
  resp.fp.readline()  # the first "data: ..." line: the row is decoding
  return conn


def test_clients_that_leave_free_their_slots(ckpt):
  flags = ["--slots", "2", "--max_batch_size", "2", "--length_buckets", "32",
           "--decode_buckets", str(LONG), "--chunk_tokens", "1"]
  with sh.Server(ckpt, *flags) as srv:
    body = {"prompt": "God is love", "max_tokens": LONG, "temperature": 0.9, "seed": 1,
            "top_p": 1}
    # A streamed client that leaves: its slot frees within a few steps.
    conn = _stream_open(srv.url, body)
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 1, 30, "one running")
    conn.close()
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 0, 10, "slot freed")
    assert _metric(srv.url, "t5forge_cancelled_total") >= 1
    # A non-streamed client that leaves: likewise.
    host, port = srv.url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 1, 30, "one running")
    c.close()
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 0, 10, "slot freed")
    # Two slots busy; a queued client that leaves is never encoded.
    held = [_stream_open(srv.url, body) for _ in range(2)]
    encodes = _metric(srv.url, "t5forge_encode_seconds_count")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    sh.wait_for(lambda: _metric(srv.url, "t5forge_queue_depth") == 1, 30, "one queued")
    c.close()
    sh.wait_for(lambda: _metric(srv.url, 't5forge_cancelled_total{stage="queued"}') == 1, 10,
                "the queued row dropped")
    for h in held:
      h.close()
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 0, 10, "slots freed")
    assert _metric(srv.url, "t5forge_encode_seconds_count") == encodes
    assert _metric(srv.url, "t5forge_compiles_since_ready") == 0


def test_queue_wait_priority_and_cost_limits(ckpt):
  flags = ["--slots", "1", "--max_batch_size", "1", "--length_buckets", "32",
           "--decode_buckets", str(LONG), "--chunk_tokens", "1", "--max_queue_wait_s", "0.3",
           "--max_request_tokens", "3000"]
  with sh.Server(ckpt, *flags) as srv:
    status, _, body = sh.request(srv.url, "/v1/completions", {
        "prompt": "God", "max_tokens": 4, "priority": 101})
    assert status == 400 and body["error"]["param"] == "priority", body
    assert "[-100, 100]" in body["error"]["message"]
    status, _, body = sh.request(srv.url, "/v1/completions", {
        "prompt": ["God", "is"], "max_tokens": LONG, "n": 1})
    assert status == 400 and body["error"]["code"] == "request_too_large", body
    assert "--max_request_tokens" in body["error"]["message"]
    held = _stream_open(srv.url, {"prompt": "God is love", "max_tokens": LONG,
                                  "temperature": 0.9, "seed": 3})
    try:
      status, headers, body = sh.request(srv.url, "/v1/completions", {
          "prompt": "God", "max_tokens": 4, "priority": -5})
    finally:
      held.close()
    assert status == 503 and body["error"]["code"] == "queue_timeout", body
    assert headers.get("retry-after") == "1"


def test_beams_beside_greedy_traffic_equal_beams_alone(ckpt):
  flags = ["--slots", "4", "--max_batch_size", "4", "--length_buckets", "32",
           "--decode_buckets", "16"]
  beam = {"prompt": "In the beginning God created", "max_tokens": 16, "num_beams": 4, "n": 4,
          "temperature": 0}
  with sh.Server(ckpt, *flags) as srv:
    alone = sh.request(srv.url, "/v1/completions", beam)[2]
    stop = threading.Event()

    def greedy():
      while not stop.is_set():
        sh.request(srv.url, "/v1/completions", {"prompt": "God is love", "max_tokens": 16,
                                                "temperature": 0})

    threads = [threading.Thread(target=greedy) for _ in range(4)]
    for t in threads:
      t.start()
    try:
      beside = [sh.request(srv.url, "/v1/completions", beam)[2] for _ in range(3)]
    finally:
      stop.set()
      for t in threads:
        t.join(60)
  texts = [c["text"] for c in alone["choices"]]
  for b in beside:
    assert [c["text"] for c in b["choices"]] == texts


def test_shutdown_timeout_ends_streams_with_an_error_event(ckpt):
  srv = sh.Server(ckpt, "--slots", "1", "--max_batch_size", "1", "--length_buckets", "32",
                  "--decode_buckets", str(LONG), "--chunk_tokens", "1",
                  "--shutdown_timeout", "0.5")
  try:
    bodies = {}

    def ask(i):
      bodies[i] = sh.request(srv.url, "/v1/completions", {
          "prompt": f"God is love {i}", "max_tokens": LONG, "temperature": 0.8,
          "seed": i, "stream": True}, timeout=120)[2]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    sh.wait_for(lambda: _metric(srv.url, "t5forge_running_requests") == 1, 30, "running")
    start = time.monotonic()
    srv.proc.terminate()
    assert srv.proc.wait(60) == 0, srv.output()[-2000:]
    assert time.monotonic() - start < 30
    for t in threads:
      t.join(60)
    ended = [b for b in bodies.values() if '"error"' in b]
    assert ended, bodies
    assert all("shut down" in b for b in ended)
  finally:
    srv.stop()


def test_seeded_text_is_the_same_alone_and_in_a_crowd(ckpt):
  flags = ["--slots", "8", "--max_batch_size", "8", "--length_buckets", "32",
           "--decode_buckets", "24"]
  asks = [{"prompt": f"God is love {i}", "max_tokens": 24, "temperature": 1.0, "seed": 7 + i,
           "n": 2} for i in range(6)]
  with sh.Server(ckpt, *flags) as srv:
    # Greedy n > 1: one decode, its text n times (streamed too).
    greedy = {"prompt": "God is love", "max_tokens": 12, "temperature": 0}
    one = sh.request(srv.url, "/v1/completions", greedy)[2]["choices"][0]["text"]
    assert one
    three = sh.request(srv.url, "/v1/completions", {**greedy, "n": 3})[2]["choices"]
    assert [c["text"] for c in three] == [one] * 3
    events = sh.request(srv.url, "/v1/completions", {**greedy, "n": 3, "stream": True})[2]
    streamed = ["", "", ""]
    for line in events.splitlines():
      if line.startswith("data: {"):
        c = json.loads(line[6:])["choices"][0]
        streamed[c["index"]] += c["text"]
    assert streamed == [one] * 3
    alone = [sh.request(srv.url, "/v1/completions", a)[2] for a in asks]
    crowd = [None] * len(asks)

    def ask(i):
      crowd[i] = sh.request(srv.url, "/v1/completions", asks[i])[2]

    order = np.random.default_rng(0).permutation(len(asks))
    threads = [threading.Thread(target=ask, args=(int(i),)) for i in order]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
  for a, c in zip(alone, crowd):
    assert [x["text"] for x in a["choices"]] == [x["text"] for x in c["choices"]]
