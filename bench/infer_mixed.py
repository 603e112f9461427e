"""`t5forge infer` on a file of mixed-length prompts: the engine (`--scheduler continuous`,
the default) against padded static batches (`--scheduler static`), alternated in one run.

    python -m bench infer                 # flan-t5-small shape, 256 prompts, 2 rounds each
    python -m bench infer --quick         # tiny model, 48 prompts, 1 round

The model is a random-init flan-t5-small shape with the bundled vocabulary whose EOS
column is a random vector, scaled so that about half of the rows end early (random
weights alone never emit EOS, and a trained model's outputs have many lengths). Prompts
are 8-200 tokens. Each run is the whole command (start-up and compiles included), the
way a user meets it; both must write the same greedy predictions. Writes
bench/results/infer_mixed.json (infer_mixed_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import t5forge
from bench.prepare import CACHE_DIR, RESULTS_DIR, machine_info
from bench.workers import log
from t5forge import testing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALES = (2.0, 2.4, 2.8, 3.2)  # EOS column scales tried, in units of the kernel's std


def build(preset: str, seed: int, max_decode: int) -> tuple[str, dict]:
  """The checkpoint (built once) and how its probe rows ended."""
  path = os.path.join(CACHE_DIR, f"infer-{preset}-eos-seed{seed}", "checkpoint")
  info_path = path + ".json"
  if os.path.exists(info_path):
    with open(info_path, encoding="utf-8") as f:
      return path, json.load(f)
  vocab = testing.bundled_vocabulary()
  m = t5forge.init(preset, vocab_size=vocab.vocab_size, vocabulary=vocab, seed=seed)
  rng = np.random.default_rng(seed)
  probe = [rng.integers(5, 8000, int(rng.integers(8, 200))).tolist() for _ in range(32)]
  arr, _ = m._encode_texts(probe, 512)
  params = m.params
  dec = params["decoder"]
  kernel = dec["logits_dense"]["kernel"]
  direction = jax.random.normal(jax.random.key(seed + 7), (kernel.shape[0],)) * jnp.std(kernel)
  best = None
  for scale in SCALES:
    m.params = {**params, "decoder": {**dec, "logits_dense": {
        "kernel": kernel.at[:, 1].set(direction * scale)}}}
    tokens, _ = m.predict(arr, max_decode)
    lengths = sorted((tokens != 0).sum(1).tolist())
    early = float(np.mean(np.array(lengths) < max_decode))
    log(f"EOS scale {scale}: {early:.0%} of probe rows end early; lengths {lengths}")
    if best is None or abs(early - 0.5) < abs(best[1] - 0.5):
      best = (scale, early, lengths)
  scale, early, lengths = best
  m.params = {**params, "decoder": {**dec, "logits_dense": {
      "kernel": kernel.at[:, 1].set(direction * scale)}}}
  m.save(path)
  info = {"eos_scale": scale, "probe_early_fraction": early, "probe_lengths": lengths}
  with open(info_path, "w", encoding="utf-8") as f:
    json.dump(info, f)
  return path, info


def prompts(count: int, seed: int) -> list[str]:
  vocab = testing.bundled_vocabulary()
  rng = np.random.default_rng(seed + 1)
  out = []
  for _ in range(count):
    text = vocab.decode(rng.integers(100, 8000, int(rng.integers(8, 200))).tolist())
    out.append(" ".join(text.split()))  # one line each
  return out


def run_infer(ckpt: str, src: str, out: str, scheduler: str, batch: int, max_decode: int):
  """-> (wall seconds, output rows)."""
  cmd = [sys.executable, "-m", "t5forge", "infer", "--checkpoint", ckpt, "--input", src,
         "--output_dir", out, "--batch_size", str(batch), "--max_decode_length",
         str(max_decode), "--scheduler", scheduler, "--overwrite"]
  start = time.perf_counter()
  r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if r.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
  name = [f for f in os.listdir(out) if f.endswith(".jsonl")][0]
  with open(os.path.join(out, name), encoding="utf-8") as f:
    return wall, [json.loads(line) for line in f]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench infer", description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny model, 48 prompts, 1 round")
  p.add_argument("--rounds", type=int, default=None, help="runs per scheduler (default 2)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  preset = "t5_1_1.tiny" if args.quick else "flan_t5.small"
  count, rounds = (48, 1) if args.quick else (256, 2)
  rounds = args.rounds or rounds
  batch, max_decode = 32, 128
  ckpt, info = build(preset, args.seed, max_decode)
  work = os.path.join(CACHE_DIR, "infer_mixed")
  os.makedirs(work, exist_ok=True)
  src = os.path.join(work, "prompts.txt")
  with open(src, "w", encoding="utf-8") as f:
    f.write("\n".join(prompts(count, args.seed)) + "\n")
  walls: dict[str, list[float]] = {"static": [], "continuous": []}
  outputs = {}
  for k in range(rounds):
    for scheduler in ("static", "continuous"):  # alternated: drift hits both alike
      wall, rows = run_infer(ckpt, src, os.path.join(work, f"{scheduler}-{k}"), scheduler,
                             batch, max_decode)
      log(f"round {k} {scheduler}: {wall:.1f} s")
      walls[scheduler].append(wall)
      outputs[scheduler] = [r["prediction_tokens"] for r in rows]
  same = outputs["static"] == outputs["continuous"]
  lengths = [len(t) for t in outputs["continuous"]]
  median = {s: float(np.median(w)) for s, w in walls.items()}
  report = {
      "benchmark": "t5forge infer, mixed lengths", "command": " ".join(
          ["python -m bench infer"] + list(argv or sys.argv[1:])),
      "machine": machine_info(), "model": f"{preset} shape, random init (seed {args.seed}), "
      f"EOS column scale {info['eos_scale']}", "prompts": count, "batch_size": batch,
      "max_decode_length": max_decode, "rounds": rounds, "walls_s": walls,
      "median_s": median, "tokens": int(sum(lengths)),
      "rows_ending_early": float(np.mean(np.array(lengths) < max_decode)),
      "identical_predictions": same,
      "speedup": median["static"] / median["continuous"]}
  name = "infer_mixed_quick.json" if args.quick else "infer_mixed.json"
  with open(os.path.join(RESULTS_DIR, name), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  print(f"\n| scheduler | wall (median of {rounds}) | output tok/s |\n|---|---|---|")
  for s in ("static", "continuous"):
    print(f"| {s} | {median[s]:.1f} s | {report['tokens'] / median[s]:.1f} |")
  print(f"\ncontinuous is {report['speedup']:.2f}x static; {report['rows_ending_early']:.0%} "
        f"of {count} rows end before {max_decode} tokens; identical predictions: {same}")
  return 0 if same else 1
