"""Who may call `t5forge serve`, and how often: named API keys (--api_key, --api_key_file)
and per-key rate limits (--requests_per_second, --tokens_per_minute).

    Authorization: Bearer KEY -> Keys.identify -> the key's NAME -> Limiter.admit(NAME)
    -> the route -> Limiter.charge(NAME, prompt tokens) ... charge(NAME, output tokens)

Every route but those on `OPEN` needs a key once keys are configured (app.py's guard).
Past this module a key is only ever its NAME: logs, metrics (`t5forge_key_requests_total
{key=NAME}`) and error messages never hold the key itself. Keys are compared as SHA-256
digests with `hmac.compare_digest` against every configured key, so neither the time
taken nor an early exit tells a caller how much of a key was right.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
import threading
import time

from t5forge.errors import UserError
from t5forge.serve import api

# No key needed: liveness, readiness, and the static page (which asks for the key itself).
OPEN = frozenset({"/livez", "/readyz", "/health", "/"})
DEFAULT_NAME = "default"  # the name of --api_key's key
ANONYMOUS = "anonymous"   # whose buckets the rate limits fill when no keys are configured
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _digest(key: str) -> bytes:
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Keys:
  """The configured keys by NAME (`named`: name -> key); `identify` maps an Authorization
  header to a NAME, or None."""

  def __init__(self, named: dict[str, str]):
    if not named:
      raise ValueError("Keys needs at least one key")
    self.names = tuple(named)
    self._digests = [(name, _digest(key)) for name, key in named.items()]

  def identify(self, authorization: str | None) -> str | None:
    """The NAME of the key in `Authorization: Bearer KEY`; None for no header, another
    scheme, or a key that is not configured."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
      return None
    got = _digest(token.strip())
    found = None
    for name, want in self._digests:  # no early exit: every key costs the same
      if hmac.compare_digest(got, want):
        found = name
    return found


