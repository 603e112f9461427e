"""`t5forge serve` subprocesses for the server tests: a tiny T5 checkpoint that carries the
bundled SentencePiece vocabulary, a server on a free 127.0.0.1 port, its URL from the one
`ready at` line."""
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

from train_helpers import ROOT

BUNDLED_SPM = os.path.join(ROOT, "t5forge", "data", "bundled", "bible_en_es_8k.model")
# Few, small buckets: start-up compiles in seconds on CPU.
FAST_FLAGS = ["--max_batch_size", "8", "--batch_buckets", "1,8", "--length_buckets", "32",
              "--decode_buckets", "8", "--warmup", "greedy"]


def tiny_checkpoint(path: str) -> str:
  """A random t5_1_1.tiny saved with Model.save (the checkpoint carries its vocabulary)."""
  import t5forge  # pylint: disable=import-outside-toplevel
  from t5forge.data.vocab import SentencePieceVocabulary  # pylint: disable=import-outside-toplevel
  vocab = SentencePieceVocabulary(BUNDLED_SPM, extra_ids=100)
  t5forge.init("t5_1_1.tiny", vocabulary=vocab, vocab_size=vocab.vocab_size, seed=1).save(path)
  return path


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """A running `t5forge serve`; `.url`, `.proc`, `.output()` (everything it printed).

  wait=False returns as soon as the process started (on a port chosen here, so `.url` is
  known before the ready line); `.wait_ready()` then waits for that line."""

  def __init__(self, checkpoint: str, *flags: str, wait: bool = True, timeout: float = 300,
               env: dict | None = None, cwd: str = ROOT):
    self.port = free_port()
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "t5forge", "serve", "--checkpoint", checkpoint, "--port",
         str(self.port), *flags], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env)
    self.url = f"http://127.0.0.1:{self.port}"
    self._lines: list[str] = []
    self._ready = threading.Event()
    self.ready_line = None
    threading.Thread(target=self._read, daemon=True).start()
    if wait:
      self.wait_ready(timeout)

  def wait_ready(self, timeout: float = 300) -> None:
    if not self._ready.wait(timeout) or self.ready_line is None:
      self.proc.kill()
      raise AssertionError(f"t5forge serve not ready in {timeout} s:\n{self.output()[-3000:]}")

  def _read(self):
    for line in self.proc.stdout:
      self._lines.append(line)
      m = re.search(r"ready at (http://\S+)", line)
      if m:
        assert m.group(1) == self.url, line
        self.ready_line = line
        self._ready.set()
    self._ready.set()  # exited

  def output(self) -> str:
    return "".join(self._lines)

  def stop(self, timeout: float = 60) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    return self.proc.returncode


def request(url: str, path: str, body=None, *, headers=None, method=None, raw: bytes | None = None,
            timeout: float = 120):
  """-> (status, headers, parsed JSON or text) without raising on 4xx/5xx."""
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


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)
