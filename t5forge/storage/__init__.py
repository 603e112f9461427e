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

The package's modules, each importing only those before it: `paths` (URLs and local
paths, no request), `clients` (the fsspec clients, `call` with its retries and error
classes), `objects` (reads, writes, conditional writes and deletes, listings, copies) and
`local` (the cache of local copies, staged uploads, `AppendMirror`). Import the package
(`from t5forge import storage`): every name is here.
"""
from __future__ import annotations

import os

# Orbax names bucket paths with etils' epath, which sends gs:// and s3:// through
# TensorFlow's file system whenever TensorFlow is installed (the [tf] extra): that client
# ignores STORAGE_EMULATOR_HOST, our time-outs and retries, and importing it costs
# seconds and a gigabyte. Bucket paths take fsspec (the clients here) either way; a
# user's own EPATH_USE_TF wins.
os.environ.setdefault("EPATH_USE_TF", "false")

from t5forge.storage.clients import (PreconditionFailed, StorageError, StorageUnavailable,
                                     is_transient, call, check_bucket,
                                     configure_tensorstore, emulator, filesystem, fs_path,
                                     no_bucket, reset_clients, s3_error_code, status_of)
from t5forge.storage.local import (AppendMirror, cache_enabled, cache_root, check_new_output,
                                   forget_shared_listings, local_copy, staged_upload)
from t5forge.storage.objects import (copy_tree, download, exists, glob, info, isdir, isfile,
                                     listdir, makedirs, open_read, read_bytes, read_range,
                                     read_text, remove, remove_if, rmtree, upload, upload_tree,
                                     walk_files, write_bytes, write_if)
from t5forge.storage.paths import basename, dirname, is_remote, join, normalize, scheme, split

__all__ = [
    "AppendMirror", "PreconditionFailed", "StorageError", "StorageUnavailable", "is_transient",
    "basename", "cache_enabled",
    "cache_root", "call", "check_bucket", "check_new_output", "configure_tensorstore",
    "copy_tree", "dirname", "download", "emulator", "exists", "filesystem",
    "forget_shared_listings", "fs_path", "glob", "info", "is_remote", "isdir", "isfile", "join",
    "listdir", "local_copy", "makedirs", "no_bucket", "normalize", "open_read", "read_bytes",
    "read_range", "read_text", "remove", "remove_if", "reset_clients", "rmtree",
    "s3_error_code", "scheme", "split", "staged_upload", "status_of", "upload", "upload_tree",
    "walk_files", "write_bytes", "write_if",
]
