"""Two processes x two CPU devices on 127.0.0.1 with jax.distributed: they train one model
together, equal to one process with four devices; the checkpoint resumes in one process;
killing one process makes the other exit with an error in bounded time."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from t5forge.convert import native
from train_helpers import ROOT, host_devices, read_jsonl, wait_all, write_gin

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices):
  return host_devices(devices)


def _cmd(gin, model_dir, *extra):
  return [sys.executable, "-m", "t5forge", "train", f"--gin_file={gin}",
          f'--gin.MODEL_DIR="{model_dir}"', *extra]


def _two_processes(gin, model_dir, *extra, heartbeat=10):
  port = _port()
  return [subprocess.Popen(_cmd(gin, model_dir, *extra, f"--coordinator_address=127.0.0.1:{port}",
                                "--process_count=2", f"--process_index={i}",
                                f"--heartbeat_timeout_seconds={heartbeat}"),
                           cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for i in range(2)]


def _params(model_dir, step):
  _, params, _ = native.load(os.path.join(model_dir, f"checkpoint_{step}"))
  return jax.tree.map(np.asarray, params)


def test_two_processes_train_like_one_process_with_four_devices(tmp_path):
  gin = write_gin(tmp_path / "run.gin", steps=4, period=2)
  procs = _two_processes(gin, tmp_path / "two")
  outs = wait_all(procs)
  assert "training stopped at step 4" in outs[0]  # process 0 reports for both
  fp = [read_jsonl(tmp_path / "two" / f"batch_fingerprints.{i}.jsonl") for i in (0, 1)]
  assert fp[0] == fp[1] and len(fp[0]) == 4  # both read the same global batches
  one = subprocess.run(_cmd(gin, tmp_path / "one"), cwd=ROOT, env=_env(4), capture_output=True,
                       text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  # One model trained together: each process holds only its rows of every batch, so the
  # checkpoint both processes wrote equals the one-process run on the whole batch only
  # if both processes' gradients went into every update.
  # Sharded sums add in a different order in the two layouts. Adafactor divides each
  # update by the gradient's RMS, so for a token whose gradient is ~0 (an output-layer
  # column seen in no batch) rounding noise becomes an update of the learning rate's size:
  # allow such columns (under 0.1% of entries) to differ by a few hundredths.
  def close(a, b):
    off = ~np.isclose(a, b, rtol=1e-4, atol=1e-5)
    assert off.mean() < 1e-3 and np.abs(a - b).max() < 0.05, (off.mean(), np.abs(a - b).max())
  jax.tree.map(close, _params(tmp_path / "two", 4), _params(tmp_path / "one", 4))
  # The two-process checkpoint resumes in one process (one device) and continues the same
  # data stream: it ends where the one-process run, continued, ends.
  for d, env in ((tmp_path / "two", _env(1)), (tmp_path / "one", _env(4))):
    r = subprocess.run(_cmd(gin, d, "--gin.TRAIN_STEPS=6"), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {d}/checkpoint_4" in r.stdout
  jax.tree.map(close,
               _params(tmp_path / "two", 6), _params(tmp_path / "one", 6))


@pytest.mark.parametrize("victim", [1, 0])
def test_killing_one_process_stops_the_other(tmp_path, victim):
  gin = write_gin(tmp_path / "run.gin", steps=100000, period=100000, stats_period=1000)
  procs = _two_processes(gin, tmp_path / "m", heartbeat=5)
  try:
    # Training is under way (step 1 compiled and ran) once both processes logged the
    # fingerprint of their second batch: each is written before its step.
    fingerprints = [tmp_path / "m" / f"batch_fingerprints.{i}.jsonl" for i in (0, 1)]
    deadline = time.monotonic() + 300
    while not all(f.exists() and f.read_text().count("\n") >= 2 for f in fingerprints):
      assert time.monotonic() < deadline, "training did not start in 300 s"
      assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
      time.sleep(0.2)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=120)
    waited = time.time() - killed
    assert survivor.returncode != 0
    assert waited < 120, waited
    # JAX's coordination service names the failure (heartbeats stopped / service gone).
    assert re.search(r"coordination|distributed|heartbeat", err, re.I), err[-2000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
