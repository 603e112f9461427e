"""Opt-in: keep freed host memory in the process, so that each step reuses the last one's pages.

XLA:CPU allocates the temporaries of every execution with `posix_memalign` and frees
them when it ends (3.4 GB per flan-t5-small training step at batch 8, 512/114 tokens;
10.2 GB for flan-t5-base with scan). glibc serves requests that large with a fresh `mmap`
and returns them with `munmap`, so the next step touches new pages again: measured on a
2-core AMD EPYC, ~920,000 page faults and ~3 s of kernel time per flan-t5-small step
(the step took 9.7 s; with this module's setting 7.8 s and no faults after the first).

`keep_freed_memory()` sets glibc's malloc to one arena, no `mmap` for large blocks and no
trimming of the heap, so freed blocks stay mapped and are reused. It is off unless
T5FORGE_MALLOC=keep, because of what it costs: XLA releases a step's temporaries a moment
after the step's outputs are ready, so the next step's can be allocated while the last
one's still exist. With `mmap` that overlap is brief; on a heap that never shrinks, it
leaves the process holding up to twice the temporaries for good (measured: flan-t5-base,
scan, AdamW grew from 14.4 GB past 19 GB in three runs of four, two of them killed for want
of memory at 24 GB; the fourth stayed at 14.4 GB with steps 12% faster than system malloc).
Turn it on when twice `compiled.memory_analysis().temp_size_in_bytes` plus the training
state fits in RAM. The command line calls this first thing, before JAX's threads exist.
On other C libraries it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

ENV = "T5FORGE_MALLOC"
_applied = False


def keep_freed_memory() -> bool:
  """Applies the malloc settings above once; returns whether they are in effect."""
  global _applied
  if _applied:
    return True
  value = os.environ.get(ENV, "system").lower()
  if value not in ("keep", "system"):
    raise ValueError(f"{ENV}={value!r}: expected 'keep' (reuse freed memory) or 'system'")
  if value != "keep":
    return False
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return False
  # mallopt returns 1 on success. -1 as the trim threshold is SIZE_MAX: never trim.
  ok = all(libc.mallopt(param, setting) == 1 for param, setting in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
  _applied = ok
  return ok
