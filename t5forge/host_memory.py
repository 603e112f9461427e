"""The host memory allocator: chosen by T5FORGE_MALLOC, applied by the command line first thing.

Why: XLA:CPU allocates the temporaries of every execution (gigabytes for a training step)
with `posix_memalign` and frees them when it ends; glibc serves blocks that large with a
fresh `mmap`, so every step faults its temporaries in again, 4 KiB at a time, and spends
seconds in the kernel. Measurements of every choice: docs/performance.md (history in
docs/dev/performance-log.md).

T5FORGE_MALLOC picks what the `t5forge` command does about it:

- `auto` (the default): `hugepages` where glibc and the kernel allow it, else jemalloc
  where it is installed (Debian: `libjemalloc2`; `make venv` installs it where it can),
  else the system allocator.
- `hugepages`: glibc's own malloc with transparent huge pages for its blocks
  (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc 2.35+, the kernel's
  /sys/kernel/mm/transparent_hugepage/enabled `always` or `madvise`). glibc still maps
  each step's temporaries afresh and unmaps them after, so resident memory stays bounded
  like the system malloc's, but the kernel faults them in 2 MiB at a time. Where it
  cannot work (not glibc, glibc < 2.35, huge pages `never`), a one-line note and the
  system allocator.
- `jemalloc` / `tcmalloc`: that library, or the system allocator with a one-line note
  when it cannot be loaded. jemalloc runs with SETTINGS below (one arena, freed pages
  reused and idle ones returned after 1 s). `auto` never chooses tcmalloc (slower steps
  and a higher peak than the system malloc).
- `keep`: glibc's malloc with one arena, no `mmap` for large blocks and no trimming
  (`keep_freed_memory`). Fast, but XLA releases a step's temporaries a moment after the
  step's outputs are ready, so the next step's can be allocated while the last one's
  still exist; on a heap that never shrinks that can leave the process holding twice the
  temporaries for good.
- `system`: the C library's malloc as it is.
- a path (containing `/`): that malloc library, as for `tcmalloc`.

An allocator must be in place before the process allocates anything, and glibc reads its
tunables only when a program starts, so `reexec()` runs the same command line again once,
with the library in LD_PRELOAD or the tunable in GLIBC_TUNABLES (os.execve: same pid,
arguments, open files and exit status). `keep` needs no restart: mallopt before JAX starts.
Processes the command starts inherit the environment and the marker, so they use the same
allocator and do not restart.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import subprocess
import sys

log = logging.getLogger(__name__)

ENV = "T5FORGE_MALLOC"
CHOICES = ("auto", "hugepages", "jemalloc", "tcmalloc", "keep", "system")
# Set on the re-executed process: the allocator it was started with ("system" after a
# failed load), so that it does not restart again and can say what it runs with.
MARKER = "T5FORGE_MALLOC_CHOSEN"
# Sonames, first found wins (the full tcmalloc has the same allocator plus a profiler).
LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
             "jemalloc": ("libjemalloc.so.2",)}
AUTO_ORDER = ("hugepages", "jemalloc")
# glibc's tunable for transparent huge pages on malloc's mmap'd blocks and heap (2.35+).
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
# Settings each library reads from the environment (set only where the user has not).
SETTINGS = {
    # gperftools prints a line with a stack trace for every allocation above 1 GiB by
    # default; XLA's per-step temporary buffer is one such allocation.
    "tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)},
    # narenas:1: XLA allocates a step's temporaries (one block of 1.8 GB for flan-t5-small
    # AdamW at batch 4) on whichever of its threads starts the step, and a freed block's
    # pages stay in the arena it came from: with jemalloc's arena per thread the next
    # step, on another thread, could not reuse them and touched a second block while the
    # first waited out dirty_decay_ms (a higher peak than the system malloc's). One arena
    # costs little: small blocks come from per-thread caches.
    # oversize_threshold:0: blocks above 8 MiB otherwise go to an arena that returns them
    # at once (glibc's page faults again); background_thread: idle dirty pages are
    # returned after dirty_decay_ms even while every thread is busy in XLA.
    "jemalloc": {"MALLOC_CONF": "narenas:1,background_thread:true,oversize_threshold:0,"
                                "dirty_decay_ms:1000,muzzy_decay_ms:0"},
}
# Directories searched when `ldconfig -p` does not know a library.
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
             "/usr/lib", "/usr/local/lib")

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied = False


def setting(environ=None) -> str:
  """T5FORGE_MALLOC, lower-cased and checked; ValueError (one line) for an unknown value."""
  value = (os.environ if environ is None else environ).get(ENV, "auto").strip() or "auto"
  if "/" in value:  # a malloc library by path
    return value
  if value.lower() not in CHOICES:
    raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} or the path "
                     "of a malloc library (auto: hugepages where the system allows, else "
                     "jemalloc where installed)")
  return value.lower()


def _kind(path: str) -> str:
  """'tcmalloc', 'jemalloc' or 'library' (another malloc) for a library path."""
  base = os.path.basename(path)
  return next((n for n, sonames in LIBRARIES.items()
               if any(base.startswith(s.split(".so")[0]) for s in sonames)), "library")


def hugepages_problem(libc=None, thp_path=THP_ENABLED) -> str | None:
  """Why glibc's malloc cannot use transparent huge pages here, or None when it can.

  `libc`: (name, version) as platform.libc_ver() gives them; `thp_path`: the kernel's
  setting, e.g. "always [madvise] never" (the bracketed word is the mode).
  """
  if platform.system() != "Linux":
    return f"needs Linux (this is {platform.system()})"
  name, version = libc if libc is not None else platform.libc_ver()
  if name != "glibc":
    return f"needs glibc's malloc (this C library is {name or 'unknown'})"
  try:
    major_minor = tuple(int(x) for x in version.split(".")[:2])
  except ValueError:
    major_minor = (0, 0)
  if major_minor < (2, 35):
    return f"needs glibc 2.35+ for {HUGEPAGES_TUNABLE.split('=')[0]} (this is {version})"
  try:
    with open(thp_path, encoding="utf-8") as f:
      modes = f.read()
  except OSError:
    return f"the kernel has no transparent huge pages ({thp_path} is missing)"
  mode = modes[modes.find("[") + 1:modes.find("]")] if "[" in modes else modes.strip()
  if mode not in ("always", "madvise"):
    return f"transparent huge pages are off ({thp_path} is {mode!r})"
  return None


def find_library(name: str) -> str | None:
  """The path of allocator `name`'s shared library, or None when it is not installed."""
  for soname in LIBRARIES[name]:
    for d in _LIB_DIRS:
      path = os.path.join(d, soname)
      if os.path.isfile(path):
        return path
    found = ctypes.util.find_library(soname[3:].split(".so")[0])
    if found == soname:  # ldconfig knows it under a directory not listed above
      return found
  return None


