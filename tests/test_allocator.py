"""T5FORGE_MALLOC and the command line's restart with a preloaded allocator
(t5forge/host_memory.py): what plan() chooses, the note for a library that cannot be
loaded, and a real `python -m t5forge` that restarts once, in the same process, with the
library mapped and says so."""
import os
import subprocess
import sys

import pytest

from t5forge import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = [n for n in host_memory.AUTO_ORDER if host_memory.find_library(n)]


def _no_call(*_):
  raise AssertionError("must not look for or load a library")


def test_auto_preloads_the_first_library_found_with_its_settings():
  env, note = host_memory.plan({"T5FORGE_MALLOC": "auto", "LD_PRELOAD": "/x/other.so"},
                               find=lambda n: f"/x/lib{n}.so" if n == "jemalloc" else None,
                               loads=lambda _: None)
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
  assert host_memory.plan({}, find=lambda _: None, loads=_no_call) == (None, None)


@pytest.mark.parametrize("env", [{"T5FORGE_MALLOC": "system"}, {"T5FORGE_MALLOC": "keep"},
                                 {"T5FORGE_MALLOC": "auto", host_memory.MARKER: "tcmalloc"},
                                 {host_memory.MARKER: "system"}])
def test_system_keep_and_an_already_restarted_process_do_nothing(env):
  assert host_memory.plan(env, find=_no_call, loads=_no_call) == (None, None)


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
  f.write(f"{os.getpid()} {os.environ.get('T5FORGE_MALLOC_CHOSEN', '-')} {','.join(mapped) or '-'}\\n")
"""


def _run_cli(tmp_path, **env_changes):
  (tmp_path / "site").mkdir(exist_ok=True)
  (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
  log = tmp_path / "starts.log"
  log.unlink(missing_ok=True)
  env = {k: v for k, v in os.environ.items()
         if k not in ("T5FORGE_MALLOC", host_memory.MARKER, "LD_PRELOAD")}
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


@pytest.mark.skipif(not INSTALLED, reason="needs libjemalloc2 (make venv)")
def test_the_command_restarts_once_with_the_allocator_mapped_and_says_so(tmp_path):
  proc, out, err, starts = _run_cli(tmp_path)
  name = INSTALLED[0]
  # Same pid (execve), first without, then with the library mapped; no third start.
  assert starts == [[str(proc.pid), "-", "-"], [str(proc.pid), name, f"lib{name}"]], starts
  assert f"host memory: {name} (T5FORGE_MALLOC=auto)" in out.splitlines()
  assert proc.returncode == 2  # the error's status survives the restart
  assert len(err.strip().splitlines()) == 1 and "missing.gin" in err, err


def test_the_command_with_system_or_a_bad_library_does_not_restart(tmp_path):
  proc, out, _, starts = _run_cli(tmp_path, T5FORGE_MALLOC="system")
  assert starts == [[str(proc.pid), "-", "-"]]
  assert "host memory: system malloc (T5FORGE_MALLOC=system)" in out.splitlines()
  bogus = tmp_path / "libjemalloc.so.2"
  bogus.write_text("not a shared library\n")
  proc, out, err, starts = _run_cli(tmp_path, T5FORGE_MALLOC=str(bogus))
  assert starts == [[str(proc.pid), "-", "-"]]  # no restart
  note, error = err.strip().splitlines()  # the note, then train's own error
  assert note.startswith(f"t5forge: note: T5FORGE_MALLOC={bogus}: {bogus} cannot be loaded (")
  assert note.endswith("; using the system allocator")
  assert error.startswith("t5forge: error: ") and "missing.gin" in error
  assert (f"host memory: system malloc (T5FORGE_MALLOC={bogus}: the chosen library could not "
          "be loaded)") in out.splitlines()


def test_bad_value_is_a_one_line_cli_error():
  env = dict(os.environ, T5FORGE_MALLOC="tcmaloc")
  proc = subprocess.run([sys.executable, "-m", "t5forge", "vocab", "--help"], env=env,
                        capture_output=True, text=True, check=False, cwd=ROOT)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "t5forge: error: T5FORGE_MALLOC='tcmaloc': expected one of auto, tcmalloc, jemalloc, "
      "keep, system or the path of a malloc library (auto: jemalloc where installed)"]


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
  env, note = host_memory.plan({k: v for k, v in os.environ.items()
                                if k not in ("T5FORGE_MALLOC", host_memory.MARKER,
                                             "MALLOC_CONF", "LD_PRELOAD")})
  assert note is None and env is not None
  proc = subprocess.run([sys.executable, "-c", REUSE_ACROSS_THREADS], env=env,
                        capture_output=True, text=True, check=True, timeout=60)
  assert proc.stdout.strip() == "same block", proc.stdout + proc.stderr
