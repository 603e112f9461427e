"""Checksums of a t5forge checkpoint's files: recorded when it is committed, checked on read.

`<checkpoint>/t5forge_manifest.json`:

    {"format": 1, "hash": "sha256",
     "files": {"params/ocdbt.process_0/d/40f8...": {"size": 3914635, "sha256": "9c1e..."}, ...}}

Every file of the checkpoint is listed except the two Orbax writes or rewrites as it
commits (`_CHECKPOINT_METADATA`, whose presence and JSON are checked instead, and the
top-level `commit_success.txt`). The manifest is written into Orbax's temporary directory
after every process's files are complete and before Orbax renames that directory into
place (`write_staged`, run as Orbax's post-finalization callback), so it is committed with
the checkpoint: a `checkpoint_<step>` directory has its manifest or was damaged since.
Checkpoints record in their config item that they carry one (`EXPECTED`); one without
that key was written before manifests existed and is read unverified, with a note.

On a bucket (`gs://`, where Orbax writes the checkpoint in place and renames nothing) the
manifest is written last, after every other object, and is the commit marker: a
`checkpoint_<step>` prefix without it is not a checkpoint. It records what the bucket's
listing already says of each object instead of a hash computed by reading it back:

    {"format": 1, "hash": "object",
     "files": {"params/ocdbt.process_0/d/40f8...": {"size": 3914635, "md5": "Ypf2...",
                                                   "version": "1796346957765516390"}, ...}}

`md5` is the object's content hash as the server computed it (GCS `md5Hash`), `version`
its generation; a flipped byte means a rewritten object, so a new md5 and a new
generation, found by one listing of the checkpoint on restore without downloading it.
With `md5` on both sides it is what is compared (a copy of the checkpoint to another
bucket keeps it); else the version. A checkpoint staged locally and uploaded (`s3://`)
carries the sha256 manifest of a local one and is verified on its local copy
(`storage.local_copy`, which a restore reads anyway).

Cost: sha256 runs at ~1.6 GB/s per core on a CPU with SHA extensions (AMD EPYC here),
so the ~300 MB of a flan-t5-small checkpoint with its optimizer state takes ~0.2 s to
hash, in Orbax's background thread when saves are asynchronous.
"""
from __future__ import annotations

import hashlib
import json
import os

from t5forge import files as t5files
from t5forge import storage
from t5forge.errors import Unavailable, UserError

MANIFEST = "t5forge_manifest.json"
OBJECT = "object"  # the "hash" of a bucket manifest: the listing's md5 / generation
EXPECTED = "checksums"  # config-item key: {"checksums": MANIFEST} in checkpoints that have one
HASH = "sha256"
ORBAX_METADATA = "_CHECKPOINT_METADATA"


def _orbax_paths():
  import orbax.checkpoint as ocp  # noqa: PLC0415 # slow to import
  return ocp.path.atomicity_types


class CheckpointDamaged(UserError):
  """A checkpoint's files differ from what was committed (or Orbax cannot read them).

  Attributes:
    path: the checkpoint directory.
  """

  def __init__(self, path: str, problem: str):
    super().__init__(f"{path}: damaged: {problem}")
    self.path = path


# (path, hash, device, inode, size, mtime_ns) -> digest. Choosing the newest intact
# checkpoint of a MODEL_DIR verifies it, and reading it verifies it again; a file not
# rewritten since is not hashed twice in one process (a rewrite changes its mtime).
_DIGESTS: dict[tuple, str] = {}


