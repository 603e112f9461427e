"""Will the training step fit in accelerator memory? Asked once, before the first step.

XLA knows, after compiling, how many bytes one device needs for the step: its arguments
(parameters, optimizer state, batch), its outputs and its temporaries, less the outputs
that reuse donated argument buffers (the new state is written over the old one). A GPU
or TPU reports what its allocator may hold (`memory_stats()['bytes_limit']`). A step
that needs more would fail at its first run with an allocator error many lines long
("RESOURCE_EXHAUSTED: Out of memory while trying to allocate ..."); this says it in one
line, with the settings that change it.

On CPU nothing is checked: the host device reports no limit (`memory_stats()` is None).
Host memory is shared with the OS, other processes and swap, and XLA:CPU allocates each
temporary with malloc as it runs (no arena sized up front), so there is no fixed budget
to compare a total with; the host allocator is `t5forge/host_memory.py`'s job.
"""
from __future__ import annotations

from typing import Any

from t5forge.errors import UserError

GIB = 1024 ** 3


def limit_bytes(device: Any) -> int | None:
  """What the device's allocator may hold, in bytes; None where the backend reports no
  limit (CPU)."""
  stats = device.memory_stats()
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def step_bytes(compiled: Any) -> int | None:
  """Bytes one device needs to run `compiled` (a `jax.stages.Compiled`): arguments +
  outputs + temporaries - outputs aliased to donated arguments + generated code; None
  where the backend gives no memory analysis."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes + m.generated_code_size_in_bytes)


def check_step_fits(compiled: Any, *, device: Any, batch_size: int, config: Any,
                    num_microbatches: int | None) -> None:
  """Raises a one-line UserError when the compiled training step needs more memory
  than `device` has; does nothing on a device that reports no limit (CPU).

  Args:
    compiled: the compiled training step (`jit(...).lower(state, batch).compile()`).
    device: one device of the step's mesh (every device runs the same program).
    batch_size: the global BATCH_SIZE; config: the ModelConfig; num_microbatches: the
      run's trainer.Trainer.num_microbatches (None = 1): named in the message.
  """
  limit = limit_bytes(device)
  if limit is None:
    return
  need = step_bytes(compiled)
  if need is None or need <= limit:
    return
  fixes = [f"lower BATCH_SIZE (now {batch_size})",
           f"raise trainer.Trainer.num_microbatches (now {num_microbatches or 1})"]
  remat = {"none": "'minimal' or 'full'", "minimal": "'full'"}.get(config.remat_policy)
  if remat:
    fixes.append(f"set network.ModelConfig.remat_policy = {remat} (now "
                 f"'{config.remat_policy}')")
  if not config.scan_layers:
    fixes.append("set network.ModelConfig.scan_layers = True (now False)")
  raise UserError(f"the training step needs {need / GIB:.1f} GiB per device but "
                  f"{device.device_kind} {device.platform}:{device.id} has "
                  f"{limit / GIB:.1f} GiB: {', '.join(fixes)}")