def read_key_file(path: str) -> dict[str, str]:
  """`name:key` lines of `path` (blank lines and `#` comments allowed) -> {name: key}; a
  malformed line, or a name or key given twice, is a UserError naming `path:line`."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise UserError(f"--api_key_file {path}: {e.strerror}") from None
  except UnicodeDecodeError:
    raise UserError(f"--api_key_file {path}: not UTF-8 text") from None
  named: dict[str, str] = {}
  seen_name: dict[str, int] = {}
  seen_key: dict[bytes, int] = {}
  for number, raw in enumerate(lines, 1):
    line = raw.strip()
    if not line or line.startswith("#"):
      continue
    where = f"--api_key_file {path}:{number}"
    name, sep, key = line.partition(":")
    name, key = name.strip(), key.strip()
    if not sep or not name or not key:
      raise UserError(f"{where}: expected `name:key` (one key a line), got a line without "
                      f"{'a name' if sep and not name else 'a key' if sep else 'a colon'}")
    if not _NAME.fullmatch(name):
      raise UserError(f"{where}: the name {name!r} may use only letters, digits, `_`, `.` "
                      "and `-` (at most 64): it becomes a metrics label")
    if any(c.isspace() for c in key):
      raise UserError(f"{where}: the key of {name!r} holds whitespace; keys are one word")
    if name in seen_name:
      raise UserError(f"{where}: the name {name!r} is already given on line "
                      f"{seen_name[name]}; each key needs its own name")
    d = _digest(key)
    if d in seen_key:
      raise UserError(f"{where}: the key of {name!r} is the key already given on line "
                      f"{seen_key[d]}; give each client its own key")
    seen_name[name], seen_key[d] = number, number
    named[name] = key
  if not named:
    raise UserError(f"--api_key_file {path}: holds no `name:key` line")
  return named


def load_keys(api_key: str | None, api_key_file: str | None) -> Keys | None:
  """The keys of --api_key (named "default") and --api_key_file; None when neither is
  given (then every route is open)."""
  named = read_key_file(api_key_file) if api_key_file else {}
  if api_key is not None:
    if not api_key.strip() or any(c.isspace() for c in api_key):
      raise UserError("--api_key must be one non-empty word")
    if DEFAULT_NAME in named:
      raise UserError(f"--api_key_file {api_key_file} names a key {DEFAULT_NAME!r}, the name "
                      "of --api_key's; rename it or drop --api_key")
    if any(hmac.compare_digest(_digest(api_key), _digest(k)) for k in named.values()):
      raise UserError(f"--api_key is also a key of --api_key_file {api_key_file}; drop one")
    named = {DEFAULT_NAME: api_key, **named}
  return Keys(named) if named else None


def positive(flag: str, text: str | None) -> float | None:
  """A rate-limit flag's value: None when not given, else a positive finite number; any
  other value is a UserError naming `flag`."""
  if text is None:
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise UserError(f"{flag} takes a positive number, got {text!r}")
  return value


@dataclasses.dataclass
class _Bucket:
  """A token bucket of `capacity`, refilled at `rate` per second. Charges made after the
  fact (output tokens) may take it below zero: it then refuses until refilled past it."""
  rate: float
  capacity: float
  level: float
  at: float

  def refill(self, now: float) -> None:
    self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
    self.at = now

  def wait_s(self, need: float) -> float:
    """Seconds until the bucket holds `need` (0 if it does now)."""
    return max(0.0, (need - self.level) / self.rate)


class Limiter:
  """Per-NAME token buckets: `requests_per_second` R (bursts of up to max(1, R)
  requests) and `tokens_per_minute` T (prompt + output tokens; up to max(1, T) held).

  `admit` takes one request, or raises the 429 (+ Retry-After, whole seconds) of the
  bucket that is empty; the token bucket is only checked there (a request in flight is
  never cut short), `charge` fills it in as prompt and output tokens are known."""

  def __init__(self, requests_per_second: float | None = None,
               tokens_per_minute: float | None = None, *, metrics=None, clock=time.monotonic):
    self.requests_per_second, self.tokens_per_minute = requests_per_second, tokens_per_minute
    self.metrics, self._clock = metrics, clock
    self._lock = threading.Lock()
    self._buckets: dict[str, tuple[_Bucket | None, _Bucket | None]] = {}

  def _of(self, name: str, now: float):
    got = self._buckets.get(name)
    if got is None:
      r, t = self.requests_per_second, self.tokens_per_minute
      got = self._buckets[name] = (
          None if r is None else _Bucket(r, max(1.0, r), max(1.0, r), now),
          None if t is None else _Bucket(t / 60.0, max(1.0, t), max(1.0, t), now))
    for b in got:
      if b is not None:
        b.refill(now)
    return got

  def admit(self, name: str | None) -> None:
    """Takes one request of `name` (None: no keys configured), or raises ApiError 429."""
    name = name or ANONYMOUS
    with self._lock:
      requests, tokens = self._of(name, self._clock())
      # Empty: not one token left (output charged after the fact may leave it in debt).
      if tokens is not None and tokens.level < 1:
        self._refuse(name, "tokens", tokens.wait_s(1.0),
                     f"{self.tokens_per_minute:g} tokens per minute (--tokens_per_minute)")
      if requests is not None and requests.level < 1:
        self._refuse(name, "requests", requests.wait_s(1.0),
                     f"{self.requests_per_second:g} requests per second (--requests_per_second)")
      if requests is not None:
        requests.level -= 1

  def _refuse(self, name: str, limit: str, wait_s: float, what: str):
    if self.metrics is not None:
      self.metrics.rate_limited.labels(name, limit).inc()
    retry = max(1, math.ceil(wait_s))
    raise api.ApiError(429, f"rate limit of {what} reached for key {name!r}; retry after "
                       f"{retry} s", type_=limit, code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry)})

  def charge(self, name: str | None, tokens: int) -> None:
    """Takes `tokens` (prompt or output) from `name`'s token bucket, below zero if need be."""
    if self.tokens_per_minute is None or tokens <= 0:
      return
    with self._lock:
      self._of(name or ANONYMOUS, self._clock())[1].level -= tokens
