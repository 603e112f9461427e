"""Where bytes live: local paths and `gs://` / `s3://` buckets, behind one set of calls.

Every place that touches a user path (MODEL_DIR, checkpoints, INITIAL_CHECKPOINT_PATH,
data, vocabularies, eval/infer outputs, convert/export outputs) goes through here or
through `t5forge.files`, which uses it. A local path takes the plain `os` route; a bucket
URL goes through fsspec (`gcsfs`, `s3fs`), which reads and writes objects, byte ranges
and object metadata (generation / ETag) with the clouds' own credential chains. Orbax
reads and writes checkpoints on `gs://` itself (TensorStore's GCS driver, pointed at the
same endpoint as here); see `t5forge.train.checkpoint`.

Buckets have no rename, so what is atomic on disk becomes a single-object write here: an
object appears whole or not at all. Readers of random-access formats get one local copy per
object version (`local_copy`), kept under the cache directory (T5FORGE_CACHE) and made
again only when the object's generation / ETag changes.

    storage.is_remote("gs://b/run")               # True
    storage.join("s3://b/run", "config.gin")     # "s3://b/run/config.gin"
    storage.write_bytes("gs://b/run/x.json", b"{}")
    storage.local_copy("s3://b/data/train.tfrecord")   # a local file, cached per ETag

Credentials and endpoints are the clouds' own: application-default credentials or
GOOGLE_APPLICATION_CREDENTIALS for GCS, AWS_PROFILE / AWS_ACCESS_KEY_ID for S3;
STORAGE_EMULATOR_HOST and AWS_ENDPOINT_URL point them at an emulator. The clients are an
optional extra: `pip install 't5forge[gcs]'` or `'t5forge[s3]'`. A request that fails on
the network is tried T5FORGE_STORAGE_RETRIES times in all (default 4) with backoff, each
try waiting at most T5FORGE_STORAGE_TIMEOUT_S seconds (default 60) for an answer, and then
named in one line.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import glob as globlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from t5forge.errors import UserError

# scheme -> (fsspec package, extra that installs it)
_CLIENTS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}
# Schemes users write that we do not read; each is refused by name rather than taken for a
# relative local directory called "hdfs:".
_KNOWN_OTHER = ("hdfs", "az", "abfs", "abfss", "adl", "http", "https", "ftp", "sftp",
                "file", "gcs", "s3a", "s3n", "oss", "r2", "hf")


class StorageError(UserError):
  """A bucket operation that failed for a reason a user can act on (one line)."""


def scheme(path: str) -> str:
  """'gs', 's3', or '' for a local path. An unknown `scheme://` is a UserError."""
  path = os.fspath(path)
  head, sep, _ = path.partition("://")
  if not sep or "/" in head:
    return ""
  head = head.lower()
  if head in _CLIENTS:
    return head
  if head == "file":
    return ""
  hint = " (write gs://)" if head == "gcs" else " (write s3://)" if head.startswith("s3") else ""
  raise UserError(f"{path}: unknown storage scheme '{head}://'{hint}; t5forge reads and "
                  "writes local paths, gs:// and s3://")


def is_remote(path: str) -> bool:
  """True for a `gs://` or `s3://` URL."""
  return bool(scheme(path))


def normalize(path: str) -> str:
  """A local path made absolute (`~` expanded); a bucket URL without a trailing slash."""
  path = os.fspath(path)
  if path.startswith("file://"):
    path = path[len("file://"):]
  if is_remote(path):
    s, _, rest = path.partition("://")
    rest = "/".join(p for p in rest.split("/") if p)
    return f"{s.lower()}://{rest}"
  return os.path.abspath(os.path.expanduser(path))


def split(url: str) -> tuple[str, str, str]:
  """`gs://bucket/a/b` -> ('gs', 'bucket', 'a/b')."""
  s = scheme(url)
  if not s:
    raise ValueError(f"{url}: not a bucket URL")
  bucket, _, key = url.partition("://")[2].partition("/")
  return s, bucket, key.strip("/")


def join(base: str, *parts: str) -> str:
  """`os.path.join` for local paths; '/'-joining for bucket URLs."""
  if not is_remote(base):
    return os.path.join(base, *parts)
  out = base.rstrip("/")
  for p in parts:
    if p:
      out = out + "/" + p.strip("/")
  return out


def dirname(path: str) -> str:
  if not is_remote(path):
    return os.path.dirname(path)
  s, bucket, key = split(path)
  return f"{s}://{bucket}/{key.rpartition('/')[0]}".rstrip("/")


def basename(path: str) -> str:
  return path.rstrip("/").rpartition("/")[2] if is_remote(path) else os.path.basename(path)


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


def _fs_path(url: str) -> str:
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


def _is_transient(e: BaseException) -> bool:
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
      if _is_transient(e) and attempt + 1 < tries:
        time.sleep(delay)
        delay = min(delay * 2, 8.0)
        continue
      if _is_transient(e):
        raise StorageError(f"{url}: {op} failed after {tries} tries ({_describe_error(e)}); "
                           "check the network, or the endpoint in "
                           f"{'STORAGE_EMULATOR_HOST' if split(url)[0] == 'gs' else 'AWS_ENDPOINT_URL'}"
                           ) from None
      mapped = _user_error(url, op, e)
      if mapped is not e:
        raise mapped from None
      raise


# --------------------------------------------------------------------- path queries

def _object_type(path: str, op: str) -> str | None:
  """'file' or 'directory' for the bucket path `path`, None when absent. Not fsspec's
  exists/isdir/isfile: they answer False for any error, so an outage would read as
  "missing"; here it is retried and then named (`call`)."""
  fs = filesystem(path)
  fs.invalidate_cache(_fs_path(path))

  def stat() -> str | None:
    try:
      return fs.info(_fs_path(path)).get("type") or "file"
    except FileNotFoundError:
      return None

  return call(path, op, stat)


def exists(path: str) -> bool:
  if not is_remote(path):
    return os.path.exists(path)
  return _object_type(path, "stat") is not None


def isdir(path: str) -> bool:
  if not is_remote(path):
    return os.path.isdir(path)
  _, _, key = split(path)
  if not key:
    fs = filesystem(path)
    return bool(call(path, "stat", lambda: fs.exists(_fs_path(path))))
  return _object_type(path, "list") == "directory"


def isfile(path: str) -> bool:
  if not is_remote(path):
    return os.path.isfile(path)
  return _object_type(path, "stat") == "file"


def listdir(path: str) -> list[str]:
  """Names directly under `path` (files and 'directories'), sorted; [] when there are none."""
  if not is_remote(path):
    return sorted(os.listdir(path))
  fs = filesystem(path)
  p = _fs_path(path).rstrip("/")
  fs.invalidate_cache(p)
  try:
    entries = call(path, "list", lambda: fs.ls(p, detail=False))
  except FileNotFoundError:
    return []
  names = {e.rstrip("/").rpartition("/")[2] for e in entries}
  names.discard("")
  return sorted(names)


def walk_files(path: str) -> dict[str, dict]:
  """Every object under the prefix `path` -> its info (size, version; for a bucket also
  'md5', GCS's server-side `md5Hash` in base64 or None), keyed by the path relative to
  `path` ('/'-separated), from one listing. Local directories are walked the same way."""
  if not is_remote(path):
    out = {}
    for root, _, files in os.walk(path):
      for name in files:
        full = os.path.join(root, name)
        st = os.stat(full)
        out[os.path.relpath(full, path).replace(os.sep, "/")] = {
            "size": st.st_size, "version": f"{st.st_mtime_ns}-{st.st_size}"}
    return out
  fs = filesystem(path)
  p = _fs_path(path).rstrip("/")
  fs.invalidate_cache(p)
  try:
    found = call(path, "list", lambda: fs.find(p, detail=True))
  except FileNotFoundError:
    return {}
  out = {}
  for name, entry in found.items():
    if entry.get("type") == "directory" or name.rstrip("/") == p:
      continue
    out[name[len(p) + 1:]] = {"size": int(entry.get("size") or 0),
                              "version": _version_of(entry),
                              "md5": entry.get("md5Hash") or None}
  return out


def _version_of(entry: dict) -> str | None:
  """The object's GCS generation or S3 ETag; None when the listing gave neither (nothing
  then tells one version of the object from the next: callers say what they do)."""
  for k in ("generation", "ETag", "etag", "VersionId"):
    v = entry.get(k)
    if v:
      return str(v).strip('"')
  return None


def info(path: str) -> dict:
  """{'size', 'version', 'mtime'} of one file or object; FileNotFoundError when absent.
  `version` is the GCS generation, the S3 ETag, or mtime+size on disk; `mtime` is seconds
  since the epoch (the server's clock for an object). Either is None for an object whose
  server did not give it: never made up from the size or this machine's clock."""
  if not is_remote(path):
    st = os.stat(path)
    return {"size": st.st_size, "version": f"{st.st_mtime_ns}-{st.st_size}",
            "mtime": st.st_mtime}
  fs = filesystem(path)
  fs.invalidate_cache(_fs_path(path))
  entry = call(path, "stat", lambda: fs.info(_fs_path(path)))
  if entry.get("type") == "directory":
    raise IsADirectoryError(path)
  when = entry.get("updated") or entry.get("LastModified") or entry.get("mtime")
  if isinstance(when, str):
    when = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
  if isinstance(when, (int, float)) and not isinstance(when, bool):
    mtime = float(when)
  else:
    mtime = when.timestamp() if hasattr(when, "timestamp") else None
  return {"size": int(entry.get("size") or 0), "version": _version_of(entry), "mtime": mtime}


def glob(pattern: str) -> list[str]:
  """Sorted matches of a glob pattern; bucket matches come back as full URLs."""
  if not is_remote(pattern):
    return sorted(globlib.glob(os.path.expanduser(pattern)))
  s = scheme(pattern)
  fs = filesystem(pattern)
  fs.invalidate_cache()
  found = call(pattern, "list", lambda: fs.glob(_fs_path(pattern)))
  return sorted(f"{s}://{f}" for f in found)


# -------------------------------------------------------------------- reads, writes

def read_bytes(path: str) -> bytes:
  if not is_remote(path):
    with open(path, "rb") as f:
      return f.read()
  fs = filesystem(path)
  return call(path, "read", lambda: fs.cat_file(_fs_path(path)))


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def read_range(path: str, offset: int, size: int) -> bytes:
  """`size` bytes of `path` from `offset` (one ranged GET on a bucket)."""
  if not is_remote(path):
    with open(path, "rb") as f:
      f.seek(offset)
      return f.read(size)
  fs = filesystem(path)
  return call(path, "read", lambda: fs.cat_file(_fs_path(path), start=offset,
                                                end=offset + size))


def open_read(path: str, binary: bool = True):
  """A file object for reading; on a bucket it reads in blocks by byte range."""
  if not is_remote(path):
    return open(path, "rb") if binary else open(path, encoding="utf-8")
  fs = filesystem(path)
  return call(path, "open", lambda: fs.open(_fs_path(path), "rb" if binary else "rt",
                                            **({} if binary else {"encoding": "utf-8"})))


def write_bytes(path: str, data: bytes, *, exclusive: bool = False) -> None:
  """`data` as the object `path`, in one request (a reader sees all of it or the old one).

  `exclusive=True` creates it only if absent (`write_if` with no version) and raises
  FileExistsError otherwise. Local paths are not handled here (`t5forge.files` writes
  those through a temp file and a rename).
  """
  if exclusive:
    try:
      write_if(path, data, version=None)
    except PreconditionFailed:
      raise FileExistsError(path) from None
    return
  fs = filesystem(path)

  def put():
    fs.pipe_file(_fs_path(path), data)
    fs.invalidate_cache(_fs_path(path))

  call(path, "write", put)


def write_if(path: str, data: bytes, *, version: str | None) -> str:
  """`data` as the object `path`, only if the object is now at `version` (a `version` of
  `info`; None: only if there is no object), in one request; -> the new object's version.

  The bucket decides, atomically (GCS `ifGenerationMatch`, S3 `If-Match` / `If-None-Match`):
  PreconditionFailed when the object is at another version, or absent (present, for None).
  A request whose reply was lost may have been made: its retry (`call`) then fails the
  condition it met itself, so a PreconditionFailed after a network error is ambiguous and
  the caller reads the object to know (the lock's token, `run_lock`).
  """
  fs = filesystem(path)
  s, bucket, key = split(path)

  def put() -> str:
    try:
      if s == "gs":
        # A media upload: gcsfs's own uploads take no generation but 0 (create).
        root = fs.base[:-len("storage/v1/")]
        out = fs.call("POST", root + "upload/storage/v1/b/{}/o", bucket, uploadType="media",
                      name=key, ifGenerationMatch="0" if version is None else version,
                      headers={"Content-Type": "application/octet-stream"}, data=data,
                      json_out=True)
        new = out.get("generation")
      else:
        match = {"IfNoneMatch": "*"} if version is None else {"IfMatch": f'"{version}"'}
        out = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **match)
        new = out.get("ETag")
    except Exception as e:
      _raise_condition(path, e, upload=True)
      raise
    finally:
      fs.invalidate_cache(_fs_path(path))
    if not new:
      raise StorageError(f"{path}: the bucket's answer to a write has no generation or ETag; "
                         "t5forge needs a service that reports them (GCS, S3, or one "
                         "compatible with them)")
    return str(new).strip('"')

  return call(path, "write", put)


