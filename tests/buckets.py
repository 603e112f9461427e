"""The `bucket_env` fixture: a real GCS or S3 emulator on 127.0.0.1 per test.

The emulators themselves are `t5forge.testing.Emulator` (shared with the storage
benchmark): `gcp-storage-emulator` speaks the GCS JSON API (gcsfs, google-cloud-storage and
TensorStore's GCS driver reach it through STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL);
`moto[server]` speaks S3 (s3fs / botocore through AWS_ENDPOINT_URL). `Emulator.env()` is
the environment a subprocess needs to reach one; `Emulator.stop()` kills it (a network
outage), `start()` brings it back on the same port with its data kept (GCS only: moto keeps
buckets in memory, so S3 outages use `pause()` / `resume()`).
"""
from __future__ import annotations

import os
import time

import pytest

from t5forge import storage
from t5forge.testing import Emulator, emulator  # noqa: F401 - re-exported for tests


@pytest.fixture(params=["gs", "s3"])
def bucket_env(request, tmp_path_factory, monkeypatch):
  """(emulator, bucket URL) for each scheme, with this process's environment pointed at
  the emulator; a fresh bucket per test."""
  root = tmp_path_factory.mktemp(f"emu-{request.param}")
  with emulator(request.param, str(root)) as emu:
    for k, v in emu.env().items():
      monkeypatch.setenv(k, v)
    storage.reset_clients()
    name = f"t5forge-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    yield emu, emu.make_bucket(name)
    storage.reset_clients()
