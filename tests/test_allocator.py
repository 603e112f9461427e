"""T5FORGE_MALLOC and the command line's restart with the chosen allocator
(t5forge/host_memory.py): what plan() chooses, the note for an allocator that cannot be
used, a real `python -m t5forge` that restarts once, in the same process, with the
library mapped or glibc's huge-page tunable set and says so, and huge pages really
backing glibc's large blocks."""
import os
import subprocess
import sys

import pytest

from t5forge import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = [n for n in ("jemalloc",) if host_memory.find_library(n)]
HUGEPAGES = host_memory.hugepages_problem() is None  # glibc 2.35+ and THP not `never`
AUTO = "hugepages" if HUGEPAGES else (INSTALLED or ["system"])[0]


def _no_call(*_):
  raise AssertionError("must not look for or load a library")


def test_auto_sets_glibcs_huge_page_tunable_where_it_can():
  env, note = host_memory.plan({"T5FORGE_MALLOC": "auto"}, find=_no_call, loads=_no_call,
                               hugepages=lambda: None)
  assert note is None
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  assert env[host_memory.MARKER] == "hugepages" and "LD_PRELOAD" not in env
  # The user's other tunables are kept; their own hugetlb value wins over ours.
  env, _ = host_memory.plan({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                            hugepages=lambda: None)
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  env, _ = host_memory.plan({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
                            hugepages=lambda: None)
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


@pytest.mark.parametrize("libc,modes,problem", [
    (("glibc", "2.36"), "always [madvise] never", None),
    (("glibc", "2.35"), "[always] madvise never", None),
    (("glibc", "2.31"), "always [madvise] never", "needs glibc 2.35+"),
    (("musl", ""), "always [madvise] never", "needs glibc's malloc"),
    (("glibc", "2.36"), "always madvise [never]", "transparent huge pages are off"),
    (("glibc", "2.36"), None, "the kernel has no transparent huge pages")])
def test_huge_pages_need_glibc_2_35_and_the_kernels_transparent_huge_pages(
    tmp_path, libc, modes, problem):
  thp = tmp_path / "enabled"
  if modes is not None:
    thp.write_text(modes + "\n")
  found = host_memory.hugepages_problem(libc=libc, thp_path=str(thp))
  assert found is None if problem is None else found.startswith(problem), found


def test_auto_falls_back_to_jemalloc_and_an_asked_for_hugepages_to_a_note():
  env, note = host_memory.plan({"T5FORGE_MALLOC": "auto", "LD_PRELOAD": "/x/other.so"},
                               find=lambda n: f"/x/lib{n}.so" if n == "jemalloc" else None,
                               loads=lambda _: None, hugepages=lambda: "off")
  assert note is None
  assert env["LD_PRELOAD"] == "/x/libjemalloc.so /x/other.so"  # the user's preload is kept
  assert env[host_memory.MARKER] == "jemalloc" and "GLIBC_TUNABLES" not in env
  env, note = host_memory.plan({"T5FORGE_MALLOC": "hugepages"}, find=_no_call,
                               loads=_no_call, hugepages=lambda: "needs glibc 2.35+ (x)")
  assert env is None
  assert note == ("t5forge: note: T5FORGE_MALLOC=hugepages: glibc malloc with huge pages: "
                  "needs glibc 2.35+ (x); using the system allocator")


def test_jemalloc_is_preloaded_with_its_settings():
  env, note = host_memory.plan({"T5FORGE_MALLOC": "jemalloc", "LD_PRELOAD": "/x/other.so"},
                               find=lambda n: f"/x/lib{n}.so" if n == "jemalloc" else None,
                               loads=lambda _: None, hugepages=_no_call)
  assert note is None
  assert env["LD_PRELOAD"] == "/x/libjemalloc.so /x/other.so"  # the user's preload is kept
  assert env[host_memory.MARKER] == "jemalloc"
  assert "oversize_threshold:0" in env["MALLOC_CONF"]
  # A setting the user made wins over ours.
  env, _ = host_memory.plan({"T5FORGE_MALLOC": "tcmalloc",
                             "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"},
                            find=lambda n: f"/x/lib{n}.so", loads=lambda _: None)
  assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
  assert env["LD_PRELOAD"] == "/x/libtcmalloc.so"


def test_auto_without_any_library_is_the_system_allocator_without_a_note():
  assert host_memory.plan({}, find=lambda _: None, loads=_no_call,
                          hugepages=lambda: "off") == (None, None)


@pytest.mark.parametrize("env", [{"T5FORGE_MALLOC": "system"}, {"T5FORGE_MALLOC": "keep"},
                                 {"T5FORGE_MALLOC": "auto", host_memory.MARKER: "tcmalloc"},
                                 {host_memory.MARKER: "system"}])
def test_system_keep_and_an_already_restarted_process_do_nothing(env):
  assert host_memory.plan(env, find=_no_call, loads=_no_call,
                          hugepages=_no_call) == (None, None)


def test_unloadable_library_is_a_one_line_note_and_the_system_allocator(tmp_path):
  bogus = tmp_path / "libtcmalloc_minimal.so.4"
  bogus.write_text("not a shared library\n")
  for path in (str(bogus), str(tmp_path / "missing.so")):
    env, note = host_memory.plan({"T5FORGE_MALLOC": "tcmalloc"}, find=lambda _, p=path: p)
    assert env is None
    assert "\n" not in note
    assert note.startswith(f"t5forge: note: T5FORGE_MALLOC=tcmalloc: {path} cannot be loaded (")
    assert note.endswith("; using the system allocator")
  env, note = host_memory.plan({"T5FORGE_MALLOC": "jemalloc"}, find=lambda _: None)
  assert env is None and "jemalloc is not installed (Debian: apt-get install libjemalloc2)" in note


# Written at every interpreter start-up of the command (sitecustomize): pid, marker, and
# which allocator /proc/self/maps shows, read independently of host_memory.
SITECUSTOMIZE = """
import os
maps = open("/proc/self/maps").read()
mapped = [n for n in ("libtcmalloc", "libjemalloc") if n in maps]
with open(os.environ["ALLOC_TEST_LOG"], "a") as f:
  f.write(f"{os.getpid()} {os.environ.get('T5FORGE_MALLOC_CHOSEN', '-')} {','.join(mapped) or '-'}"
          f" {os.environ.get('GLIBC_TUNABLES') or '-'}\\n")
"""


def _run_cli(tmp_path, **env_changes):
  (tmp_path / "site").mkdir(exist_ok=True)
  (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
  log = tmp_path / "starts.log"
  log.unlink(missing_ok=True)
  env = {k: v for k, v in os.environ.items()
         if k not in ("T5FORGE_MALLOC", host_memory.MARKER, "LD_PRELOAD", "GLIBC_TUNABLES")}
  env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]),
             ALLOC_TEST_LOG=str(log), **env_changes)
  # A missing gin file: train prints its start-up lines, then a one-line error (status 2).
  proc = subprocess.Popen([sys.executable, "-m", "t5forge", "train",
                           f"--gin_file={tmp_path / 'missing.gin'}"],
                          env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  out, err = proc.communicate(timeout=120)
  starts = [line.split() for line in log.read_text().splitlines()]
  return proc, out, err, starts


def test_the_command_restarts_once_with_the_default_and_says_so(tmp_path):
  proc, out, err, starts = _run_cli(tmp_path)
  # Same pid (execve), first as started, then with what auto chose in effect; no third start.
  restarted = {"hugepages": [str(proc.pid), "hugepages", "-", "glibc.malloc.hugetlb=1"],
               "jemalloc": [str(proc.pid), "jemalloc", "libjemalloc", "-"]}.get(AUTO)
  assert starts == [[str(proc.pid), "-", "-", "-"]] + ([restarted] if restarted else []), starts
  said = {"hugepages": "glibc malloc with transparent huge pages", "jemalloc": "jemalloc"}
  assert f"host memory: {said.get(AUTO, 'system malloc')} (T5FORGE_MALLOC=auto" in out, out
  assert proc.returncode == 2  # the error's status survives the restart
  assert len(err.strip().splitlines()) == 1 and "missing.gin" in err, err


@pytest.mark.skipif(not INSTALLED, reason="needs libjemalloc2 (make venv)")
def test_the_command_restarts_once_with_jemalloc_mapped_and_says_so(tmp_path):
  proc, out, _, starts = _run_cli(tmp_path, T5FORGE_MALLOC="jemalloc")
  assert starts == [[str(proc.pid), "-", "-", "-"],
                    [str(proc.pid), "jemalloc", "libjemalloc", "-"]], starts
  assert "host memory: jemalloc (T5FORGE_MALLOC=jemalloc)" in out.splitlines()
  assert proc.returncode == 2


def test_the_command_with_system_or_a_bad_library_does_not_restart(tmp_path):
  proc, out, _, starts = _run_cli(tmp_path, T5FORGE_MALLOC="system")
  assert starts == [[str(proc.pid), "-", "-", "-"]]
  assert "host memory: system malloc (T5FORGE_MALLOC=system)" in out.splitlines()
  bogus = tmp_path / "libjemalloc.so.2"
  bogus.write_text("not a shared library\n")
  proc, out, err, starts = _run_cli(tmp_path, T5FORGE_MALLOC=str(bogus))
  assert starts == [[str(proc.pid), "-", "-", "-"]]  # no restart
  note, error = err.strip().splitlines()  # the note, then train's own error
  assert note.startswith(f"t5forge: note: T5FORGE_MALLOC={bogus}: {bogus} cannot be loaded (")
  assert note.endswith("; using the system allocator")
  assert error.startswith("t5forge: error: ") and "missing.gin" in error
  assert (f"host memory: system malloc (T5FORGE_MALLOC={bogus}: the chosen allocator could "
          "not be used)") in out.splitlines()


def test_bad_value_is_a_one_line_cli_error():
  env = dict(os.environ, T5FORGE_MALLOC="tcmaloc")
  proc = subprocess.run([sys.executable, "-m", "t5forge", "vocab", "--help"], env=env,
                        capture_output=True, text=True, check=False, cwd=ROOT)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "t5forge: error: T5FORGE_MALLOC='tcmaloc': expected one of auto, hugepages, jemalloc, "
      "tcmalloc, keep, system or the path of a malloc library (auto: hugepages where the "
      "system allows, else jemalloc where installed)"]


