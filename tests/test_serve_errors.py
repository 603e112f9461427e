"""`t5forge serve` refuses bad input the way OpenAI does:
each bad request is a 4xx whose `{"error": {...}}` names the field, and the next good request
still succeeds; a full queue is a 503 with Retry-After; start-up errors (missing checkpoint,
no vocabulary, port in use, buckets that do not fit) are one `t5forge: error:` line. One
server serves the module; the full queue is checked in-process, its workers held before
their warm-up."""
import asyncio
import socket
import subprocess
import sys
import threading

import pytest

from serve_inprocess import InProcess, poll
from t5forge import testing as sh
from train_helpers import ROOT, error_line

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"prompt": "God is love.", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sh.tiny_checkpoint(str(tmp_path_factory.mktemp("serve_err") / "tiny"))


@pytest.fixture(scope="module")
def server(ckpt):
  """Queue of one row, at most 16 prompt tokens, n <= 2, 4 KiB bodies, a key."""
  srv = sh.Server(ckpt, *sh.FAST_FLAGS, "--max_queue", "1", "--max_prompt_tokens", "16",
                  "--max_n", "2", "--max_body_bytes", "4096", "--api_key", KEY,
                  "--warmup", "greedy,sample")
  try:
    yield srv
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]


def test_queue_full_is_503_with_retry_after(ckpt):
  """The workers wait for `gate` before their warm-up, so nothing is taken from the
  queue: one request fills the one-row queue, the next gets 503 + Retry-After, /health
  says 503 (compiling); once the gate opens the first is answered."""
  srv = InProcess("--checkpoint", ckpt, *sh.FAST_FLAGS, "--max_queue", "1")
  gate = threading.Event()
  srv.service.batcher.warm_after = gate  # the engine warms up after the batcher
  srv.start(wait=False)
  engine = srv.service.engine

  async def go():
    seen = {"health_before": (await srv.call("/health"))[0]}
    first = asyncio.ensure_future(srv.call("/v1/completions", GOOD, deadline_s=300))
    await poll(lambda: engine.queue_depth() == 1, 60, "the first request to be queued")
    seen["second"] = await srv.call("/v1/completions", GOOD)
    seen["health_during"] = (await srv.call("/health"))[0]
    gate.set()
    seen["first"] = await first
    return seen

  try:
    seen = asyncio.run(go())
  finally:
    gate.set()
    srv.close()
  assert seen["health_before"] == 503 and seen["health_during"] == 503  # still compiling
  status, headers, body = seen["second"]
  assert status == 503 and headers.get("retry-after") == "1", (status, body)
  assert body["error"]["code"] == "queue_full"
  status, _, body = seen["first"]  # queued before the warm-up, answered after it
  assert status == 200 and body["choices"][0]["text"], body


