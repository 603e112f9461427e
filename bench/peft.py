"""Adapter training on a frozen base that does not fit as float32: peak RSS and step time.

    python -m bench peft                      # the three cases below, one process each
    python -m bench peft --cases xl-bf16      # one case
    python -m bench peft --quick              # smoke test: flan-t5-small shape, short inputs

Each case is one LoRA (q, v; rank 8) training step of the real shape, batch 8, inputs
512 / targets 114, `remat_policy='full'`, scanned layers, bfloat16 compute, Adafactor on
the adapter: one compile and two steps, in a fresh process whose `ru_maxrss` is the
figure reported (the whole process: base, adapter, optimizer state, the step's
temporaries, the compiler).

    xl-bf16        flan-t5-xl (2.85B), bfloat16 base          target <= 11 GiB
    xxl-int8       flan-t5-xxl (11.3B), int8 base             target <= 18 GiB
    t5gemma-2b-bf16  T5Gemma 2B-2B, bfloat16 base             target <= 16 GiB

The base is built directly in its storage dtype with random values (no 44 GB file is
written or read; reading one tensor by tensor is measured by tests/test_base_loading.py):
kernels N(0, 1/in) rounded to bfloat16, or int8 values with per-channel scales of the
same spread (`QArray(exact=True)`, the training path), one random block per kernel shape
copied into every layer; embeddings float32 (a random block tiled) and norms 1. Memory and time do not depend on
the values.
Writes bench/results/peft.json (peft_quick.json with --quick); the table goes into
docs/performance.md ("Adapter training on a frozen base").
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (preset, base_dtype, target peak GiB)
CASES = {
    "xl-bf16": ("flan_t5.xl", "bfloat16", 11.0),
    "xxl-int8": ("flan_t5.xxl", "int8", 18.0),
    "t5gemma-2b-bf16": ("t5gemma.2b-2b", "bfloat16", 16.0),
}
QUICK = {"small-bf16": ("flan_t5.small", "bfloat16", None),
         "small-int8": ("flan_t5.small", "int8", None)}
BATCH, INPUT_LENGTH, TARGET_LENGTH = 8, 512, 114
QUICK_LENGTHS = (64, 16)
STEPS = 2  # after the compile; the first one's peak is the step's peak
# The memory guard: a case stops (and says so) when its RSS passes its target by this
# factor, or when the machine has less than MIN_AVAILABLE left, rather than push a shared
# machine into the OOM killer.
OVER_TARGET = 1.2
MIN_AVAILABLE = 1.5 * 2 ** 30


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 2 ** 62


def _guard(row: dict, limit: float | None) -> None:
  """Watches this process's RSS from a thread; past `limit` bytes or the machine's
  MIN_AVAILABLE, prints `row` with the reason and exits at once."""
  import threading

  def watch():
    while True:
      rss, available = _rss(), _available()
      if (limit is not None and rss > limit) or available < MIN_AVAILABLE:
        why = (f"stopped at {rss / 2**30:.1f} GiB RSS" + (
            f" (over {limit / 2**30:.1f} GiB)" if limit is not None and rss > limit else
            f" ({available / 2**30:.1f} GiB left on the machine)"))
        print(json.dumps({**row, "peak_rss_bytes": max(rss, row.get("peak_rss_bytes", 0)),
                          "stopped": why}), flush=True)
        os._exit(3)
      time.sleep(0.2)

  threading.Thread(target=watch, daemon=True).start()


def _random_base(abstract: dict, base_dtype: str, seed: int) -> dict:
  """Base parameters (jax arrays) of the shapes in `abstract` (ShapeDtypeStructs, any
  layout), made in their storage dtype one leaf at a time (never a float32 copy of a
  kernel, nor two copies of the base)."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import numpy as np

  from t5forge.nn import quant
  rng = np.random.default_rng(seed)
  blocks: dict = {}  # one random [in, out] block per shape, copied into every layer

  def block(shape):
    if shape not in blocks:
      if base_dtype == "int8":
        blocks[shape] = rng.integers(-127, 128, shape, dtype=np.int8)
      else:
        w = rng.standard_normal(shape, np.float32) / np.sqrt(shape[0])
        blocks[shape] = w.astype(ml_dtypes.bfloat16) if base_dtype == "bfloat16" else w
    return blocks[shape]

  def kernel(shape):
    out = np.empty(shape, block(shape[-2:]).dtype)
    for idx in np.ndindex(*shape[:-2]):
      out[idx] = block(shape[-2:])
    if base_dtype != "int8":
      return out
    # Uniform int8 values have spread ~73; this scale gives the N(0, 1/in) spread.
    scale = np.full(shape[:-2] + shape[-1:], 1.0 / (73.0 * np.sqrt(shape[-2])), np.float32)
    return quant.QArray(q=out, scale=scale, exact=True)

  def leaf(name, spec):
    shape = tuple(spec.shape)
    if name == "kernel":
      return kernel(shape)
    if name == "scale":  # norms
      return np.ones(shape, np.float32)
    # Embeddings (256k x 2304 for T5Gemma): one random block of up to 1M values, tiled.
    size = int(np.prod(shape))
    return np.resize(rng.standard_normal(min(size, 2 ** 20), np.float32) * np.float32(0.5),
                     shape)

  def walk(tree):
    # Each leaf placed as it is made (jax arrays; on CPU a copy): the host copy of one
    # leaf at a time, never of the whole base.
    return {k: walk(v) if isinstance(v, dict) else jax.tree.map(jnp.asarray, leaf(k, v))
            for k, v in tree.items()}

  return walk(abstract)


