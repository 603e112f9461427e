"""Storage clients: one fsspec filesystem per scheme and endpoint, and `call`, through which
every bucket request goes: retried on the network, its errors classified by type and HTTP
status, never by their text (see `t5forge.storage`)."""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from t5forge.errors import Unavailable, UserError
from t5forge.storage.paths import scheme, split

# scheme -> (fsspec package, extra that installs it)
_CLIENTS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


class StorageError(UserError):
  """A bucket operation that failed for a reason a user can act on (one line)."""


class StorageUnavailable(StorageError, Unavailable):
  """A bucket operation that failed on the network through every try (exit status 75)."""


# ---------------------------------------------------------------------------- clients

_fs_lock = threading.Lock()
_filesystems: dict[tuple, Any] = {}


def emulator(s: str) -> str | None:
  """The emulator endpoint the environment names for scheme `s`, or None."""
  if s == "gs":
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host and not host.startswith("http"):
      host = "http://" + host
    return host or None
  return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def configure_tensorstore() -> None:
  """Points TensorStore's GCS driver (Orbax's array I/O) at STORAGE_EMULATOR_HOST too."""
  host = emulator("gs")
  if host:
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)


def _check_credentials(s: str, url: str) -> None:
  if emulator(s):
    return
  if s == "gs":
    import google.auth  # noqa: PLC0415 (the [gcs] extra installs it with gcsfs)
    from google.auth import exceptions as gexc  # noqa: PLC0415
    try:
      google.auth.default()
    except gexc.DefaultCredentialsError as e:
      key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
      if key_file:  # set, but not a key google-auth can use (missing, malformed, wrong type)
        why = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        raise StorageError(
            f"{url}: GOOGLE_APPLICATION_CREDENTIALS={key_file} was refused "
            f"({' '.join(why.split())[:160]}); set GOOGLE_APPLICATION_CREDENTIALS to a "
            "service-account key JSON file, or unset it to use `gcloud auth "
            "application-default login`") from None
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise StorageError(
          f"{url}: no Google Cloud credentials ({first[:160]}); set "
          "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file or run "
          "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for an "
          "emulator)") from None
  else:
    import botocore.session  # noqa: PLC0415 (the [s3] extra installs it with s3fs)
    if botocore.session.get_session().get_credentials() is None:
      raise StorageError(
          f"{url}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
          "AWS_PROFILE (AWS_ENDPOINT_URL for an emulator or another S3 service)")


def filesystem(path: str):
  """The fsspec filesystem for `path`'s scheme, made once per process and endpoint."""
  s = scheme(path)
  key = (s, emulator(s), os.getpid())
  with _fs_lock:
    fs = _filesystems.get(key)
    if fs is not None:
      return fs
    package, extra = _CLIENTS[s]
    if s == "gs":
      # gcsfs's hierarchical-namespace probe speaks gRPC to the endpoint and waits a minute
      # on anything that is not Google itself (an emulator, a proxy).
      os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
      module = __import__(package)
    except ImportError:
      raise StorageError(f"{path}: {s}:// paths need the {package} package; install it with "
                         f"pip install 't5forge[{extra}]'") from None
    _check_credentials(s, path)
    timeout = _timeout()
    if s == "gs":
      fs = _one_try_gcs(module)(token="anon" if emulator(s) else None,
                                skip_instance_cache=True, requests_timeout=timeout)
    else:
      # botocore's own retries (5, each waiting out a 60 s read timeout) would stack under
      # ours (`call`): one try per request here, retried with backoff there.
      fs = module.S3FileSystem(skip_instance_cache=True, config_kwargs={
          "connect_timeout": min(10.0, timeout), "read_timeout": timeout,
          # (botocore's max_attempts counts retries after the first: 1 gave 2 requests)
          "retries": {"total_max_attempts": 1, "mode": "standard"}})
      fs.retries = 1  # s3fs's own loop around botocore (5 tries), likewise
    _filesystems[key] = fs
    return fs


_ONE_TRY_GCS: list = []


