"""Tiny fixtures shared by the tests and the benchmarks: a random checkpoint that carries the
bundled vocabulary, and `python -m t5forge serve` as a child process.

    path = testing.tiny_checkpoint("/tmp/tiny")            # t5_1_1.tiny, seed 1, 8,100 ids
    with testing.Server(path, *testing.FAST_FLAGS) as server:   # ready: compiled, listening
      status, headers, body = testing.request(server.url, "/v1/completions",
                                              {"prompt": "God is love.", "max_tokens": 4})

A server listens on 127.0.0.1 on a free port chosen here (so `.url` is known before it is
ready); it is ready when it prints its one `ready at URL` line, which `t5forge serve` prints
once /health would answer 200. Everything it prints is kept (`.output()`, and a log file if
asked) and shown when it fails to become ready.

`Emulator` runs a GCS (`gcp-storage-emulator`) or S3 (`moto[server]`) emulator on
127.0.0.1 for the bucket tests and the storage benchmark; both are in the test extras.

    with testing.emulator("gs", "/tmp/emu") as gcs:
      url = gcs.make_bucket("runs")                 # gs://runs
      subprocess.run([...], env={**os.environ, **gcs.env()})

This module imports only the standard library at module level (never pytest, torch or
transformers); building a checkpoint imports t5forge's models when called.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

BUNDLED_VOCABULARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bundled",
                                  "bible_en_es_8k.model")
EXTRA_IDS = 100  # T5's sentinels, appended to the bundled SentencePiece model's 8,000 pieces
# Few, small buckets: start-up compiles in seconds on CPU.
FAST_FLAGS = ["--max_batch_size", "8", "--batch_buckets", "1,8", "--length_buckets", "32",
              "--decode_buckets", "8", "--warmup", "greedy"]


# -- models ---------------------------------------------------------------------------------
def bundled_vocabulary():
  """The bundled SentencePiece vocabulary with T5's 100 sentinels (8,100 ids)."""
  from t5forge.data.vocab import SentencePieceVocabulary  # noqa: PLC0415 (the harness imports no jax until a fixture needs it)
  return SentencePieceVocabulary(BUNDLED_VOCABULARY, extra_ids=EXTRA_IDS)


def checkpoint_with_vocabulary(path: str, preset: str, seed: int) -> str:
  """A random-init `preset` whose vocabulary is the bundled one, saved with `Model.save`
  (the checkpoint carries its vocabulary, as `t5forge serve` needs); returns `path`."""
  import t5forge  # noqa: PLC0415 (as above)
  vocab = bundled_vocabulary()
  t5forge.init(preset, vocabulary=vocab, vocab_size=vocab.vocab_size, seed=seed).save(path)
  return path


def eos_prone(name: str, *, vocab_size: int = 256, seed: int = 1, vocabulary=None):
  """A random-init `name` (a preset) whose EOS logit nearly copies the token its greedy
  decodes pick most: its outputs end at many different lengths, as a trained model's do
  (random weights alone rarely emit EOS). -> a `t5forge.Model`."""
  import numpy as np  # noqa: PLC0415 (as above)

  import t5forge  # noqa: PLC0415 (as above)
  m = t5forge.init(name, vocab_size=vocab_size, seed=seed, vocabulary=vocabulary)
  x = np.zeros((4, 16), np.int32)
  x[:, :8] = np.random.default_rng(0).integers(2, vocab_size, (4, 8))
  x[:, 8] = 1
  tokens, _ = m.predict(x, max_decode_length=24)
  counts = np.bincount(tokens[:, 2:].ravel(), minlength=vocab_size)
  counts[:2] = 0
  params = m.params
  dec = params["decoder"]
  if "logits_dense" in dec:
    kernel = dec["logits_dense"]["kernel"]
    kernel = kernel.at[:, 1].set(kernel[:, int(counts.argmax())] * 1.01)
    m.params = {**params, "decoder": {**dec, "logits_dense": {"kernel": kernel}}}
  else:  # a tied embedding: EOS's row nearly copies the frequent token's
    owner = dec if "token_embedder" in dec else params
    table = owner["token_embedder"]["embedding"]
    table = table.at[1].set(table[int(counts.argmax())] * 1.01)
    owner = {**owner, "token_embedder": {"embedding": table}}
    m.params = ({**params, "decoder": owner} if "token_embedder" in dec
                else {**params, "token_embedder": owner["token_embedder"]})
  return m