def _fresh_adapter(abstract: dict, seed: int) -> dict:
  """LoRA leaves as a fresh adapter has them (the layers' init; `t5nn.init_params` would
  initialise the float32 base too): lora_a U(-1/sqrt(in), 1/sqrt(in)), lora_b zeros."""
  import jax
  import jax.numpy as jnp
  keys = iter(jax.random.split(jax.random.key(seed), 4096))

  def leaf(name, spec):
    if name == "lora_a":
      bound = 1.0 / spec.shape[-2] ** 0.5
      return jax.random.uniform(next(keys), spec.shape, spec.dtype, -bound, bound)
    return jnp.zeros(spec.shape, spec.dtype)

  def walk(tree):
    return {k: walk(v) if isinstance(v, dict) else leaf(k, v) for k, v in tree.items()}

  return walk(abstract)


def _nbytes(tree) -> int:
  import jax
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def worker(name: str, preset: str, base_dtype: str, quick: bool, steps: int = STEPS,
           seed: int = 0, target_gib: float | None = None) -> dict:
  """One case in this process: build, compile, run `steps` steps; the measurements, a
  JSON line after the compile and after each step (the memory guard prints its own)."""
  import jax
  import jax.numpy as jnp

  from bench import shapes
  from t5forge import presets
  from t5forge import nn as t5nn
  from t5forge.models import model_for
  from t5forge.nn import adapters, lora
  from t5forge.train import optim
  from t5forge.train.state import create as create_state
  from t5forge.train import step as train_step

  row = {"case": name, "preset": preset, "base_dtype": base_dtype, "step_s": []}
  _guard(row, None if target_gib is None else target_gib * OVER_TARGET * 2 ** 30)
  started = time.perf_counter()
  config = presets.get(preset, scan_layers=True, remat_policy="full", dtype="bfloat16",
                       dropout_rate=0.0, lora=lora.LoraConfig(rank=8, targets="qv"))
  model = model_for(config)
  adapter, base_abstract = adapters.split(t5nn.abstract_params(config))
  base = _random_base(base_abstract, base_dtype, seed)
  adapter = _fresh_adapter(adapter, seed)
  build_s = time.perf_counter() - started
  axes, _ = adapters.split(model.logical_axes())
  tx = optim.Adafactor().build(lambda _: 1e-3, axes)
  state = create_state(adapter, tx)
  input_length, target_length = QUICK_LENGTHS if quick else (INPUT_LENGTH, TARGET_LENGTH)
  feats = {k: jnp.asarray(v) for k, v in shapes.train_batch(
      config.vocab_size, BATCH, input_length, target_length, seed).items()}
  step = jax.jit(train_step.make_train_step(model, tx, seed=seed, adapter=True),
                 donate_argnums=(0,))
  t0 = time.perf_counter()
  compiled = step.lower(state, feats, base).compile()
  memory = compiled.memory_analysis()
  row.update({
      "batch": BATCH, "input_length": input_length, "target_length": target_length,
      "base_params": int(sum(x.size for x in jax.tree.leaves(base_abstract))),
      "adapter_params": int(sum(x.size for x in jax.tree.leaves(adapter))),
      "base_bytes": _nbytes(base), "adapter_bytes": _nbytes(state.params),
      "optimizer_bytes": _nbytes(state.opt_state),
      "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0) or 0),
      "build_s": round(build_s, 1), "compile_s": round(time.perf_counter() - t0, 1),
      "losses": [],
      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  })
  print(json.dumps(row), flush=True)
  for _ in range(steps):
    t0 = time.perf_counter()
    state, sums = compiled(state, feats, base)
    jax.block_until_ready((state, sums))
    row["step_s"].append(round(time.perf_counter() - t0, 2))
    row["losses"].append(float(sums["cross_ent_loss"]) / float(sums["weight_sum"]))
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # A line per step: a case stopped by the driver's timeout keeps what it measured.
    print(json.dumps(row), flush=True)
  return row


