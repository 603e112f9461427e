"""Local GCS and S3 emulators for tests, started by the test itself on 127.0.0.1.

`gcp-storage-emulator` speaks the GCS JSON API (gcsfs, google-cloud-storage and
TensorStore's GCS driver use it through STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL);
`moto[server]` speaks S3 (s3fs / botocore through AWS_ENDPOINT_URL). Both are pinned in
the test extras. `Emulator.env()` is the environment a subprocess needs to reach one;
`Emulator.stop()` kills it (a network outage), `start()` brings it back on the same port
with its data kept.

    with gcs_emulator(tmp_path) as gcs:
      gcs.make_bucket("runs")
      subprocess.run([...], env={**os.environ, **gcs.env()})
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: str, timeout: float = 30.0) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"emulator exited ({proc.returncode}): {open(log).read()[-2000:]}")
    try:
      urllib.request.urlopen(url, timeout=1)
      return
    except urllib.error.HTTPError:
      return  # it answers
    except OSError:
      time.sleep(0.2)
  raise RuntimeError(f"emulator did not answer on {url}: {open(log).read()[-2000:]}")


class Emulator:
  """One emulator process. `scheme` is 'gs' or 's3'; `root` keeps its data (GCS) and log."""

  def __init__(self, scheme: str, root: str):
    self.scheme = scheme
    self.root = str(root)
    os.makedirs(self.root, exist_ok=True)
    self.port = _free_port()
    self.proc: subprocess.Popen | None = None
    self.log = os.path.join(self.root, f"{scheme}-emulator.log")

  @property
  def endpoint(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def env(self) -> dict[str, str]:
    """Variables that point t5forge (and the cloud clients) at this emulator."""
    if self.scheme == "gs":
      return {"STORAGE_EMULATOR_HOST": self.endpoint,
              "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
              "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
              "GOOGLE_CLOUD_PROJECT": "t5forge-test"}
    return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}

  def start(self) -> None:
    if self.scheme == "gs":
      cmd = [os.path.join(BIN, "gcp-storage-emulator"), "-d", os.path.join(self.root, "gcs-data"),
             "start", "--host=127.0.0.1",
             f"--port={self.port}"]
      probe = f"{self.endpoint}/storage/v1/b"
    else:
      # moto keeps its buckets in memory only; `stop()` + `start()` of an S3 emulator
      # loses them, so outage tests on S3 use `pause()` / `resume()` instead.
      cmd = [os.path.join(BIN, "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
      probe = f"{self.endpoint}/moto-api/"
    with open(self.log, "a") as log:
      self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    _wait(probe, self.proc, self.log)

  def stop(self) -> None:
    """Kills the emulator (SIGKILL): every request after this fails to connect."""
    if self.proc and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    self.proc = None

  def pause(self) -> None:
    """Stops the emulator answering (SIGSTOP) while keeping its state."""
    os.killpg(self.proc.pid, signal.SIGSTOP)

  def resume(self) -> None:
    os.killpg(self.proc.pid, signal.SIGCONT)

  def make_bucket(self, name: str) -> str:
    """Creates bucket `name`; returns its URL (`gs://name` / `s3://name`)."""
    with _env(self.env()):
      if self.scheme == "gs":
        from google.cloud import storage as gcs
        gcs.Client(project="t5forge-test").create_bucket(name)
      else:
        import boto3
        boto3.client("s3").create_bucket(Bucket=name)
    return f"{self.scheme}://{name}"


@contextlib.contextmanager
def _env(values: dict[str, str]):
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@contextlib.contextmanager
def emulator(scheme: str, root: str):
  """A started emulator, killed on exit."""
  emu = Emulator(scheme, root)
  emu.start()
  try:
    yield emu
  finally:
    emu.stop()


def _forget_clients():
  from t5forge import storage
  storage.reset_clients()


@pytest.fixture(params=["gs", "s3"])
def bucket_env(request, tmp_path_factory, monkeypatch):
  """(emulator, bucket URL) for each scheme, with this process's environment pointed at
  the emulator; a fresh bucket per test."""
  root = tmp_path_factory.mktemp(f"emu-{request.param}")
  with emulator(request.param, str(root)) as emu:
    for k, v in emu.env().items():
      monkeypatch.setenv(k, v)
    _forget_clients()
    name = f"t5forge-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    yield emu, emu.make_bucket(name)
    _forget_clients()
