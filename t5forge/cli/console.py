"""What the command line shows of the library's log: one plain handler.

Library modules log through `logging.getLogger("t5forge")` (or a child of it) and print
nothing; a library user sees warnings (Python's last-resort handler) and configures the rest
as with any library. The command line shows INFO on stdout and WARNING and above on stderr,
as bare messages, so its output reads as before. Streams are looked up at each record, so a
test's captured stdout/stderr sees them.
"""
from __future__ import annotations

import logging
import sys


class _Console(logging.Handler):
  """INFO -> stdout, WARNING and above -> stderr; the message only, flushed."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
      stream.write(self.format(record) + "\n")
      stream.flush()
    except Exception:  # noqa: BLE001 (logging's own contract)
      self.handleError(record)


def install() -> None:
  """Adds the console handler to the root logger once and lets t5forge's INFO through.

  On the root logger, as an application does: absl (which orbax logs through) calls
  `logging.basicConfig()` when the root has no handler, which would print every record a
  second time in its own format.
  """
  if not any(isinstance(h, _Console) for h in logging.root.handlers):
    logging.root.addHandler(_Console())
  logger = logging.getLogger("t5forge")
  if logger.level == logging.NOTSET or logger.level > logging.INFO:
    logger.setLevel(logging.INFO)