def _run_case(name: str, spec: tuple, quick: bool, steps: int, timeout_s: float) -> dict:
  preset, base_dtype, target = spec
  cmd = [sys.executable, "-m", "bench.peft", "--worker", name, "--preset", preset,
         "--base-dtype", base_dtype, "--steps", str(steps)] + (
             ["--quick"] if quick else ["--target", str(target)])
  started = time.perf_counter()
  failed = {"case": name, "preset": preset, "base_dtype": base_dtype, "target_gib": target}
  try:
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT})
    stdout, error = out.stdout, None
    if out.returncode:
      error = f"exit {out.returncode}: " + (out.stderr.strip().splitlines() or ["no output"])[-1]
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    error = f"stopped after {timeout_s:.0f} s"
  lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
  if not lines:
    return {**failed, "error": error or "no result"}
  row = json.loads(lines[-1])  # the last step it finished, or why the guard stopped it
  row.update(target_gib=target, wall_s=round(time.perf_counter() - started, 1))
  if len(row["step_s"]) < steps:
    row["note"] = f"{len(row['step_s'])} of {steps} steps: {row.get('stopped') or error}"
  return row


def render(rows: list[dict]) -> str:
  """The markdown table of docs/performance.md; blank where a case did not get that far."""
  gib = 2 ** 30

  def cell(r, key, scale, fmt):
    return "" if r.get(key) is None else format(r[key] / scale, fmt)

  out = ["| case | base | base GiB | adapter + optimizer MiB | XLA temp GiB | peak RSS GiB "
         "| target GiB | compile s | step s | note |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    target, peak = r.get("target_gib"), r.get("peak_rss_bytes")
    verdict = "" if target is None or peak is None else (
        " (met)" if peak / gib <= target and not r.get("note") else
        " (missed)" if peak / gib > target else "")
    state = "" if "adapter_bytes" not in r else f"{(r['adapter_bytes'] + r['optimizer_bytes']) / 2**20:.1f}"
    out.append(
        f"| {r['case']} ({r['preset']}) | {r['base_dtype']} | {cell(r, 'base_bytes', gib, '.2f')} "
        f"| {state} | {cell(r, 'temp_bytes', gib, '.2f')} | {cell(r, 'peak_rss_bytes', gib, '.2f')} "
        f"| {'' if target is None else f'<= {target:g}'}{verdict} | {cell(r, 'compile_s', 1, '.0f')} "
        f"| {', '.join(f'{x:.1f}' for x in r.get('step_s', []))} "
        f"| {r.get('note') or r.get('error') or ''} |")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench peft", description=__doc__.splitlines()[0])
  p.add_argument("--cases", default=None,
                 help=f"comma-separated, of {', '.join(CASES)} (default: all, in that order)")
  p.add_argument("--quick", action="store_true", help="smoke test: flan-t5-small shape")
  p.add_argument("--steps", type=int, default=STEPS, help=f"steps after the compile "
                 f"(default {STEPS}; 1 still measures the step's peak)")
  p.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
  p.add_argument("--output", default=None, help="JSON path (default bench/results/peft.json)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--preset", default=None, help=argparse.SUPPRESS)
  p.add_argument("--base-dtype", default=None, help=argparse.SUPPRESS)
  p.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    worker(args.worker, args.preset, args.base_dtype, args.quick, args.steps,
           target_gib=args.target)
    return 0
  table = QUICK if args.quick else CASES
  names = args.cases.split(",") if args.cases else list(table)
  unknown = [n for n in names if n not in table]
  if unknown:
    p.error(f"unknown case(s) {unknown}; choose from {', '.join(table)}")
  from bench.prepare import RESULTS_DIR, machine_info
  from bench.report import write_json
  output = args.output or os.path.join(RESULTS_DIR, "peft_quick.json" if args.quick
                                       else "peft.json")
  report = {"benchmark": "adapter training on a frozen base", "machine": machine_info(),
            "command": " ".join(["python -m bench peft"] + list(argv or sys.argv[1:])),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
  for name in names:
    print(f"[peft] {name}: {table[name][0]}, {table[name][1]} base ...", file=sys.stderr,
          flush=True)
    report["rows"].append(_run_case(name, table[name], args.quick, args.steps, args.timeout))
    write_json(output, report)  # what was measured survives a later case's failure
  print(render(report["rows"]))
  print(f"\nwrote {os.path.relpath(output)}")
  return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
  sys.exit(main())
