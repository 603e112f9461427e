"""Driver side of the T5Gemma case: training steps and greedy decoding of a T5Gemma-S-S
shaped model, ours next to transformers' `T5GemmaForConditionalGeneration`.

    python -m bench t5gemma              # ~20-30 minutes on 2 cores
    python -m bench t5gemma --quick      # tiny shape, smoke test

Both sides start from the same random-init HF T5Gemma directory (built once by an `hf`
worker with transformers' own init, `bench/results/.cache/`); our side reads it with
`t5forge.load` and checks that the config it gets is the preset `t5gemma.s-s` (the
released shape: 256k vocabulary, soft-caps 50 / 30, window 4096 on alternate layers).

Training: forward + backward + Adafactor update on one fixed batch, ours fp32 / bf16 and
HF fp32 / bf16 autocast, dropout 0 on both sides (the released configs' value) and the
same loss: mean cross-entropy over every target token (ours with z_loss 0). The first
step's losses of all rows are reported: from the same weights and batch they must agree
(fp32 to ~1e-5; bf16 rows to ~1e-2). The rows of one dtype alternate in one group (two
~5 GB workers at a time; four would not fit next to other work in 24 GiB).

Decoding: greedy, exactly `new_tokens` tokens from BOS 2 (as bench/decode_cases.py: HF
min_new_tokens = max_new_tokens with use_cache, ours with an unreachable EOS), batch 1
and a larger batch, ours fp32 / bf16 / int8 and HF fp32 / bf16 autocast; every job
alternates with every other. Token check: ours fp32 vs HF fp32 greedy tokens.
"""
from __future__ import annotations

from bench import decode_cases, shapes
from bench.prepare import Context
from bench.workers import WorkerError, WorkerGroup, alternate, log, warm_up

SHORT = {"float32": "fp32", "bfloat16": "bf16"}
OPTIMIZER = "adafactor"


def shape_of(ctx: Context) -> shapes.T5GemmaShape:
  return shapes.T5GEMMA_SHAPES[ctx.plan.t5gemma_size]


def train_rows(dtypes: tuple[str, ...]) -> list[dict]:
  rows = [{"framework": fw, "dtype": d, "optimizer": OPTIMIZER, "scan": False}
          for d in dtypes for fw in ("ours", "hf")]
  for r in rows:
    r["label"] = f"{r['framework']} {SHORT[r['dtype']]} {OPTIMIZER}"
  return rows


def run_train(ctx: Context, peaks: dict[str, float]) -> dict:
  """Training-step rows in the format of train_cases.run_train (bench/table.py renders
  both), plus each row's first-step loss."""
  plan, shape = ctx.plan, shape_of(ctx)
  batch, (inp, tgt) = plan.t5gemma_train_batch, plan.t5gemma_train_lengths
  rows = train_rows(ctx.dtypes)
  for dtype in ctx.dtypes:
    group_rows = [r for r in rows if r["dtype"] == dtype]
    with WorkerGroup(ctx.log_dir) as group:
      workers = [group.start(r["framework"], f"{shape.name} train {r['label']}")
                 for r in group_rows]
      group.wait_ready()
      for w, r in zip(workers, group_rows):
        args = dict(kind="train", model_dir=ctx.shape_dir(shape), dtype=dtype,
                    optimizer=OPTIMIZER, batch=batch, input_length=inp, target_length=tgt,
                    seed=ctx.seed)
        if r["framework"] == "ours":
          args.update(scan=False, z_loss=0.0, preset=shape.preset)
        log(f"t5gemma train: setting up {r['label']}")
        info = w.setup("step", **args)
        info["first_loss"] = info.pop("loss", None)
        r.update(info)
        r["warmup_s"] = warm_up(w, "step", min_runs=plan.warmup_runs,
                                max_runs=plan.max_warmup_runs)
      log(f"t5gemma train: timing {', '.join(r['label'] for r in group_rows)}")
      timings = alternate([(w, "step") for w in workers], ctx.rounds, lead_in=1)
      for w, r in zip(workers, group_rows):
        r.update(timings[(w.label, "step")])
        r["peak_rss_mib"] = w.peak_rss_mib()
  flops = shapes.train_matmul_flops(shape.as_t5_shape(), batch, inp, tgt)
  for r in rows:
    r["step_s"] = r["median_s"]
    r["target_tokens_per_s"] = batch * tgt / r["step_s"]
    r["matmul_flops"] = flops
    peak = peaks.get(f"{'jax' if r['framework'] == 'ours' else 'torch'} {r['dtype']}")
    r["matmul_util"] = flops / r["step_s"] / (peak * 1e9) if peak else None
  return {"size": plan.t5gemma_size, "shape": shape.name, "preset": shape.preset,
          "batch": batch, "lengths": [inp, tgt], "sequential": False,
          "matmul_flops": flops, "rows": rows, "loss_check": loss_check(rows)}


