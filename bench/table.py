"""Tables and the benchmark's targets, from the results of bench/train_cases.py and
bench/decode_cases.py (plain dicts, the same that go into bench/results/bench.json).

`targets(report)` evaluates every target that the run measured, as ratios within this
run; `render(report)` formats one table per section and the targets.
"""
from __future__ import annotations

SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def _target(section: str, name: str, value, goal: str, met) -> dict:
  return {"section": section, "target": name, "value": value, "goal": goal, "met": met}


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
  return none if x is None else format(x, spec)


def _gflop(x: float) -> str:
  return f"{x / 1e9:,.1f} GFLOP"


def _by(rows: list[dict], **match) -> dict | None:
  for r in rows:
    if all(r.get(k) == v for k, v in match.items()):
      return r
  return None


# -- targets ---------------------------------------------------------------------------
def train_targets(train: dict) -> list[dict]:
  rows, out, size = train["rows"], [], train["shape"]
  for opt in ("adafactor", "adamw"):
    ours = [r for r in rows if r["framework"] == "ours" and r["optimizer"] == opt]
    hf = [r for r in rows if r["framework"] == "hf" and r["optimizer"] == opt]
    o32 = _by(ours, dtype="float32", scan=False)
    h32 = _by(hf, dtype="float32")
    if o32 and h32:
      ratio = o32["target_tokens_per_s"] / h32["target_tokens_per_s"]
      out.append(_target("train", f"{size} {opt}: ours fp32 / HF fp32 tokens/s",
                         round(ratio, 2), ">= 2.0", ratio >= 2.0))
    if ours and hf:
      best_o = max(ours, key=lambda r: r["target_tokens_per_s"])
      best_h = max(hf, key=lambda r: r["target_tokens_per_s"])
      ratio = best_o["target_tokens_per_s"] / best_h["target_tokens_per_s"]
      out.append(_target("train", f"{size} {opt}: ours fastest ({best_o['label']}) / HF fastest "
                         f"({best_h['label']}) tokens/s", round(ratio, 2), ">= 1.5",
                         ratio >= 1.5))
    if o32 and o32.get("util_vs_jax_fp32_peak") is not None:
      u = o32["util_vs_jax_fp32_peak"]
      out.append(_target("train", f"{size} {opt}: ours fp32 matmul FLOPs / step time / JAX fp32 "
                         "matmul peak", round(u, 3), ">= 0.70", u >= 0.70))
    if train["size"] == "base":
      for dtype in ("float32", "bfloat16"):
        mine = [r for r in ours if r["dtype"] == dtype and r.get("peak_rss_mib")]
        h = _by(hf, dtype=dtype)
        if mine and h and h.get("peak_rss_mib"):
          o = min(mine, key=lambda r: r["peak_rss_mib"])  # our leanest row of this dtype
          ratio = o["peak_rss_mib"] / h["peak_rss_mib"]
          out.append(_target("train", f"{size} {opt} {SHORT[dtype]}: ours ({o['label']}) / HF "
                             "peak RSS", round(ratio, 2), "<= 0.50", ratio <= 0.5))
      scan = _by(ours, dtype="float32", scan=True)
      if scan:
        out.append(_target("train", f"{size} {opt}: first-step compile with scan over layers (s)",
                           round(scan["compile_s"], 1), "<= 30", scan["compile_s"] <= 30))
  return out