def _one_try_gcs(module):
  """gcsfs's filesystem class with one try per request. gcsfs tries each request 6 times,
  up to 32 s apart, which would stack under `call`'s tries (a dead endpoint took minutes
  to name, and "failed after 2 tries" meant 12): as botocore's retries are for S3 above,
  they are turned off, so T5FORGE_STORAGE_RETRIES counts the tries in all."""
  if not _ONE_TRY_GCS:
    base = module.GCSFileSystem
    undecorated = {name: getattr(base, name).__wrapped__
                   for name in ("_request", "_get_file_request", "_get_file_concurrent")
                   if hasattr(getattr(base, name, None), "__wrapped__")}
    request = undecorated.get("_request", base._request)  # noqa: SLF001 (gcsfs's own method)

    async def typed_request(self, *args, **kwargs):
      try:
        return await request(self, *args, **kwargs)
      except OSError as e:
        # gcsfs raises a 403 as a plain OSError whose text is "Forbidden: <path>..." (its
        # validate_response; no status kept): a PermissionError from here on, so that
        # everything after classifies it by type.
        if type(e) is OSError and e.errno is None and str(e).startswith("Forbidden: "):
          raise PermissionError(str(e)) from e
        raise

    undecorated["_request"] = typed_request
    _ONE_TRY_GCS.append(type("OneTryGCSFileSystem", (base,), undecorated))
  return _ONE_TRY_GCS[0]


def reset_clients() -> None:
  """Forgets the clients made so far (after the environment's endpoint or credentials
  change within one process)."""
  with _fs_lock:
    _filesystems.clear()
    _checked_buckets.clear()


def fs_path(url: str) -> str:
  """The client's name of the bucket object `url` (`bucket/key`)."""
  return url.partition("://")[2]


# ---------------------------------------------------------------------- errors, retry

def _timeout() -> float:
  try:
    return max(1.0, float(os.environ.get("T5FORGE_STORAGE_TIMEOUT_S", "60")))
  except ValueError:
    raise UserError("T5FORGE_STORAGE_TIMEOUT_S: expected seconds, e.g. 60") from None


def _retries() -> int:
  try:
    return max(1, int(os.environ.get("T5FORGE_STORAGE_RETRIES", "4")))
  except ValueError:
    raise UserError("T5FORGE_STORAGE_RETRIES: expected a whole number of tries, e.g. 4")


# Statuses GCS and S3 ask to be retried with backoff.
_TRANSIENT_STATUS = frozenset((408, 429, 500, 502, 503, 504))
# The clients' network errors that are not builtin ConnectionError / TimeoutError.
_TRANSIENT_TYPES = frozenset((
    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ProxyError",  # gcsfs's form of a 502
))
_TRANSIENT_ERRNO = frozenset((errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                              errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH,
                              errno.ENETUNREACH))


class PreconditionFailed(Exception):
  """A conditional request (`write_if`, `remove_if`) whose condition did not hold: the
  object is not, or no longer, at the version given.

  `status` is the HTTP status that said so: 412 (another version is there, or on GCS none
  is), 404 (S3: the object is gone), 409 (S3: another conditional write to it was in flight).
  """

  def __init__(self, url: str, status: int):
    super().__init__(f"{url}: the object is not at the version this write was made for "
                     f"(HTTP {status})")
    self.url, self.status = url, status


def _chain(e: BaseException | None) -> Iterator[BaseException]:
  """`e` and the errors it was raised from (the clients wrap their HTTP errors)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)


def status_of(e: BaseException) -> int | None:
  """The HTTP status a bucket client's error carries (gcsfs's HttpError.code, botocore's
  ClientError response, aiohttp's ClientResponseError.status), on it or on the error it
  was raised from; None for an error without one (the network). Never read from the
  error's text: an object called checkpoint_4120 is not a 412."""
  for err in _chain(e):
    response = getattr(err, "response", None)
    if isinstance(response, dict):
      status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
      if isinstance(status, int):
        return status
    for name in ("code", "status"):
      value = getattr(err, name, None)
      if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
        return value
  return None


