"""Storage paths: local paths and `gs://` / `s3://` URLs told apart, normalized and joined,
without a request (see `t5forge.storage`)."""
from __future__ import annotations

import os

from t5forge.errors import UserError

# The schemes read and written here (`clients` has their fsspec packages).
SCHEMES = ("gs", "s3")
# Schemes users write that we do not read; each is refused by name rather than taken for a
# relative local directory called "hdfs:".
_KNOWN_OTHER = ("hdfs", "az", "abfs", "abfss", "adl", "http", "https", "ftp", "sftp",
                "file", "gcs", "s3a", "s3n", "oss", "r2", "hf")


def scheme(path: str) -> str:
  """'gs', 's3', or '' for a local path. An unknown `scheme://` is a UserError."""
  path = os.fspath(path)
  head, sep, _ = path.partition("://")
  if not sep or "/" in head:
    return ""
  head = head.lower()
  if head in SCHEMES:
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