def remove_if(path: str, version: str) -> None:
  """Deletes the object `path` only if it is at `version` (GCS `ifGenerationMatch`, S3
  `If-Match`); PreconditionFailed when it is at another one or gone (ambiguous after a
  network error, as `write_if`)."""
  fs = filesystem(path)
  s, bucket, key = split(path)

  def delete() -> None:
    try:
      if s == "gs":
        fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
      else:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=f'"{version}"')
    except Exception as e:
      _raise_condition(path, e, upload=False)
      raise
    finally:
      fs.invalidate_cache(_fs_path(path))

  call(path, "delete", delete)


def _raise_condition(url: str, e: BaseException, *, upload: bool) -> None:
  """Raises what the error `e` of a conditional request on `url` means, when it is about
  the condition or the bucket; returns otherwise (the caller re-raises `e`)."""
  if scheme(url) == "gs":
    # gcsfs raises its 412 as FileExistsError and its 404 as FileNotFoundError, by status.
    if isinstance(e, FileExistsError):
      raise PreconditionFailed(url, 412) from None
    if isinstance(e, FileNotFoundError):
      if upload:  # an upload names no object that could be missing: the bucket is
        raise no_bucket(url) from None
      raise PreconditionFailed(url, 404) from None
    return
  status, code = status_of(e), s3_error_code(e)
  if code == "NoSuchBucket":
    raise no_bucket(url) from None
  if status in (404, 409, 412):
    raise PreconditionFailed(url, status) from None


