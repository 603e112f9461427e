"""Checkpoint save and restore on local disk against the GCS and S3 emulators, in one run.

    python -m bench storage             # flan-t5-small shape, AdamW state, 3 rounds
    python -m bench storage --quick     # t5_1_1.tiny shape, 1 round (a smoke test)

One process, one train state (random parameters of the preset's shape plus AdamW's two
moments: three float32 copies of the model), saved by `t5forge.train.checkpoint.Checkpointer`
(what training uses: Orbax, our manifest, the bucket route of `t5forge.storage`) into a
local MODEL_DIR, `gs://` on `gcp-storage-emulator` and `s3://` on `moto`, both started on
127.0.0.1 by this script. Each round saves one step (waiting until it is committed) and
restores it; the table gives the median seconds and MB/s of the state's bytes, and each
bucket's time as a multiple of local disk's. The emulators run on the same CPU cores as
the benchmark and keep objects in a local directory (GCS) or in memory (S3): the ratios say
what the bucket route costs in requests and copies, not what a cloud's network costs.

Writes bench/results/storage.json (storage_quick.json with --quick); the table goes into
docs/performance.md ("Checkpoints on buckets").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(preset: str):
  import jax
  import optax

  from t5forge import nn as t5nn
  from t5forge import presets
  from t5forge.train import state as state_lib
  config = presets.get(preset)
  params = t5nn.init_params(config, jax.random.PRNGKey(0))
  return state_lib.create(params, optax.adamw(1e-3)), config


def _nbytes(tree) -> int:
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _round(model_dir: str, state, step: int) -> tuple[float, float]:
  import jax

  from t5forge.train import checkpoint as ckpt_lib
  from t5forge.train.settings import SaveCheckpointConfig
  ckpt = ckpt_lib.Checkpointer(model_dir, SaveCheckpointConfig(period=1, async_save=False))
  t0 = time.perf_counter()
  ckpt.save(step, state, config_item={"bench": True})
  ckpt.wait()
  saved = time.perf_counter() - t0
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  t0 = time.perf_counter()
  params, opt_state, _ = ckpt.restore(step, abstract, log=lambda _: None)
  jax.block_until_ready((params, opt_state))
  restored = time.perf_counter() - t0
  ckpt.close()
  return saved, restored


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench storage",
                              description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="t5_1_1.tiny shape, 1 round")
  p.add_argument("--rounds", type=int, default=None)
  args = p.parse_args(argv)
  preset = "t5_1_1.tiny" if args.quick else "flan_t5.small"
  rounds = args.rounds or (1 if args.quick else 3)

  from t5forge import storage, testing
  state, _ = _state(preset)
  size_mb = _nbytes((state.params, state.opt_state)) / 1e6
  rows = {}
  with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp, \
      testing.emulator("gs", os.path.join(tmp, "gs")) as gcs, \
      testing.emulator("s3", os.path.join(tmp, "s3")) as s3:
    os.environ.update(gcs.env())
    os.environ.update(s3.env())
    os.environ["T5FORGE_CACHE"] = os.path.join(tmp, "cache")
    storage.reset_clients()
    targets = {"local disk": os.path.join(tmp, "local"),
               "gs:// (emulator)": gcs.make_bucket("bench-storage") + "/run",
               "s3:// (emulator)": s3.make_bucket("bench-storage") + "/run"}
    for name, root in targets.items():
      times = [_round(f"{root}/r{i}", state, 100 + i) for i in range(rounds)]
      rows[name] = {"save_s": statistics.median(t[0] for t in times),
                    "restore_s": statistics.median(t[1] for t in times),
                    "rounds": [list(t) for t in times]}
  local = rows["local disk"]
  lines = [f"{preset}: {size_mb:,.0f} MB of parameters + AdamW state, median of {rounds}",
           "", "| where | save s | save MB/s | restore s | restore MB/s | save / local | "
           "restore / local |", "|---|---:|---:|---:|---:|---:|---:|"]
  for name, r in rows.items():
    lines.append(f"| {name} | {r['save_s']:.2f} | {size_mb / r['save_s']:,.0f} | "
                 f"{r['restore_s']:.2f} | {size_mb / r['restore_s']:,.0f} | "
                 f"{r['save_s'] / local['save_s']:.1f}x | "
                 f"{r['restore_s'] / local['restore_s']:.1f}x |")
  print("\n".join(lines))
  from bench.prepare import machine_info
  out = os.path.join(REPO_ROOT, "bench", "results",
                     "storage_quick.json" if args.quick else "storage.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"machine": machine_info(), "preset": preset, "state_mb": size_mb,
               "rows": rows}, f, indent=2)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
