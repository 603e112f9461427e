"""The bucket fixtures: real GCS and S3 emulators on 127.0.0.1.

The emulators themselves are `t5forge.testing.Emulator` (shared with the storage
benchmark): `gcp-storage-emulator` speaks the GCS JSON API (gcsfs, google-cloud-storage and
TensorStore's GCS driver reach it through STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL);
`moto[server]` speaks S3 (s3fs / botocore through AWS_ENDPOINT_URL). `Emulator.env()` is
the environment a subprocess needs to reach one.

- `bucket_env` (parametrized over "gs" and "s3"; narrow it with
  `@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)`): one emulator per scheme
  and pytest worker, started on first use and shared by the session, with a fresh bucket
  per test. A shared emulator refuses `stop`, `start`, `pause` and `resume`.
- `private_bucket_env` (same parameters): an emulator of the test's own, for the tests that
  take it down: `stop()` kills it (a network outage), `start()` brings it back on the same
  port with its data kept (GCS only: moto keeps buckets in memory, so S3 outages use
  `pause()` / `resume()`).
"""
from __future__ import annotations

import itertools
import os

import pytest

from t5forge import storage
from t5forge.testing import Emulator, emulator

_BUCKETS = itertools.count()


class SharedEmulator(Emulator):
  """An emulator the whole session uses: a test may not take it down."""

  def _refuse(self, *_a):
    raise RuntimeError("this emulator is shared by the session: use the private_bucket_env "
                       "fixture to stop, pause or restart one")

  stop = pause = resume = _refuse

  def start(self) -> None:
    if self.proc is not None:
      self._refuse()
    super().start()

  def shut_down(self) -> None:
    Emulator.stop(self)

  def check_alive(self) -> None:
    if self.proc is None or self.proc.poll() is not None:
      with open(self.log) as f:
        raise RuntimeError(f"the shared {self.scheme} emulator is gone: {f.read()[-2000:]}")


@pytest.fixture(scope="session")
def shared_emulators(tmp_path_factory):
  """scheme -> the session's started `SharedEmulator` for it (started on first use)."""
  started: dict[str, SharedEmulator] = {}

  def get(scheme: str) -> SharedEmulator:
    if scheme not in started:
      emu = SharedEmulator(scheme, str(tmp_path_factory.mktemp(f"shared-emu-{scheme}")))
      emu.start()
      started[scheme] = emu
    started[scheme].check_alive()
    return started[scheme]

  yield get
  for emu in started.values():
    emu.shut_down()


def _pointed_at(emu, monkeypatch):
  """Points this process at `emu`; -> (emu, URL of a new bucket of its own)."""
  for k, v in emu.env().items():
    monkeypatch.setenv(k, v)
  storage.reset_clients()
  return emu, emu.make_bucket(f"t5forge-{os.getpid()}-{next(_BUCKETS)}")


@pytest.fixture(params=["gs", "s3"])
def bucket_env(request, shared_emulators, monkeypatch):
  """(emulator, bucket URL) for each scheme, with this process's environment pointed at
  the session's emulator; a fresh bucket per test."""
  yield _pointed_at(shared_emulators(request.param), monkeypatch)
  storage.reset_clients()


@pytest.fixture(params=["gs", "s3"])
def private_bucket_env(request, tmp_path_factory, monkeypatch):
  """(emulator, bucket URL) as `bucket_env`, on an emulator of this test's own that it
  may stop, pause and restart."""
  root = tmp_path_factory.mktemp(f"emu-{request.param}")
  with emulator(request.param, str(root)) as emu:
    yield _pointed_at(emu, monkeypatch)
    storage.reset_clients()
