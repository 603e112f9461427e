"""Run settings, the shared model directories, and what machine this is.

Model directories are cached under `bench/results/.cache/` by shape, seed and config
hash: `<key>/hf` (the HF directory every framework starts from) and `<key>/ct2-float32`,
`<key>/ct2-int8` (CTranslate2 conversions of it). They are built by a short-lived `hf`
worker, so the driver never imports torch or JAX.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import sys

from bench import shapes
from bench.workers import REPO_ROOT, WorkerGroup, log

RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
CACHE_DIR = os.path.join(RESULTS_DIR, ".cache")
CT2_QUANTIZATIONS = ("float32", "int8")


@dataclasses.dataclass(frozen=True)
class Context:
  """What every case needs: the plan, how many rounds, where logs and models go."""

  plan: shapes.Plan
  rounds: int
  quick: bool
  seed: int = 0
  cache_dir: str = CACHE_DIR
  dtypes: tuple[str, ...] = ("float32", "bfloat16")  # training / matmul / decode rows

  @property
  def log_dir(self) -> str:
    return os.path.join(self.cache_dir, "logs")

  def model_dir(self, size: str) -> str:
    return self.shape_dir(shapes.SHAPES[size])

  def shape_dir(self, shape) -> str:
    """The HF directory of a `shapes.Shape` or `shapes.T5GemmaShape`."""
    return os.path.join(self.cache_dir, shape.cache_key(self.seed), "hf")

  def ct2_dirs(self, size: str) -> dict[str, str]:
    root = os.path.dirname(self.model_dir(size))
    return {q: os.path.join(root, f"ct2-{q}") for q in CT2_QUANTIZATIONS}


def model_dir(size: str, model_dir: str | None) -> str:
  """The HF directory of the bench's random-init model of `size` (or `model_dir`, if
  given); exits with the command that builds it where it is missing."""
  path = model_dir or os.path.join(CACHE_DIR, shapes.SHAPES[size].cache_key(0), "hf")
  if not os.path.isdir(path):
    raise SystemExit(f"{path} does not exist: run `python -m bench train --sizes {size}` once "
                     f"(it builds the model directories), or pass --model_dir")
  return path


def prepare_models(ctx: Context, sizes: list[str], *, ct2_sizes: list[str],
                   extra_shapes: tuple = ()) -> None:
  """Builds the HF directories (and CTranslate2 conversions) that are not cached yet.

  Args:
    sizes: keys of shapes.SHAPES (T5).
    extra_shapes: more shapes (shapes.T5GemmaShape), HF directories only.
  """
  todo = [(shapes.SHAPES[s], s in ct2_sizes and ctx.ct2_dirs(s)) for s in sizes]
  todo += [(shape, None) for shape in extra_shapes]
  with WorkerGroup(ctx.log_dir) as group:
    worker = None
    for shape, ct2_dirs in todo:
      if worker is None:
        worker = group.start("hf", "prepare models")
      hf_dir = ctx.shape_dir(shape)
      log(f"models for {shape.name}: {os.path.dirname(hf_dir)}")
      built = worker.call("prepare", hf_dir=hf_dir, hf_config=shape.hf_config(),
                          seed=ctx.seed, ct2_dirs=ct2_dirs or None)["built"]
      for path in built:
        log(f"  built {os.path.relpath(path, REPO_ROOT)}")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
  wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "fma")
  from t5forge import precision
  have = precision.cpu_flags()
  return [w for w in wanted if w in have]


def bf16_hardware() -> bool:
  """Whether this CPU has native bfloat16 instructions (t5forge.precision's test, which
  decides `t5forge train`'s default dtype). Without them torch multiplies bf16 matrices in
  an unvectorised loop (one [4096, 4096] product took over 7 minutes on an AVX2-only AMD
  EPYC) and bf16 has nothing to gain, so `--bf16 auto` leaves those rows out."""
  from t5forge import precision
  return precision.bf16_reason("cpu", precision.cpu_flags()) is not None


def machine_info() -> dict:
  """CPU, cores, memory, load, and the versions of everything measured (no imports)."""
  import psutil
  versions = {}
  for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "ctranslate2",
               "numpy", "grain", "t5forge"):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {
      "cpu": _cpu_model(),
      "cpu_flags": _cpu_flags(),
      "logical_cores": os.cpu_count(),
      "physical_cores": psutil.cpu_count(logical=False),
      "memory_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
      "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
      "platform": platform.platform(),
      "python": sys.version.split()[0],
      "versions": versions,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
  }