def tiny_checkpoint(path: str) -> str:
  """A random t5_1_1.tiny (seed 1) with the bundled vocabulary, saved at `path`."""
  return checkpoint_with_vocabulary(path, "t5_1_1.tiny", seed=1)


# -- the server -----------------------------------------------------------------------------
class ServerNotReady(RuntimeError):
  """`t5forge serve` exited or timed out before its ready line; the message ends with what
  it printed."""


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """A running `python -m t5forge serve --checkpoint CHECKPOINT --host 127.0.0.1 --port P
  *flags`; `.url`, `.port`, `.argv`, `.proc`, `.ready_line`, `.output()` (all it printed).

  Args:
    checkpoint: what `--checkpoint` gets (relative to `cwd` when relative).
    *flags: more flags of `t5forge serve`.
    wait: wait for the ready line here; wait=False returns once the process started,
      and `.wait_ready()` waits later.
    timeout: seconds to wait for the ready line (start-up compiles every bucket first).
    env, cwd: the child's environment and directory (default: this process's).
    log_path: also write everything the server prints to this file.
    own_session: start it in its own session, so that a ctrl-C in the terminal reaches
      only this process (which then stops the server with SIGTERM, via `stop`).
    command: what runs `serve ...` (default `python -m t5forge`): e.g. `python -c CODE`
      whose CODE patches something in, then calls `t5forge.cli.main.main(sys.argv[1:])`.

  As a context manager, leaving it stops the server (`stop`).
  """

  def __init__(self, checkpoint: str, *flags: str, wait: bool = True, timeout: float = 300,
               env: dict | None = None, cwd: str | None = None, log_path: str | None = None,
               own_session: bool = False, command: list[str] | None = None):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.argv = [*(command or [sys.executable, "-m", "t5forge"]), "serve", "--checkpoint",
                 checkpoint, "--host", "127.0.0.1", "--port", str(self.port), *flags]
    self.log_path = log_path
    self.ready_line: str | None = None
    self.ready_s: float | None = None  # seconds from the start to the ready line
    self._ready_url: str | None = None
    self._lines: list[str] = []
    self._ready = threading.Event()
    self._log = None
    if log_path:
      os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
      self._log = open(log_path, "w", encoding="utf-8")
    self._start = time.perf_counter()
    self.proc = subprocess.Popen(
        self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=own_session)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    if wait:
      self.wait_ready(timeout)

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._lines.append(line)
      if self._log is not None:
        self._log.write(line)
        self._log.flush()
      m = re.search(r"ready at (http://\S+)", line)
      if m and self.ready_line is None:
        self.ready_line, self._ready_url = line, m.group(1)
        self.ready_s = time.perf_counter() - self._start
        self._ready.set()
    self._ready.set()  # it exited

  def wait_ready(self, timeout: float = 300) -> float:
    """Waits for the ready line; returns the seconds from the start to it. Kills the
    server and raises ServerNotReady (with what it printed) when it exits or times out."""
    if not self._ready.wait(timeout) or self.ready_line is None:
      code = None
      if self._ready.is_set():  # its output ended: it exited, or is about to
        try:
          code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
          pass
      self.proc.kill()
      self.proc.wait()
      why = (f"exited with {code}" if code is not None else f"not ready in {timeout:.0f} s")
      raise ServerNotReady(f"t5forge serve {why}:\n{self.output()[-3000:]}")
    if self._ready_url != self.url:
      self.stop()
      raise ServerNotReady(f"t5forge serve announced another address than {self.url}: "
                           f"{self.ready_line}")
    return self.ready_s

  def output(self) -> str:
    """Everything the server printed so far (stdout and stderr)."""
    return "".join(self._lines)

  def stop(self, timeout: float = 60) -> int:
    """SIGTERM (it finishes the requests in flight), SIGKILL after `timeout` s; -> the
    exit code."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._reader.join(5)
    if self._log is not None and not self._log.closed:
      self._log.close()
    return self.proc.returncode

  def __enter__(self) -> Server:
    return self

  def __exit__(self, *exc) -> bool:
    self.stop()
    return False


def request(url: str, path: str, body=None, *, headers=None, method=None, raw: bytes | None = None,
            timeout: float = 120):
  """One HTTP request; -> (status, headers with lower-case names, parsed JSON or text),
  without raising on 4xx/5xx. `body` is sent as JSON, `raw` as given."""
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  hdrs = {"Content-Type": "application/json"} if data is not None else {}
  hdrs.update(headers or {})
  req = urllib.request.Request(url + path, data=data, headers=hdrs, method=method)
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      status, h, payload = r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
  except urllib.error.HTTPError as e:
    status, h, payload = e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
  try:
    return status, h, json.loads(payload)
  except ValueError:
    return status, h, payload.decode()


def wait_for(predicate, timeout: float = 30, what: str = "condition",
             interval: float = 0.05) -> None:
  """Polls `predicate` every `interval` s until it is true; TimeoutError after `timeout`
  s."""
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() >= deadline:
      raise TimeoutError(f"timed out waiting for {what} ({timeout:g} s)")
    time.sleep(interval)


# ------------------------------------------------------------ storage emulators

def _wait_answer(url: str, proc: subprocess.Popen, log: str, timeout: float = 30.0) -> None:
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
    self.port = free_port()
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
      cmd = [sys.executable, "-c", "from t5forge.testing import run_gcs_emulator; "
             "run_gcs_emulator()", "-d", os.path.join(self.root, "gcs-data"), "start",
             "--host=127.0.0.1", f"--port={self.port}"]
      probe = f"{self.endpoint}/storage/v1/b"
    else:
      # moto keeps its buckets in memory only; `stop()` + `start()` of an S3 emulator
      # loses them, so outage tests on S3 use `pause()` / `resume()` instead.
      cmd = [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
      probe = f"{self.endpoint}/moto-api/"
    with open(self.log, "a") as log:
      self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    _wait_answer(probe, self.proc, self.log)

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
    with _environ(self.env()):
      if self.scheme == "gs":
        from google.cloud import storage as gcs  # noqa: PLC0415 (the test extras' client)
        gcs.Client(project="t5forge-test").create_bucket(name)
      else:
        import boto3  # noqa: PLC0415
        boto3.client("s3").create_bucket(Bucket=name)
    return f"{self.scheme}://{name}"


@contextlib.contextmanager
def _environ(values: dict[str, str]):
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


def run_gcs_emulator() -> None:
  """`gcp-storage-emulator` (arguments from sys.argv) with GCS's generation semantics.

  The emulator keeps a generation per object but neither sends it with a download
  (`x-goog-generation`) nor honours the preconditions (`ifGenerationMatch`,
  `ifGenerationNotMatch`). Real GCS does both, and TensorStore relies on them: it caches a
  read by its generation and writes OCDBT manifests conditionally on it, so against the
  bare emulator a checkpoint save fails now and then with "Malformed StorageGeneration",
  and an exclusive create (a lock) overwrites. This adds both, for single-request uploads
  (media and multipart, which is what TensorStore, gcsfs and google-cloud-storage send for
  small objects), downloads and deletes (a lock's conditional delete), before the
  emulator's routes are built.
  """
  import threading as _threading  # noqa: PLC0415 - the emulator's process only
  from http import HTTPStatus  # noqa: PLC0415

  from gcp_storage_emulator import storage as emu_storage  # noqa: PLC0415
  from gcp_storage_emulator.exceptions import NotFound  # noqa: PLC0415
  from gcp_storage_emulator.handlers import objects  # noqa: PLC0415

  local = _threading.local()

  class _ConditionNotMet(Exception):
    pass

  def generation_of(storage, bucket, name):
    try:
      return int(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
      return 0

  def condition(query, key):
    values = query.get(key)
    return int(values[0]) if values else None

  original_create = emu_storage.Storage.create_file

  def create_file(self, bucket_name, file_name, content, file_obj, *args, **kwargs):
    match = getattr(local, "if_generation_match", None)
    if match is not None and generation_of(self, bucket_name, file_name) != match:
      raise _ConditionNotMet()
    return original_create(self, bucket_name, file_name, content, file_obj, *args, **kwargs)

  emu_storage.Storage.create_file = create_file

  # Tests kill the emulator (SIGKILL) to cut the network and start it again on the same
  # data; its plain writes left a half-written `.meta` (then it cannot start: "Expecting
  # value") when the kill came mid-write. Written whole or not at all, as GCS does.
  def write_bytes(self, rel, content):
    if self._root is None:
      return original_write(self, rel, content)
    path = self._disk_path(self._norm(rel))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_threading.get_ident()}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)
    return None

  store = emu_storage._FileStore  # noqa: SLF001 (the emulator's file store: no public hook)
  original_write, store.write_bytes = store.write_bytes, write_bytes
  original_insert, original_download = objects.insert, objects.download

  def failed_precondition(response):
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": "At least one of the pre-conditions "
                             "you specified did not hold.", "errors": [
                                 {"reason": "conditionNotMet"}]}})

  def insert(request, response, storage, *args, **kwargs):
    local.if_generation_match = condition(request.query, "ifGenerationMatch")
    try:
      return original_insert(request, response, storage, *args, **kwargs)
    except _ConditionNotMet:
      failed_precondition(response)
    finally:
      local.if_generation_match = None

  def download(request, response, storage, *args, **kwargs):
    bucket, name = request.params["bucket_name"], request.params["object_id"]
    generation = generation_of(storage, bucket, name)
    match = condition(request.query, "ifGenerationMatch")
    not_match = condition(request.query, "ifGenerationNotMatch")
    if generation and match is not None and match != generation:
      return failed_precondition(response)
    if generation and not_match is not None and not_match == generation:
      response.status = HTTPStatus.NOT_MODIFIED
      response["x-goog-generation"] = str(generation)
      return None
    original_download(request, response, storage, *args, **kwargs)
    if generation and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
      response["x-goog-generation"] = str(generation)
      response["x-goog-metageneration"] = "1"
    return None

  original_delete = objects.delete

  def delete(request, response, storage, *args, **kwargs):
    match = condition(request.query, "ifGenerationMatch")
    if match is not None:
      generation = generation_of(storage, request.params["bucket_name"],
                                 request.params["object_id"])
      if not generation:
        response.status = HTTPStatus.NOT_FOUND
        return None
      if generation != match:
        return failed_precondition(response)
    return original_delete(request, response, storage, *args, **kwargs)

  # (one request at a time: the emulator's HTTPServer is not threaded, so a condition
  # checked here still holds when the handler writes)
  objects.insert, objects.download, objects.delete = insert, download, delete
  _exact_multipart_uploads()
  from gcp_storage_emulator.__main__ import main  # noqa: PLC0415 - builds routes from `objects`
  main(sys.argv[1:])


def _exact_multipart_uploads() -> None:
  """The emulator reads a multipart upload with `email`'s parser, which takes a trailing
  CR of the content for a line end: an object ending in b"\\r" lost its last byte (an
  OCDBT manifest now and then, by its checksum; the checkpoint then read as truncated).
  Here the body is split on its boundary as RFC 2046 says: the CRLF before each delimiter
  belongs to the delimiter, every other byte to the part."""
  import base64  # noqa: PLC0415 - the emulator's process only
  import email.message  # noqa: PLC0415
  import json as _json  # noqa: PLC0415

  from gcp_storage_emulator import server  # noqa: PLC0415

  original = server._read_data  # noqa: SLF001 - the function the emulator's handlers call

  def read_data(request_handler, query):
    ctype = request_handler.headers.get("Content-Type") or ""
    if not ctype.startswith("multipart/related"):
      return original(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)  # noqa: SLF001
    if not raw:
      return None
    header = email.message.Message()
    header["Content-Type"] = ctype
    parts = []
    chunks = raw.split(b"--" + header.get_param("boundary").encode())[1:-1]
    # Clients end lines with CRLF, or with LF alone (gcsfs): the first delimiter's says which.
    eol = b"\r\n" if chunks and chunks[0].startswith(b"\r\n") else b"\n"
    for part in chunks:
      head, _, body = part.removeprefix(eol).partition(eol + eol)
      body = body.removesuffix(eol)
      fields = dict(line.split(":", 1) for line in head.decode().splitlines() if ":" in line)
      fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
      if fields.get("content-transfer-encoding", "").lower() == "base64":
        body = base64.b64decode(body)
      parts.append((fields, body))
    return {"meta": _json.loads(parts[0][1]), "content": parts[1][1],
            "content-type": parts[1][0].get("content-type", "application/octet-stream")}

  server._read_data = read_data  # noqa: SLF001
