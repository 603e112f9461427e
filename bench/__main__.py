"""t5forge side by side with Hugging Face transformers and CTranslate2, in one run.

    make bench                             # everything, flan-t5-small and -base shapes
    python -m bench                        # the same, from the repo root
    python -m bench decode --sizes small   # one case, one shape
    python -m bench --quick                # smoke test: tiny shapes, 1 round (~2-3 minutes)
    python -m bench serve                  # `t5forge serve` under load (bench/serve.py)
    python -m bench infer                  # `t5forge infer`, engine vs static batches
    python -m bench peft                   # LoRA on a bf16 / int8 frozen base (bench/peft.py)
    python -m bench storage                # checkpoints: local disk vs GCS / S3 emulators
    python -m bench matmul t5gemma         # T5Gemma-S-S training + greedy vs transformers

Cases: `matmul` (JAX and torch matmul peaks), `train` (step time, tokens/s, peak RSS,
compile time, matmul-FLOP utilisation; ours fp32/bf16 (+ scan over layers) vs HF fp32 /
bf16 autocast, Adafactor and AdamW), `decode` (greedy batch 1 and 16, beam 4 batch 1;
ours vs HF fp32 / bf16 vs CTranslate2 fp32 / int8), `data` (the packing pipeline), and
`scaling` (our step as batch and length double), `t5gemma` (a T5Gemma-S-S training step
and greedy decoding, ours fp32 / bf16 vs transformers' T5Gemma fp32 / bf16 autocast;
bench/t5gemma_cases.py; only when named). `train` runs `matmul` first when it is not
asked for, since utilisation is measured against the peak of the same run.

Models are random-init T5s built offline from flan-t5-small / -base configs with a
fixed seed and written once as HF directories under bench/results/.cache/ (with
CTranslate2 conversions); every framework loads those same weights. Each framework
runs in its own worker process (peak RSS per worker; JAX and torch never share a
process); timed runs alternate between live workers, and the tables report medians.
Expected time on 2 cores: about an hour for the full run (flan-t5-base training with
HF dominates; HF needs ~18 GB there).

Writes bench/results/bench.json (bench_quick.json with --quick; bench_t5gemma.json for
`matmul t5gemma` or `t5gemma` alone) with machine info,
every timing, and the benchmark's targets evaluated as ratios within the run. Worker
logs: bench/results/.cache/logs/.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from bench import (decode_cases, infer_mixed, peft, report as report_lib, serve, shapes,
                   storage, t5gemma_cases, table, train_cases)
from bench.prepare import RESULTS_DIR, Context, bf16_hardware, machine_info, prepare_models
from bench.workers import WorkerError, log

CASES = ("matmul", "train", "decode", "data", "scaling", "t5gemma")
DEFAULT_CASES = CASES[:-1]  # `python -m bench` alone: the full benchmark, as before


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
  p.add_argument("cases", nargs="*", metavar="case",
                 help=f"any of {', '.join(CASES)} (default: all)")
  p.add_argument("--quick", action="store_true",
                 help="smoke test: tiny shapes and lengths, 1 round")
  p.add_argument("--sizes", default=None,
                 help="comma-separated shapes of train/decode: small, base (default "
                      "small,base; tiny with --quick)")
  p.add_argument("--rounds", type=int, default=None,
                 help="timed runs per job (default 3; 1 with --quick)")
  p.add_argument("--int8", choices=("auto", "on", "off"), default="auto",
                 help="our int8 weight-only decode row: auto = when t5forge supports it")
  p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                 help="bf16 rows (ours bf16, HF bf16 autocast, bf16 matmul peaks): auto = "
                      "only on a CPU with bf16 instructions (avx512_bf16 or amx_bf16)")
  p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
  p.add_argument("--output", default=None, help="JSON path (default bench/results/bench.json)")
  args = p.parse_args(argv)
  bad = [c for c in args.cases if c not in CASES]
  if bad:
    p.error(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
  return args


def _cases(raw: list) -> list[str]:
  """The cases in their canonical order; matmul is added for train."""
  cases = [c for c in CASES if c in raw] or list(DEFAULT_CASES)
  if "train" in cases and "matmul" not in cases:
    log("train: adding the matmul case (utilisation needs this run's matmul peak)")
    cases.insert(0, "matmul")
  return cases


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["serve"]:  # its own driver, flags and JSON (bench/serve.py); never in "all"
    return serve.main(argv[1:])
  if argv[:1] == ["infer"]:  # its own driver too (bench/infer_mixed.py)
    return infer_mixed.main(argv[1:])
  if argv[:1] == ["peft"]:  # and this one (bench/peft.py)
    return peft.main(argv[1:])
  if argv[:1] == ["storage"]:  # and this one (bench/storage.py)
    return storage.main(argv[1:])
  args = _parse(argv)
  plan = shapes.QUICK if args.quick else shapes.FULL
  rounds = args.rounds or plan.rounds
  if not args.quick and rounds < 3:
    log(f"warning: --rounds {rounds} < 3; the tables want medians of at least 3")
  sizes = (args.sizes.split(",") if args.sizes else (["tiny"] if args.quick else ["small", "base"]))
  unknown = [s for s in sizes if s not in shapes.SHAPES]
  if unknown:
    print(f"unknown size(s) {unknown}; choose from {sorted(shapes.SHAPES)}", file=sys.stderr)
    return 2
  cases = _cases(args.cases)
  scaling_size = "tiny" if args.quick else "small"
  with_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and bf16_hardware())
  bf16_note = (None if with_bf16 else
               "bf16 rows left out: --bf16 off" if args.bf16 == "off" else
               "bf16 rows left out: this CPU has no bf16 instructions (avx512_bf16 / "
               "amx_bf16), where torch multiplies bf16 matrices unvectorised; --bf16 on "
               "forces them")
  if bf16_note:
    log(bf16_note)
  ctx = Context(plan=plan, rounds=rounds, quick=args.quick, seed=args.seed,
                dtypes=("float32", "bfloat16") if with_bf16 else ("float32",))
  # A T5Gemma run (with matmul at most) has its own file, so it never replaces bench.json.
  stem = "bench_t5gemma" if set(cases) <= {"matmul", "t5gemma"} and "t5gemma" in cases else "bench"
  output = args.output or os.path.join(RESULTS_DIR, f"{stem}_quick.json" if args.quick
                                       else f"{stem}.json")
  report_lib.unwind_on_sigterm()

  report = {"benchmark": "t5forge side by side",
            "command": " ".join(["python -m bench"] + list(argv)),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
            "rounds": rounds, "sizes": sizes, "cases": cases,
            "plan": dataclasses.asdict(plan), "machine": machine_info(), "errors": [],
            "dtypes": list(ctx.dtypes), "notes": [bf16_note] if bf16_note else []}
  started = time.perf_counter()
  model_sizes = list(sizes) if {"train", "decode"} & set(cases) else []
  if "scaling" in cases and scaling_size not in model_sizes:
    model_sizes.append(scaling_size)
  gemma = [t5gemma_cases.shape_of(ctx)] if "t5gemma" in cases else []
  try:
    prepare_models(ctx, model_sizes, ct2_sizes=sizes if "decode" in cases else [],
                   extra_shapes=gemma)
    for case in cases:
      try:
        if case == "matmul":
          report["matmul"] = train_cases.run_matmul(ctx)
        elif case == "train":
          peaks = report.get("matmul", {}).get("peaks_gflops", {})
          report["train"] = [train_cases.run_train(ctx, s, peaks) for s in sizes]
        elif case == "decode":
          report["decode"] = [decode_cases.run_decode(ctx, s, args.int8) for s in sizes]
        elif case == "data":
          report["data"] = train_cases.run_data(ctx)
        elif case == "scaling":
          report["scaling"] = [train_cases.run_scaling(ctx, scaling_size)]
        elif case == "t5gemma":
          peaks = report.get("matmul", {}).get("peaks_gflops", {})
          report["t5gemma"] = t5gemma_cases.run(ctx, peaks, args.int8)
          report["errors"] += report["t5gemma"].pop("errors")
      except WorkerError as e:
        log(f"{case} failed: {e}")
        report["errors"].append({"case": case, "error": str(e)})
      report["targets"] = table.targets(report)
      report_lib.write_json(output, report)  # partial results survive a later failure
  except KeyboardInterrupt:
    log("interrupted; workers stopped")
    report["errors"].append({"case": "all", "error": "interrupted"})
    report_lib.write_json(output, report)
    return 130
  report["seconds"] = round(time.perf_counter() - started, 1)
  report["targets"] = table.targets(report)
  report_lib.write_json(output, report)
  print(table.render(report))
  for err in report["errors"]:
    print(f"\n{err['case']} FAILED: {err['error'].strip().splitlines()[-1]}")
  print(f"\nwrote {os.path.relpath(output)} ({report['seconds']:.0f} s)")
  return 1 if report["errors"] else 0


if __name__ == "__main__":
  sys.exit(main())