# XLA allocates a step's temporaries on whichever of its threads runs the step; the next
# step's block must reuse the last one's freed pages even from another thread (with one
# jemalloc arena per thread it did not, and the peak grew by a block: flan-t5-small AdamW
# 1.29x the system malloc's). Both threads stay alive, as XLA's pool threads do.
REUSE_ACROSS_THREADS = """
import ctypes, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
addresses, freed, done = [], threading.Event(), threading.Event()
def first():
  p = libc.malloc(size); ctypes.memset(p, 1, size); addresses.append(p); libc.free(p)
  freed.set(); done.wait()
def second():
  freed.wait(); p = libc.malloc(size); ctypes.memset(p, 2, size); addresses.append(p)
  libc.free(p); done.set()
threads = [threading.Thread(target=f) for f in (first, second)]
[t.start() for t in threads]; [t.join() for t in threads]
# jemalloc starts a large block at a random cache line of its first page.
print("same block" if addresses[0] >> 12 == addresses[1] >> 12 else "another block")
"""


@pytest.mark.skipif(not INSTALLED, reason="needs libjemalloc2 (make venv)")
def test_default_settings_reuse_a_block_freed_by_another_thread():
  env, note = host_memory.plan({**{k: v for k, v in os.environ.items()
                                   if k not in (host_memory.MARKER, "MALLOC_CONF",
                                                "LD_PRELOAD")},
                                "T5FORGE_MALLOC": "jemalloc"})
  assert note is None and env is not None
  proc = subprocess.run([sys.executable, "-c", REUSE_ACROSS_THREADS], env=env,
                        capture_output=True, text=True, check=True, timeout=60)
  assert proc.stdout.strip() == "same block", proc.stdout + proc.stderr