def loss_check(rows: list[dict]) -> list[dict]:
  """|ours - HF| first-step loss per dtype (same weights, batch and loss)."""
  out = []
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    o = next((r for r in rows if r["dtype"] == dtype and r["framework"] == "ours"), None)
    h = next((r for r in rows if r["dtype"] == dtype and r["framework"] == "hf"), None)
    if o and h and o.get("first_loss") is not None and h.get("first_loss") is not None:
      out.append({"dtype": dtype, "ours": o["first_loss"], "hf": h["first_loss"],
                  "abs_diff": abs(o["first_loss"] - h["first_loss"])})
  return out


IMPLEMENTATIONS = tuple(i for i in decode_cases.IMPLEMENTATIONS if i[1] != "ct2")


def run_decode(ctx: Context, int8: str = "auto") -> dict:
  """Greedy decoding rows in the format of decode_cases.run_decode."""
  plan, shape = ctx.plan, shape_of(ctx)
  rows = [{"row": f"greedy b{b}", "method": "greedy", "batch": b, "beams": 1}
          for b in plan.t5gemma_decode_batches]
  new_tokens, input_length = plan.t5gemma_new_tokens, plan.t5gemma_decode_input_length
  skipped, jobs, infos = {}, [], {}
  with WorkerGroup(ctx.log_dir) as group:
    workers = {k: group.start(k, f"{shape.name} decode {k}") for k in ("ours", "hf")}
    group.wait_ready()
    caps = workers["ours"].call("capabilities")
    impls = [i for i in IMPLEMENTATIONS if i[2] != "bfloat16" or "bfloat16" in ctx.dtypes]
    if int8 == "off" or not caps["int8"]:
      impls = [i for i in impls if i[0] != "ours int8"]
      skipped["ours int8"] = "--int8 off" if int8 == "off" else caps["int8_note"]
    for label, kind, dtype, extra in impls:
      w = workers[kind]
      for row in rows:
        tag = f"{label} / {row['row']}"
        args = dict(kind="decode", tag=tag, method="greedy", batch=row["batch"], beams=1,
                    input_length=input_length, new_tokens=new_tokens, seed=ctx.seed,
                    model_dir=ctx.shape_dir(shape), dtype=dtype, **extra)
        if kind == "ours":
          args["preset"] = shape.preset
        else:
          args["decoder_start"] = shape.bos_id
        log(f"t5gemma decode: setting up {tag}")
        try:
          infos[(label, row["row"])] = w.setup(tag, **args)
        except WorkerError as e:
          if label != "ours int8":
            raise
          skipped[label] = str(e).strip().splitlines()[-1]
          jobs = [j for j in jobs if not j[1].startswith(label + " /")]
          break
        infos[(label, row["row"])]["warmup_s"] = warm_up(
            w, tag, min_runs=plan.warmup_runs, max_runs=plan.max_warmup_runs)
        jobs.append((w, tag))
    log(f"t5gemma decode: {len(jobs)} jobs x {ctx.rounds} rounds")
    timings = alternate(jobs, ctx.rounds)
    sanity = []
    for row in rows:
      pairs = [("ours fp32", "hf fp32")]
      if "bfloat16" in ctx.dtypes:
        pairs.append(("ours bf16", "hf bf16"))
      for a, b in pairs:
        tokens = {label: workers[label.split()[0]].call("tokens", tag=f"{label} / {row['row']}")
                  for label in (a, b)}
        sanity.append({"row": row["row"], "pair": f"{a} vs {b}",
                       **decode_cases.compare(tokens[a], tokens[b])})
  results = []
  for w, tag in jobs:
    label, row_name = tag.split(" / ")
    row = next(r for r in rows if r["row"] == row_name)
    t = timings[(w.label, tag)]
    results.append({"impl": label, **row, **t, "latency_s": t["median_s"],
                    "tokens_per_s": row["batch"] * new_tokens / t["median_s"],
                    "first_run_s": infos[(label, row_name)].get("first_run_s")})
  notes = [f"ours int8 skipped: {skipped['ours int8']}"] if "ours int8" in skipped else []
  return {"size": plan.t5gemma_size, "shape": shape.name, "preset": shape.preset,
          "input_length": input_length, "new_tokens": new_tokens, "rows": results,
          "sanity": sanity, "skipped": skipped, "notes": notes}


def run(ctx: Context, peaks: dict[str, float], int8: str = "auto") -> dict:
  """Both parts; a failed part is recorded and the other still runs."""
  out, errors = {}, []
  for part, fn in (("train", lambda: run_train(ctx, peaks)),
                   ("decode", lambda: run_decode(ctx, int8))):
    try:
      out[part] = fn()
    except WorkerError as e:
      log(f"t5gemma {part} failed: {e}")
      errors.append({"case": f"t5gemma {part}", "error": str(e)})
  out["errors"] = errors
  return out
