"""Test-only: `t5forge serve` with a fault patched in, run by tests/test_serve_faults.py as

    python -c "import sys; sys.path.insert(1, 'tests'); import serve_fault_hook; \
serve_fault_hook.main(sys.argv[1:])" serve --checkpoint ...

A completion whose prompt starts with token id MARKER arms the fault: from then on every
decode step raises, and so does rebuilding the slot state afterwards, so the engine's
worker cannot go on and dies. Nothing here is read by t5forge itself.
"""
from __future__ import annotations

import threading

from t5forge.cli import main as cli_main
from t5forge.engine import scheduler, slots

MARKER = 7999  # the vocabulary's last id: no prompt of the tests starts with it
FAULT = "injected fault"
_armed = threading.Event()


def _patch() -> None:
  submit, step, reset = scheduler.Engine.submit, slots.Slots.step, slots.Slots.reset

  def submit_(self, rows):
    if any(r.ids[:1] == [MARKER] for r in rows):
      _armed.set()
    return submit(self, rows)

  def step_(self, free=None):
    if _armed.is_set():
      raise RuntimeError(f"{FAULT}: the decode step")
    return step(self, free)

  def reset_(self):
    if _armed.is_set():
      raise RuntimeError(f"{FAULT}: the slot state")
    return reset(self)

  scheduler.Engine.submit, slots.Slots.step, slots.Slots.reset = submit_, step_, reset_


def main(argv: list[str]) -> None:
  _patch()
  cli_main.main(argv)
