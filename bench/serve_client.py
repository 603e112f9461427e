"""The client side of `python -m bench serve` (bench/serve.py) and `--schedulers`
(bench/serve_loads.py): the random-init model and its prompts, the offline reference
calls, closed-loop HTTP clients, and /metrics scrapes. Both benchmarks import it; it
imports neither. A `plan` is either benchmark's Plan (preset, input_tokens, new_tokens,
max_batch_size, ...).
"""
from __future__ import annotations

import gzip
import http.client
import json
import math
import os
import statistics
import threading
import time

from bench.prepare import CACHE_DIR
from bench.workers import REPO_ROOT, log
from t5forge import testing

TEXT_PATH = os.path.join(REPO_ROOT, "t5forge", "data", "bundled", "english_web_bible.txt.gz")


# -- model and prompts -------------------------------------------------------------------
def checkpoint_dir(plan, seed: int) -> str:
  return os.path.join(CACHE_DIR, f"serve-{plan.preset}-v8000-seed{seed}", "checkpoint")


def build_checkpoint(plan, seed: int) -> str:
  """The random-init model with its vocabulary, as a t5forge checkpoint (built once; the
  save commits atomically, so the cache never holds half of one)."""
  path = checkpoint_dir(plan, seed)
  if os.path.isdir(path):
    return path
  log(f"building {plan.preset} (bundled vocabulary, seed {seed}) -> "
      f"{os.path.relpath(path, REPO_ROOT)}")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return testing.checkpoint_with_vocabulary(path, plan.preset, seed)


def candidate_prompts(vocab, count: int, pieces: int) -> list[str]:
  """Consecutive stretches of the bundled English Bible text that encode to exactly
  `pieces` pieces (the server appends EOS)."""
  with gzip.open(TEXT_PATH, "rt", encoding="utf-8") as f:
    ids = vocab.encode(" ".join(f.read().splitlines()[:20000]))
  out, pos = [], 0
  while len(out) < count and pos + pieces <= len(ids):
    text = vocab.decode(ids[pos:pos + pieces])
    pos += pieces
    if len(vocab.encode(text)) == pieces:  # round trip kept the length
      out.append(text)
  if len(out) < count:
    raise RuntimeError(f"only {len(out)} prompts of {pieces} pieces in {TEXT_PATH}")
  return out


# -- offline: the server's compiled path, called directly --------------------------------
class Offline:
  """Greedy `Generator.generate(stream=False)` on [b, 128] inputs, 64 new tokens."""

  def __init__(self, path: str, plan):
    import numpy as np
    from t5forge import generation, opener
    self._np = np
    self.opened = opener.open_checkpoint(path, require_vocabulary=True)
    self.vocab = self.opened.vocabulary
    self.generator = generation.Generator(self.opened.model, self.opened.params,
                                          partitioner=self.opened.partitioner)
    self.kind = generation.Kind(method="greedy")
    self.plan = plan

  def inputs(self, prompts: list[str]):
    """[b, input_tokens] int32: pieces + EOS, 0-padded (all prompts are full length)."""
    np = self._np
    arr = np.zeros((len(prompts), self.plan.input_tokens), np.int32)
    for i, p in enumerate(prompts):
      ids = self.vocab.encode(p) + [self.vocab.eos_id]
      arr[i, :len(ids)] = ids
    return arr

  def generate(self, inputs, new_tokens: int | None = None):
    """-> Generated; greedy, every row may run `new_tokens` (default the plan's) new
    tokens, which is also the decode length."""
    np, b = self._np, inputs.shape[0]
    n = new_tokens or self.plan.new_tokens
    return self.generator.generate(
        self.kind, inputs, decode_length=n, max_new_tokens=np.full([b], n, np.int32),
        temperature=np.zeros([b], np.float32), topp=np.ones([b], np.float32), stream=False)

  def time_call(self, inputs, new_tokens: int | None = None) -> float:
    n = new_tokens or self.plan.new_tokens
    start = time.perf_counter()
    out = self.generate(inputs, n)
    seconds = time.perf_counter() - start
    if int(out.lengths.min()) != n:
      raise AssertionError(f"offline rows decoded {out.lengths.ravel().tolist()} tokens, "
                           f"expected {n} each")
    return seconds

  def full_length(self, prompts: list[str], batch: int, new_tokens: int | None = None
                  ) -> list[str]:
    """The prompts whose greedy decoding runs all `new_tokens` without EOS."""
    n, keep = new_tokens or self.plan.new_tokens, []
    for start in range(0, len(prompts), batch):
      chunk = prompts[start:start + batch]
      out = self.generate(self.inputs(chunk), n)
      keep += [p for p, k, fin in zip(chunk, out.lengths[:, 0], out.finished[:, 0])
               if k == n and not fin]
    return keep


