"""`t5forge serve` speaks OpenAI's completions API: the official
`openai` client, streamed and not, gets the texts `t5forge infer` decodes greedily; 32
concurrent clients get every output equal to unbatched generation, and /metrics shows
batches above 1; stop sequences, logprobs, /v1/score, beams and seeded sampling behave as
documented. One server serves the module."""
import json
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest

from t5forge import testing as sh
from train_helpers import ROOT, read_jsonl

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

PROMPTS = ["translate English to Spanish: God is love.", "In the beginning God created",
           "¿Quién es?", "The Lord is my shepherd; I shall not want.", "Hello there, friend",
           "and the earth was without form", "Amen.", "Jesus wept."]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sh.tiny_checkpoint(str(tmp_path_factory.mktemp("serve_openai") / "tiny"))


@pytest.fixture(scope="module")
def server(ckpt):
  srv = sh.Server(ckpt, "--max_batch_size", "8", "--batch_buckets", "1,2,4,8",
                  "--length_buckets", "32", "--decode_buckets", "8", "--warmup", "greedy",
                  "--max_wait_ms", "20", "--max_queue", "512", "--model_name", "tiny-t5")
  yield srv
  assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def infer_texts(ckpt, tmp_path_factory):
  """`t5forge infer`'s greedy predictions of PROMPTS with the same checkpoint."""
  d = tmp_path_factory.mktemp("serve_infer")
  (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
  r = subprocess.run([sys.executable, "-m", "t5forge", "infer", "--checkpoint", ckpt,
                      "--input", str(d / "prompts.txt"), "--output_dir", str(d / "out"),
                      "--max_decode_length", str(MAX_TOKENS)],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  path = r.stdout.split("lines to ")[1].split()[0]
  rows = read_jsonl(path)
  assert [row["inputs"]["inputs_pretokenized"] for row in rows] == PROMPTS
  return [row["prediction"] for row in rows]


def test_openai_client_matches_t5forge_infer(client, infer_texts):
  got = client.completions.create(model="tiny-t5", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                  temperature=0)
  assert got.object == "text_completion" and got.model == "tiny-t5"
  assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
  assert [c.text for c in got.choices] == infer_texts
  assert all(c.finish_reason in ("stop", "length") for c in got.choices)
  assert got.usage.completion_tokens > 0 and got.usage.total_tokens == (
      got.usage.prompt_tokens + got.usage.completion_tokens)
  # Streamed: text deltas that join to the same texts, then a finish_reason.
  for prompt, want in zip(PROMPTS[:3], infer_texts):
    pieces, reasons = [], []
    for chunk in client.completions.create(model="tiny-t5", prompt=prompt, temperature=0,
                                           max_tokens=MAX_TOKENS, stream=True):
      pieces.append(chunk.choices[0].text)
      reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == want
    assert reasons[-1] in ("stop", "length") and set(reasons[:-1]) == {None}


def test_sse_wire_format(server):
  """The bytes on the wire: `data: {json}` events, then `data: [DONE]`."""
  import urllib.request
  req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(
      {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}).encode(),
      headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=60) as r:
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = r.read().decode().split("\n\n")
  assert events[-1] == "" and events[-2] == "data: [DONE]"
  for e in events[:-2]:
    assert e.startswith("data: ") and json.loads(e[6:])["object"] == "text_completion"


def _reference(ckpt, prompts, max_new: int) -> dict:
  """Greedy tokens of each prompt alone (batch of one) through the Python API."""
  import t5forge
  m = t5forge.load(ckpt)
  out = {}
  for p in prompts:
    ids = m.vocabulary.encode(p) + [m.vocabulary.eos_id]
    tokens, _ = m.predict(np.array([ids + [0] * (32 - len(ids))], np.int32),
                          max_decode_length=max_new)
    out[p] = tokens[0].tolist()
  return out


def test_32_concurrent_clients_equal_unbatched(server, ckpt):
  ref = _reference(ckpt, PROMPTS, MAX_TOKENS)
  import t5forge
  vocab = t5forge.load(ckpt).vocabulary
  jobs = [(PROMPTS[i % len(PROMPTS)], 1 + (i * 5) % MAX_TOKENS) for i in range(256)]
  results, errors = [None] * len(jobs), []

  def client_thread(k):
    for j in range(k, len(jobs), 32):
      prompt, max_tokens = jobs[j]
      status, _, body = sh.request(server.url, "/v1/completions", {
          "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
      if status != 200:
        errors.append((status, body))
      else:
        results[j] = body["choices"][0]["text"]

  threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(32)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(600)
  assert not errors, errors[:3]
  for (prompt, max_tokens), text in zip(jobs, results):
    # Greedy decoding is causal: the first max_tokens of the longer reference.
    assert text == vocab.decode(ref[prompt][:max_tokens]), (prompt, max_tokens)
  _, _, metrics = sh.request(server.url, "/metrics")
  buckets = {line.split('le="')[1].split('"')[0]: float(line.split()[-1])
             for line in metrics.splitlines() if line.startswith("t5forge_batch_size_bucket")}
  total = float([l for l in metrics.splitlines() if l.startswith("t5forge_batch_size_count")][0]
                .split()[-1])
  assert total > buckets["1.0"], metrics  # some model calls held more than one request
  assert "t5forge_compiles_since_ready 0.0" in metrics  # the engine compiled nothing more
  assert 't5forge_requests_total{route="/v1/completions",status="200"}' in metrics


def test_stop_logprobs_and_score_agree(client, server, infer_texts):
  full = client.completions.create(model="tiny-t5", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                   temperature=0, logprobs=2).choices[0]
  lp = full.logprobs
  assert "".join(lp.tokens) == full.text
  assert len(lp.top_logprobs) == len(lp.tokens) and all(len(d) <= 2 for d in lp.top_logprobs)
  assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]
  # Greedy picks the most likely token: its log-prob is the best of the top ones.
  for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
    assert tok_lp == pytest.approx(max(top.values()), abs=1e-5)
  # /v1/score batches its targets: the same target twice scores the same.
  status, _, out = sh.request(server.url, "/v1/score", {
      "prompt": PROMPTS[0], "targets": [full.text[:12], "Amen.", full.text[:12]]})
  assert status == 200, out
  scores = [d["log_likelihood"] for d in out["data"]]
  assert scores[0] == pytest.approx(scores[2], abs=1e-5) and all(x < 0 for x in scores)
  # A stop sequence inside the text cuts it there, streamed or not.
  words = full.text.split()
  stop = " " + words[len(words) // 2]
  want = full.text[:full.text.index(stop)]
  cut = client.completions.create(model="tiny-t5", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop, "@@@"]).choices[0]
  assert (cut.text, cut.finish_reason) == (want, "stop")
  streamed = "".join(c.choices[0].text for c in client.completions.create(
      model="tiny-t5", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=stop,
      stream=True))
  assert streamed == want


def test_beams_n_and_seeded_sampling(client, server):
  beams = client.completions.create(model="tiny-t5", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                    n=2, extra_body={"num_beams": 2, "alpha": 0.6})
  assert [c.index for c in beams.choices] == [0, 1, 2, 3]
  assert beams.choices[0].text != beams.choices[1].text  # the two best beams of prompt 0
  # Sampling with a seed is reproducible whatever else is being served at the time.
  body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 1.0, "n": 2,
          "seed": 1234}
  first = sh.request(server.url, "/v1/completions", body)[2]
  noise = [threading.Thread(target=sh.request, args=(server.url, "/v1/completions", {
      "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 1.0})) for p in PROMPTS]
  for t in noise:
    t.start()
  again = sh.request(server.url, "/v1/completions", body)[2]
  for t in noise:
    t.join()
  texts = [c["text"] for c in first["choices"]]
  assert texts == [c["text"] for c in again["choices"]]
  other = sh.request(server.url, "/v1/completions", {**body, "seed": 99})[2]
  assert [c["text"] for c in other["choices"]] != texts


def test_beam_logprobs_and_min_log_prob(client, server, ckpt):
  """Beams carry their tokens' log-probs (those of `Generator.generate` on the same
  input, whatever shares the batch); min_log_prob is a beams-only field."""
  import t5forge
  from t5forge.generation import Generator, Kind
  m = t5forge.load(ckpt)
  ids = m.vocabulary.encode(PROMPTS[3]) + [m.vocabulary.eos_id]
  x = np.array([ids + [0] * (32 - len(ids))], np.int32)
  ref = Generator(m.model, m.params).generate(
      Kind("beam", num_decodes=3, top_logprobs=2), x, decode_length=MAX_TOKENS,
      max_new_tokens=np.array([MAX_TOKENS], np.int32), temperature=0.0, topp=0.0, alpha=0.6)
  got = client.completions.create(model="tiny-t5", prompt=[PROMPTS[3], PROMPTS[0]],
                                  max_tokens=MAX_TOKENS, logprobs=2,
                                  extra_body={"num_beams": 3, "alpha": 0.6}).choices[0]
  n = int(ref.lengths[0, -1])
  np.testing.assert_allclose(got.logprobs.token_logprobs[:n], ref.token_logprobs[0, -1, :n],
                             atol=1e-5)
  assert all(len(d) <= 2 for d in got.logprobs.top_logprobs)
  # Every token of a random model costs more than 1 nat: the beams stop after one token.
  short = client.completions.create(model="tiny-t5", prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                    logprobs=0,
                                    extra_body={"num_beams": 3, "min_log_prob": -1.0})
  assert len(short.choices[0].logprobs.tokens) == 1
  status, _, body = sh.request(server.url, "/v1/completions", {
      "prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "min_log_prob": -1.0})
  assert status == 400 and body["error"]["param"] == "min_log_prob", body


@pytest.mark.slow
def test_exported_directory_serves_the_same_texts(ckpt, client, tmp_path):
  """`t5forge serve` on a `t5forge export --format jax` directory (run by the standalone
  loader): the same greedy texts; what the export lacks is a 400 naming the option."""
  out = str(tmp_path / "exported")
  r = subprocess.run([sys.executable, "-m", "t5forge", "export", "--checkpoint", ckpt,
                      "--output", out, "--format", "jax", "--batch_sizes", "1,4",
                      "--input_lengths", "32", "--decode_lengths", str(MAX_TOKENS),
                      "--methods", "greedy,beam"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  srv = sh.Server(out, "--max_batch_size", "4", "--batch_buckets", "1,4")
  try:
    assert "ready at" in srv.ready_line and "2 shapes compiled" in srv.ready_line, srv.ready_line
    want = [c.text for c in client.completions.create(
        model="tiny-t5", prompt=PROMPTS[:4], max_tokens=MAX_TOKENS, temperature=0).choices]
    status, _, body = sh.request(srv.url, "/v1/completions", {
        "prompt": PROMPTS[:4], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200 and [c["text"] for c in body["choices"]] == want, body
    status, _, body = sh.request(srv.url, "/v1/completions", {"prompt": "x", "temperature": 0.7})
    assert status == 400 and body["error"]["param"] == "temperature", body
    # Its beam functions give the best beam only; a served beam request wants num_beams.
    status, _, body = sh.request(srv.url, "/v1/completions", {"prompt": "x", "num_beams": 4})
    assert status == 400 and body["error"]["param"] == "num_beams", body
    assert "(num_beams=4) returns the best beam only" in body["error"]["message"], body
    status, _, body = sh.request(srv.url, "/v1/score", {"prompt": "x", "targets": "y"})
    assert status == 400 and body["error"]["code"] == "unsupported", body
    status, _, body = sh.request(srv.url, "/v1/embeddings", {"input": "x"})
    assert status == 400 and body["error"]["code"] == "unsupported", body
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]
