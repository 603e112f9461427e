"""SIGTERM with requests in flight: every accepted request
completes, new ones are refused, and `t5forge serve` exits 0."""
import threading

import pytest

from t5forge import testing as sh

MAX_TOKENS = 128
REQUESTS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sh.tiny_checkpoint(str(tmp_path_factory.mktemp("serve_term") / "tiny"))


@pytest.mark.slow
def test_sigterm_finishes_in_flight_refuses_new_exits_0(ckpt):
  # One row per model call and long outputs: the requests are still queued or running
  # when the signal arrives.
  srv = sh.Server(ckpt, "--max_batch_size", "1", "--batch_buckets", "1", "--length_buckets",
                  "32", "--decode_buckets", str(MAX_TOKENS), "--warmup", "greedy")
  try:
    results = {}

    def ask(i):
      results[i] = sh.request(srv.url, "/v1/completions", {
          "prompt": f"God is love {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
          "stream": i % 2 == 1}, timeout=300)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
      t.start()

    def depth() -> float:
      text = sh.request(srv.url, "/metrics")[2]
      return float(text.split("\nt5forge_queue_depth ")[1].split()[0])

    # All accepted: one running, the rest waiting in the queue.
    sh.wait_for(lambda: depth() >= 3, 60, "requests to queue")
    srv.proc.terminate()
    in_flight = REQUESTS - len(results)
    assert in_flight >= 3

    def draining() -> bool:  # /readyz says 503 from the signal on (or the socket is closed)
      try:
        return sh.request(srv.url, "/readyz", timeout=5)[0] == 503
      except OSError:
        return True
    sh.wait_for(draining, 30, "the server to drain after SIGTERM")
    try:
      status = sh.request(srv.url, "/v1/completions", {"prompt": "late", "max_tokens": 2},
                          timeout=30)[0]
    except OSError:
      status = "refused"   # the listening socket is closed
    assert status in (503, "refused"), status
    assert srv.proc.wait(300) == 0, srv.output()[-3000:]
    for t in threads:
      t.join(60)
    assert sorted(results) == list(range(REQUESTS))
    for i, (status, _, body) in results.items():
      assert status == 200, (i, body)
      if i % 2:   # streamed: SSE events ending in [DONE]
        assert body.rstrip().endswith("data: [DONE]"), body[-300:]
      else:
        assert body["choices"][0]["text"], body
  finally:
    srv.stop()
