"""The exception types the CLI turns into a one-line message instead of a traceback."""


class UserError(Exception):
  """Bad input from the user: a file, field, flag or name, and how to fix it.

  The message must fit on one line and say what to do. The CLI prints
  `t5forge: error: <message>` and exits with `exit_code` (2).
  """

  exit_code = 2


class Unavailable(UserError):
  """Something outside the run failed for now (the network, a bucket, memory) and went on
  failing through its retries; nothing was changed or set aside. The CLI exits with 75
  (EX_TEMPFAIL in sysexits.h): a supervisor may restart the same command as it is."""

  exit_code = 75