# A 256 MiB block, touched, then how much of its mapping the kernel backs with huge pages
# (AnonHugePages in /proc/self/smaps), read independently of host_memory.
HUGE_PAGES_OF_A_BLOCK = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
p = libc.malloc(256 << 20); ctypes.memset(p, 1, 256 << 20)
kib, inside = 0, False
for line in open("/proc/self/smaps"):
  head = line.split()[0]
  if "-" in head and not head.endswith(":"):
    lo, hi = (int(x, 16) for x in head.split("-"))
    inside = lo <= p < hi
  elif inside and head == "AnonHugePages:":
    kib = int(line.split()[1])
print(kib >> 10)
"""


def _huge_mib(env):
  proc = subprocess.run([sys.executable, "-c", HUGE_PAGES_OF_A_BLOCK], env=env,
                        capture_output=True, text=True, check=True, timeout=60)
  return int(proc.stdout)


def test_hugepages_backs_glibcs_large_blocks_with_huge_pages_where_the_kernel_allows():
  base = {k: v for k, v in os.environ.items()
          if k not in ("T5FORGE_MALLOC", host_memory.MARKER, "LD_PRELOAD", "GLIBC_TUNABLES")}
  env, note = host_memory.plan({**base, "T5FORGE_MALLOC": "hugepages"})
  if not HUGEPAGES:  # this kernel or C library cannot: a note, and auto does not choose it
    assert env is None and "glibc malloc with huge pages: " in note
    assert host_memory.plan(base)[0] is None or AUTO != "hugepages"
    return
  assert note is None
  assert _huge_mib(env) >= 192  # most of the 256 MiB block (its first and last 2 MiB may not)
  with open(host_memory.THP_ENABLED, encoding="utf-8") as f:
    if "[madvise]" in f.read():  # then only marked blocks get huge pages: the tunable's doing
      assert _huge_mib(base) == 0


@pytest.mark.parametrize("tunables,said", [
    ("glibc.malloc.hugetlb=1", "glibc malloc with transparent huge pages"),
    ("glibc.mem.tagging=0:glibc.malloc.hugetlb=2", "glibc malloc with huge pages (hugetlb=2)"),
    ("glibc.malloc.hugetlb=0", "system malloc (T5FORGE_MALLOC=hugepages: GLIBC_TUNABLES sets "
                               "glibc.malloc.hugetlb=0)"),
    ("glibc.malloc.hugetlb_x=1", "system malloc (T5FORGE_MALLOC=hugepages: GLIBC_TUNABLES "
                                 "does not set glibc.malloc.hugetlb)")])
def test_describe_reads_the_hugetlb_tunable_the_process_started_with(monkeypatch, tunables,
                                                                     said):
  # The user's own hugetlb value wins over ours (plan), so the startup line reports that one.
  monkeypatch.setenv("T5FORGE_MALLOC", "hugepages")
  monkeypatch.setenv(host_memory.MARKER, "hugepages")
  monkeypatch.setenv("GLIBC_TUNABLES", tunables)
  monkeypatch.setattr(host_memory, "loaded_allocator", lambda: None)  # whatever runs pytest
  monkeypatch.setattr(host_memory, "_applied", False)
  assert host_memory.describe() == f"host memory: {said}" + (
      " (T5FORGE_MALLOC=hugepages)" if said.startswith("glibc") else "")
