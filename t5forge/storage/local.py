"""Local copies: the cache of bucket objects (`local_copy`), staged uploads, and the local
working copies of the files a run appends to (`AppendMirror`) (see `t5forge.storage`)."""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator

from t5forge.errors import UserError
from t5forge.storage.clients import check_bucket
from t5forge.storage.objects import download, info, upload_tree, upload, walk_files
from t5forge.storage.paths import basename, is_remote, join, normalize, split

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


def local_copy(path: str, *, keep: Callable[[str], bool] | None = None) -> str:
  """A local path holding what `path` holds: `path` itself when local; for a bucket object
  or prefix, a copy under the cache, made once per object version (generation / ETag) and
  reused until the object changes. Directories are copied file by file; with `keep`, only
  the files whose names (relative to `path`) it accepts (e.g. one checkpoint of several)."""
  if not is_remote(path):
    return path
  path = normalize(path)
  try:
    entry = info(path)
    files = None
  except (FileNotFoundError, IsADirectoryError):
    files = walk_files(path)
    if keep is not None:
      files = {name: f for name, f in files.items() if keep(name)}
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
