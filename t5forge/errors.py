"""The exceptions the CLI and the server treat specially.

`UserError` is bad input: the CLI prints its one line and exits with its `exit_code` (2);
the server answers 400. `Unavailable` (a UserError) is a failure outside the run that may
pass: one line, exit status 75. `InternalError` is a bug or a failure of ours:
`internal_error(exc, what)` logs `exc`'s traceback under a fresh error id and returns an
`InternalError` that carries only the id, which is all a client is ever told
(`internal error (id ID)`).
"""
from __future__ import annotations

import logging
import secrets

log = logging.getLogger(__name__)


class UserError(Exception):
  """Bad input from the user: a file, field, flag or name, and how to fix it.

  The message must fit on one line and say what to do. The CLI prints
  `t5forge: error: <message>` and exits with status `exit_code`: 2, unless a subclass
  names another (3: the run lost its MODEL_DIR lock, `run_lock.LockLost`; 75:
  `Unavailable`).
  """

  exit_code = 2


class Unavailable(UserError):
  """Something outside the run failed for now (the network, a bucket, memory) and went on
  failing through its retries; nothing was changed or set aside. The CLI exits with 75
  (EX_TEMPFAIL in sysexits.h): a supervisor may restart the same command as it is."""

  exit_code = 75


class InternalError(Exception):
  """An unexpected exception, logged with its traceback under `error_id` (its
  `__cause__`); its message names the id only."""

  def __init__(self, error_id: str):
    super().__init__(f"internal error (id {error_id})")
    self.error_id = error_id


def internal_error(exc: BaseException, what: str) -> InternalError:
  """Logs `exc` with its traceback under a new error id, saying `what` failed; -> the
  `InternalError` to hand on (its `__cause__` is `exc`)."""
  error_id = secrets.token_hex(6)
  log.error("internal error %s: %s", error_id, what, exc_info=exc)
  err = InternalError(error_id)
  err.__cause__ = exc
  return err
