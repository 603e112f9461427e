"""Driver side of the decoding case: ours, HF transformers and CTranslate2 side by side.

Three workers (ours, hf, ct2) live together; each holds its models for every row
(greedy at each batch size, beam search at batch 1). Every (implementation, row) job is
compiled / warmed up first, then the timed runs alternate over all jobs round-robin.

Every side decodes exactly `new_tokens` tokens from the same random inputs
(`input_length` tokens ending in EOS, no padding): HF with min_new_tokens =
max_new_tokens, CTranslate2 with min_decoding_length = max_decoding_length, ours with an
EOS id that no token has (bench/ours.py, NoEosModel); each worker checks the output
length on every run.
"""
from __future__ import annotations

from bench import shapes
from bench.prepare import Context
from bench.workers import WorkerError, WorkerGroup, alternate, log, warm_up

# label, worker kind, dtype / compute type, extra setup arguments
IMPLEMENTATIONS = (
    ("ours fp32", "ours", "float32", {}),
    ("ours bf16", "ours", "bfloat16", {}),
    ("ours int8", "ours", "float32", {"int8": True}),
    ("hf fp32", "hf", "float32", {}),
    ("hf bf16", "hf", "bfloat16", {}),
    ("ct2 fp32", "ct2", "float32", {}),
    ("ct2 int8", "ct2", "int8", {}),
)


def decode_rows(plan: shapes.Plan) -> list[dict]:
  rows = [{"row": f"greedy b{b}", "method": "greedy", "batch": b, "beams": 1}
          for b in plan.decode_batches]
  rows.append({"row": f"beam{plan.beam_size} b1", "method": "beam", "batch": 1,
               "beams": plan.beam_size})
  return rows


def compare(a: list, b: list) -> dict:
  """How many rows and tokens of two [b, l] token lists agree."""
  rows = sum(x == y for x, y in zip(a, b))
  tokens = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
  total = sum(len(x) for x in a)
  return {"rows_equal": rows, "rows": len(a), "tokens_equal": tokens, "tokens": total}


def run_decode(ctx: Context, size: str, int8: str = "auto") -> dict:
  """Decoding latency and tokens/s of every implementation and row.

  Args:
    int8: 'auto' (our int8 row if t5forge supports it), 'on' (the same, and say why
      not), 'off'.
  """
  plan, shape = ctx.plan, shapes.SHAPES[size]
  rows = decode_rows(plan)
  notes, skipped = [], {}
  with WorkerGroup(ctx.log_dir) as group:
    workers = {k: group.start(k, f"{shape.name} decode {k}") for k in ("ours", "hf", "ct2")}
    group.wait_ready()
    caps = workers["ours"].call("capabilities")
    impls = [i for i in IMPLEMENTATIONS if i[2] != "bfloat16" or "bfloat16" in ctx.dtypes]
    if int8 == "off" or not caps["int8"]:
      impls = [i for i in impls if i[0] != "ours int8"]
      skipped["ours int8"] = ("--int8 off" if int8 == "off" else caps["int8_note"])
    jobs, infos = [], {}
    for label, kind, dtype, extra in impls:
      w = workers[kind]
      ok = True
      for row in rows:
        tag = f"{label} / {row['row']}"
        args = dict(kind="decode", tag=tag, method=row["method"], batch=row["batch"],
                    beams=row["beams"], input_length=plan.decode_input_length,
                    new_tokens=plan.new_tokens, seed=ctx.seed, **extra)
        if kind == "ct2":
          quant = "int8" if dtype == "int8" else "float32"
          args.update(model_dir=ctx.ct2_dirs(size)[quant], compute_type=dtype,
                      vocab_size=shape.vocab_size)
        else:
          args.update(model_dir=ctx.model_dir(size), dtype=dtype)
        log(f"decode {shape.name}: setting up {tag}")
        try:
          infos[(label, row["row"])] = w.setup(tag, **args)
        except WorkerError as e:
          if label != "ours int8":
            raise
          skipped[label] = str(e).strip().splitlines()[-1]
          ok = False
          break
        infos[(label, row["row"])]["warmup_s"] = warm_up(
            w, tag, min_runs=plan.warmup_runs, max_runs=plan.max_warmup_runs)
        jobs.append((w, tag))
      if not ok:
        jobs = [j for j in jobs if not j[1].startswith(label + " /")]
    log(f"decode {shape.name}: {len(jobs)} jobs x {ctx.rounds} rounds")
    timings = alternate(jobs, ctx.rounds)
    # Sanity: the same tokens from CTranslate2 and HF (fp32), and from ours, on the
    # largest greedy batch and on beam search.
    sanity = []
    for check_row in (f"greedy b{max(plan.decode_batches)}", rows[-1]["row"]):
      tokens = {label: workers[kind].call("tokens", tag=f"{label} / {check_row}")
                for label, kind in (("hf fp32", "hf"), ("ct2 fp32", "ct2"),
                                    ("ours fp32", "ours"))}
      for a in ("ct2 fp32", "ours fp32"):
        sanity.append({"row": check_row, "pair": f"{a} vs hf fp32",
                       **compare(tokens[a], tokens["hf fp32"])})
  results = []
  for w, tag in jobs:
    label, row_name = tag.split(" / ")
    row = next(r for r in rows if r["row"] == row_name)
    t = timings[(w.label, tag)]
    results.append({"impl": label, **row, **t, "latency_s": t["median_s"],
                    "tokens_per_s": row["batch"] * plan.new_tokens / t["median_s"],
                    "first_run_s": infos[(label, row_name)].get("first_run_s")})
  if "ours int8" in skipped:
    notes.append(f"ours int8 skipped: {skipped['ours int8']}")
  return {"size": size, "shape": shape.name, "input_length": plan.decode_input_length,
          "new_tokens": plan.new_tokens, "rows": results, "sanity": sanity,
          "skipped": skipped, "notes": notes}
