"""Driver side of the compute cases: matmul peaks, training steps, scaling, data pipeline.

Each function starts its workers, warms every one up (compile, then runs until stable), then
alternates the timed runs between them (bench.workers.alternate) and returns plain
dicts for bench/table.py and the JSON file.
"""
from __future__ import annotations

from bench import shapes
from bench.prepare import Context
from bench.workers import WorkerGroup, alternate, log, warm_up

DTYPES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
# flan-t5-base training: HF needs ~18 GB, so its workers cannot live next to ours in
# 24 GiB; those rows run one worker at a time (said in the table).
SEQUENTIAL_TRAIN_SIZES = ("base",)
# Shapes whose training rows include scan + remat="minimal" in fp32 and bf16 (peak RSS vs HF).
REMAT_SIZES = ("base",)
# Rows with glibc's malloc keeping freed memory (one arena, no mmap, no trim): ours with
# T5FORGE_MALLOC=keep (t5forge.host_memory, opt-in), HF with the same setting through glibc's
# tunables (not a default of HF's). Only for shapes where twice the step's temporaries fit in
# RAM: flan-t5-base's 10 GB (scan) would not, next to its training state, in 24 GiB.
KEEP_FREED_MEMORY_SIZES = ("small",)
KEEP_FREED_MEMORY_ENV = {
    "ours": {"T5FORGE_MALLOC": "keep"},
    "hf": {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                             "glibc.malloc.trim_threshold=18446744073709551615"}}


# -- matmul ----------------------------------------------------------------------------
def run_matmul(ctx: Context) -> dict:
  """[n, n] x [n, n] throughput of jitted JAX and of torch, fp32 and bf16.

  Returns:
    {"rows": [...], "peaks_gflops": {"jax float32": ..., ...}} (peak = best size).
  """
  plan = ctx.plan
  rows, jobs = [], []
  with WorkerGroup(ctx.log_dir) as group:
    workers = {"jax": group.start("ours", "ours matmul"), "torch": group.start("hf", "hf matmul")}
    group.wait_ready()
    for fw, w in workers.items():
      for dtype in ctx.dtypes:
        for n in plan.matmul_sizes:
          name = f"{fw} {dtype} {n}"
          info = w.setup(name, kind="matmul", n=n, dtype=dtype, seconds=plan.matmul_seconds)
          rows.append({"framework": fw, "dtype": dtype, "n": n, "name": name,
                       "flops_per_run": info["flops_per_run"], "reps": info["reps"]})
          jobs.append((w, name))
    log(f"matmul: {len(jobs)} jobs x {ctx.rounds} rounds")
    timings = alternate(jobs, ctx.rounds)
  peaks: dict[str, float] = {}
  for row, (w, name) in zip(rows, jobs):
    t = timings[(w.label, name)]
    row.update(t)
    row["gflops"] = row["flops_per_run"] / t["median_s"] / 1e9
    key = f"{row['framework']} {row['dtype']}"
    peaks[key] = max(peaks.get(key, 0.0), row["gflops"])
  return {"rows": rows, "peaks_gflops": peaks}


# -- training --------------------------------------------------------------------------
def train_rows(size: str = "small", dtypes: tuple[str, ...] = DTYPES) -> list[dict]:
  """ours fp32 / bf16 (each also with scan over layers; for flan-t5-base also both with
  scan and remat_policy="minimal", the lean-memory setting) and HF fp32 / bf16 autocast, for
  Adafactor and AdamW."""
  rows = []
  for opt in ("adafactor", "adamw"):
    rows += [{"framework": "ours", "dtype": d, "optimizer": opt, "scan": False} for d in dtypes]
    rows += [{"framework": "ours", "dtype": d, "optimizer": opt, "scan": True} for d in dtypes]
    if size in REMAT_SIZES:
      rows += [{"framework": "ours", "dtype": d, "optimizer": opt, "scan": True,
                "remat": "minimal"} for d in dtypes]
    rows += [{"framework": "hf", "dtype": d, "optimizer": opt, "scan": False} for d in dtypes]
    if size in KEEP_FREED_MEMORY_SIZES:
      rows += [{"framework": fw, "dtype": "float32", "optimizer": opt, "scan": False,
                "malloc": "kept"} for fw in ("ours", "hf")]
  for r in rows:
    r["label"] = (f"{r['framework']} {SHORT[r['dtype']]} {r['optimizer']}"
                  + (" scan" if r["scan"] else "")
                  + (f" remat={r['remat']}" if r.get("remat") else "")
                  + (" +kept-memory malloc" if r.get("malloc") else ""))
  return rows


