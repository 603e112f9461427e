"""`python -m bench serve --schedulers`: the static path (`--scheduler static`) against the
continuous-batching engine (`--scheduler continuous`) under the same loads; bench/serve.py's
docstring says what each scenario measures and its target.

A round starts one server, measures every scenario, stops it (SIGTERM) and does the same
with the other scheduler; rounds alternate which goes first (static, continuous, then
continuous, static), and each cell of the table is the median over rounds. An offline
batch-16 `generate` call (64 new tokens) is timed before the first server and after each,
while no server runs.
"""
from __future__ import annotations

import dataclasses
import http.client
import os
import random
import statistics
import threading
import time

from bench import serve_client
from bench.prepare import CACHE_DIR
from bench.workers import REPO_ROOT, log
from t5forge import testing

SCHEDULERS = ("static", "continuous")
SCENARIOS = ("mixed", "open", "uniform", "rss", "hostile")
TARGETS = {"mixed_tokens_per_s": 1.5, "open_ttft_p50": 0.4, "open_ttft_p99": 0.5,
           "uniform_tokens_per_s": 0.95, "uniform_vs_offline_b16": 0.8, "rss_growth": 1.05,
           "hostile_rss_growth": 1.05, "hostile_engine_compiles": 0}
KEEP_ALIVE_S = 2.0  # reuse an idle connection at most this long (uvicorn closes at 5 s)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes of the comparison. FULL is the measurement; QUICK a smoke test."""

  preset: str = "flan_t5.small"
  input_tokens: int = 128  # including the EOS the server appends
  new_tokens: int = 64  # the uniform scenario's, and the offline batch-16 call's
  short_tokens: int = 8  # mixed lengths: half short, half long (the largest decode bucket)
  long_tokens: int = 128
  max_batch_size: int = 16  # both servers; the engine's --slots
  rounds: int = 2
  mixed_concurrency: int = 32
  mixed_requests: int = 320
  open_load: float = 0.6  # of the static path's requests/s in the mixed scenario
  open_requests: int = 400
  uniform_concurrency: int = 16
  uniform_requests: int = 160
  rss_requests: tuple[int, int] = (100, 2000)  # served by the continuous server, in all
  # Random options (temperature, top_k 1..1000, top_p, n, logprobs), both servers: the
  # first batch compiles what the static path compiles per kind; compiles and VmRSS are
  # then measured over the second.
  hostile_requests: tuple[int, int] = (100, 500)
  prompts: int = 32
  seed: int = 0  # arrivals and lengths of the open loop
  scenarios: tuple[str, ...] = SCENARIOS  # what each session measures (--scenarios)
  health_timeout_s: float = 900.0
  # Both servers: only 128-token inputs; decode buckets 8 (a batch of short rows only), 64
  # (the uniform scenario) and 128 (the longest), so the static path never decodes a batch
  # in a longer bucket than its longest row needs; batch buckets every power of 2, so an
  # open-loop batch pads to at most twice its rows. The engine's cache holds 128 tokens.
  server_flags: tuple[str, ...] = ("--length_buckets", "128", "--decode_buckets", "8,64,128",
                                   "--batch_buckets", "1,2,4,8,16", "--warmup", "greedy")

  def scheduler_flags(self, scheduler: str) -> list[str]:
    flags = ["--max_batch_size", str(self.max_batch_size), *self.server_flags,
             "--scheduler", scheduler]
    return flags + (["--slots", str(self.max_batch_size)] if scheduler == "continuous" else [])


FULL = Plan()
QUICK = Plan(preset="t5_1_1.tiny", rounds=1, mixed_requests=64, open_requests=48,
             uniform_requests=32, rss_requests=(100, 300), prompts=16, health_timeout_s=300.0)


