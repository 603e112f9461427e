"""Which checkpoint a path names: the one resolver every command uses.

A user names a checkpoint to `t5forge.load`, eval, infer, serve, export, convert,
INITIAL_CHECKPOINT_PATH or a vocabulary `from_checkpoint` in one of these ways:

- a checkpoint: `MODEL_DIR/checkpoint_<step>`, a converted t5forge directory, a Hugging
  Face directory, a T5X checkpoint directory or file, a Mesh TF bundle's prefix
  (`model.ckpt-N`, not a file itself), its .index or directory; it names itself;
- a MODEL_DIR: its newest intact `checkpoint_<step>` (newer damaged ones are named in a
  note, `native.latest_checkpoint`), or, with `step`, that step's;
- every checkpoint of a MODEL_DIR (`resolve_all`: eval's mode 'all').

    resolve("run")            # -> Resolved(path="/abs/run/checkpoint_300", step=300, ...)
    resolve("run", step=100)  # -> /abs/run/checkpoint_100
    resolve_all("run")        # -> [.../checkpoint_100, .../checkpoint_200, ...]

Paths come back absolute (Orbax takes no other), so a relative one works from any working
directory; what the user wrote is kept for messages. A `gs://` or `s3://` URL names a
checkpoint or MODEL_DIR in a bucket the same ways and comes back a URL (normalized); what
reads it is decided after (`convert.readable`: Orbax in place on gs://, else a local copy). A Hugging Face Hub name is fetched
before it gets here (`convert.local_path`). Which format the checkpoint is in is decided
after (`convert.detect_format`).
"""
from __future__ import annotations

import dataclasses
import os

from t5forge import storage
from t5forge.convert import mtf, native
from t5forge.errors import UserError

_KINDS = ("pass a checkpoint (checkpoint_<step>, a t5forge, HF, T5X or Mesh TF "
          "model.ckpt-N checkpoint) or the MODEL_DIR a run wrote")


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A checkpoint to read.

  Attributes:
    path: absolute path of the checkpoint directory (or T5X file).
    given: the path as the user wrote it, for messages.
    step: the step of a `checkpoint_<step>` directory; None for a checkpoint of another
      name (an HF directory, a converted one).
    model_dir: absolute MODEL_DIR that `path` is a step of; None when it is not one.
  """

  path: str  # a URL for a checkpoint in a bucket
  given: str
  step: int | None = None
  model_dir: str | None = None


def _absolute(path: str) -> str:
  if not path:
    raise UserError(f"no checkpoint path given; {_KINDS}")
  if storage.is_remote(path):
    return storage.normalize(path)
  return os.path.abspath(os.path.expanduser(path))


def _found(path: str) -> str:
  if storage.is_remote(path):
    names = storage.listdir(path)
  else:
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
  return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "nothing"


def is_model_dir(path: str) -> bool:
  """A directory of `checkpoint_<step>` directories (not itself a checkpoint)."""
  if path and storage.is_remote(path):
    full = storage.normalize(path)
    return bool(native.checkpoint_steps(full)) and not native.is_native_checkpoint(full)
  full = os.path.abspath(os.path.expanduser(path)) if path else ""
  return (os.path.isdir(full) and not native.is_native_checkpoint(full)
          and bool(native.checkpoint_steps(full)))


def _of(full: str, given: str) -> Resolved:
  step = native.step_of(full) if native.is_native_checkpoint(full) else None
  return Resolved(full, given, step, storage.dirname(full) if step is not None else None)


def resolve(path: str, *, step: int | None = None) -> Resolved:
  """The checkpoint `path` names (see the module doc).

  Args:
    path: a checkpoint or a MODEL_DIR, absolute or relative to the working directory.
    step: with a MODEL_DIR, read its `checkpoint_<step>` instead of the newest.

  Raises:
    UserError (one line naming the path and the fix): no such path; `step` of a path that
      is not a MODEL_DIR or that it does not hold; every checkpoint of the MODEL_DIR damaged.
  """
  full = _absolute(path)
  shown = path if full == path else f"{path} ({full})"
  if not storage.exists(full):
    if mtf.find_prefix(full) is not None:  # a Mesh TF prefix names files, not itself one
      if step is not None and mtf.step_of(full) != step:
        raise UserError(f"{shown}: step {step} asked for, but this Mesh TF checkpoint is "
                        f"step {mtf.step_of(full)}; pass the prefix of step {step}")
      # Its directory plays a MODEL_DIR's part (eval writes inference_eval/ there).
      return Resolved(full, path, mtf.step_of(full), storage.dirname(full))
    raise UserError(f"{shown}: no such file or directory; {_KINDS}")
  if not is_model_dir(full):
    if step is not None and native.step_of(full) != step:
      raise UserError(f"{shown}: step {step} asked for, but this is not a MODEL_DIR of "
                      f"checkpoint_<step> directories (found {_found(full)}); pass the MODEL_DIR")
    return _of(full, path)
  if step is None:
    latest = native.latest_checkpoint(full)  # UserError when every one is damaged
    return Resolved(latest, path, native.step_of(latest), full)
  steps = native.checkpoint_steps(full)
  if step not in steps:
    raise UserError(f"{shown}: has no complete checkpoint_{step} (its steps: "
                    f"{', '.join(map(str, steps))}); pass one of them")
  return Resolved(native.step_dir(full, step), path, step, full)


def resolve_all(path: str) -> list[Resolved]:
  """Every committed checkpoint of the MODEL_DIR `path`, oldest first (intact or not: the
  reader of each says which is damaged).

  Raises:
    UserError: `path` is not a MODEL_DIR.
  """
  full = _absolute(path)
  steps = native.checkpoint_steps(full) if not native.is_native_checkpoint(full) else []
  if not steps:
    raise UserError(f"{path}: every checkpoint of a MODEL_DIR asked for (mode 'all'), but "
                    f"it holds no checkpoint_<step> directories (found {_found(full)}); "
                    "pass the MODEL_DIR a run wrote, or mode 'latest' / 'specific'")
  return [Resolved(native.step_dir(full, s), path, s, full) for s in steps]
