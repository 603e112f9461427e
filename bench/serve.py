"""`python -m bench serve`: `t5forge serve` under load, against offline `generate` calls
of the same model in the same run.

    python -m bench serve                  # flan-t5-small shape, c = 1, 4, 16, 64 (~6 min)
    python -m bench serve --quick          # smoke test: tiny model, few requests (~1 min)
    python -m bench serve --schedulers     # --scheduler static vs continuous (~30 min)
    python -m bench serve --schedulers --quick   # its smoke test (~2-3 min)

The model: flan-t5-small's shape (t5_1_1 small: 8+8 layers, 512 wide, gated GELU),
random init (seed 0), with the bundled SentencePiece vocabulary
(`t5forge/data/bundled/bible_en_es_8k.model`, extra_ids=100: 8,000 ids, so the
vocabulary-sized layers are a quarter of flan-t5-small's 32,128) saved in the checkpoint,
as `t5forge serve` needs. It is written once under bench/results/.cache/.

Prompts: Bible text cut to exactly 127 SentencePiece pieces (+ EOS = 128 input tokens),
kept only if offline greedy decoding runs all 64 new tokens without EOS (the server has no
minimum length); every completion's `usage.completion_tokens` is recorded and summed,
so tokens/s counts what was produced either way.

Offline baselines (this process, the server's compiled path:
`t5forge.generation.Generator.generate(stream=False)`, `t5forge.opener` to open the
checkpoint): one batch-16 and one batch-1 greedy call, warm, timed before the first
level and after every level while the server idles; each target compares a level with
the calls just around it (the load of a shared machine drifts within minutes). The
server (`python -m t5forge serve ... --max_batch_size 16`, a child process, SIGTERM at the
end) is driven by closed-loop clients (threads, one keep-alive connection each) at
concurrency 1, 4, 16 and 64, then by one client alternating streamed and plain requests
(what streaming costs, under the same load). Time in queue and batch sizes come from the
server's /metrics histograms (differences between scrapes around each level).

Writes bench/results/serve.json (serve_quick.json with --quick) and prints a table.

--schedulers (bench/serve_loads.py) compares the static path (`--scheduler static`: batches
that run until their longest row is done) with the continuous-batching engine
(`--scheduler continuous --slots 16`) on the same checkpoint, float32, both with
`--max_batch_size 16 --length_buckets 128 --decode_buckets 8,64,128 --batch_buckets
1,2,4,8,16 --warmup greedy` (the static path's best fair shapes: a batch of 8-token rows
decodes in the 8 bucket, a 64-token one in the 64 bucket, a partial batch pads to at most
twice its rows; the engine's cache holds the largest decode bucket, 128). Prompts as above
(128 input tokens), but screened to run all 128 new tokens without EOS, so every length
is fixed by max_tokens. Each round starts one server, runs every scenario, stops it
(SIGTERM), then does the same with the other; rounds alternate which goes first (2
rounds: static, continuous, continuous, static) and the table holds medians over rounds:
  1. mixed lengths: closed loop, concurrency 32, max_tokens 8 and 128 alternating by
     request index, 320 requests: output tokens/s (sum of usage.completion_tokens / wall).
     Target: continuous >= 1.5x static.
  2. open loop: 400 streamed requests, Poisson arrivals at 0.6x the static path's
     requests/s of scenario 1 (first round; the same rate for both), max_tokens half 8,
     half 128 (seeded shuffle); each request on its own thread started at its arrival
     time (idle keep-alive connections reused). TTFT = client side, send to the first SSE
     chunk carrying text. Targets: continuous p50 <= 0.4x static, p99 <= 0.5x.
  3. uniform lengths: 128 in, 64 new, closed loop at concurrency 16, 160 requests:
     tokens/s. Targets: continuous >= 0.95x static, and >= 0.8x an offline batch-16
     `generate` call (64 new tokens) timed in this process just before and after that
     server ran (one before the first server and one after each).
  4. memory: VmRSS (/proc/PID/status) of the last round's continuous server after 100
     and after 2,000 requests served (warm-up included; mixed lengths, concurrency 32),
     run first in that session. Target: within 5% (after 2,000 / after 100 <= 1.05).
  5. hostile clients, every session: 100 then 500 completions whose options are drawn at
     random (temperature 0.01..2, top_k 1..1000, top_p 0.05..1, n 1..3, logprobs none or
     0..5, max_tokens 1..8), concurrency 32: t5forge_compiles_since_ready's rise during
     each, and VmRSS after each. Targets: the engine compiles nothing; VmRSS after the
     500 within 5% of after the 100, on both paths (the static path compiles once per
     kind: n x logprobs x batch bucket, bounded by generation.CompiledFns).
Queue time, rows per model call and the engine's TTFT come from /metrics as above;
t5forge_compiles_since_ready is read after each session (0: nothing compiled under
load). --rounds N changes the pairs. --quick: tiny model, 1 round, 64 /
48 / 32 requests, RSS after 100 and 300; a smoke test, its ratios mean little (the tiny
model's step is mostly host overhead). Writes bench/results/serve_schedulers.json
(serve_schedulers_quick.json); server logs in bench/results/.cache/logs/.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

from bench import report as report_lib
from bench.prepare import CACHE_DIR, RESULTS_DIR, machine_info
from bench.workers import REPO_ROOT, log
from t5forge import testing

TEXT_PATH = os.path.join(REPO_ROOT, "t5forge", "data", "bundled", "english_web_bible.txt.gz")
TARGETS = {"c16_vs_offline_b16_tokens_per_s": 0.8, "c1_p50_vs_offline_b1_latency": 1.2}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes of the run. FULL is the full measurement; QUICK a smoke test."""

  preset: str = "flan_t5.small"
  input_tokens: int = 128  # including the EOS the server appends
  new_tokens: int = 64
  max_batch_size: int = 16
  concurrency: tuple[int, ...] = (1, 4, 16, 64)
  # requests per level: enough for several full batches at each (a few hundred in all)
  requests: tuple[int, ...] = (16, 32, 160, 256)
  stream_requests: int = 16  # streamed, concurrency 1
  prompts: int = 32  # distinct prompts, reused round-robin
  health_timeout_s: float = 900.0  # start-up compiles every bucket before /health is ready
  # Buckets of exactly this workload (the offline call's shapes, so the ratios measure
  # batching, not padding), and only greedy compiled (all requests are greedy): start-up
  # compiles 3 batch buckets instead of 36 shapes. --server_args can override these.
  server_flags: tuple[str, ...] = ("--length_buckets", "128", "--decode_buckets", "64",
                                   "--warmup", "greedy")