# -- loads --------------------------------------------------------------------------------
def open_loop(port: int, model: str, prompts: list[str], rate: float, plan: Plan) -> dict:
  """`plan.open_requests` streamed requests with Poisson arrivals at `rate` per second,
  each on its own thread started at its arrival time; max_tokens half short, half long
  (seeded shuffle), prompts round-robin. Idle keep-alive connections are reused."""
  rng = random.Random(plan.seed)
  n = plan.open_requests
  tokens = [plan.short_tokens] * (n // 2) + [plan.long_tokens] * (n - n // 2)
  rng.shuffle(tokens)
  arrivals, t = [], 0.0
  for _ in range(n):
    t += rng.expovariate(rate)
    arrivals.append(t)
  lock, idle, results = threading.Lock(), [], []

  def connection():
    with lock:
      while idle:
        conn, used = idle.pop()
        if time.monotonic() - used < KEEP_ALIVE_S:
          return conn
        conn.close()
    return http.client.HTTPConnection("127.0.0.1", port, timeout=900)

  def one(k: int, late: float):
    conn = connection()
    body = {"model": model, "prompt": prompts[k % len(prompts)], "max_tokens": tokens[k],
            "temperature": 0, "stream": True}
    try:
      r = serve_client.one(conn, body, True)
      with lock:
        idle.append((conn, time.monotonic()))
    except (OSError, http.client.HTTPException, ValueError) as e:
      r = {"status": None, "error": f"{type(e).__name__}: {e}", "max_tokens": tokens[k]}
      conn.close()
    r["late_s"] = late
    with lock:
      results.append(r)

  threads = []
  start = time.perf_counter()
  for k, at in enumerate(arrivals):
    delay = start + at - time.perf_counter()
    if delay > 0:
      time.sleep(delay)
    th = threading.Thread(target=one, args=(k, max(0.0, -delay)), daemon=True)
    th.start()
    threads.append(th)
  for th in threads:
    th.join()
  wall = time.perf_counter() - start
  with lock:
    for conn, _ in idle:
      conn.close()
  row = serve_client.summarize(results, wall, None, True)
  row.update(offered_per_s=rate, arrivals_s=arrivals[-1],
             late_max_s=max(r["late_s"] for r in results))
  return row


def hostile(port: int, model: str, prompts: list[str], plan: Plan, total: int,
            seed: int) -> dict:
  """`total` completions whose options a hostile client draws at random: temperature
  0.01..2, top_k 1..1000, top_p 0.05..1, n 1..3, logprobs none or 0..5, max_tokens
  1..short_tokens, from `plan.mixed_concurrency` closed-loop clients. -> {"requests",
  "statuses": {status: count}, "error_count": 5xx and failed connections}."""
  rng = random.Random(seed)
  bodies = []
  for k in range(total):
    body = {"model": model, "prompt": prompts[k % len(prompts)],
            "max_tokens": rng.randint(1, plan.short_tokens),
            "temperature": round(rng.uniform(0.01, 2.0), 3), "top_k": rng.randint(1, 1000),
            "top_p": round(rng.uniform(0.05, 1.0), 3), "n": rng.randint(1, 3), "seed": k}
    logprobs = rng.choice([None, 0, 1, 2, 3, 4, 5])
    if logprobs is not None:
      body["logprobs"] = logprobs
    bodies.append(body)
  lock, statuses = threading.Lock(), {}

  def client():
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
      while True:
        with lock:
          if not bodies:
            return
          body = bodies.pop()
        try:
          status = serve_client.one(conn, body, False)["status"]
        except (OSError, http.client.HTTPException, ValueError):
          status = None
          conn.close()
          conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        with lock:
          statuses[status] = statuses.get(status, 0) + 1
    finally:
      conn.close()

  threads = [threading.Thread(target=client, daemon=True) for _ in range(plan.mixed_concurrency)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  errors = sum(n for st, n in statuses.items() if st is None or st >= 500)
  return {"requests": total, "statuses": {str(k): v for k, v in statuses.items()},
          "error_count": errors}


def mixed_tokens(plan: Plan):
  """max_tokens of closed-loop request k: short and long, interleaved."""
  return lambda k: plan.short_tokens if k % 2 == 0 else plan.long_tokens


def gauge(url: str, name: str) -> float | None:
  """One unlabelled sample of GET /metrics (None where absent)."""
  status, _, body = testing.request(url, "/metrics", timeout=30)
  for line in body.splitlines() if status == 200 else ():
    if line.startswith(name + " "):
      return float(line.split()[1])
  return None


def vm_kib(pid: int) -> dict[str, int]:
  """VmRSS and VmHWM of a process, KiB (/proc/PID/status)."""
  out = {}
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmRSS", "VmHWM"):
        out[key] = int(value.split()[0])
  return out


# -- one server -------------------------------------------------------------------------------
def session(path: str, plan: Plan, scheduler: str, round_: int, prompts: list[str],
            shared: dict, server_args: list[str], rss: bool) -> dict:
  """Starts `scheduler`'s server, runs the scenarios, stops it. `shared["rate"]`: the
  open loop's arrival rate, set from the first static session's mixed scenario."""
  out = {"scheduler": scheduler, "round": round_}
  log_path = os.path.join(CACHE_DIR, "logs", f"serve_{scheduler}_{round_}.log")
  with testing.Server(path, *plan.scheduler_flags(scheduler), *server_args, wait=False,
                      cwd=REPO_ROOT, log_path=log_path, own_session=True) as server:
    log(f"[{scheduler}, round {round_ + 1}] starting: " + " ".join(server.argv[3:]))
    out["server_argv"] = ["python"] + server.argv[1:]
    out["ready_s"] = server.wait_ready(plan.health_timeout_s)
    log(f"  ready after {out['ready_s']:.1f} s (port {server.port})")
    status, _, body = testing.request(server.url, "/v1/models")
    model_id = body["data"][0]["id"] if status == 200 else "t5forge"
    port, mixed = server.port, mixed_tokens(plan)
    # Warm-up: every length through the whole stack, plain and streamed.
    warm = [serve_client.drive(port, model_id, prompts, 2, 4, mixed),
            serve_client.drive(port, model_id, prompts, 2, 2, plan.new_tokens),
            serve_client.drive(port, model_id, prompts, 2, 2, mixed, stream=True)]
    served = sum(r["requests"] for r in warm)
    out["warmup_errors"] = sum(r["error_count"] for r in warm)
    names = list(serve_client.scrape(server.url))
    hist = serve_client.pick_histograms(names)
    for key in ("step", "encode"):  # the engine's: one k-step decode call, one insert
      hist[key] = f"t5forge_{key}_seconds" if f"t5forge_{key}_seconds" in names else None
    out["histograms"] = hist

    def measured(name: str, load) -> dict:
      m0 = serve_client.scrape(server.url)
      row = load()
      m1 = serve_client.scrape(server.url)
      for key, metric in hist.items():
        if metric:
          row[key] = serve_client.histogram_delta(m0, m1, metric)
      out[name] = row
      log(f"  {name}: {row['tokens_per_s']:.1f} tok/s, {row['requests_per_s']:.2f} req/s, "
          f"p50 {serve_client.fmt(row['p50_s'])} s, p99 {serve_client.fmt(row['p99_s'])} s"
          + (f", first text p50 {serve_client.fmt(row['first_token_p50_s'])} s, p99 "
             f"{serve_client.fmt(row['first_token_p99_s'])} s" if row["stream"] else "")
          + f", errors {row['error_count']}")
      return row

    if rss and "rss" in plan.scenarios:  # first: the counts are the requests it served
      out["rss"], loads = [], []
      for total in plan.rss_requests:
        log(f"  RSS: mixed lengths, concurrency {plan.mixed_concurrency}, up to {total} "
            "requests served")
        loads.append(serve_client.drive(port, model_id, prompts, plan.mixed_concurrency,
                                 max(0, total - served), mixed))
        served += loads[-1]["requests"]
        out["rss"].append({"served": served, **vm_kib(server.proc.pid)})
        log(f"    after {served} requests: VmRSS {out['rss'][-1]['VmRSS'] / 1024:.1f} MiB")
      out["rss_errors"] = sum(r["error_count"] for r in loads)
      out["rss_loads"] = loads
    if "hostile" in plan.scenarios:
      out["hostile"] = h = {"compiles": [], "VmRSS": [], "loads": []}
      for i, total in enumerate(plan.hostile_requests):
        before = gauge(server.url, "t5forge_compiles_since_ready")
        log(f"  hostile: {total} requests with random options")
        h["loads"].append(hostile(port, model_id, prompts, plan, total, plan.seed + i))
        h["compiles"].append(gauge(server.url, "t5forge_compiles_since_ready") - before)
        h["VmRSS"].append(vm_kib(server.proc.pid)["VmRSS"])
        log(f"    {h['loads'][-1]['statuses']}; compiles {h['compiles'][-1]:.0f}, VmRSS "
            f"{h['VmRSS'][-1] / 1024:.1f} MiB")
      served += sum(x["requests"] for x in h["loads"])
      out["hostile_errors"] = sum(x["error_count"] for x in h["loads"])
    if "mixed" in plan.scenarios:
      measured("mixed", lambda: serve_client.drive(port, model_id, prompts, plan.mixed_concurrency,
                                            plan.mixed_requests, mixed))
    if "open" in plan.scenarios:
      if shared.get("rate") is None:
        if scheduler != "static" or "mixed" not in out:
          raise AssertionError("the open loop's rate comes from a static session's mixed "
                               "scenario run before")
        shared["rate"] = plan.open_load * out["mixed"]["requests_per_s"]
        log(f"  open-loop rate: {plan.open_load} x {out['mixed']['requests_per_s']:.2f} = "
            f"{shared['rate']:.2f} requests/s")
      log(f"  open loop: {plan.open_requests} streamed requests, Poisson at "
          f"{shared['rate']:.2f}/s")
      measured("open", lambda: open_loop(port, model_id, prompts, shared["rate"], plan))
    if "uniform" in plan.scenarios:
      measured("uniform", lambda: serve_client.drive(port, model_id, prompts,
                                              plan.uniform_concurrency, plan.uniform_requests,
                                              plan.new_tokens))
    out["compiles_since_ready"] = gauge(server.url, "t5forge_compiles_since_ready")
  out["exit_code"] = server.proc.returncode
  out["error_count"] = (out["warmup_errors"] + out.get("rss_errors", 0)
                        + out.get("hostile_errors", 0)
                        + sum(out[k]["error_count"] for k in ("mixed", "open", "uniform")
                              if k in out))
  return out


# -- the run ------------------------------------------------------------------------------
def run(plan: Plan, seed: int, server_args: list[str]) -> dict:
  path = serve_client.build_checkpoint(plan, seed)
  offline = serve_client.Offline(path, plan)
  report = {"checkpoint": os.path.relpath(path, REPO_ROOT),
            "model": f"{plan.preset} shape, random init (seed {seed}), vocabulary "
                     f"bible_en_es_8k.model + {testing.EXTRA_IDS} extra ids "
                     f"({offline.vocab.vocab_size})",
            "plan": dataclasses.asdict(plan), "notes": []}
  log(f"screening prompts (offline greedy, all {plan.long_tokens} new tokens without EOS)")
  candidates = serve_client.candidate_prompts(offline.vocab, plan.prompts * 2, plan.input_tokens - 1)
  prompts = offline.full_length(candidates, plan.max_batch_size, plan.long_tokens)
  prompts = prompts[:plan.prompts]
  if len(prompts) < plan.max_batch_size:
    raise RuntimeError(f"only {len(prompts)} of {len(candidates)} prompts decode "
                       f"{plan.long_tokens} tokens without EOS")
  report["prompts"] = len(prompts)
  b16 = offline.inputs(prompts[:plan.max_batch_size])
  offline.time_call(b16)  # compile
  offline_s = []

  def offline_point():
    offline_s.append(offline.time_call(b16))
    log(f"offline batch {plan.max_batch_size}, {plan.new_tokens} new tokens: "
        f"{offline_s[-1]:.3f} s")

  offline_point()
  sessions, shared = [], {}
  order = [s for r in range(plan.rounds) for s in (SCHEDULERS if r % 2 == 0
                                                   else SCHEDULERS[::-1])]
  last_continuous = max(i for i, s in enumerate(order) if s == "continuous")
  for i, scheduler in enumerate(order):
    sessions.append(session(path, plan, scheduler, i // 2, prompts, shared, server_args,
                            rss=i == last_continuous))
    offline_point()
    sessions[-1]["offline_adjacent_s"] = offline_s[-2:]
  report["open_rate_per_s"] = shared.get("rate")
  report["offline_b16"] = {"times_s": offline_s, "median_s": statistics.median(offline_s),
                           "tokens_per_s": plan.max_batch_size * plan.new_tokens
                           / statistics.median(offline_s)}
  report["sessions"] = sessions
  report["error_count"] = sum(s["error_count"] for s in sessions)
  report["server_exit_codes"] = [s["exit_code"] for s in sessions]
  report["rows"] = rows(report)
  return report


def _median(sessions: list[dict], scheduler: str, get) -> float | None:
  values = [get(s) for s in sessions if s["scheduler"] == scheduler]
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def rows(report: dict) -> list[dict]:
  """The table: one row per scenario and metric, static and continuous medians over
  rounds, ratio continuous / static, target where there is one."""
  plan, sessions, out = report["plan"], report["sessions"], []

  def row(name, get, goal=None, fmt=".1f", higher=True):
    s, c = (_median(sessions, k, get) for k in SCHEDULERS)
    ratio = c / s if s and c is not None else None
    met = None if goal is None or ratio is None else (ratio >= goal if higher else ratio <= goal)
    out.append({"row": name, "static": s, "continuous": c, "ratio": ratio, "fmt": fmt,
                "goal": None if goal is None else f"{'>=' if higher else '<='} {goal}",
                "met": met})

  hist = lambda key, q: lambda s: (s.get(key) or {}).get(q)
  short, long_ = plan["short_tokens"], plan["long_tokens"]
  chosen = plan.get("scenarios", SCENARIOS)
  m = f"1 mixed {short}/{long_} new, c={plan['mixed_concurrency']}"
  if "mixed" in chosen:
    _mixed_rows(row, hist, m)
  if "open" in chosen:
    _open_rows(row, hist, f"2 open loop {report['open_rate_per_s']:.2f} req/s, streamed")
  if "uniform" in chosen:
    _uniform_rows(row, report, out)
  if "rss" in chosen:
    rss = next(s["rss"] for s in sessions if "rss" in s)
    v, goal = rss[-1]["VmRSS"] / rss[0]["VmRSS"], TARGETS["rss_growth"]
    out.append({"row": f"4 continuous VmRSS MiB after {rss[0]['served']} -> "
                       f"{rss[-1]['served']} requests", "static": None,
                "continuous": f"{rss[0]['VmRSS'] / 1024:.1f} -> {rss[-1]['VmRSS'] / 1024:.1f}",
                "ratio": v, "fmt": ".1f", "goal": f"<= {goal}", "met": v <= goal})
  if "hostile" in chosen:
    _hostile_rows(row, sessions, plan["hostile_requests"], out)
  row("errors (all requests)", lambda s: s["error_count"], fmt="d")
  return out


def _hostile_rows(row, sessions: list[dict], counts, out: list) -> None:
  h = f"5 hostile options, {counts[0]} then {counts[1]} requests"
  row(f"{h}: compiles in the first {counts[0]}", lambda s: s["hostile"]["compiles"][0], fmt="d")
  row(f"{h}: compiles in the next {counts[1]}", lambda s: s["hostile"]["compiles"][1], fmt="d")
  goal = TARGETS["hostile_engine_compiles"]
  c = _median(sessions, "continuous", lambda s: s["hostile"]["compiles"][1])
  out[-1].update(goal=f"continuous = {goal}", met=c == goal)
  for scheduler in SCHEDULERS:
    rss = [s["hostile"]["VmRSS"] for s in sessions if s["scheduler"] == scheduler][-1]
    v, goal = rss[1] / rss[0], TARGETS["hostile_rss_growth"]
    out.append({"row": f"{h}: {scheduler} VmRSS MiB over the next {counts[1]}",
                "static": f"{rss[0] / 1024:.1f} -> {rss[1] / 1024:.1f}"
                if scheduler == "static" else None,
                "continuous": f"{rss[0] / 1024:.1f} -> {rss[1] / 1024:.1f}"
                if scheduler == "continuous" else None,
                "ratio": v, "fmt": ".1f", "goal": f"<= {goal}", "met": v <= goal})


def _mixed_rows(row, hist, m: str) -> None:
  row(f"{m}: output tok/s", lambda s: s["mixed"]["tokens_per_s"], TARGETS["mixed_tokens_per_s"])
  row(f"{m}: requests/s", lambda s: s["mixed"]["requests_per_s"], fmt=".2f")
  row(f"{m}: p50 latency s", lambda s: s["mixed"]["p50_s"], fmt=".3f")
  row(f"{m}: rows per model call (mean)", lambda s: hist("batch", "mean")(s["mixed"]),
      fmt=".1f")
  row(f"{m}: engine step s (mean)", lambda s: hist("step", "mean")(s["mixed"]), fmt=".4f")


def _open_rows(row, hist, o: str) -> None:
  row(f"{o}: TTFT p50 s", lambda s: s["open"]["first_token_p50_s"], TARGETS["open_ttft_p50"],
      ".3f", higher=False)
  row(f"{o}: TTFT p99 s", lambda s: s["open"]["first_token_p99_s"], TARGETS["open_ttft_p99"],
      ".3f", higher=False)
  row(f"{o}: p50 latency s", lambda s: s["open"]["p50_s"], fmt=".3f")
  row(f"{o}: queue s mean (server)", lambda s: hist("queue", "mean")(s["open"]), fmt=".3f")
  row(f"{o}: TTFT p50 s (server, engine only)", lambda s: hist("ttft", "p50")(s["open"]),
      fmt=".3f")


def _uniform_rows(row, report: dict, out: list) -> None:
  plan, sessions = report["plan"], report["sessions"]
  u = f"3 uniform {plan['new_tokens']} new, c={plan['uniform_concurrency']}"
  row(f"{u}: tok/s", lambda s: s["uniform"]["tokens_per_s"], TARGETS["uniform_tokens_per_s"])
  ratios = [s["uniform"]["tokens_per_s"] * statistics.fmean(s["offline_adjacent_s"])
            / (plan["max_batch_size"] * plan["new_tokens"])
            for s in sessions if s["scheduler"] == "continuous"]
  v, goal = statistics.median(ratios), TARGETS["uniform_vs_offline_b16"]
  off = report["offline_b16"]["tokens_per_s"]
  out.append({"row": f"{u}: vs offline batch-16 generate ({off:.1f} tok/s)", "static": None,
              "continuous": _median(sessions, "continuous", lambda s: s["uniform"]["tokens_per_s"]),
              "ratio": v, "fmt": ".1f", "goal": f">= {goal}", "met": v >= goal})


# -- output -------------------------------------------------------------------------------
def _cell(x, fmt: str) -> str:
  if x is None or isinstance(x, str):
    return x or "-"
  return format(int(x), "d") if fmt == "d" else format(x, fmt)


def render(report: dict) -> str:
  from bench import table
  plan = report["plan"]
  lines = table.render_machine(report["machine"], 0, report["quick"])[:2]
  argv = report["sessions"][0]["server_argv"]
  flags = " ".join(argv[argv.index("--port") + 2:]).replace(REPO_ROOT + "/", "")
  lines += [f"model: {report['model']}; float32",
            f"== t5forge serve: --scheduler static vs continuous, {plan['input_tokens']} input "
            f"tokens, greedy; medians of {plan['rounds']} round(s), servers alternated ==",
            f"static server: {flags}; continuous: the same with --scheduler continuous "
            f"--slots {plan['max_batch_size']}",
            "TTFT = client side, from sending to the first SSE chunk carrying text; "
            "ratio = continuous / static; the open loop's rate is "
            f"{plan['open_load']} x the static path's requests/s in scenario 1 (first round)"]
  body = [[r["row"], _cell(r["static"], r["fmt"]), _cell(r["continuous"], r["fmt"]),
           _cell(r["ratio"], ".3f"), r["goal"] or "-",
           {True: "yes", False: "NO", None: "-"}[r["met"]]] for r in report["rows"]]
  lines += table._table(["scenario / metric", "static", "continuous", "ratio", "target",
                         "pass"], body)
  lines += ["", "sessions (in order):"]
  get = lambda s, k, key: (s.get(k) or {}).get(key)
  body = [[s["scheduler"], str(s["round"] + 1), f"{s['ready_s']:.0f}",
           _cell(get(s, "mixed", "tokens_per_s"), ".1f"),
           serve_client.fmt(get(s, "open", "first_token_p50_s")),
           serve_client.fmt(get(s, "open", "first_token_p99_s")),
           _cell(get(s, "uniform", "tokens_per_s"), ".1f"),
           " / ".join(f"{t:.3f}" for t in s["offline_adjacent_s"]),
           _cell(s["compiles_since_ready"], "d"), str(s["error_count"]), str(s["exit_code"])]
          for s in report["sessions"]]
  lines += table._table(["scheduler", "round", "ready s", "mixed tok/s", "TTFT p50",
                         "TTFT p99", "uniform tok/s", "offline b16 s before / after",
                         "compiles after ready", "errors", "exit"], body)
  short = sum(s[k]["short_completions"] for s in report["sessions"]
              for k in ("mixed", "open", "uniform") if k in s)
  if short:
    lines.append(f"{short} completions ended before their max_tokens (EOS); tokens/s counts "
                 "usage.completion_tokens")
  lines += report.get("notes", [])
  return "\n".join(lines)