def upload(local: str, url: str) -> None:
  """The local file `local` as the object `url` (one object, whole or absent)."""
  fs = filesystem(url)

  def put():
    fs.put_file(local, _fs_path(url))
    fs.invalidate_cache(_fs_path(url))

  call(url, "write", put)


def upload_tree(local_dir: str, url: str, *, last: tuple[str, ...] = ()) -> None:
  """Every file under `local_dir` to the prefix `url`; the relative names in `last` are
  written after all others (the file a reader takes as the mark of a complete copy)."""
  names = sorted(walk_files(local_dir))
  ordered = [n for n in names if n not in last] + [n for n in last if n in names]
  for name in ordered:
    upload(os.path.join(local_dir, name), join(url, name))


def download(url: str, local: str) -> None:
  """The object `url` into the local file `local` (through a temp file and a rename)."""
  fs = filesystem(url)
  os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(local) or ".", prefix=".download-")
  os.close(fd)
  try:
    call(url, "read", lambda: fs.get_file(_fs_path(url), tmp))
    os.replace(tmp, local)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def remove(path: str) -> None:
  """Deletes a file or object; absent is fine."""
  if not is_remote(path):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)
    return
  fs = filesystem(path)
  with contextlib.suppress(FileNotFoundError):
    call(path, "delete", lambda: fs.rm_file(_fs_path(path)))
  fs.invalidate_cache(_fs_path(path))


