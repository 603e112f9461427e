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
    t5forge_cancelled_total{stage}                   rows dropped: queued, running,
                                                     queue_timeout, shutdown
"""
from __future__ import annotations

import prometheus_client as prom

_LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_STEP_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)


class Metrics:
  """The server's counters; `render()` is the /metrics body."""

  def __init__(self):
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

  def watch_compiles(self, engine) -> None:
    """Reports `engine.compiles_since_ready()` as t5forge_compiles_since_ready."""
    self.compiles.set_function(engine.compiles_since_ready)

  def render(self) -> tuple[bytes, str]:
    """-> (body, content type) of the Prometheus text format."""
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
