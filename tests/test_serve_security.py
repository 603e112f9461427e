"""A running `t5forge serve` with named keys (--api_key_file and --api_key), per-key rate
limits, a body timeout, a request cost cap and vLLM's metric names:

- every route of the application (walked from `app.routes`, so a route added later is
  covered) but the open ones answers 401 without a key, with a wrong key, and with the
  key outside the Bearer scheme, for each of its methods;
- two named keys are served and counted by name; past its request rate one key gets 429 +
  Retry-After while another is served; past its tokens per minute likewise;
- a body that stalls is answered 408 (connection closed) while other requests are served;
- a request over --max_request_tokens is refused before its later prompts are tokenized;
- /metrics parses with prometheus_client's parser, has vLLM's names labelled model_name,
  and a load run of N completions moves the histogram counts by exactly N;
- no key appears in what the server printed or in /metrics.

One server serves the module; each test uses keys of its own (the limits are per key)."""
import json
import math
import secrets
import socket
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from t5forge import testing as sh
from t5forge.serve import api, app as app_lib, auth
from t5forge.serve.metrics import Metrics
from t5forge.serve.service import Service

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

NAMES = ("alice", "bob", "tok", "slow", "walker", "prom", "cap", *(f"load{i}" for i in range(6)))
KEYS = {name: f"sk-{name}-{secrets.token_hex(12)}" for name in NAMES}
DEFAULT_KEY = f"sk-default-{secrets.token_hex(12)}"
RPS, TPM, BODY_TIMEOUT_S, COST_CAP = 3, 20, 2, 30
GOOD = {"prompt": "God is love.", "max_tokens": 4, "temperature": 0}
LONG_PROMPT = ("In the beginning God created the heaven and the earth. And the earth was "
               "without form, and void")  # 20 pieces + EOS: over TPM by itself
VLLM = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds")


def _auth(name: str) -> dict:
  return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_security")
  ckpt = sh.tiny_checkpoint(str(d / "tiny"))
  keys = d / "keys.txt"
  keys.write_text("# one key a line: name:key\n\n" + "".join(
      f"{name}:{key}\n" + ("# the next team\n" if i == 1 else "")
      for i, (name, key) in enumerate(KEYS.items())), encoding="utf-8")
  srv = sh.Server(ckpt, *sh.FAST_FLAGS, "--model_name", "tiny-t5", "--api_key", DEFAULT_KEY,
                  "--api_key_file", str(keys), "--requests_per_second", str(RPS),
                  "--tokens_per_minute", str(TPM), "--body_timeout_s", str(BODY_TIMEOUT_S),
                  "--max_request_tokens", str(COST_CAP), "--metrics_compat", "vllm")
  yield srv
  assert srv.stop() == 0, srv.output()[-3000:]
  _no_key_in(srv.output())  # shutting down printed none either


def _no_key_in(text: str) -> None:
  for name, key in (*KEYS.items(), ("default", DEFAULT_KEY)):
    assert key not in text, f"the key of {name} is in the server's output"
    assert key[:12] not in text, f"a part of the key of {name} is in the server's output"


def _app_routes():
  """(path, method) of every route of the application `t5forge serve` runs."""
  service = Service(batcher=None, vocabulary=None, kind_cls=None, model_name="m",
                    limits=api.Limits(), metrics=Metrics())
  return sorted(_walk(app_lib.create_app(service).routes, ""))


def _walk(routes, prefix: str):
  for r in routes:
    inner = getattr(r, "original_router", None)  # FastAPI's include_router
    if inner is not None:
      yield from _walk(inner.routes, prefix + r.include_context.prefix)
      continue
    for method in getattr(r, "methods", None) or ():
      yield prefix + r.path.replace("{", "").replace("}", ""), method


def test_every_route_but_the_open_ones_needs_a_key(server):
  walked = _app_routes()
  guarded = [(p, m) for p, m in walked if p not in auth.OPEN]
  # The walk sees the routes there are (and whatever is added later).
  assert {"/v1/completions", "/v1/score", "/v1/models", "/metrics"} <= {p for p, _ in guarded}
  wrong = {"none": {}, "wrong key": {"Authorization": "Bearer sk-not-a-key"},
           "no scheme": {"Authorization": KEYS["walker"]},
           "basic scheme": {"Authorization": f"Basic {KEYS['walker']}"},
           "empty bearer": {"Authorization": "Bearer "}}
  for path, method in guarded:
    body = json.dumps(GOOD).encode() if method in ("POST", "PUT", "PATCH") else None
    for what, headers in wrong.items():
      status, _, out = sh.request(server.url, path, raw=body, method=method,
                                  headers={"Content-Type": "application/json", **headers})
      assert status == 401, (path, method, what, status, out)
      if method != "HEAD":
        err = out["error"]
        assert err["param"] == "Authorization" and err["code"] == "invalid_api_key", err
        assert KEYS["walker"] not in err["message"]
  # The open routes answer without a key.
  for path, method in walked:
    if path in auth.OPEN and method == "GET":
      status, _, _ = sh.request(server.url, path)
      assert status == 200, (path, status)
  # An unknown path is no way around the guard either.
  assert sh.request(server.url, "/v1/nothing")[0] == 401