def _loads(path: str) -> str | None:
  """None when a program starts with `path` preloaded; else the loader's complaint.

  Checked in a throwaway process: loading a malloc into this one, after its own has
  served allocations, is not safe.
  """
  try:
    proc = subprocess.run([sys.executable, "-S", "-c", ""], env={"LD_PRELOAD": path},
                          capture_output=True, text=True, timeout=60, check=False)
  except (OSError, subprocess.SubprocessError) as e:
    return str(e)
  if proc.returncode != 0 or proc.stderr.strip():
    return (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
  return None


def plan(environ=None, find=find_library, loads=_loads,
         hugepages=hugepages_problem) -> tuple[dict | None, str | None]:
  """What reexec() would do: (environment to restart with or None, note or None).

  None for the environment: keep this process as it is (T5FORGE_MALLOC=system or keep,
  already restarted, not Linux, or nothing could be used; the note says which).
  `find`, `loads` and `hugepages` are the checks, replaceable in tests.
  """
  environ = dict(os.environ if environ is None else environ)
  choice = setting(environ)
  if environ.get(MARKER) or choice in ("system", "keep") or platform.system() != "Linux":
    return None, None
  names = AUTO_ORDER if choice == "auto" else (choice,)
  problems, silent = [], []  # silent: what `auto` passes over without a note
  for name in names:
    if name == "hugepages":
      problem = hugepages()
      if problem is not None:
        problems.append(f"glibc malloc with huge pages: {problem}")
        silent.append(True)
        continue
      env = dict(environ)
      tunables = environ.get("GLIBC_TUNABLES", "")
      if _hugetlb(tunables) is None:  # the user's own value wins
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, HUGEPAGES_TUNABLE) if t)
      env[MARKER] = "hugepages"
      return env, None
    path = name if "/" in name else find(name)
    name = _kind(path) if path else name
    if path is None:
      problems.append(f"{name} is not installed (Debian: apt-get install "
                      f"{'libtcmalloc-minimal4' if name == 'tcmalloc' else 'libjemalloc2'})")
      silent.append(True)
      continue
    error = loads(path)
    if error is not None:
      problems.append(f"{path} cannot be loaded ({error})")
      silent.append(False)
      continue
    env = dict(environ)
    for key, value in SETTINGS.get(name, {}).items():
      env.setdefault(key, value)
    env["LD_PRELOAD"] = " ".join(p for p in (path, environ.get("LD_PRELOAD", "")) if p)
    env[MARKER] = name
    return env, None
  if choice == "auto" and all(silent):
    return None, None  # nothing to use: the system allocator, as documented, no note
  return None, f"t5forge: note: {ENV}={choice}: {'; '.join(problems)}; using the system allocator"