def decode_targets(dec: dict) -> list[dict]:
  rows, out, size = dec["rows"], [], dec["shape"]
  for row in dict.fromkeys(r["row"] for r in rows):
    mine = [r for r in rows if r["row"] == row and r["impl"] in ("ours fp32", "ours bf16")]
    if not mine:
      continue
    best = max(mine, key=lambda r: r["tokens_per_s"])
    ct2 = _by(rows, row=row, impl="ct2 fp32")
    if row.startswith("greedy"):
      peers = [r for r in (ct2, _by(rows, row=row, impl="hf bf16")) if r]
      if peers:
        peer = max(peers, key=lambda r: r["tokens_per_s"])
        ratio = best["tokens_per_s"] / peer["tokens_per_s"]
        out.append(_target("decode", f"{size} {row}: ours ({best['impl']}) / better of CT2 fp32 "
                           f"and HF bf16 ({peer['impl']}) tokens/s", round(ratio, 2), ">= 1.0",
                           ratio >= 1.0))
    elif ct2:
      ratio = best["tokens_per_s"] / ct2["tokens_per_s"]
      out.append(_target("decode", f"{size} {row}: ours ({best['impl']}) / CT2 fp32 tokens/s",
                         round(ratio, 2), ">= 1.0", ratio >= 1.0))
    o8, c8 = _by(rows, row=row, impl="ours int8"), _by(rows, row=row, impl="ct2 int8")
    if o8 and c8:
      ratio = o8["tokens_per_s"] / c8["tokens_per_s"]
      out.append(_target("decode", f"{size} {row}: ours int8 / CT2 int8 tokens/s",
                         round(ratio, 2), "closes on 1.0 (state the ratio)", None))
  if "ours int8" in dec.get("skipped", {}):
    out.append(_target("decode", f"{size}: ours int8 weight-only decode vs CT2 int8",
                       None, "state the ratio", None))
  for s in dec["sanity"]:
    if s["pair"].startswith("ct2") and s["row"].startswith("greedy"):
      out.append(_target("decode", f"{size} sanity: CT2 fp32 greedy tokens == HF fp32 "
                         f"({s['row']})", f"{s['rows_equal']}/{s['rows']} rows", "all rows",
                         s["rows_equal"] == s["rows"]))
  return out


def targets(report: dict) -> list[dict]:
  out = []
  for train in report.get("train", []):
    out += train_targets(train)
  for dec in report.get("decode", []):
    out += decode_targets(dec)
  return out


# -- tables ----------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
  widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
  line = lambda cells: "  ".join(
      str(c).ljust(w) if k < left else str(c).rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))
  return [line(headers), "-" * len(line(headers))] + [line(r) for r in rows]


def render_machine(m: dict, rounds: int, quick: bool) -> list[str]:
  v = m["versions"]
  load = m["load_average_at_start"][0]
  lines = [f"machine: {m['cpu']} ({', '.join(m['cpu_flags'])}), {m['logical_cores']} logical / "
           f"{m['physical_cores']} physical cores, {m['memory_gib']} GiB; load average at "
           f"start {load}" + ("  ** machine not quiet: timings are unreliable **"
                              if load > 0.7 else ""),
           "versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x),
           f"timing: medians of {rounds} timed run(s) per job after warm-up, alternated "
           "round-robin between live workers" + ("; --quick (tiny shapes, smoke test only)"
                                                if quick else "")]
  return lines


def render_matmul(mm: dict) -> list[str]:
  sizes = sorted({r["n"] for r in mm["rows"]})
  body = []
  for key, peak in mm["peaks_gflops"].items():
    fw, dtype = key.split()
    cells = [fw, SHORT[dtype]]
    for n in sizes:
      r = _by(mm["rows"], framework=fw, dtype=dtype, n=n)
      cells.append(_fmt(r and r["gflops"], ".1f"))
    body.append(cells + [f"{peak:.1f}"])
  return (["== matmul: [n, n] x [n, n], GFLOP/s (JAX jitted; torch.matmul) =="]
          + _table(["framework", "dtype"] + [f"n={n}" for n in sizes] + ["peak"], body, left=2))


def render_train(train: dict, peaks: dict) -> list[str]:
  b, (i, t) = train["batch"], train["lengths"]
  rows = train["rows"]
  head = [f"== training: {train['shape']}, batch {b}, {i}/{t} tokens, step = forward + backward "
          "+ optimizer update ==",
          f"tokens/s = target tokens per step ({b}*{t}) / step time. Matmul FLOPs per step "
          f"(analytic, fwd+bwd): {_gflop(train['matmul_flops'])}"
          + (f"; XLA's cost analysis of our whole fp32 step (all ops): "
             f"{_gflop(rows[0]['xla_flops'])} (analytic / XLA = "
             f"{train['matmul_flops'] / rows[0]['xla_flops']:.2f})"
             if rows and rows[0].get("xla_flops") else ""),
          "util = those FLOPs / step time / the same framework's matmul peak in this run, same "
          "dtype (JAX fp32 peak "
          f"{_fmt(peaks.get('jax float32'), '.1f')} GFLOP/s). first step: JAX compile + run; "
          "compile: lower + compile only."]
  if train["sequential"]:
    head.append("workers ran ONE AFTER THE OTHER (not alternated): HF training at this size "
                "needs ~18 GB and would not fit next to ours in 24 GiB.")
  body = []
  for r in rows:
    peer = _by(rows, framework="hf", dtype=r["dtype"], optimizer=r["optimizer"],
               malloc=r.get("malloc"))  # rows with the kept-memory malloc against each other
    vs = r["target_tokens_per_s"] / peer["target_tokens_per_s"] if peer else None
    body.append([r["label"], _fmt(r["step_s"], ".3f"), _fmt(r["target_tokens_per_s"], ".0f"),
                 _fmt(vs, ".2f") + "x", _fmt(r.get("peak_rss_mib"), ".0f"),
                 _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("first_run_s"), ".1f"),
                 _fmt(r.get("matmul_util") and 100 * r["matmul_util"], ".0f") + "%"])
  return head + _table(["row", "step s", "tok/s", "vs HF same dtype", "peak RSS MiB",
                        "compile s", "first step s", "util"], body)