def test_two_named_keys_and_the_default_key(server):
  for name in ("alice", "bob"):
    status, _, out = sh.request(server.url, "/v1/models", headers=_auth(name))
    assert status == 200 and out["data"][0]["id"] == "tiny-t5", out
  status, _, out = sh.request(server.url, "/v1/completions", GOOD,
                              headers={"Authorization": f"Bearer {DEFAULT_KEY}"})
  assert status == 200 and out["choices"][0]["text"], out
  counts = _key_counts(server)
  assert counts["alice"] >= 1 and counts["bob"] >= 1 and counts["default"] >= 1, counts


def _key_counts(server) -> dict:
  text = _scrape(server)
  return {s.labels["key"]: s.value for f in text_string_to_metric_families(text)
          if f.name == "t5forge_key_requests" for s in f.samples if s.name.endswith("_total")}


def _scrape(server) -> str:
  """/metrics with the scraper's own key, waiting out its own rate limit like a client."""
  for _ in range(10):
    status, headers, text = sh.request(server.url, "/metrics", headers=_auth("prom"))
    if status != 429:
      assert status == 200, (status, text)
      _no_key_in(text)
      return text
    time.sleep(float(headers["retry-after"]))
  raise AssertionError("/metrics stayed rate limited")


def test_request_rate_limit_is_per_key(server):
  seen = []
  for _ in range(4 * RPS):  # a burst holds RPS requests; they come back in milliseconds
    status, headers, out = sh.request(server.url, "/v1/models", headers=_auth("alice"))
    seen.append(status)
    if status == 429:
      break
  assert seen[-1] == 429 and set(seen[:-1]) == {200} and len(seen) > RPS - 1, seen
  assert headers["retry-after"] == "1", headers
  err = out["error"]
  assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
  assert "'alice'" in err["message"] and "--requests_per_second" in err["message"], err
  # The other key is served meanwhile.
  assert sh.request(server.url, "/v1/models", headers=_auth("bob"))[0] == 200
  time.sleep(1.0)  # refilled
  assert sh.request(server.url, "/v1/models", headers=_auth("alice"))[0] == 200


def test_tokens_per_minute_is_per_key(server):
  status, _, first = sh.request(server.url, "/v1/completions",
                                {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0},
                                headers=_auth("tok"))
  assert status == 200 and first["usage"]["prompt_tokens"] > TPM, first
  status, headers, out = sh.request(server.url, "/v1/completions", GOOD, headers=_auth("tok"))
  assert status == 429, (status, out)
  err = out["error"]
  assert err["type"] == "tokens" and "--tokens_per_minute" in err["message"], err
  # In debt by the prompt and output tokens over TPM; refilled at TPM / 60 tokens a second
  # until it holds one again.
  want = math.ceil((1 + first["usage"]["total_tokens"] - TPM) * 60 / TPM)
  assert want - 2 <= int(headers["retry-after"]) <= want, (headers, want)
  # The `openai` client reads it as its RateLimitError.
  client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["tok"], max_retries=0)
  with pytest.raises(openai.RateLimitError) as e:
    client.completions.create(model="tiny-t5", prompt="God", max_tokens=2)
  assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
  assert int(e.value.response.headers["retry-after"]) >= 1
  status, _, out = sh.request(server.url, "/v1/completions", GOOD, headers=_auth("bob"))
  assert status == 200 and out["choices"][0]["text"], out


def test_slow_body_gets_408_while_others_are_served(server):
  body = json.dumps(GOOD).encode()
  with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEYS['slow']}\r\n".encode()
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
    start = time.monotonic()
    # Meanwhile (the body still stalls) the server answers another client's completion.
    status, _, out = sh.request(server.url, "/v1/completions", GOOD, headers=_auth("bob"))
    answered = time.monotonic() - start
    assert status == 200 and out["choices"][0]["text"], out
    assert answered < BODY_TIMEOUT_S, answered
    reply = b""
    while chunk := sock.recv(65536):  # the server closes the connection after its 408
      reply += chunk
    waited = time.monotonic() - start
  head, _, payload = reply.partition(b"\r\n\r\n")
  assert head.startswith(b"HTTP/1.1 408"), reply[:300]
  assert b"connection: close" in head.lower(), head
  err = json.loads(payload)["error"]
  assert err["param"] == "body" and "--body_timeout_s" in err["message"], err
  assert BODY_TIMEOUT_S - 0.5 <= waited < BODY_TIMEOUT_S + 10, waited