def reexec() -> None:
  """Restarts this command line once with the chosen allocator preloaded (see above).

  Called by the command line before anything else; returns when there is nothing to do
  (after printing plan()'s note, if any). ValueError for a bad T5FORGE_MALLOC.
  """
  env, note = plan()
  if note:
    log.warning(note)
    os.environ[MARKER] = "system"  # tell describe() and child processes
  if env is None:
    return
  argv = getattr(sys, "orig_argv", None)
  if not argv or not sys.executable:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, argv, env)


def loaded_allocator() -> str | None:
  """'tcmalloc' or 'jemalloc' when that library is mapped into this process, else None."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as f:
      maps = f.read()
  except OSError:
    return None
  for name, sonames in LIBRARIES.items():
    if any(s.split(".so")[0] + ".so" in maps for s in sonames):
      return name
  preloaded = os.environ.get("LD_PRELOAD", "").split()
  if os.environ.get(MARKER) == "library" and preloaded and preloaded[0] in maps:
    return preloaded[0]
  return None


def _hugetlb(tunables: str) -> str | None:
  """The value GLIBC_TUNABLES (`name=value:name=value`) gives glibc.malloc.hugetlb, or None."""
  key = HUGEPAGES_TUNABLE.split("=")[0]
  values = [t.partition("=")[2] for t in tunables.split(":") if t.partition("=")[0] == key]
  return values[-1] if values else None


def describe() -> str:
  """One line for a run's startup output: the allocator this process runs with."""
  name = loaded_allocator()
  if name:
    return f"host memory: {name} ({ENV}={setting()})"
  hugetlb = _hugetlb(os.environ.get("GLIBC_TUNABLES", ""))
  if os.environ.get(MARKER) == "hugepages" and hugetlb not in (None, "0"):
    # 1: transparent huge pages; 2 (the user's): hugetlbfs pages reserved by the admin.
    pages = "transparent huge pages" if hugetlb == "1" else f"huge pages (hugetlb={hugetlb})"
    return f"host memory: glibc malloc with {pages} ({ENV}={setting()})"
  if _applied:
    return f"host memory: glibc malloc keeping freed memory ({ENV}=keep)"
  choice = setting()
  why = ""
  if os.environ.get(MARKER) == "system":
    why = ": the chosen allocator could not be used"
  elif os.environ.get(MARKER) == "hugepages":
    key = HUGEPAGES_TUNABLE.split("=")[0]
    why = (f": GLIBC_TUNABLES does not set {key}" if hugetlb is None else
           f": GLIBC_TUNABLES sets {key}={hugetlb}")
  elif "/" in choice:
    why = ": not preloaded (only the t5forge command restarts itself with it)"
  elif choice != "system":
    names = AUTO_ORDER if choice == "auto" else (choice,)
    usable = any(hugepages_problem() is None if n == "hugepages" else find_library(n)
                 for n in names)
    why = (": not in effect (only the t5forge command restarts itself with it)" if usable
           else f": {' or '.join(names)} cannot be used here")
  return f"host memory: system malloc ({ENV}={choice}{why})"


def keep_freed_memory() -> bool:
  """With T5FORGE_MALLOC=keep, applies the glibc settings above once; returns whether
  they are in effect. ValueError for a value not in CHOICES."""
  global _applied
  if _applied:
    return True
  if setting() != "keep":
    return False
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return False
  # mallopt returns 1 on success. -1 as the trim threshold is SIZE_MAX: never trim.
  ok = all(libc.mallopt(param, setting_) == 1 for param, setting_ in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
  _applied = ok
  return ok
