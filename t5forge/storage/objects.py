"""Objects and files: queries, reads and writes (conditional ones too), uploads, downloads
and deletes of one path or of a prefix, local or in a bucket (see `t5forge.storage`).
Every bucket request goes through `clients.call`."""
from __future__ import annotations

import contextlib
import datetime
import glob as globlib
import os
import shutil
import tempfile

from t5forge.storage import clients
from t5forge.storage.clients import (PreconditionFailed, StorageError, check_bucket, filesystem,
                                     fs_path, no_bucket, s3_error_code, status_of)
from t5forge.storage.paths import is_remote, join, scheme, split

# --------------------------------------------------------------------- path queries

def _object_type(path: str, op: str) -> str | None:
  """'file' or 'directory' for the bucket path `path`, None when absent. Not fsspec's
  exists/isdir/isfile: they answer False for any error, so an outage would read as
  "missing"; here it is retried and then named (`call`)."""
  fs = filesystem(path)
  fs.invalidate_cache(fs_path(path))

  def stat() -> str | None:
    try:
      return fs.info(fs_path(path)).get("type") or "file"
    except FileNotFoundError:
      return None

  return clients.call(path, op, stat)


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
    return bool(clients.call(path, "stat", lambda: fs.exists(fs_path(path))))
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
  p = fs_path(path).rstrip("/")
  fs.invalidate_cache(p)
  try:
    entries = clients.call(path, "list", lambda: fs.ls(p, detail=False))
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
  p = fs_path(path).rstrip("/")
  fs.invalidate_cache(p)
  try:
    found = clients.call(path, "list", lambda: fs.find(p, detail=True))
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
  fs.invalidate_cache(fs_path(path))
  entry = clients.call(path, "stat", lambda: fs.info(fs_path(path)))
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
  found = clients.call(pattern, "list", lambda: fs.glob(fs_path(pattern)))
  return sorted(f"{s}://{f}" for f in found)


# -------------------------------------------------------------------- reads, writes

def read_bytes(path: str) -> bytes:
  if not is_remote(path):
    with open(path, "rb") as f:
      return f.read()
  fs = filesystem(path)
  return clients.call(path, "read", lambda: fs.cat_file(fs_path(path)))


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def read_range(path: str, offset: int, size: int) -> bytes:
  """`size` bytes of `path` from `offset` (one ranged GET on a bucket)."""
  if not is_remote(path):
    with open(path, "rb") as f:
      f.seek(offset)
      return f.read(size)
  fs = filesystem(path)
  return clients.call(path, "read", lambda: fs.cat_file(fs_path(path), start=offset,
                                                        end=offset + size))


def open_read(path: str, binary: bool = True):
  """A file object for reading; on a bucket it reads in blocks by byte range."""
  if not is_remote(path):
    return open(path, "rb") if binary else open(path, encoding="utf-8")
  fs = filesystem(path)
  return clients.call(path, "open", lambda: fs.open(
      fs_path(path), "rb" if binary else "rt", **({} if binary else {"encoding": "utf-8"})))


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
    fs.pipe_file(fs_path(path), data)
    fs.invalidate_cache(fs_path(path))

  clients.call(path, "write", put)


def write_if(path: str, data: bytes, *, version: str | None) -> str:
  """`data` as the object `path`, only if the object is now at `version` (a `version` of
  `info`; None: only if there is no object), in one request; -> the new object's version.

  The bucket decides, atomically (GCS `ifGenerationMatch`, S3 `If-Match` / `If-None-Match`):
  PreconditionFailed when the object is at another version, or absent (present, for None).
  A request whose reply was lost may have been made: its retry (`clients.call`) then fails the
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
      fs.invalidate_cache(fs_path(path))
    if not new:
      raise StorageError(f"{path}: the bucket's answer to a write has no generation or ETag; "
                         "t5forge needs a service that reports them (GCS, S3, or one "
                         "compatible with them)")
    return str(new).strip('"')

  return clients.call(path, "write", put)


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
      fs.invalidate_cache(fs_path(path))

  clients.call(path, "delete", delete)


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
    fs.put_file(local, fs_path(url))
    fs.invalidate_cache(fs_path(url))

  clients.call(url, "write", put)


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
    clients.call(url, "read", lambda: fs.get_file(fs_path(url), tmp))
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
    clients.call(path, "delete", lambda: fs.rm_file(fs_path(path)))
  fs.invalidate_cache(fs_path(path))


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