def test_cost_cap_stops_before_the_later_prompts(server):
  # Prompt 0 and 2 x 8 output tokens fit in the cap; prompt 1 passes it. Prompt 2 is over
  # the prompt limit: tokenizing it would have been a prompt_too_long error instead.
  body = {"prompt": ["a", "b", "word " * 100], "max_tokens": 8, "n": 2, "temperature": 0}
  status, _, out = sh.request(server.url, "/v1/completions", body, headers=_auth("cap"))
  assert status == 400, out
  err = out["error"]
  assert err["code"] == "request_too_large" and err["param"] == "max_tokens", err
  assert "by prompt 1 of 3" in err["message"] and f"{COST_CAP}" in err["message"], err


def _families(server) -> dict:
  return {f.name: f for f in text_string_to_metric_families(_scrape(server))}


def _count(families, name: str) -> float:
  return next(s.value for s in families[name].samples if s.name == name + "_count")


def test_vllm_metrics_and_a_load_run(server):
  fam = _families(server)
  samples = {s.name: s for f in fam.values() for s in f.samples}
  for name in VLLM:
    assert name in samples or name + "_count" in samples, name
    assert (samples.get(name) or samples[name + "_count"]).labels["model_name"] == "tiny-t5"
  reasons = {s.labels["finished_reason"] for s in fam["vllm:request_success"].samples}
  assert reasons == {"stop", "length", "abort"}, reasons
  before = {h: _count(fam, h) for h in HISTOGRAMS}
  tokens_before = (samples["vllm:prompt_tokens_total"].value,
                   samples["vllm:generation_tokens_total"].value)
  success_before = sum(s.value for s in fam["vllm:request_success"].samples)

  # N concurrent completions, half of them streamed, one key each (the limits are per key);
  # 8 tokens take two engine steps (--chunk_tokens 4): an inter-token latency each.
  n = 6
  results = [None] * n
  body = {**GOOD, "max_tokens": 8}

  def one(i):
    if i % 2:
      results[i] = ("json", sh.request(server.url, "/v1/completions", body,
                                       headers=_auth(f"load{i}")))
    else:
      results[i] = ("sse", sh.request(server.url, "/v1/completions", {**body, "stream": True},
                                      headers=_auth(f"load{i}")))
  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  prompt_tokens = generated = 0
  for kind, (status, _, out) in results:
    assert status == 200, out
    if kind == "json":
      prompt_tokens += out["usage"]["prompt_tokens"]
      generated += out["usage"]["completion_tokens"]
  # A stream's latency is observed as it closes, a moment after its last byte.
  sh.wait_for(lambda: _count(_families(server), "vllm:e2e_request_latency_seconds")
              >= before["vllm:e2e_request_latency_seconds"] + n, 10, "the streams' latency")
  fam = _families(server)
  for h in HISTOGRAMS:
    assert _count(fam, h) == before[h] + n, (h, _count(fam, h), before[h])
  assert _count(fam, "vllm:inter_token_latency_seconds") > 0
  samples = {s.name: s for f in fam.values() for s in f.samples}
  assert sum(s.value for s in fam["vllm:request_success"].samples) == success_before + n
  # The streamed half: the same prompt, so the same prompt tokens as the JSON half.
  assert samples["vllm:prompt_tokens_total"].value == tokens_before[0] + 2 * prompt_tokens
  assert samples["vllm:generation_tokens_total"].value >= tokens_before[1] + generated
  assert 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1
  # The t5forge_* names are still there, and the vLLM ones mirror them.
  t5 = {s.name: s.value for f in fam.values() for s in f.samples if s.name.startswith("t5forge")}
  assert t5["t5forge_prompt_tokens_total"] == samples["vllm:prompt_tokens_total"].value
  assert t5["t5forge_time_to_first_token_seconds_count"] == _count(
      fam, "vllm:time_to_first_token_seconds")


def test_no_key_in_the_logs(server):
  # Whatever was printed by now (every test above sent keys, right and wrong).
  _no_key_in(server.output())
  assert "ready at" in server.output()