def render_decode(dec: dict) -> list[str]:
  head = [f"== decoding: {dec['shape']}, {dec['input_length']} input tokens, exactly "
          f"{dec['new_tokens']} new tokens; tokens/s = batch * {dec['new_tokens']} / latency ==",
          "ours: EOS made unreachable (eos_id -1) so every row decodes all tokens; HF: "
          "min_new_tokens = max_new_tokens; CT2: min = max decoding length. HF bf16 = autocast."]
  body = []
  for r in dec["rows"]:
    ct2 = _by(dec["rows"], row=r["row"], impl="ct2 fp32")
    hfb = _by(dec["rows"], row=r["row"], impl="hf bf16")
    body.append([r["row"], r["impl"], _fmt(r["latency_s"], ".3f"), _fmt(r["tokens_per_s"], ".1f"),
                 _fmt(ct2 and r["tokens_per_s"] / ct2["tokens_per_s"], ".2f") + "x",
                 _fmt(hfb and r["tokens_per_s"] / hfb["tokens_per_s"], ".2f") + "x",
                 _fmt(r.get("first_run_s"), ".1f")])
  lines = head + _table(["row", "impl", "latency s", "tok/s", "vs CT2 fp32", "vs HF bf16",
                         "first run s"], body, left=2)
  for s in dec["sanity"]:
    lines.append(f"sanity, {s['row']}: {s['pair']}: {s['rows_equal']}/{s['rows']} rows, "
                 f"{s['tokens_equal']}/{s['tokens']} tokens identical")
  lines += dec.get("notes", [])
  return lines


def render_t5gemma(t5g: dict, peaks: dict) -> list[str]:
  """The T5Gemma case (bench/t5gemma_cases.py): its training table (render_train's, with
  the first-step loss check) and its decoding table (ratios to HF fp32 and bf16)."""
  lines = []
  if "train" in t5g:
    tr = t5g["train"]
    lines += render_train(tr, peaks)
    lines.append("same loss on both sides: mean cross-entropy over all target tokens, "
                 "dropout 0, ours z_loss 0; Adafactor. First-step loss (same weights, batch):")
    for c in tr.get("loss_check", []):
      lines.append(f"  {SHORT[c['dtype']]}: ours {c['ours']:.6f}, HF {c['hf']:.6f}, |diff| "
                   f"{c['abs_diff']:.2e}")
  if "decode" in t5g:
    dec = t5g["decode"]
    lines += ([""] if lines else []) + [
              f"== T5Gemma decoding: {dec['shape']} (preset {dec['preset']}), "
              f"{dec['input_length']} input tokens, greedy, exactly {dec['new_tokens']} new "
              f"tokens from BOS 2; tokens/s = batch * {dec['new_tokens']} / latency ==",
              "ours: EOS made unreachable; HF: generate(do_sample=False, num_beams=1, "
              "use_cache=True, min_new_tokens = max_new_tokens), eager attention. HF bf16 = "
              "autocast."]
    body = []
    for r in dec["rows"]:
      h32 = _by(dec["rows"], row=r["row"], impl="hf fp32")
      hb = _by(dec["rows"], row=r["row"], impl="hf bf16")
      body.append([r["row"], r["impl"], _fmt(r["latency_s"], ".3f"),
                   _fmt(r["tokens_per_s"], ".1f"),
                   _fmt(h32 and r["tokens_per_s"] / h32["tokens_per_s"], ".2f") + "x",
                   _fmt(hb and r["tokens_per_s"] / hb["tokens_per_s"], ".2f") + "x",
                   _fmt(r.get("first_run_s"), ".1f")])
    lines += _table(["row", "impl", "latency s", "tok/s", "vs HF fp32", "vs HF bf16",
                     "first run s"], body, left=2)
    for c in dec["sanity"]:
      lines.append(f"greedy tokens, {c['row']}: {c['pair']}: {c['rows_equal']}/{c['rows']} "
                   f"rows, {c['tokens_equal']}/{c['tokens']} tokens identical")
    lines += dec.get("notes", [])
  return lines


