"""The keys and rate limits of `t5forge serve` (t5forge/serve/auth.py) on their own: a key
file's names, comments and errors (each naming the file and line), constant-time lookup by
name, the token buckets on a controlled clock, and the start-up errors of the CLI for a
malformed key file or a limit that is not a positive number (one `t5forge: error:` line,
before any checkpoint is opened)."""
import subprocess
import sys

import pytest

from t5forge.errors import UserError
from t5forge.serve import api, auth
from train_helpers import ROOT, error_line


def _file(tmp_path, text: str) -> str:
  path = tmp_path / "keys.txt"
  path.write_text(text, encoding="utf-8")
  return str(path)


def test_key_file_names_and_lookup(tmp_path):
  path = _file(tmp_path, "# team keys\n\nalice:sk-a1\n  bob : sk-b2  \n# gone:sk-old\n")
  assert auth.read_key_file(path) == {"alice": "sk-a1", "bob": "sk-b2"}
  keys = auth.load_keys("sk-d0", path)
  assert keys.names == ("default", "alice", "bob")
  assert keys.identify("Bearer sk-a1") == "alice" and keys.identify("bearer  sk-b2") == "bob"
  assert keys.identify("Bearer sk-d0") == "default"
  for bad in (None, "", "Bearer", "Bearer sk-a", "Bearer sk-a1x", "sk-a1", "Basic sk-a1",
              "Bearer sk-old"):
    assert keys.identify(bad) is None, bad
  assert auth.load_keys(None, None) is None


@pytest.mark.parametrize("text,line,words", [
    ("alice:sk-1\nbob sk-2\n", 2, "a colon"),
    ("alice:sk-1\n:sk-2\n", 2, "a name"),
    ("\n\nalice:\n", 3, "a key"),
    ("alice:sk-1\n# c\nalice:sk-2\n", 3, "already given on line 1"),
    ("alice:sk-1\nbob:sk-1\n", 2, "already given on line 1"),
    ("al ice:sk-1\n", 1, "letters, digits"),
    ("alice:sk 1\n", 1, "whitespace"),
])
def test_key_file_errors_name_the_line(tmp_path, text, line, words):
  path = _file(tmp_path, text)
  with pytest.raises(UserError) as e:
    auth.read_key_file(path)
  msg = str(e.value)
  assert f"{path}:{line}:" in msg and words in msg and "\n" not in msg, msg
  assert "sk-" not in msg, msg  # a key is never repeated, even in an error


def test_key_file_as_a_whole(tmp_path):
  with pytest.raises(UserError, match="holds no `name:key` line"):
    auth.read_key_file(_file(tmp_path, "# nothing\n\n"))
  with pytest.raises(UserError, match="No such file"):
    auth.read_key_file(str(tmp_path / "missing.txt"))
  with pytest.raises(UserError, match="'default'"):
    auth.load_keys("sk-x", _file(tmp_path, "default:sk-y\n"))
  with pytest.raises(UserError, match="also a key of --api_key_file"):
    auth.load_keys("sk-y", _file(tmp_path, "alice:sk-y\n"))


@pytest.mark.parametrize("text", ["0", "-1", "abc", "nan", "inf", ""])
def test_limits_must_be_positive_numbers(text):
  with pytest.raises(UserError, match=r"--requests_per_second takes a positive number"):
    auth.positive("--requests_per_second", text)
  assert auth.positive("--requests_per_second", "2.5") == 2.5
  assert auth.positive("--requests_per_second", None) is None


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def _refused(limiter, name) -> api.ApiError:
  with pytest.raises(api.ApiError) as e:
    limiter.admit(name)
  assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
  return e.value


def test_request_bucket_per_key():
  clock = _Clock()
  lim = auth.Limiter(requests_per_second=2, clock=clock)
  lim.admit("alice")
  lim.admit("alice")  # a burst of one second's worth
  e = _refused(lim, "alice")
  assert e.type == "requests" and e.headers == {"Retry-After": "1"}
  assert "'alice'" in e.message and "--requests_per_second" in e.message
  lim.admit("bob")  # another key has its own bucket
  clock.now += 0.5  # refills one request
  lim.admit("alice")
  _refused(lim, "alice")
  # Below one request per second: Retry-After is the wait for a whole request.
  slow = auth.Limiter(requests_per_second=0.25, clock=clock)
  slow.admit(None)
  assert _refused(slow, None).headers == {"Retry-After": "4"}


def test_token_bucket_charges_prompt_and_output():
  clock = _Clock()
  lim = auth.Limiter(tokens_per_minute=60, clock=clock)  # one token a second
  lim.admit("alice")
  lim.charge("alice", 50)  # prompt, up front
  lim.admit("alice")  # 10 left: still served
  lim.charge("alice", 15)  # output at the end: 5 in debt
  e = _refused(lim, "alice")
  # Empty until it holds one token again: 6 s.
  assert e.type == "tokens" and e.headers == {"Retry-After": "6"}, (e.type, e.headers)
  assert "--tokens_per_minute" in e.message
  lim.admit("bob")
  clock.now += 5.5
  _refused(lim, "alice")
  clock.now += 1
  lim.admit("alice")
  clock.now += 1000  # refills to a minute's worth at most
  lim.charge("alice", 61)
  _refused(lim, "alice")


def _serve(*args):
  return subprocess.run([sys.executable, "-m", "t5forge", "serve", "--checkpoint",
                         "no-such-checkpoint", "--port", "0", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_bad_startup_settings_are_one_line(tmp_path):
  path = _file(tmp_path, "alice:sk-secret-1\n\nbob=sk-secret-2\n")
  line = error_line(_serve("--api_key_file", path))
  assert f"{path}:3:" in line and "name:key" in line and "sk-secret" not in line, line
  for flag, value in (("--requests_per_second", "0"), ("--tokens_per_minute", "-5"),
                      ("--body_timeout_s", "soon")):
    line = error_line(_serve(flag, value))
    assert f"{flag} takes a positive number, got {value!r}" in line, line
