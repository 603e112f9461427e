"""Prometheus metrics of one server, in a registry of its own (so that two servers in one
process, as in tests, do not share counters and nothing registers globally).

    t5forge_requests_total{route, status}          requests answered
    t5forge_request_latency_seconds{route}         arrival -> last byte sent (histogram)
    t5forge_queue_time_seconds                     enqueue -> its batch starts (histogram)
    t5forge_batch_size                             rows per model call, before padding
                                                   (the engine: rows decoding per step)
    t5forge_queue_depth                            rows waiting
    t5forge_prompt_tokens_total / t5forge_completion_tokens_total
  the engine (continuous batching):
    t5forge_running_requests / t5forge_slots_in_use (fraction of --slots)
    t5forge_time_to_first_token_seconds / t5forge_inter_token_latency_seconds
    t5forge_encode_seconds / t5forge_step_seconds    one insert / one k-step call
    t5forge_compiles_since_ready                     XLA compilations after ready
    t5forge_compile_cache_entries / t5forge_compile_cache_evictions_total
                                                     the static path's jitted functions
                                                     (generation.CompiledFns, bounded LRU)
    t5forge_cancelled_total{stage}                   rows dropped: queued, running,
                                                     queue_timeout, shutdown
  completions (and other generating routes), per request:
    t5forge_requests_finished_total{finished_reason} stop, length (a choice hit max_tokens)
                                                     or abort (the client left, or it failed)
  keys (auth.py), by the key's NAME, never the key:
    t5forge_key_requests_total{key}                  requests the key authenticated
    t5forge_key_rate_limited_total{key, limit}       429s, limit: requests or tokens

With `compat="vllm"` (--metrics_compat vllm) the registry also shows vLLM's names, each
with a `model_name` label, read from the metrics above when /metrics is scraped (nothing
records twice; `VLLM_NAMES` lists them):

    vllm:num_requests_running        t5forge_running_requests
    vllm:num_requests_waiting        t5forge_queue_depth
    vllm:kv_cache_usage_perc         t5forge_slots_in_use (slots in use / slots, 0..1)
    vllm:time_to_first_token_seconds t5forge_time_to_first_token_seconds
    vllm:inter_token_latency_seconds t5forge_inter_token_latency_seconds
    vllm:e2e_request_latency_seconds t5forge_request_latency_seconds of GENERATE_ROUTES
    vllm:request_queue_time_seconds  t5forge_queue_time_seconds
    vllm:prompt_tokens_total         t5forge_prompt_tokens_total
    vllm:generation_tokens_total     t5forge_completion_tokens_total
    vllm:request_success_total       t5forge_requests_finished_total
"""
from __future__ import annotations

import math

import prometheus_client as prom
from prometheus_client import core as prom_core
from prometheus_client import utils as prom_utils

_LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_STEP_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)
COMPAT = ("none", "vllm")
FINISH_REASONS = ("stop", "length", "abort")
# The routes whose latency is vLLM's end-to-end request latency: those that generate.
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
              "vllm:request_success")  # counters: exposed with _total