def render_data(data: dict, report: dict) -> list[str]:
  body = [[r["name"], _fmt(r["examples_per_s"], ".0f"), _fmt(r["rows_per_s"], ".0f"),
           _fmt(r["real_tokens_per_s"], ".0f"), _fmt(r["examples_per_row"], ".2f"),
           f"{r['real_share_total']:.1%}"] for r in data["rows"]]
  lines = ([f"== data pipeline: read -> preprocess -> tokenize -> pack (first-fit) -> batch, "
            f"batch {data['batch_size']}, {data['batches']} batches, one process =="]
           + _table(["configuration", "examples/s", "rows/s", "real tok/s", "ex/row",
                     "real share"], body))
  # What training consumes, for scale: the fastest of our training rows.
  train_rows = [(tr["shape"], tr["batch"], r) for tr in report.get("train", [])
                for r in tr["rows"] if r["framework"] == "ours"]
  if train_rows and data["rows"]:
    shape, b, fastest = max(train_rows, key=lambda x: x[1] / x[2]["step_s"])
    need = b / fastest["step_s"]
    worst = min(r["rows_per_s"] for r in data["rows"])
    lines.append(f"our fastest training ({shape} {fastest['label']}) consumes {need:.1f} rows/s; "
                 f"the slowest configuration above makes {worst:.0f} rows/s "
                 f"({worst / need:.0f}x headroom)")
  return lines


def render_scaling(sc: dict) -> list[str]:
  body = []
  for series in ("batch_series", "length_series"):
    for r in sc[series]:
      body.append([series.split("_")[0], str(r["batch"]), f"{r['lengths'][0]}/{r['lengths'][1]}",
                   _fmt(r["step_s"], ".3f"), _fmt(r["target_tokens_per_s"], ".0f"),
                   _fmt(r["tokens_per_s"], ".0f"), _fmt(r.get("cost_ratio"), ".2f"),
                   _fmt(r.get("flops_ratio"), ".2f")])
  return ([f"== scaling: ours, {sc['shape']}, fp32, Adafactor; cost ratio = step time / "
           "previous step time (linear = 2.00 per doubling; FLOP ratio: matmul FLOPs, "
           "attention makes length superlinear) =="]
          + _table(["series", "batch", "lengths", "step s", "target tok/s", "all tok/s",
                    "cost ratio", "FLOP ratio"], body))


def render_targets(tgts: list[dict]) -> list[str]:
  lines = ["== targets (ratios within this run) =="]
  for t in tgts:
    mark = {True: "[met]    ", False: "[NOT MET]", None: "[info]   "}[t["met"]]
    lines.append(f"{mark} {t['target']}: {t['value'] if t['value'] is not None else 'n/a'} "
                 f"(goal {t['goal']})")
  return lines


def render(report: dict) -> str:
  """The whole report as text: machine, then one table per section measured, then
  the targets."""
  out = render_machine(report["machine"], report["rounds"], report["quick"])
  out += report.get("notes", [])
  peaks = report.get("matmul", {}).get("peaks_gflops", {})
  if "matmul" in report:
    out += [""] + render_matmul(report["matmul"])
  for train in report.get("train", []):
    out += [""] + render_train(train, peaks)
  for dec in report.get("decode", []):
    out += [""] + render_decode(dec)
  if "t5gemma" in report:
    out += [""] + render_t5gemma(report["t5gemma"], peaks)
  if "data" in report:
    out += [""] + render_data(report["data"], report)
  for sc in report.get("scaling", []):
    out += [""] + render_scaling(sc)
  if report.get("targets"):
    out += [""] + render_targets(report["targets"])
  return "\n".join(out)
