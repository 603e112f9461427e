"""What the benchmark drivers (`python -m bench`, `python -m bench serve`) do with a run:
write its report as JSON, and unwind on SIGTERM as on ctrl-C, so that the workers and
servers they started are stopped on the way out."""
from __future__ import annotations

import json
import signal

from t5forge import files


def write_json(path: str, report: dict) -> None:
  """`report` -> `path` (indented JSON; values json cannot write become strings), atomically,
  so a run killed while writing leaves the previous file."""
  with files.atomic_file(path) as f:
    json.dump(report, f, indent=2, default=str)


def _terminate(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def unwind_on_sigterm() -> None:
  """SIGTERM raises KeyboardInterrupt in the main thread, as ctrl-C does."""
  signal.signal(signal.SIGTERM, _terminate)