def run_train(ctx: Context, size: str, peaks: dict[str, float]) -> dict:
  """Training steps of one shape, every row in its own worker (peak RSS per row).

  Rows of one optimizer (and malloc setting) share a group of live workers and alternate;
  for the sizes in SEQUENTIAL_TRAIN_SIZES each worker runs alone, one after the other.
  """
  plan, shape = ctx.plan, shapes.SHAPES[size]
  batch, (inp, tgt) = plan.train_batch, plan.train_lengths
  sequential = size in SEQUENTIAL_TRAIN_SIZES
  rows = train_rows(size, ctx.dtypes)
  if sequential:
    groups = [[r] for r in rows]
  else:
    # Five training workers of flan-t5-small do not fit in 24 GiB at once: the rows with
    # the kept-memory malloc alternate with each other, the rest with each other.
    keys = dict.fromkeys((r["optimizer"], r.get("malloc")) for r in rows)
    groups = [[r for r in rows if (r["optimizer"], r.get("malloc")) == k] for k in keys]
  flops = shapes.train_matmul_flops(shape, batch, inp, tgt)
  for group_rows in groups:
    with WorkerGroup(ctx.log_dir) as group:
      workers = [group.start("ours" if r["framework"] == "ours" else "hf",
                             f"{shape.name} train {r['label']}",
                             KEEP_FREED_MEMORY_ENV[r["framework"]] if r.get("malloc") else None)
                 for r in group_rows]
      group.wait_ready()
      for w, r in zip(workers, group_rows):
        args = dict(kind="train", model_dir=ctx.model_dir(size), dtype=r["dtype"],
                    optimizer=r["optimizer"], batch=batch, input_length=inp,
                    target_length=tgt, seed=ctx.seed)
        if r["framework"] == "ours":
          args.update(scan=r["scan"], remat=r.get("remat", "none"))
        log(f"train {shape.name}: setting up {r['label']}")
        r.update(w.setup("step", **args))
        r["warmup_s"] = warm_up(w, "step", min_runs=plan.warmup_runs,
                                max_runs=plan.max_warmup_runs)
      log(f"train {shape.name}: timing {', '.join(r['label'] for r in group_rows)}")
      timings = alternate([(w, "step") for w in workers], ctx.rounds, lead_in=1)
      for w, r in zip(workers, group_rows):
        r.update(timings[(w.label, "step")])
        r["peak_rss_mib"] = w.peak_rss_mib()
  for r in rows:
    r["step_s"] = r["median_s"]
    r["target_tokens_per_s"] = batch * tgt / r["step_s"]
    r["matmul_flops"] = flops
    fw = "jax" if r["framework"] == "ours" else "torch"
    peak = peaks.get(f"{fw} {r['dtype']}")
    r["matmul_util"] = flops / r["step_s"] / (peak * 1e9) if peak else None
    jax_fp32 = peaks.get("jax float32")
    r["util_vs_jax_fp32_peak"] = flops / r["step_s"] / (jax_fp32 * 1e9) if jax_fp32 else None
  return {"size": size, "shape": shape.name, "batch": batch, "lengths": [inp, tgt],
          "sequential": sequential, "matmul_flops": flops, "rows": rows}


# -- scaling ---------------------------------------------------------------------------
def scaling_configs(plan: shapes.Plan) -> tuple[list, list, list]:
  """(all (batch, inputs, targets) configs, the batch series, the length series)."""
  inp, tgt = plan.train_lengths
  by_batch = [(b, inp, tgt) for b in plan.scaling_batches]
  by_length = [(plan.scaling_batch, i, t) for i, t in plan.scaling_lengths]
  configs = list(dict.fromkeys(by_batch + by_length))
  return configs, by_batch, by_length


def run_scaling(ctx: Context, size: str) -> dict:
  """Our training step (fp32, Adafactor) as batch and sequence length double."""
  shape = shapes.SHAPES[size]
  configs, by_batch, by_length = scaling_configs(ctx.plan)
  timings = {}
  with WorkerGroup(ctx.log_dir) as group:
    w = group.start("ours", f"{shape.name} scaling")
    names = {}
    for b, i, t in configs:
      name = names[(b, i, t)] = f"b{b} {i}/{t}"
      log(f"scaling {shape.name}: setting up {name}")
      w.setup(name, kind="train", model_dir=ctx.model_dir(size), dtype="float32",
              optimizer="adafactor", scan=False, batch=b, input_length=i, target_length=t,
              seed=ctx.seed)
      warm_up(w, name, min_runs=ctx.plan.warmup_runs, max_runs=ctx.plan.max_warmup_runs)
    res = alternate([(w, names[c]) for c in configs], ctx.rounds)
    for c in configs:
      timings[c] = res[(w.label, names[c])]

  def series(cfgs):
    out = []
    for k, (b, i, t) in enumerate(cfgs):
      step = timings[(b, i, t)]["median_s"]
      row = {"batch": b, "lengths": [i, t], "step_s": step,
             "target_tokens_per_s": b * t / step, "tokens_per_s": b * (i + t) / step,
             "matmul_flops": shapes.train_matmul_flops(shape, b, i, t)}
      if k:
        prev = out[-1]
        row["cost_ratio"] = step / prev["step_s"]
        row["flops_ratio"] = row["matmul_flops"] / prev["matmul_flops"]
      out.append(row)
    return out

  return {"size": size, "shape": shape.name, "optimizer": "adafactor", "dtype": "float32",
          "batch_series": series(by_batch), "length_series": series(by_length)}


# -- data pipeline ---------------------------------------------------------------------
def run_data(ctx: Context) -> dict:
  """bench/data_pipeline.py's packed configurations (first-fit packing), in a worker."""
  with WorkerGroup(ctx.log_dir) as group:
    w = group.start("ours", "data pipeline")
    log("data pipeline: running")
    results = w.call("data", num_batches=ctx.plan.data_batches,
                     batch_size=ctx.plan.data_batch_size)
  return {"batch_size": ctx.plan.data_batch_size, "batches": ctx.plan.data_batches,
          "rows": results}
