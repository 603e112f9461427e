"""Small collectives between processes (no-ops with one process).

Rows of a global batch are laid out process by process (process 0's rows first), which
is how `Partitioner.shard_batch` builds them; `gather_rows` restores that order on every
process.
"""
from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5forge.errors import UserError


def is_chief() -> bool:
  return jax.process_index() == 0


def to_host(x) -> np.ndarray:
  """A (possibly multi-process) global array -> the full numpy array on every process."""
  if jax.process_count() == 1 or isinstance(x, np.ndarray) or x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_rows(local: np.ndarray) -> np.ndarray:
  """This process's rows [b_local, ...] -> every process's rows [b_local * n, ...]."""
  if jax.process_count() == 1:
    return np.asarray(local)
  return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def gather_json(obj: Any) -> list:
  """Every process's JSON-able object, in process order (collectives on all processes)."""
  if jax.process_count() == 1:
    return [obj]
  raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([raw.size], np.int32))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:raw.size] = raw
  bufs = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(bufs[i][: int(np.ravel(lengths[i])[0])]).decode())
          for i in range(jax.process_count())]


def sync(name: str) -> None:
  """A barrier: every process reaches this point before any continues."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def initialize(*, coordinator_address: str | None = None, process_count: int | None = None,
               process_index: int | None = None, heartbeat_timeout_seconds: int = 30,
               initialization_timeout: int = 300) -> None:
  """Joins JAX's multi-controller runtime (`jax.distributed`).

  With an explicit coordinator address, process count and index (T5X's flags) the
  processes meet there; without them JAX detects the cluster itself (SLURM, Kubernetes
  / GKE, TPU VMs, Open MPI). On CPU, collectives between processes go over gloo. A
  process that stops sending heartbeats for `heartbeat_timeout_seconds` makes the others
  fail with an error instead of waiting forever.
  """
  explicit = (coordinator_address, process_count, process_index)
  if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
    raise UserError("--coordinator_address, --process_count and --process_index go together; "
                    "give all three, or none to let JAX detect the cluster")
  if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=process_count, process_id=process_index,
                               initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  except (ValueError, RuntimeError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"could not start the multi-process runtime ({first}); check "
                    "--coordinator_address (host:port reachable from every process), "
                    "--process_count and --process_index") from None