class Metrics:
  """The server's counters; `render()` is the /metrics body."""

  def __init__(self, *, model_name: str = "", compat: str = "none"):
    if compat not in COMPAT:
      raise ValueError(f"compat must be one of {COMPAT}, got {compat!r}")
    r = self.registry = prom.CollectorRegistry()
    self.requests = prom.Counter("t5forge_requests", "HTTP requests answered, by route and status",
                                 ["route", "status"], registry=r)
    self.latency = prom.Histogram("t5forge_request_latency_seconds",
                                  "Request latency, arrival to the last byte", ["route"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
    self.queue_time = prom.Histogram("t5forge_queue_time_seconds",
                                     "Time a row waits in the queue before its batch starts",
                                     buckets=_LATENCY_BUCKETS, registry=r)
    self.batch_size = prom.Histogram("t5forge_batch_size", "Rows per model call (before padding)",
                                     buckets=_BATCH_BUCKETS, registry=r)
    self.queue_depth = prom.Gauge("t5forge_queue_depth", "Rows waiting in the queue", registry=r)
    self.prompt_tokens = prom.Counter("t5forge_prompt_tokens", "Prompt tokens read (EOS included)",
                                      registry=r)
    self.completion_tokens = prom.Counter("t5forge_completion_tokens",
                                          "Completion tokens generated (EOS included)", registry=r)
    self.running = prom.Gauge("t5forge_running_requests", "Rows decoding in a slot", registry=r)
    self.slots_in_use = prom.Gauge("t5forge_slots_in_use", "Fraction of the decode slots in use",
                                   registry=r)
    self.time_to_first_token = prom.Histogram(
        "t5forge_time_to_first_token_seconds", "Enqueue to a row's first token",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.inter_token_latency = prom.Histogram(
        "t5forge_inter_token_latency_seconds", "Seconds per token after the first",
        buckets=_STEP_BUCKETS, registry=r)
    self.encode_seconds = prom.Histogram("t5forge_encode_seconds",
                                         "One encode+insert of admitted rows",
                                         buckets=_STEP_BUCKETS, registry=r)
    self.step_seconds = prom.Histogram("t5forge_step_seconds", "One k-step decode of every slot",
                                       buckets=_STEP_BUCKETS, registry=r)
    self.compiles = prom.Gauge("t5forge_compiles_since_ready",
                               "XLA compilations since the engine was ready", registry=r)
    self.cancelled = prom.Counter("t5forge_cancelled", "Rows dropped before they finished",
                                  ["stage"], registry=r)
    self.finished = prom.Counter("t5forge_requests_finished",
                                 "Generating requests that ended, by finish reason",
                                 ["finished_reason"], registry=r)
    for reason in FINISH_REASONS:
      self.finished.labels(reason)  # shown at 0 before the first
    self.key_requests = prom.Counter("t5forge_key_requests",
                                     "Requests authenticated, by the key's name", ["key"],
                                     registry=r)
    self.rate_limited = prom.Counter("t5forge_key_rate_limited",
                                     "Requests refused with 429, by the key's name and limit",
                                     ["key", "limit"], registry=r)
    if compat == "vllm":
      r.register(_VllmNames(self, model_name))

  def finish(self, reasons: list) -> None:
    """Counts one generating request by its choices' finish reasons (None: it was aborted):
    abort if any was, else length if any choice hit max_tokens, else stop."""
    reason = ("abort" if not reasons or None in reasons else
              "length" if "length" in reasons else "stop")
    self.finished.labels(reason).inc()

  def watch_compiles(self, worker) -> None:
    """Reports `worker.compiles_since_ready()` (an engine or a batcher, whichever is ready
    last) as t5forge_compiles_since_ready."""
    self.compiles.set_function(worker.compiles_since_ready)

  def watch_compile_cache(self, cache) -> None:
    """Reports a `generation.CompiledFns` (its size and evictions) at every scrape."""
    self.registry.register(_CompileCache(cache))

  def render(self) -> tuple[bytes, str]:
    """-> (body, content type) of the Prometheus text format."""
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


def _samples(metric) -> list:
  return [x for family in metric.collect() for x in family.samples]


def _value(metric) -> float:
  """The value of an unlabelled gauge, or the total of a counter over its labels."""
  return sum(x.value for x in _samples(metric) if not x.name.endswith("_created"))


def _histogram(metric, bounds, keep=lambda labels: True) -> tuple[list, float]:
  """(cumulative [(le, count)], sum) of a histogram, its labelled children that `keep`
  accepts added up."""
  counts = {prom_utils.floatToGoString(b): 0.0 for b in (*bounds, math.inf)}
  total = 0.0
  for x in _samples(metric):
    if not keep(x.labels):
      continue
    if x.name.endswith("_bucket"):
      counts[x.labels["le"]] += x.value
    elif x.name.endswith("_sum"):
      total += x.value
  return sorted(counts.items(), key=lambda kv: float(kv[0])), total


class _CompileCache:
  """t5forge_compile_cache_{entries,evictions_total} read from a `CompiledFns`."""

  def __init__(self, cache):
    self.cache = cache

  def collect(self):
    g = prom_core.GaugeMetricFamily("t5forge_compile_cache_entries",
                                    "Jitted functions held by the static decode path")
    g.add_metric([], len(self.cache))
    yield g
    c = prom_core.CounterMetricFamily("t5forge_compile_cache_evictions",
                                      "Jitted functions dropped as least recently used")
    c.add_metric([], self.cache.evictions)
    yield c


class _VllmNames:
  """vLLM's metric names (`VLLM_NAMES`), each labelled model_name, mirrored from `m`'s
  t5forge_* metrics at every scrape."""

  def __init__(self, m: Metrics, model_name: str):
    self.m, self.model = m, model_name

  def collect(self):
    m, labels = self.m, ["model_name"]
    for name, doc, src in (
        ("vllm:num_requests_running", "Requests decoding in a slot", m.running),
        ("vllm:num_requests_waiting", "Requests waiting in the queue", m.queue_depth),
        ("vllm:kv_cache_usage_perc", "Decode slots in use / slots (0..1)", m.slots_in_use)):
      g = prom_core.GaugeMetricFamily(name, doc, labels=labels)
      g.add_metric([self.model], _value(src))
      yield g
    for name, doc, src, bounds, keep in (
        ("vllm:time_to_first_token_seconds", "Enqueue to the first token",
         m.time_to_first_token, _LATENCY_BUCKETS, None),
        ("vllm:inter_token_latency_seconds", "Seconds per token after the first",
         m.inter_token_latency, _STEP_BUCKETS, None),
        ("vllm:e2e_request_latency_seconds", "Arrival to the last byte of generating requests",
         m.latency, _LATENCY_BUCKETS, lambda lab: lab.get("route") in GENERATE_ROUTES),
        ("vllm:request_queue_time_seconds", "Time a row waits before it is encoded",
         m.queue_time, _LATENCY_BUCKETS, None)):
      buckets, total = _histogram(src, bounds, keep or (lambda lab: True))
      h = prom_core.HistogramMetricFamily(name, doc, labels=labels)
      h.add_metric([self.model], buckets, total)
      yield h
    for name, doc, src in (("vllm:prompt_tokens", "Prompt tokens read", m.prompt_tokens),
                           ("vllm:generation_tokens", "Tokens generated", m.completion_tokens)):
      c = prom_core.CounterMetricFamily(name, doc, labels=labels)
      c.add_metric([self.model], _value(src))
      yield c
    c = prom_core.CounterMetricFamily("vllm:request_success", "Finished requests by reason",
                                      labels=[*labels, "finished_reason"])
    for x in _samples(m.finished):
      if x.name.endswith("_total"):
        c.add_metric([self.model, x.labels["finished_reason"]], x.value)
    yield c
