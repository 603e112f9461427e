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
import os
import statistics
import subprocess
import sys
import time

from bench import report as report_lib
from bench import serve_client
from bench.prepare import CACHE_DIR, RESULTS_DIR, machine_info
from bench.workers import REPO_ROOT, log
from t5forge import testing

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


def run(plan: Plan, seed: int, server_args: list[str]) -> dict:
  """Offline calls and server levels, interleaved: one offline batch-16 and batch-1 call
  before the first level and after every level (the server idle meanwhile), so that each
  ratio compares timings taken minutes apart at most on a machine whose load drifts."""
  path = serve_client.build_checkpoint(plan, seed)
  offline = serve_client.Offline(path, plan)
  report = {"checkpoint": os.path.relpath(path, REPO_ROOT),
            "model": f"{plan.preset} shape, random init (seed {seed}), vocabulary "
                     f"bible_en_es_8k.model + {testing.EXTRA_IDS} extra ids ({offline.vocab.vocab_size})",
            "plan": dataclasses.asdict(plan), "notes": []}

  log("screening prompts (offline greedy, all new tokens without EOS)")
  candidates = serve_client.candidate_prompts(offline.vocab, plan.prompts * 2, plan.input_tokens - 1)
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
    serve_client.drive(server.port, model_id, prompts, 2, 4, plan.new_tokens)
    serve_client.drive(server.port, model_id, prompts, 1, 2, plan.new_tokens, stream=True)
    names = list(serve_client.scrape(server.url))
    hist = serve_client.pick_histograms(names)
    report["histograms"] = {**hist, "all": names}
    runs = [(c, n, False) for c, n in zip(plan.concurrency, plan.requests)]
    runs.append((1, 2 * plan.stream_requests, "alternate"))
    offline_point()
    for c, n, stream in runs:
      m0 = serve_client.scrape(server.url)
      log(f"concurrency {c}{', streamed every other' if stream else ''}: {n} requests")
      out = serve_client.drive(server.port, model_id, prompts, c, n, plan.new_tokens, stream=stream)
      m1 = serve_client.scrape(server.url)
      offline_point()
      for row in out if isinstance(out, tuple) else (out,):
        for key, name in hist.items():
          if name:  # (alternated rows: both halves of the level together)
            row[key] = serve_client.histogram_delta(m0, m1, name)
        log(f"  {'streamed: ' if row['stream'] else ''}{row['tokens_per_s']:.1f} tok/s, "
            f"p50 {serve_client.fmt(row['p50_s'])} s, p99 {serve_client.fmt(row['p99_s'])} s, errors "
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
  body = [["offline batch 1", "-", "-", serve_client.fmt(off["b1"]["tokens_per_s"], ".1f"),
           serve_client.fmt(off["b1"]["median_s"])] + ["-"] * 5,
          ["offline batch 16", "-", "-", serve_client.fmt(off["b16"]["tokens_per_s"], ".1f"),
           serve_client.fmt(off["b16"]["median_s"])] + ["-"] * 5]
  for r in report["levels"]:
    q, b = r.get("queue") or {}, r.get("batch") or {}
    adj = adjacent(r, plan)
    name = (f"serve c={r['concurrency']}" + (" streamed" if r["stream"] else "")
            + (" (alt.)" if r["alternated"] else ""))
    body.append([name, f"{r['ok']}/{r['requests']}", str(r["error_count"]),
                 serve_client.fmt(r["tokens_per_s"], ".1f"), serve_client.fmt(r["p50_s"]), serve_client.fmt(r["p99_s"]),
                 f"{serve_client.fmt(q.get('mean'))} / {serve_client.fmt(q.get('p99'))}", serve_client.fmt(b.get("mean"), ".1f"),
                 " ".join(f"{k[2:]}:{n}" for k, n in b.get("histogram", {}).items()) or "-",
                 f"{serve_client.fmt(adj['b16_tokens_per_s'], '.1f')} / {serve_client.fmt(adj['b1_s'])}"])
  lines += table._table(["row", "ok", "errors", "tok/s", "p50 s", "p99 s",
                         "queue s mean / p99", "batch", "batches (size<=:count)",
                         "adjacent offline b16 tok/s / b1 s"], body)
  streamed = next((r for r in report["levels"] if r["stream"]), None)
  if streamed:
    lines.append(f"(alt.) = one client alternating streamed and plain requests (queue and "
                 f"batch columns: both together); streamed: first text after "
                 f"{serve_client.fmt(streamed.get('first_token_p50_s'))} s (p50), "
                 f"{serve_client.fmt(streamed.get('chunks_mean'), '.1f')} text chunks per request")
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
