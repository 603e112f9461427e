"""t5forge.storage against real GCS and S3 emulators started on 127.0.0.1."""
import os

import pytest

from t5forge import storage
from t5forge.errors import UserError



def test_write_read_list_and_versions(bucket_env, tmp_path):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run", "a.txt")
  storage.write_bytes(url, b"one")
  assert storage.read_bytes(url) == b"one"
  assert storage.read_range(url, 1, 2) == b"ne"
  assert storage.exists(url) and storage.isfile(url) and not storage.isdir(url)
  assert storage.isdir(storage.join(bucket, "run"))
  v1 = storage.info(url)["version"]
  storage.write_bytes(storage.join(bucket, "run", "sub", "b.txt"), b"two")
  assert storage.listdir(storage.join(bucket, "run")) == ["a.txt", "sub"]
  assert sorted(storage.walk_files(storage.join(bucket, "run"))) == ["a.txt", "sub/b.txt"]
  assert storage.glob(storage.join(bucket, "run", "*.txt")) == [url]
  # one local copy per version
  first = storage.local_copy(url)
  assert open(first, "rb").read() == b"one"
  assert storage.local_copy(url) == first
  storage.write_bytes(url, b"changed")
  assert storage.info(url)["version"] != v1
  second = storage.local_copy(url)
  assert second != first and open(second, "rb").read() == b"changed"
  tree = storage.local_copy(storage.join(bucket, "run"))
  assert open(os.path.join(tree, "sub", "b.txt"), "rb").read() == b"two"
  storage.rmtree(storage.join(bucket, "run"))
  assert storage.listdir(storage.join(bucket, "run")) == []


def test_objects_ending_in_a_line_break_keep_every_byte(bucket_env):
  """The GCS emulator's multipart reader once dropped a trailing CR (an OCDBT manifest
  ending in one then read as truncated): small uploads keep their last bytes exactly."""
  _, bucket = bucket_env
  for tail in (b"\r", b"\n", b"\r\n", b"\n\r", b"\r\r\n"):
    data = b"\x00\x01ocdbt" + tail
    storage.write_bytes(f"{bucket}/o", data)
    assert storage.read_bytes(f"{bucket}/o") == data, tail


def test_exclusive_create(bucket_env):
  emu, bucket = bucket_env
  url = storage.join(bucket, "lock")
  storage.write_bytes(url, b"mine", exclusive=True)
  with pytest.raises(FileExistsError):
    storage.write_bytes(url, b"theirs", exclusive=True)
  assert storage.read_bytes(url) == b"mine"


def test_missing_bucket_is_one_line(bucket_env):
  emu, bucket = bucket_env
  with pytest.raises(UserError, match=r"nope-missing-bucket: the bucket does not exist"):
    storage.check_bucket(f"{emu.scheme}://nope-missing-bucket/run")


def test_unknown_scheme():
  with pytest.raises(UserError, match=r"unknown storage scheme 'hdfs://'"):
    storage.is_remote("hdfs://namenode/run")
  with pytest.raises(UserError, match=r"write gs://"):
    storage.is_remote("gcs://bucket/run")
  assert not storage.is_remote("/tmp/x") and not storage.is_remote("relative/dir")


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_the_tries_setting_counts_every_request_the_client_sends(scheme, tmp_path,
                                                                 monkeypatch):
  """T5FORGE_STORAGE_RETRIES is the number of tries in all: an endpoint that answers every
  request with 503 sees exactly that many requests, not that many times the client's own
  retries (gcsfs's 6 tries per request stacked under ours: "failed after 3 tries" was 18)."""
  import socket
  import threading

  from t5forge.testing import Emulator
  listener = socket.create_server(("127.0.0.1", 0))
  requests = []

  def unavailable():
    while True:
      try:
        conn, _ = listener.accept()
      except OSError:  # closed: the test is over
        return
      with conn:
        head = b""
        while b"\r\n\r\n" not in head:
          chunk = conn.recv(65536)
          if not chunk:
            break
          head += chunk
        requests.append(head.split(b"\r\n", 1)[0].decode())
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                     b"Connection: close\r\n\r\n")

  threading.Thread(target=unavailable, daemon=True).start()
  endpoint = Emulator(scheme, str(tmp_path))
  endpoint.port = listener.getsockname()[1]
  for k, v in endpoint.env().items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "3")
  storage.reset_clients()
  try:
    with pytest.raises(storage.StorageError, match=rf"{scheme}://b/x: read failed after 3 tries"):
      storage.read_bytes(f"{scheme}://b/x")
  finally:
    listener.close()
    storage.reset_clients()
  assert len(requests) == 3, requests