def rmtree(path: str) -> None:
  """Deletes a directory or every object under a prefix; absent is fine."""
  if not is_remote(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  for name in walk_files(path):
    remove(join(path, name))


def makedirs(path: str) -> None:
  """Creates a local directory (and parents). A bucket has no directories: for a bucket URL
  this checks that the bucket exists, the first mistake a user makes with one."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)
    return
  check_bucket(path)


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


def copy_tree(src: str, dst: str) -> None:
  """Copies every file under `src` to `dst`; either or both may be buckets."""
  for name in sorted(walk_files(src)):
    s, d = join(src, name), join(dst, name)
    if is_remote(d):
      if is_remote(s):
        write_bytes(d, read_bytes(s))
      else:
        upload(s, d)
    elif is_remote(s):
      download(s, d)
    else:
      os.makedirs(os.path.dirname(d), exist_ok=True)
      shutil.copy2(s, d)


# ------------------------------------------------------------------ the local cache

_OFF = ("off", "none")
# The temporary cache of T5FORGE_CACHE=off, named in the environment so that processes
# started from this one (Grain's workers) reuse it instead of redoing the work.
_TEMP_ENV = "T5FORGE_CACHE_TEMP"
_temp_root: str | None = None
_temp_lock = threading.Lock()


def cache_enabled() -> bool:
  """False when T5FORGE_CACHE is `off` or `none`: nothing is kept between runs."""
  return os.environ.get("T5FORGE_CACHE", "").strip().lower() not in _OFF


def cache_root() -> str:
  """The cache dir: `$T5FORGE_CACHE`, else `$XDG_CACHE_HOME/t5forge`, else
  `~/.cache/t5forge`; with T5FORGE_CACHE=off, a temporary directory removed at exit."""
  value = os.environ.get("T5FORGE_CACHE", "").strip()
  if value.lower() in _OFF:
    return _temporary_root()
  if value:
    return os.path.expanduser(value)
  xdg = os.environ.get("XDG_CACHE_HOME", "")
  if os.path.isabs(xdg):  # the XDG spec: a relative path is invalid and ignored
    return os.path.join(xdg, "t5forge")
  return os.path.expanduser("~/.cache/t5forge")


def _temporary_root() -> str:
  global _temp_root
  with _temp_lock:
    if _temp_root is None or not os.path.isdir(_temp_root):
      inherited = os.environ.get(_TEMP_ENV, "")
      if inherited and os.path.isdir(inherited):
        _temp_root = inherited  # the process that made it removes it
      else:
        _temp_root = tempfile.mkdtemp(prefix="t5forge-cache-")
        os.environ[_TEMP_ENV] = _temp_root
        atexit.register(_remove_temporary_root, _temp_root, os.getpid())
    return _temp_root


def _remove_temporary_root(path: str, owner: int) -> None:
  if os.getpid() == owner:  # not in a forked child that happens to run atexit
    shutil.rmtree(path, ignore_errors=True)


def _cache_dir(url: str, version: str) -> str:
  s, bucket, key = split(url)
  digest = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()[:16]
  return os.path.join(cache_root(), "buckets", s, bucket, key.replace("/", "_")[-80:] + "-" + digest)


_UNVERSIONED = "unversioned"


def local_copy(path: str) -> str:
  """A local path holding what `path` holds: `path` itself when local; for a bucket object
  or prefix, a copy under the cache, made once per object version (generation / ETag) and
  reused until the object changes. Directories are copied file by file."""
  if not is_remote(path):
    return path
  path = normalize(path)
  try:
    entry = info(path)
    files = None
  except (FileNotFoundError, IsADirectoryError):
    files = walk_files(path)
    if not files:
      raise FileNotFoundError(path) from None
  # An object without a generation / ETag (a server that gives none) cannot be told from
  # its next version: it is downloaded again on every call, into one place per URL.
  if files is None:
    target_dir = _cache_dir(path, entry["version"] or _UNVERSIONED)
    target = os.path.join(target_dir, basename(path))
    if entry["version"] is None or not os.path.exists(target):
      download(path, target)
    return target
  unversioned = any(f["version"] is None for f in files.values())
  listing = "\n".join(f"{n}\0{f['version']}" for n, f in sorted(files.items()))
  target = _cache_dir(path, _UNVERSIONED if unversioned
                      else hashlib.sha256(listing.encode()).hexdigest())
  done = os.path.join(target, ".t5forge-complete")
  if unversioned or not os.path.exists(done):
    for name in sorted(files):
      local = os.path.join(target, *name.split("/"))
      if unversioned or not os.path.exists(local):
        download(join(path, name), local)
    if not unversioned:
      with open(done, "w") as f:
        f.write(listing)
  return target


@contextlib.contextmanager
def staged_upload(url: str, *, last: tuple[str, ...] = ()) -> Iterator[str]:
  """A local temporary directory to write into; on success its files go to the prefix
  `url` (those named in `last` after all the rest) and the directory is removed."""
  tmp = tempfile.mkdtemp(prefix="t5forge-upload-")
  try:
    yield tmp
    upload_tree(tmp, url, last=last)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------- checkpoints (manifest)

def forget_shared_listings(path: str) -> None:
  """Forgets the listings cached by the client of `path`'s scheme, which Orbax (through etils epath)
  lists a `gs://` MODEL_DIR with: its cached listings would still show objects deleted
  here (and Orbax then fails to delete them again). Ours are not shared."""
  if is_remote(path):
    from etils import epath  # noqa: PLC0415 (Orbax's path layer, installed with it)
    epath.backend.fsspec_backend.fs(path).invalidate_cache()


# ------------------------------------------- training runs: files appended to on a bucket

class AppendMirror:
  """Where a run writes the files it appends to (metrics.jsonl, TensorBoard events,
  batch fingerprints) under MODEL_DIR, when MODEL_DIR may be a bucket.

  An object cannot be appended to. For a bucket `url` the files are written in a local
  working copy, one per `url` and `name` (the writing process) under the cache directory,
  emptied when the mirror is made; `sync()` uploads each file that changed since its last
  upload as one whole object (a reader sees the previous upload or this one). For a local
  `url` the working copy is `url` itself and `sync()` does nothing.

    mirror = storage.AppendMirror("gs://b/run", name="process-0")
    open(mirror.path("metrics.jsonl", resume=True), "a")   # continues the bucket's copy
    mirror.sync()                                           # at each checkpoint, at exit
  """

  def __init__(self, url: str, *, name: str = "0"):
    self.url = normalize(url) if is_remote(url) else url
    self.remote = is_remote(url)
    self._uploaded: dict[str, str] = {}  # relative name -> local version last uploaded
    if self.remote:
      digest = hashlib.sha256(f"{self.url}\0{name}".encode()).hexdigest()[:16]
      self.root = os.path.join(cache_root(), "appending", f"{basename(self.url)}-{digest}")
      shutil.rmtree(self.root, ignore_errors=True)  # a killed run's unsent lines
      os.makedirs(self.root)
    else:
      self.root = url

  def path(self, relative: str, *, resume: bool = False) -> str:
    """The local path at which to write `url/relative` (a file or a directory). With
    `resume`, a file that continues across runs: the bucket's object, if any, is first
    downloaded into the working copy."""
    local = os.path.join(self.root, *relative.split("/"))
    if self.remote and resume and not os.path.exists(local):
      try:
        download(join(self.url, relative), local)
        self._uploaded[relative] = info(local)["version"]
      except FileNotFoundError:
        pass
    return local

  def sync(self) -> None:
    """Uploads every file of the working copy that changed since its last upload."""
    if not self.remote:
      return
    for relative, meta in sorted(walk_files(self.root).items()):
      if self._uploaded.get(relative) != meta["version"]:
        upload(os.path.join(self.root, *relative.split("/")), join(self.url, relative))
        self._uploaded[relative] = meta["version"]

  def close(self, *, upload: bool = True) -> None:
    """A last `sync()` (none with `upload=False`), then the working copy is removed (kept
    if the upload failed)."""
    if not self.remote:
      return
    if upload:
      self.sync()
    shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------ outputs (eval, infer, convert, export, serve)

def check_new_output(url: str) -> str:
  """`url` normalized, for a directory about to be written under that bucket prefix: one
  line (StorageError / UserError) naming it when the bucket does not exist, the client or
  credentials are missing, or the prefix already holds files."""
  url = normalize(url)
  check_bucket(url)
  if walk_files(url):
    raise UserError(f"{url}: exists and is not empty; choose a new output directory")
  return url
