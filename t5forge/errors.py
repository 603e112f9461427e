"""The one exception type the CLI turns into a one-line message instead of a traceback."""


class UserError(Exception):
  """Bad input from the user: a file, field, flag or name, and how to fix it.

  The message must fit on one line and say what to do. The CLI prints
  `t5forge: error: <message>` and exits with status `exit_code`: 2, unless a subclass
  names another (3: the run lost its MODEL_DIR lock, `run_lock.LockLost`).
  """

  exit_code = 2
