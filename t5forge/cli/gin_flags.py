"""T5X's gin flags: `--gin_file=F` (repeatable), `--gin.NAME=VALUE` (repeatable),
`--gin_bindings=...`, `--gin_search_paths=a,b`; and gin's errors as one line.

Search paths always include the working directory, t5forge's `configs/` directory (so
`include 'runs/finetune.gin'` works) and the directory holding the `t5forge` package
(so `include 't5forge/configs/runs/finetune.gin'` works too).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Callable, Sequence

from t5forge.errors import UserError

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(CONFIGS_DIR))

# Flags T5X's scripts accept that mean nothing here; accepted so copied commands run.
_IGNORED = ("--alsologtostderr", "--logtostderr", "--tfds_data_dir", "--seqio_additional_cache_dirs")


def split_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
  """argv -> (gin files, gin bindings, search paths, other args)."""
  files, bindings, paths, rest = [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    takes_value = name in ("--gin_file", "--gin_bindings", "--gin_search_paths")
    if takes_value and not eq:
      if i + 1 >= len(args):
        raise UserError(f"{name} needs a value")
      value, i = args[i + 1], i + 1
    if name == "--gin_file":
      files += [v for v in value.split(",") if v]
    elif name == "--gin_bindings":
      bindings.append(value)
    elif name == "--gin_search_paths":
      paths += [v for v in value.split(",") if v]
    elif name.startswith("--gin."):
      if not eq:
        raise UserError(f"{arg}: write --gin.NAME=VALUE (strings in quotes: "
                        f"--gin.MODEL_DIR=\\\"/tmp/run\\\")")
      bindings.append(f"{name[len('--gin.'):]}={value}")
    elif name in _IGNORED:
      pass
    else:
      rest.append(arg)
    i += 1
  return files, bindings, paths, rest


def _describe_binding(binding: str, sources: dict[str, str]) -> str:
  return sources.get(binding, binding)


def parse(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
  """Parses gin files and bindings, translating gin's errors into UserErrors."""
  import gin  # pylint: disable=import-outside-toplevel
  gin.clear_config()
  for path in [os.getcwd(), CONFIGS_DIR, PACKAGE_PARENT, *search_paths]:
    gin.add_config_file_search_path(path)
  if not files:
    raise UserError("no --gin_file given; e.g. --gin_file=t5forge/configs/examples/"
                    "bible_translate_from_scratch.gin")
  # A binding of a macro that is not quoted (--gin.MODEL_DIR=/tmp/x) is the most common slip.
  for b in bindings:
    name, _, value = b.partition("=")
    value = value.strip()
    if value.startswith("/") or value.startswith("~"):
      raise UserError(f"--gin.{name.strip()}={value}: gin needs strings quoted; write "
                      f"--gin.{name.strip()}=\\\"{value}\\\"")
  quiet = _DropPathNotFound()
  logging.getLogger().addFilter(quiet)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=True)
  except (ValueError, KeyError, SyntaxError, ImportError, OSError, TypeError, NameError) as e:
    raise UserError(explain(e)) from None
  finally:
    logging.getLogger().removeFilter(quiet)


class _DropPathNotFound(logging.Filter):
  """gin logs an ERROR for every search path an include was not found in, even when a
  later one has it; only a file found nowhere is an error (raised as such)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.getMessage()).startswith("Path not found:")


def explain(e: BaseException) -> str:
  """One line for a gin error: what is wrong, which binding, and the flag that fixes it."""
  msg = str(e).strip()
  first = msg.splitlines()[0] if msg else type(e).__name__
  m = re.search(r"(\S+?)(?:/macro\.value)? set to `%gin\.REQUIRED` but not subsequently overridden",
                msg)
  if m:
    name = m.group(1).split("/")[0]
    return (f"{name} is required but not set; set it in your gin file or with "
            f"--gin.{name}=... (strings quoted)")
  m = re.search(r"'([^']+)' was not provided by an import statement", msg)
  if m:
    return (f"{m.group(1)!r} is used but not imported{_where(msg)}; a gin file with "
            "`from __gin__ import dynamic_registration` must import every module it names, "
            "e.g. `from t5forge.nn import config as network`")
  m = re.search(r"No configurable matching reference '([^']+)'", msg)
  if m:
    return (f"unknown reference {m.group(1)}{_where(msg)}; gin imports are per file: add the "
            "module's import (e.g. `from t5forge.train import optim`) under `from __gin__ import "
            "dynamic_registration` at the top of the file that uses it")
  m = re.search(r"No configurable matching '([^']+)'", msg)
  if m:
    where = _where(msg)
    return (f"unknown configurable or macro {m.group(1)!r}{where}; check the spelling and that "
            "its module is imported in the gin file (from __gin__ import dynamic_registration)")
  m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
  if m:
    return (f"{m.group(1)} has no parameter {m.group(2)!r}{_where(msg)}; remove the binding or "
            "fix its name")
  m = re.search(r"Unable to open file: (\S+)\. Searched config paths: (.*)", msg)
  if m:
    return (f"gin file {m.group(1)} not found (searched {m.group(2).strip()}); pass its path or "
            "add its directory with --gin_search_paths")
  m = re.search(r"Unknown reference to configurable '([^']+)'|Macro '([^']+)' not found", msg)
  if m:
    return f"gin reference {m.group(1) or m.group(2)!r} is not defined{_where(msg)}"
  if isinstance(e, ImportError):
    return f"gin file imports a module that cannot be imported: {first}"
  return f"gin config error: {first}{_where(msg)}"


def _where(msg: str) -> str:
  m = re.search(r"In (?:file \"([^\"]+)\", line (\d+)|bindings string line \d+)\n\s*(.*)", msg)
  if not m:
    return ""
  if m.group(1):
    return f" ({m.group(1)}:{m.group(2)}: {m.group(3).strip()})"
  return f" (in --gin.{m.group(3).strip()})"


def call(fn: Callable, **kwargs):
  """Calls the gin-configured version of `fn`, turning missing-argument errors into one
  line that names the gin binding to add."""
  import gin  # pylint: disable=import-outside-toplevel
  configured = gin.get_configurable(fn)
  try:
    return configured(**kwargs)
  except TypeError as e:
    m = re.search(r"missing \d+ required (?:keyword-only )?argument[s]?: (.*)", str(e))
    if m and fn.__name__ in str(e):
      names = re.findall(r"'([^']+)'", m.group(1))
      raise UserError(f"{fn.__name__} needs {', '.join(names)}; bind them in a gin file or with "
                      f"--gin.{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}.{names[0]}=...") from None
    raise