FULL = Plan()
QUICK = Plan(preset="t5_1_1.tiny", concurrency=(1, 4, 16), requests=(4, 8, 32),
             stream_requests=4, prompts=16)


# -- model and prompts -------------------------------------------------------------------
def checkpoint_dir(plan: Plan, seed: int) -> str:
  return os.path.join(CACHE_DIR, f"serve-{plan.preset}-v8000-seed{seed}", "checkpoint")


def build_checkpoint(plan: Plan, seed: int) -> str:
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

  def __init__(self, path: str, plan: Plan):
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
def _one(conn, body: dict, stream: bool) -> dict:
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
          r = _one(conn, body, streamed)
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
    return tuple(_summarize(h, sum(r.get("latency_s", 0.0) for r in h), concurrency, flag,
                            alternated=True)
                 for h, flag in zip(halves, (True, False)))
  return _summarize(results, wall, concurrency, bool(stream))


def _summarize(results: list[dict], wall: float, concurrency: int, stream: bool,
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
def run(plan: Plan, seed: int, server_args: list[str]) -> dict:
  """Offline calls and server levels, interleaved: one offline batch-16 and batch-1 call
  before the first level and after every level (the server idle meanwhile), so that each
  ratio compares timings taken minutes apart at most on a machine whose load drifts."""
  path = build_checkpoint(plan, seed)
  offline = Offline(path, plan)
  report = {"checkpoint": os.path.relpath(path, REPO_ROOT),
            "model": f"{plan.preset} shape, random init (seed {seed}), vocabulary "
                     f"bible_en_es_8k.model + {testing.EXTRA_IDS} extra ids ({offline.vocab.vocab_size})",
            "plan": dataclasses.asdict(plan), "notes": []}

  log("screening prompts (offline greedy, all new tokens without EOS)")
  candidates = candidate_prompts(offline.vocab, plan.prompts * 2, plan.input_tokens - 1)
  start = time.perf_counter()
  prompts = offline.full_length(candidates, plan.max_batch_size)[:plan.prompts]
  report["prompt_screen_s"] = time.perf_counter() - start  # includes the first compiles
  if len(prompts) < plan.max_batch_size:
    raise RuntimeError(f"only {len(prompts)} of {len(candidates)} prompts decode "
                       f"{plan.new_tokens} tokens without EOS")
  report["prompts"] = len(prompts)
  inputs = {"b16": offline.inputs(prompts[:plan.max_batch_size]),
            "b1": offline.inputs(prompts[:1])}
  offline.time_call(inputs["b1"])  # compile batch 1 (batch 16 compiled while screening)
  offline_points = []  # one {b16, b1} per point between levels

  def offline_point():
    point = {k: offline.time_call(x) for k, x in inputs.items()}
    log(f"offline: b16 {point['b16']:.3f} s, b1 {point['b1']:.3f} s")
    offline_points.append(point)

  log_path = os.path.join(CACHE_DIR, "logs", "serve_server.log")
  levels = []
  flags = ["--max_batch_size", str(plan.max_batch_size), *plan.server_flags, *server_args]
  # Its own session: a ctrl-C reaches only the bench, which stops it with SIGTERM (graceful:
  # it finishes what is in flight) when leaving the `with`.
  with testing.Server(path, *flags, wait=False, cwd=REPO_ROOT, log_path=log_path,
                      own_session=True) as server:
    log("starting: " + " ".join(server.argv[1:]))
    report["server_argv"] = ["python"] + server.argv[1:]
    report["server_ready_s"] = server.wait_ready(plan.health_timeout_s)
    log(f"server ready after {report['server_ready_s']:.1f} s (port {server.port})")
    status, _, body = testing.request(server.url, "/v1/models")
    model_id = body["data"][0]["id"] if status == 200 else "t5forge"
    # Warm-up: a few requests through the whole stack (first-call costs outside XLA).
    drive(server.port, model_id, prompts, 2, 4, plan.new_tokens)
    drive(server.port, model_id, prompts, 1, 2, plan.new_tokens, stream=True)
    names = list(scrape(server.url))
    hist = pick_histograms(names)
    report["histograms"] = {**hist, "all": names}
    runs = [(c, n, False) for c, n in zip(plan.concurrency, plan.requests)]
    runs.append((1, 2 * plan.stream_requests, "alternate"))
    offline_point()
    for c, n, stream in runs:
      m0 = scrape(server.url)
      log(f"concurrency {c}{', streamed every other' if stream else ''}: {n} requests")
      out = drive(server.port, model_id, prompts, c, n, plan.new_tokens, stream=stream)
      m1 = scrape(server.url)
      offline_point()
      for row in out if isinstance(out, tuple) else (out,):
        for key, name in hist.items():
          if name:  # (alternated rows: both halves of the level together)
            row[key] = histogram_delta(m0, m1, name)
        log(f"  {'streamed: ' if row['stream'] else ''}{row['tokens_per_s']:.1f} tok/s, "
            f"p50 {_fmt(row['p50_s'])} s, p99 {_fmt(row['p99_s'])} s, errors "
            f"{row['error_count']}" + (f", batches {row['batch']['histogram']}"
                                       if row.get("batch") else ""))
        row["offline_adjacent"] = offline_points[-2:]  # just before and just after
        levels.append(row)
  report["server_exit_code"] = server.proc.returncode
  report["levels"] = levels
  report["offline"] = {}
  for k in inputs:
    times = [p[k] for p in offline_points]
    b = int(k[1:])
    report["offline"][k] = {"batch": b, "times_s": times, "median_s": statistics.median(times),
                            "tokens_per_s": b * plan.new_tokens / statistics.median(times)}
  report["targets"] = targets(report)
  return report


def adjacent(row: dict, plan: dict) -> dict:
  """The offline calls just before and after a level: batch-1 latency (s) and batch-16
  tokens/s, each the mean of the two."""
  pts = row["offline_adjacent"]
  b1 = statistics.fmean(p["b1"] for p in pts)
  b16 = statistics.fmean(p["b16"] for p in pts)
  return {"b1_s": b1, "b16_tokens_per_s": plan["max_batch_size"] * plan["new_tokens"] / b16}


def targets(report: dict) -> list[dict]:
  """The two targets, each against the offline calls adjacent to its level (the
  run-wide offline medians are in the table too), and what streaming costs."""
  out, plan = [], report["plan"]
  plain = {r["concurrency"]: r for r in report["levels"]
           if not r["stream"] and not r["alternated"]}
  streamed = next((r for r in report["levels"] if r["stream"]), None)
  pair = next((r for r in report["levels"] if r["alternated"] and not r["stream"]), None)
  if 16 in plain and plain[16]["tokens_per_s"]:
    v = plain[16]["tokens_per_s"] / adjacent(plain[16], plan)["b16_tokens_per_s"]
    goal = TARGETS["c16_vs_offline_b16_tokens_per_s"]
    out.append({"target": "c=16 tokens/s / offline batch-16 tokens/s (adjacent calls)",
                "value": round(v, 3), "goal": f">= {goal}", "met": v >= goal})
  if 1 in plain and plain[1]["p50_s"]:
    v = plain[1]["p50_s"] / adjacent(plain[1], plan)["b1_s"]
    goal = TARGETS["c1_p50_vs_offline_b1_latency"]
    out.append({"target": "c=1 p50 latency / offline batch-1 latency (adjacent calls)",
                "value": round(v, 3), "goal": f"<= {goal}", "met": v <= goal})
  if streamed and pair and streamed["p50_s"] and pair["p50_s"]:
    v = streamed["p50_s"] / pair["p50_s"]
    out.append({"target": "c=1 streamed p50 / not streamed p50, alternated requests (what "
                          "streaming costs)",
                "value": round(v, 3), "goal": "state it", "met": None})
  return out


# -- output -------------------------------------------------------------------------------
def _fmt(x, spec: str = ".3f") -> str:
  return "-" if x is None else format(x, spec)


def render(report: dict) -> str:
  from bench import table
  plan, off = report["plan"], report["offline"]
  lines = table.render_machine(report["machine"], 0, report["quick"])[:2]  # cpu, versions
  lines += [f"model: {report['model']}; float32",
            f"== t5forge serve: {plan['input_tokens']} input tokens, {plan['new_tokens']} new "
            f"tokens, greedy, max_batch_size {plan['max_batch_size']}; server ready after "
            f"{report['server_ready_s']:.0f} s ==",
            "server: " + " ".join(report["server_argv"][3:]).replace(REPO_ROOT + "/", ""),
            "offline = Generator.generate(stream=False) in the bench process (server idle), "
            f"median of {len(off['b16']['times_s'])} warm calls: one of each before the first "
            "level and after every level; 'adjacent' = the two around a level",
            "queue = time in queue from the server's histogram (mean / interpolated p99); "
            "batch = mean batch size of the batches run during that level"]
  body = [["offline batch 1", "-", "-", _fmt(off["b1"]["tokens_per_s"], ".1f"),
           _fmt(off["b1"]["median_s"])] + ["-"] * 5,
          ["offline batch 16", "-", "-", _fmt(off["b16"]["tokens_per_s"], ".1f"),
           _fmt(off["b16"]["median_s"])] + ["-"] * 5]
  for r in report["levels"]:
    q, b = r.get("queue") or {}, r.get("batch") or {}
    adj = adjacent(r, plan)
    name = (f"serve c={r['concurrency']}" + (" streamed" if r["stream"] else "")
            + (" (alt.)" if r["alternated"] else ""))
    body.append([name, f"{r['ok']}/{r['requests']}", str(r["error_count"]),
                 _fmt(r["tokens_per_s"], ".1f"), _fmt(r["p50_s"]), _fmt(r["p99_s"]),
                 f"{_fmt(q.get('mean'))} / {_fmt(q.get('p99'))}", _fmt(b.get("mean"), ".1f"),
                 " ".join(f"{k[2:]}:{n}" for k, n in b.get("histogram", {}).items()) or "-",
                 f"{_fmt(adj['b16_tokens_per_s'], '.1f')} / {_fmt(adj['b1_s'])}"])
  lines += table._table(["row", "ok", "errors", "tok/s", "p50 s", "p99 s",
                         "queue s mean / p99", "batch", "batches (size<=:count)",
                         "adjacent offline b16 tok/s / b1 s"], body)
  streamed = next((r for r in report["levels"] if r["stream"]), None)
  if streamed:
    lines.append(f"(alt.) = one client alternating streamed and plain requests (queue and "
                 f"batch columns: both together); streamed: first text after "
                 f"{_fmt(streamed.get('first_token_p50_s'))} s (p50), "
                 f"{_fmt(streamed.get('chunks_mean'), '.1f')} text chunks per request")
  short = sum(r["short_completions"] for r in report["levels"])
  if short:
    lines.append(f"{short} completions ended before {plan['new_tokens']} tokens (EOS); "
                 "tokens/s counts usage.completion_tokens")
  lines += [""] + table.render_targets(report["targets"])
  lines += report.get("notes", [])
  return "\n".join(lines)


def _git_state() -> dict:
  """The commit measured, and whether t5forge/ had uncommitted changes."""
  def git(*a):
    return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
  return {"commit": git("rev-parse", "HEAD"),
          "t5forge_uncommitted": bool(git("status", "--porcelain", "--", "t5forge"))}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m bench serve",
                              description="t5forge serve under load, against offline "
                                          "generate calls in the same run")
  p.add_argument("--quick", action="store_true", help="smoke test: tiny model, few requests")
  p.add_argument("--seed", type=int, default=0, help="seed of the weights")
  p.add_argument("--output", default=None,
                 help="JSON path (default bench/results/serve.json, serve_quick.json with "
                 "--quick; with --schedulers serve_schedulers.json, serve_schedulers_quick.json)")
  p.add_argument("--server_args", default="",
                 help="more flags for `t5forge serve` (both servers with --schedulers), one "
                 "string (e.g. '--max_wait_ms 5')")
  p.add_argument("--schedulers", action="store_true",
                 help="instead of the concurrency levels: --scheduler static against "
                 "continuous, four scenarios (bench/serve_loads.py)")
  p.add_argument("--rounds", type=int, default=None,
                 help="with --schedulers: pairs of server runs, alternated (default 2; 1 with "
                 "--quick)")
  p.add_argument("--scenarios", default=None,
                 help="with --schedulers: which to run, comma-separated, of mixed, open "
                 "(needs mixed: its rate comes from it), uniform, rss, hostile (default all)")
  args = p.parse_args(argv)
  if args.rounds is not None and (not args.schedulers or args.rounds < 1):
    p.error("--rounds takes a positive count, with --schedulers")
  if args.scenarios is not None:
    from bench.serve_loads import SCENARIOS
    chosen = tuple(x for x in args.scenarios.split(",") if x)
    if not args.schedulers or not chosen or any(x not in SCENARIOS for x in chosen) \
        or ("open" in chosen and "mixed" not in chosen):
      p.error(f"--scenarios takes some of {','.join(SCENARIOS)} (open needs mixed), with "
              "--schedulers")
    args.scenarios = chosen
  return args


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse(argv)
  if args.schedulers:
    from bench import serve_loads
    plan = serve_loads.QUICK if args.quick else serve_loads.FULL
    if args.rounds:
      plan = dataclasses.replace(plan, rounds=args.rounds)
    if args.scenarios:
      plan = dataclasses.replace(plan, scenarios=args.scenarios)
  else:
    plan = QUICK if args.quick else FULL
  name = "serve_schedulers" if args.schedulers else "serve"
  output = args.output or os.path.join(RESULTS_DIR, f"{name}{'_quick' if args.quick else ''}.json")
  # SIGTERM unwinds like ctrl-C, so the server child is stopped on the way out.
  report_lib.unwind_on_sigterm()
  started = time.perf_counter()
  report = {"benchmark": ("t5forge serve: --scheduler static vs continuous" if args.schedulers
                         else "t5forge serve under load vs offline generate"),
            "command": " ".join(["python -m bench serve"] + argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
            "machine": machine_info(), "git": _git_state()}
  if args.schedulers:
    report.update(serve_loads.run(plan, args.seed, args.server_args.split()))
    errors, exit_codes = report["error_count"], report["server_exit_codes"]
  else:
    report.update(run(plan, args.seed, args.server_args.split()))
    errors = sum(r["error_count"] for r in report["levels"])
    exit_codes = [report["server_exit_code"]]
  report["seconds"] = round(time.perf_counter() - started, 1)
  report_lib.write_json(output, report)
  print(serve_loads.render(report) if args.schedulers else render(report))
  print(f"\nwrote {os.path.relpath(output)} ({report['seconds']:.0f} s)")
  return 1 if errors or any(c != 0 for c in exit_codes) else 0


if __name__ == "__main__":
  sys.exit(main())