# -- the load -------------------------------------------------------------------------------
def one(conn, body: dict, stream: bool) -> dict:
  """One completion: latency, first-token time (streamed), completion tokens, status."""
  start = time.perf_counter()
  conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
               headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  out = {"status": resp.status, "max_tokens": body["max_tokens"]}
  if not stream or resp.status != 200:
    payload = resp.read()
    out["latency_s"] = time.perf_counter() - start
    if resp.status == 200:
      obj = json.loads(payload)
      out["completion_tokens"] = obj["usage"]["completion_tokens"]
      out["finish_reason"] = obj["choices"][0]["finish_reason"]
    else:
      out["error"] = payload[:300].decode(errors="replace")
    return out
  chunks, usage, finish = 0, None, None
  while True:
    line = resp.readline()
    if not line:
      break
    line = line.strip()
    if not line.startswith(b"data:"):
      continue
    data = line[5:].strip()
    if data == b"[DONE]":
      break
    obj = json.loads(data)
    if obj.get("usage"):
      usage = obj["usage"]
    for choice in obj.get("choices", []):
      if choice.get("text"):
        chunks += 1
        out.setdefault("first_token_s", time.perf_counter() - start)
      finish = choice.get("finish_reason") or finish
  resp.read()  # drain, so the connection can be reused
  out["latency_s"] = time.perf_counter() - start
  out["chunks"] = chunks
  out["finish_reason"] = finish
  if usage:
    out["completion_tokens"] = usage["completion_tokens"]
  elif finish == "length":  # no usage in the stream: it ran to max_tokens
    out["completion_tokens"] = body["max_tokens"]
  return out


def drive(port: int, model: str, prompts: list[str], concurrency: int, total: int,
          new_tokens, stream: bool | str = False) -> dict | tuple[dict, dict]:
  """`total` requests from `concurrency` closed-loop clients (each sends its next request
  when the last one answered); prompts taken round-robin; `new_tokens`: max_tokens of
  every request, or a function of the request's index. stream='alternate': every other
  request streamed, -> (streamed row, plain row), so that the two see the same load."""
  tokens_of = new_tokens if callable(new_tokens) else lambda k: new_tokens
  lock, counter, results = threading.Lock(), [0], []

  def client():
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
      while True:
        with lock:
          k = counter[0]
          if k >= total:
            return
          counter[0] += 1
        streamed = k % 2 == 0 if stream == "alternate" else bool(stream)
        body = {"model": model, "prompt": prompts[k % len(prompts)], "max_tokens": tokens_of(k),
                "temperature": 0, "stream": streamed}
        try:
          r = one(conn, body, streamed)
        except (OSError, http.client.HTTPException, ValueError) as e:
          r = {"status": None, "error": f"{type(e).__name__}: {e}",
               "max_tokens": body["max_tokens"]}
          conn.close()
          conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        r["stream"] = streamed
        with lock:
          results.append(r)
    finally:
      conn.close()

  threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - start
  if stream == "alternate":  # one client: each half's own time is the sum of its latencies
    halves = [[r for r in results if r["stream"] == flag] for flag in (True, False)]
    return tuple(summarize(h, sum(r.get("latency_s", 0.0) for r in h), concurrency, flag,
                            alternated=True)
                 for h, flag in zip(halves, (True, False)))
  return summarize(results, wall, concurrency, bool(stream))


