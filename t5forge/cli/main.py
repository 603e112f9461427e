"""Dispatches `t5forge <command> [flags]` to the module that implements the command.

Each command module has `main(argv: list[str]) -> int | None`. Commands are imported
lazily so that `t5forge convert --help` does not pay for importing the trainer.
"""
from __future__ import annotations

import importlib
import sys

from t5forge import host_memory
from t5forge.errors import UserError

# command name -> (module, one-line help)
COMMANDS = {
    "demo": ("t5forge.cli.demo", "the README's main job: train, evaluate BLEU, show translations"),
    "train": ("t5forge.cli.train", "train with T5X-style gin files (--gin_file, --gin.NAME=VALUE)"),
    "infer": ("t5forge.cli.infer", "predict or score a task split or a file to JSONL (resumable)"),
    "eval": ("t5forge.cli.eval", "evaluate checkpoints on a task's metrics"),
    "convert": ("t5forge.cli.convert", "convert checkpoints between HF, T5X and t5forge formats"),
    "vocab": ("t5forge.cli.vocab", "train or inspect SentencePiece vocabularies"),
    "serve": ("t5forge.cli.serve", "serve a checkpoint over HTTP: OpenAI-compatible completions"),
    "export": ("t5forge.cli.export", "export a model: jax.export functions, a TF SavedModel, or HF"),
    "cache_tasks": ("t5forge.cli.cache_tasks",
                    "write SeqIO caches of tasks on Apache Beam (use_cached=True reads them)"),
}


def _usage() -> str:
  lines = ["usage: t5forge <command> [flags]", "", "commands:"]
  lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
  lines += ["", "`t5forge <command> --help` shows a command's flags."]
  return "\n".join(lines)


# T5X's flags for several processes; accepted by every command.
_MULTIHOST_FLAGS = ("--multiprocess", "--coordinator_address", "--process_count",
                    "--process_index", "--heartbeat_timeout_seconds")


def _pop_multihost_flags(argv: list[str]) -> tuple[list[str], dict | None]:
  """Removes the multi-process flags from argv; returns their values (None: not asked)."""
  rest, values, asked = [], {}, False
  i = 0
  while i < len(argv):
    name, eq, value = argv[i].partition("=")
    if name in _MULTIHOST_FLAGS:
      asked = True
      if name != "--multiprocess":
        if not eq:
          if i + 1 >= len(argv):
            raise UserError(f"{name} needs a value")
          value, i = argv[i + 1], i + 1
        values[name[2:]] = value
    else:
      rest.append(argv[i])
    i += 1
  if not asked:
    return rest, None
  try:
    for key in ("process_count", "process_index", "heartbeat_timeout_seconds"):
      if key in values:
        values[key] = int(values[key])
  except ValueError as e:
    raise UserError(f"multi-process flag: {e}") from None
  return rest, values


def main(argv: list[str] | None = None) -> None:
  argv_given, argv = argv, list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(_usage())
    sys.exit(0)
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    print(f"t5forge: error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}",
          file=sys.stderr)
    sys.exit(2)
  # Before JAX starts its threads: the host allocator (t5forge/host_memory.py). As the
  # program (argv None), restart once with the chosen malloc (jemalloc) preloaded; from
  # Python (tests call main(argv)), only T5FORGE_MALLOC=keep applies, in this process.
  try:
    if argv_given is None:
      host_memory.reexec()
    host_memory.keep_freed_memory()
  except ValueError as e:
    print(f"t5forge: error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    rest, multihost_flags = _pop_multihost_flags(rest)
    if multihost_flags is not None:
      from t5forge import multihost  # noqa: PLC0415 (after the flags parse: --help stays fast)
      multihost.initialize(**multihost_flags)
    module = importlib.import_module(COMMANDS[name][0])
    code = module.main(rest)
  except UserError as e:
    # gin appends "In call to configurable ..." lines; the first line is the message.
    print(f"t5forge: error: {str(e).splitlines()[0]}", file=sys.stderr)
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    print("t5forge: interrupted", file=sys.stderr)
    sys.exit(130)
  except BrokenPipeError:
    # `t5forge ... | head` closed our stdout: not an error worth a traceback.
    sys.stderr.close()
    sys.exit(0)
  sys.exit(code or 0)