LONG = "God is love and light and life. " * 8   # > 16 tokens
BAD = [
    # (name, path, body or raw bytes, extra headers, status, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', {}, 400, "body"),
    ("JSON not an object", "/v1/completions", b'["x"]', {}, 400, "body"),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, {}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, {}, 400, "prompt"),
    ("prompt list item wrong type", "/v1/completions", {"prompt": ["a", 3]}, {}, 400,
     "prompt[1]"),
    ("empty prompt", "/v1/completions", {"prompt": "  "}, {}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, {}, 400, "prompt"),
    ("prompt over the limit", "/v1/completions", {"prompt": LONG}, {}, 400, "prompt"),
    ("more prompts than the queue holds", "/v1/completions", {"prompt": ["a", "b"]}, {}, 400,
     "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "4"}, {}, 400,
     "max_tokens"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -3}, {}, 400,
     "max_tokens"),
    ("max_tokens huge", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 6}, {}, 400,
     "max_tokens"),
    ("n over the limit", "/v1/completions", {"prompt": "x", "n": 3}, {}, 400, "n"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, {}, 400,
     "temperature"),
    ("num_beams 0", "/v1/completions", {"prompt": "x", "num_beams": 0}, {}, 400, "num_beams"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, {}, 400, "top_p"),
    ("top_p over 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, {}, 400, "top_p"),
    ("logprobs over 5", "/v1/completions", {"prompt": "x", "logprobs": 9}, {}, 400, "logprobs"),
    ("stream not a bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, {}, 400, "stream"),
    ("too many stops", "/v1/completions", {"prompt": "x", "stop": list("abcde")}, {}, 400, "stop"),
    ("unknown field", "/v1/completions", {"prompt": "x", "frequency_penality": 1}, {}, 400,
     "frequency_penality"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, {}, 404, "model"),
    ("wrong content type", "/v1/completions", b'{"prompt": "x"}',
     {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("body over the size limit", "/v1/completions", {"prompt": "x" * 5000}, {}, 413, "body"),
    ("missing bearer key", "/v1/completions", dict(GOOD), {"Authorization": ""}, 401,
     "Authorization"),
    ("wrong bearer key", "/v1/completions", dict(GOOD), {"Authorization": "Bearer nope"}, 401,
     "Authorization"),
    ("score targets mismatch", "/v1/score", {"prompt": ["a", "b"], "targets": ["x", "y", "z"]},
     {}, 400, "targets"),
    ("score unknown field", "/v1/score", {"prompt": "a", "targets": "b", "target": "c"}, {}, 400,
     "target"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_names_the_field_then_good_one_works(server, name, path, body, headers,
                                                         status, param):
  hdrs = {**AUTH, **headers}
  if hdrs.get("Authorization") == "":
    del hdrs["Authorization"]
  raw = body if isinstance(body, bytes) else None
  got, _, out = sh.request(server.url, path, None if raw else body, raw=raw, headers=hdrs)
  assert got == status, (name, got, out)
  err = out["error"]
  assert set(err) == {"message", "type", "param", "code"}, out
  assert err["param"] == param, (name, err)
  assert err["message"] and "\n" not in err["message"], err
  if param not in ("body", "Content-Type", "Authorization"):
    assert param.split("[")[0] in err["message"], err  # the message names the field too
  got, _, out = sh.request(server.url, "/v1/completions", GOOD, headers=AUTH)
  assert got == 200 and out["choices"][0]["text"], out


def test_health_is_open_and_other_routes_need_the_key(server):
  assert sh.request(server.url, "/health")[0] == 200
  for path in ("/v1/models", "/metrics"):
    assert sh.request(server.url, path)[0] == 401
    assert sh.request(server.url, path, headers=AUTH)[0] == 200
  status, _, out = sh.request(server.url, "/v1/nothing", headers=AUTH)
  assert status == 404 and out["error"]["param"] == "path"


def _serve(*args, timeout=180):
  return subprocess.run([sys.executable, "-m", "t5forge", "serve", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def test_startup_errors_are_one_line(tmp_path):
  missing = str(tmp_path / "nope")
  line = error_line(_serve("--checkpoint", missing, "--port", "0"))
  assert missing in line and "no such" in line, line
  # A checkpoint saved without a vocabulary: say what was found and how to give one.
  import t5forge
  bare = str(tmp_path / "bare")
  t5forge.init("t5_1_1.tiny", vocab_size=8100).save(bare)
  line = error_line(_serve("--checkpoint", bare, "--port", "0"))
  assert "no vocabulary" in line and "found" in line and "--vocabulary" in line, line
  # Buckets that cannot serve the batch size / the limits, before anything is loaded.
  line = error_line(_serve("--checkpoint", bare, "--max_batch_size", "8", "--batch_buckets",
                           "1,32"))
  assert "--batch_buckets" in line and "--max_batch_size 8" in line, line
  line = error_line(_serve("--checkpoint", bare, "--decode_buckets", "8",
                           "--max_tokens_limit", "64"))
  assert "--max_tokens_limit 64" in line, line


def test_port_in_use_and_api_key_on_public_host(tmp_path):
  with socket.socket() as taken:
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    r = _serve("--checkpoint", str(tmp_path / "any"), "--host", "0.0.0.0", "--port", str(port),
               "--api_key", "k")
  line = error_line(r)
  assert f"port {port}" in line and "in use" in line, line
  warnings = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
  assert len(warnings) == 1 and "TLS" in warnings[0] and "proxy" in warnings[0], r.stderr