def summarize(results: list[dict], wall: float, concurrency: int, stream: bool,
               alternated: bool = False) -> dict:
  """Tokens/s over `wall`, latency quantiles, errors; streamed: time to the first text."""
  ok = [r for r in results if r["status"] == 200]
  lat = sorted(r["latency_s"] for r in ok)
  tokens = sum(r.get("completion_tokens", 0) for r in ok)
  row = {"concurrency": concurrency, "stream": stream, "alternated": alternated,
         "requests": len(results), "ok": len(ok),
         "errors": [r for r in results if r["status"] != 200][:5],
         "error_count": len(results) - len(ok), "wall_s": wall,
         "completion_tokens": tokens, "tokens_per_s": tokens / wall if wall else None,
         "requests_per_s": len(ok) / wall if wall else None,
         "p50_s": _quantile(lat, 0.5), "p99_s": _quantile(lat, 0.99),
         "mean_s": statistics.fmean(lat) if lat else None,
         "short_completions": sum(r.get("completion_tokens", 0) < r["max_tokens"] for r in ok)}
  if stream:
    firsts = sorted(r["first_token_s"] for r in ok if "first_token_s" in r)
    row["first_token_p50_s"] = _quantile(firsts, 0.5)
    row["first_token_p99_s"] = _quantile(firsts, 0.99)
    row["chunks_mean"] = statistics.fmean(r["chunks"] for r in ok) if ok else None
  return row


def _quantile(xs: list[float], q: float) -> float | None:
  """Linear interpolation between order statistics (numpy's default)."""
  if not xs:
    return None
  pos = q * (len(xs) - 1)
  lo = math.floor(pos)
  hi = min(lo + 1, len(xs) - 1)
  return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- /metrics -----------------------------------------------------------------------------
def scrape(url: str) -> dict[str, dict]:
  """Histograms of GET /metrics: name -> {'buckets': {le: cumulative count}, 'sum', 'count'}
  (summed over label sets other than `le`; of a histogram by route, only the completions
  route, so that the scrapes themselves are not counted)."""
  from prometheus_client.parser import text_string_to_metric_families
  status, _, body = testing.request(url, "/metrics", timeout=30)
  if status != 200:
    return {}
  out = {}
  for fam in text_string_to_metric_families(body):
    if fam.type != "histogram":
      continue
    h = out.setdefault(fam.name, {"buckets": {}, "sum": 0.0, "count": 0.0})
    for s in fam.samples:
      if "route" in s.labels and "completions" not in s.labels["route"]:
        continue
      if s.name.endswith("_bucket"):
        le = float(s.labels["le"])
        h["buckets"][le] = h["buckets"].get(le, 0.0) + s.value
      elif s.name.endswith("_sum"):
        h["sum"] += s.value
      elif s.name.endswith("_count"):
        h["count"] += s.value
  return out


def histogram_delta(before: dict, after: dict, name: str) -> dict | None:
  """Mean and interpolated p50 / p99 (as Prometheus's histogram_quantile) of the
  observations between two scrapes."""
  if name not in after:
    return None
  a, b = after[name], before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
  count = a["count"] - b["count"]
  if count <= 0:
    return {"count": 0}
  buckets = sorted((le, a["buckets"][le] - b["buckets"].get(le, 0.0)) for le in a["buckets"])

  def quantile(q):
    rank, prev_le, prev_n = q * count, 0.0, 0.0
    for le, n in buckets:
      if n >= rank:
        if math.isinf(le):
          return prev_le  # above the last finite bucket: its bound, as Prometheus does
        return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1)
      prev_le, prev_n = le, n
    return prev_le

  per_bucket, prev = {}, 0.0
  for le, n in buckets:  # cumulative -> observations per bucket, "<=le": count
    if n > prev:
      per_bucket[f"<={le:g}"] = int(round(n - prev))
    prev = n
  return {"count": count, "mean": (a["sum"] - b["sum"]) / count, "p50": quantile(0.5),
          "p99": quantile(0.99), "histogram": per_bucket}


def pick_histograms(names) -> dict[str, str | None]:
  """Which of the server's histograms hold time in queue and batch sizes."""
  def find(*words):
    hits = [n for n in names if all(w in n for w in words)]
    return min(hits, key=len) if hits else None
  return {"queue": find("queue", "second") or find("queue"), "batch": find("batch", "size"),
          "latency": find("request", "second") or find("latency"),
          "ttft": find("first_token", "second")}


# -- the run ------------------------------------------------------------------------------
def fmt(x, spec: str = ".3f") -> str:
  return "-" if x is None else format(x, spec)