def s3_error_code(e: BaseException) -> str | None:
  """S3's error code ('NoSuchBucket', 'AccessDenied', ...) of a botocore error, on it or on
  the error it was raised from (s3fs wraps them in OSErrors); None otherwise."""
  for err in _chain(e):
    response = getattr(err, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
      return response["Error"].get("Code")
  return None


def is_transient(e: BaseException) -> bool:
  """Whether `e`, raised by a bucket client, is worth a retry (network, time-out, 408,
  429, 5xx), by its type and HTTP status."""
  if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                    NotADirectoryError, UserError, PreconditionFailed)):
    return False
  # Before the status: S3's RequestTimeout is an HTTP 400 that s3fs raises as a TimeoutError.
  if isinstance(e, (ConnectionError, TimeoutError)):
    return True
  status = status_of(e)
  if status is not None:
    return status in _TRANSIENT_STATUS
  return any(type(err).__name__ in _TRANSIENT_TYPES or (
      isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNO) for err in _chain(e))


def _describe_error(e: BaseException) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return text[:200]


def no_bucket(url: str) -> StorageError:
  """The one-line error for a bucket URL whose bucket does not exist."""
  s, bucket, _ = split(url)
  return StorageError(f"{s}://{bucket}: the bucket does not exist; create it or fix the "
                      f"name in {url}")


def _user_error(url: str, op: str, e: BaseException) -> Exception:
  s = scheme(url)
  code = s3_error_code(e)
  if code == "NoSuchBucket":
    return no_bucket(url)
  if isinstance(e, FileNotFoundError):  # a missing object, said by the caller
    return e
  # s3fs turns AccessDenied / InvalidAccessKeyId / SignatureDoesNotMatch into a
  # PermissionError; gcsfs's 403 is one too (`_one_try_gcs`).
  if isinstance(e, PermissionError) or status_of(e) in (401, 403) or code in (
      "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
    var = ("GOOGLE_APPLICATION_CREDENTIALS" if s == "gs"
           else "AWS_PROFILE or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    return StorageError(f"{url}: {op} refused ({_describe_error(e)}); check the credentials "
                        f"in {var}")
  if any(type(err).__name__ == "NoCredentialsError" for err in _chain(e)):
    return StorageError(f"{url}: no AWS credentials; set AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
  return e


def call(url: str, op: str, fn: Callable[[], Any]) -> Any:
  """`fn()` for the object `url`, retried with backoff on network errors; a failure a user
  can act on (no bucket, refused credentials, the network gone after every try) becomes a
  one-line StorageError naming `url`."""
  tries = _retries()
  delay = 0.5
  for attempt in range(tries):
    try:
      return fn()
    except FileNotFoundError as e:
      mapped = _user_error(url, op, e)
      if mapped is not e:
        raise mapped from None
      raise
    except UserError:
      raise
    except Exception as e:  # classified below, re-raised when not ours
      if is_transient(e) and attempt + 1 < tries:
        time.sleep(delay)
        delay = min(delay * 2, 8.0)
        continue
      if is_transient(e):
        raise StorageUnavailable(f"{url}: {op} failed after {tries} tries ({_describe_error(e)}); "
                           "check the network, or the endpoint in "
                           f"{'STORAGE_EMULATOR_HOST' if split(url)[0] == 'gs' else 'AWS_ENDPOINT_URL'}"
                           ) from None
      mapped = _user_error(url, op, e)
      if mapped is not e:
        raise mapped from None
      raise


_checked_buckets: set[tuple[str, str]] = set()


def check_bucket(url: str) -> None:
  """A StorageError naming the bucket when it does not exist or cannot be listed."""
  s, bucket, _ = split(url)
  if (s, bucket) in _checked_buckets:
    return
  fs = filesystem(url)
  fs.invalidate_cache(bucket)
  try:
    call(url, "list", lambda: fs.ls(bucket, detail=False))
  except FileNotFoundError:
    raise no_bucket(url) from None
  _checked_buckets.add((s, bucket))