def _digest(path: str, hash_name: str = HASH) -> str:
  st = os.stat(path)
  key = (os.path.abspath(path), hash_name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
  if key not in _DIGESTS:
    with open(path, "rb") as f:
      _DIGESTS[key] = hashlib.file_digest(f, hash_name).hexdigest()
  return _DIGESTS[key]


def _unlisted() -> set[str]:
  # Orbax writes these two after the manifest (commit time, commit marker): not hashed.
  return {ORBAX_METADATA, _orbax_paths().COMMIT_SUCCESS_FILE, MANIFEST}


def _files(directory: str) -> list[str]:
  unlisted = _unlisted()
  out = []
  for root, dirs, names in os.walk(directory):
    dirs.sort()
    for name in sorted(names):
      rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
      if rel not in unlisted and not rel.startswith(f".{MANIFEST}.tmp-"):  # a write cut short
        out.append(rel)
  return out


def committed_on_bucket(names: set[str]) -> bool:
  """Whether a checkpoint under a bucket prefix whose top-level object names are `names`
  is committed: our manifest, its last object, commits it. On `gs://` Orbax writes its own
  commit marker (`commit_success.txt`) after the manifest; a run stopped between the two
  leaves a whole checkpoint (every array written, Orbax's finalize done) that Orbax, when
  it next starts, would take for unfinished and delete, so the trainer finishes that
  commit first (`needs_orbax_commit`, `finish_orbax_commit`)."""
  return MANIFEST in names


def needs_orbax_commit(names: set[str]) -> bool:
  """A committed checkpoint on `gs://` (object names `names`) without Orbax's marker: a
  run stopped after our manifest, or a local checkpoint copied up by hand."""
  return committed_on_bucket(names) and _orbax_paths().COMMIT_SUCCESS_FILE not in names


def finish_orbax_commit(directory: str) -> None:
  """Writes Orbax's commit marker into the committed bucket checkpoint `directory`, as
  Orbax itself would have."""
  storage.write_bytes(storage.join(directory, _orbax_paths().COMMIT_SUCCESS_FILE),
                      f"Checkpoint commit was successful to {directory}".encode("utf-8"))


def write_objects(directory: str, extra_files: dict[str, str] | None = None) -> None:
  """The manifest of a checkpoint Orbax wrote in place under the bucket prefix
  `directory`, from one listing (see the module doc), after writing `extra_files`
  ({name: text}) there; the manifest is the last object written, its commit marker."""
  for name, text in (extra_files or {}).items():
    storage.write_bytes(storage.join(directory, name), text.encode("utf-8"))
  unlisted = _unlisted()
  files = {rel: {"size": o["size"], **({"md5": o["md5"]} if o.get("md5") else {}),
                 "version": o["version"]}
           for rel, o in sorted(storage.walk_files(directory).items())
           if rel not in unlisted}
  data = json.dumps({"format": 1, "hash": OBJECT, "files": files}, indent=1)
  storage.write_bytes(storage.join(directory, MANIFEST), (data + "\n").encode("utf-8"))


def write(directory: str) -> None:
  """Records size and sha256 of every file in directory (temp file, then rename)."""
  files = {}
  for rel in _files(directory):
    path = os.path.join(directory, rel)
    files[rel] = {"size": os.path.getsize(path), HASH: _digest(path)}
  t5files.write_json(os.path.join(directory, MANIFEST),
                     {"format": 1, "hash": HASH, "files": files}, indent=1, sort_keys=True,
                     fsync=True)


def staged_dir(final_dir: str) -> str:
  """Orbax's temporary directory of final_dir, where a save is written before Orbax renames
  it (files put there are committed with the checkpoint)."""
  staged = str(final_dir).rstrip("/") + _orbax_paths().TMP_DIR_SUFFIX
  if not os.path.isdir(staged):  # a future Orbax that stages elsewhere must not go unnoticed
    raise RuntimeError(f"{staged}: Orbax's temporary checkpoint directory is not there; "
                       f"cannot write {MANIFEST}")
  return staged


def write_staged(final_dir: str, extra_files: dict[str, str] | None = None) -> None:
  """`write` into Orbax's temporary directory of final_dir, before Orbax renames it, after
  writing `extra_files` ({name: text}) there (so the manifest covers them)."""
  staged = staged_dir(final_dir)
  for name, text in (extra_files or {}).items():
    t5files.write_text(os.path.join(staged, name), text)
  write(staged)


def _expects_manifest(directory: str) -> bool:
  # Orbax's JsonCheckpointHandler keeps the config item in config/metadata.
  try:
    with open(os.path.join(directory, "config", "metadata"), encoding="utf-8") as f:
      return json.load(f).get(EXPECTED) == MANIFEST
  except (OSError, ValueError, AttributeError):
    return False


def _damage(directory: str, problems: list[str]) -> None:
  if problems:
    more = f" (and {len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
    raise CheckpointDamaged(directory, problems[0] + more)


def _verify_objects(directory: str, recorded: dict) -> None:
  """`verify` of a checkpoint under a bucket prefix (its manifest `recorded`), from one
  listing of it."""
  try:
    files = recorded["files"]
    if not isinstance(files, dict):
      raise TypeError(f"'files' is a {type(files).__name__}")
  except (KeyError, TypeError) as e:
    raise CheckpointDamaged(directory, f"{MANIFEST} is unreadable ({type(e).__name__})") from None
  have = storage.walk_files(directory)
  problems = []
  for rel, want in sorted(files.items()):
    got = have.get(rel)
    try:
      saved_size = int(want["size"])
    except (KeyError, TypeError, ValueError):
      problems.append(f"{MANIFEST}: the entry of {rel} is unreadable")
      continue
    if got is None:
      problems.append(f"{rel} is missing")
    elif got["size"] != saved_size:
      problems.append(f"{rel} has {got['size']:,} bytes, {saved_size:,} were saved "
                      f"({'truncated' if got['size'] < saved_size else 'grown'})")
    elif want.get("md5") and got.get("md5"):
      if want["md5"] != got["md5"]:
        problems.append(f"{rel} changed after it was saved (same size, md5 mismatch)")
    elif want.get("version") and got["version"] and str(want["version"]) != got["version"]:
      # (a server that gives no generation / ETag leaves only size and MD5 to compare)
      problems.append(f"{rel} was rewritten after it was saved (same size, another "
                      "object version)")
  if ORBAX_METADATA not in have:
    problems.append(f"{ORBAX_METADATA} (Orbax's) is missing")
  _damage(directory, problems)


def verify(directory: str) -> str | None:
  """Checks a committed checkpoint's files against its manifest.

  `directory` may be a bucket URL: a checkpoint Orbax wrote there in place is checked
  by one listing (`write_objects`); one uploaded from a local staging copy on the local
  copy a restore reads (`storage.local_copy`, one download per object version).

  Returns:
    None when every file matches; a note when the checkpoint predates manifests (its
    files cannot be checked).

  Raises:
    CheckpointDamaged: one line naming the checkpoint, the first damaged file and what is
      wrong with it (missing, other size, other content), and how many more there are.
  """
  if storage.is_remote(directory):
    try:
      recorded = json.loads(storage.read_bytes(storage.join(directory, MANIFEST)))
    except FileNotFoundError:
      raise CheckpointDamaged(directory, f"{MANIFEST} (its commit marker) is missing") from None
    except ValueError as e:
      raise CheckpointDamaged(directory,
                              f"{MANIFEST} is unreadable ({type(e).__name__})") from None
    if isinstance(recorded, dict) and recorded.get("hash") == OBJECT:
      _verify_objects(directory, recorded)
      return None
    # A sha256 manifest (staged and uploaded, or a local checkpoint copied up).
    return _verify_files(storage.local_copy(directory), shown=directory)
  return _verify_files(directory, shown=directory)


def _verify_files(directory: str, *, shown: str) -> str | None:
  """`verify` of the local directory `directory`; messages name it `shown`."""
  problems = []
  try:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
      recorded = json.load(f)
    files, hash_name = recorded["files"], recorded["hash"]
    hashlib.new(hash_name)  # a hash this Python lacks: unreadable, as below
    if not isinstance(files, dict):
      raise TypeError(f"'files' is a {type(files).__name__}")
  except FileNotFoundError:
    if _expects_manifest(directory):
      raise CheckpointDamaged(shown, f"{MANIFEST} (its checksums, written with it) is "
                              "missing") from None
    return (f"{shown} has no {MANIFEST} (written by an earlier t5forge): its files "
            "are not verified")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointDamaged(shown, f"{MANIFEST} is unreadable ({type(e).__name__})") from None
  for rel, want in sorted(files.items()):
    path = os.path.join(directory, rel)
    try:
      saved_size, saved_hash = int(want["size"]), str(want[hash_name])
    except (KeyError, TypeError, ValueError):
      problems.append(f"{MANIFEST}: the entry of {rel} is unreadable")
      continue
    try:
      size = os.path.getsize(path)
    except OSError:
      problems.append(f"{rel} is missing")
      continue
    if size != saved_size:
      problems.append(f"{rel} has {size:,} bytes, {saved_size:,} were saved "
                      f"({'truncated' if size < saved_size else 'grown'})")
    elif _digest(path, hash_name) != saved_hash:
      problems.append(f"{rel} changed after it was saved (same size, {hash_name} mismatch)")
  try:
    with open(os.path.join(directory, ORBAX_METADATA), encoding="utf-8") as f:
      json.load(f)
  except FileNotFoundError:
    problems.append(f"{ORBAX_METADATA} (Orbax's) is missing")
  except (OSError, ValueError):
    problems.append(f"{ORBAX_METADATA} (Orbax's) is not valid JSON")
  _damage(shown, problems)
  return None


# absl status codes that mean "try again" (gRPC's retry guidance). XLA's JaxRuntimeError
# and TensorStore's errors (a plain ValueError) carry no code attribute: their message
# opens with the code, "UNAVAILABLE: ..." — a field of the message, not its prose.
_RETRY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"})


def is_passing(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) is one that may pass by itself: the
  network or a bucket (`storage.is_transient`), a time-out, or memory (host or device)."""
  seen: set[int] = set()
  e: BaseException | None = error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, (MemoryError, ConnectionError, TimeoutError)) or storage.is_transient(e):
      return True
    if str(e).lstrip().split(":", 1)[0] in _RETRY_CODES:
      return True
    e = e.__cause__ or e.__context__
  return False


class CheckpointUnavailable(Unavailable):
  """A checkpoint that could not be read although nothing shows it damaged: the error may
  pass (network, time-out, memory), or its files match its manifest. Nothing is set aside;
  the run stops with exit status 75 and a rerun reads it.

  Attributes:
    path: the checkpoint directory.
  """

  def __init__(self, path: str, error: BaseException, *, verified: bool, tries: int = 1):
    first = " ".join((str(error).strip().splitlines() or [""])[0].split())[:200]
    why = ("its files match its manifest, so it is not damaged" if verified
           else "the error may pass")
    super().__init__(f"{path}: could not be read ({type(error).__name__}: {first}) "
                     f"after {tries} {'try' if tries == 1 else 'tries'}; {why} and nothing "
                     "was set aside: rerun once the cause is gone (network, bucket, memory)")
    self.path = path


def read_failure(directory: str, error: BaseException, *, verified: bool,
                 tries: int = 1) -> UserError:
  """What an error Orbax raised while reading `directory` tells of it. Damage
  (CheckpointDamaged: a resume sets it aside) only when nothing verified its files and the
  error cannot pass by itself; else CheckpointUnavailable (nothing set aside).

  Args:
    verified: `verify(directory)` found every file as committed.
  """
  if verified or is_passing(error):
    return CheckpointUnavailable(directory, error, verified=verified, tries=tries)
  first = (str(error).strip().splitlines() or [""])[0][:200]
  return CheckpointDamaged(directory, f"Orbax could not read it ({type(error).__name__}: {first})")
