"""T5X's gin flags: `--gin_file=F` (repeatable), `--gin.NAME=VALUE` (repeatable),
`--gin_bindings=...`, `--gin_search_paths=a,b`; and gin's errors as one line.

Search paths always include the working directory, t5forge's `configs/` directory (so
`include 'runs/finetune.gin'` works) and the directory holding the `t5forge` package
(so `include 't5forge/configs/runs/finetune.gin'` works too), from any working directory.
`--gin_search_paths` directories are also put on `sys.path` (after what is there), so a
gin file's `import tasks` finds `tasks.py` in them, as with T5X's `PYTHONPATH` advice.

What gin would accept silently and we refuse, each with one line: a command-line macro
that no configuration uses (`--gin.TRAIN_STEPZ=10`: "did you mean TRAIN_STEPS?"), and an
unquoted string value (`--gin.MODEL_DIR=runs/x`).
"""
from __future__ import annotations

import ast
import difflib
import logging
import os
import re
import sys
import tokenize
from typing import Any, Callable, Sequence

import gin
from gin import config as gin_config

from t5forge import precision
from t5forge.cli import gin_internals
from t5forge.errors import UserError

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(CONFIGS_DIR))

# Flags T5X's scripts accept that mean nothing here (logging goes to stderr anyway); accepted
# so copied commands run. The data flags are `data_flags`'.
_IGNORED = ("--alsologtostderr", "--logtostderr")


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


def parse(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
  """Parses gin files and bindings, translating gin's errors into UserErrors."""
  gin.clear_config()
  _guard_package_reader()
  # gin keeps search paths across clear_config(): start from its default ('' = as given)
  # so that an earlier parse's --gin_search_paths cannot shadow this one's files.
  gin_internals.reset_search_paths()
  for path in [os.getcwd(), CONFIGS_DIR, PACKAGE_PARENT, *search_paths]:
    if path not in gin_internals.search_paths():
      gin.add_config_file_search_path(path)
  for path in search_paths:  # T5X: "the Gin file and python modules" come from these
    path = os.path.abspath(path)
    if path not in sys.path:
      sys.path.append(path)
  if not files:
    raise UserError("no --gin_file given; e.g. --gin_file=t5forge/configs/examples/"
                    "bible_translate_from_scratch.gin")
  for b in bindings:
    _check_binding_value(b)
  quiet = _DropPathNotFound()
  logging.getLogger().addFilter(quiet)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)
    _check_macros_used(bindings)
    gin.finalize()
  except tokenize.TokenError as e:  # gin's tokenizer does not say which file
    line = e.args[1][0] if len(e.args) > 1 else "?"
    raise UserError(f"gin syntax error: {e.args[0]} at line {line} of {', '.join(files)} or a "
                    "file it includes (an unclosed bracket or quote?)") from None
  except (ValueError, KeyError, SyntaxError, ImportError, OSError, TypeError, NameError) as e:
    raise UserError(explain(e)) from None
  except AttributeError as e:  # a module a gin file imports (`import tasks`) names what is not
    from t5forge.data.tasks import unknown_name_message  # noqa: PLC0415 (after the flags parse: --help stays fast)
    raise UserError(f"a gin file's import failed: {unknown_name_message(e)}") from None
  finally:
    logging.getLogger().removeFilter(quiet)


def _check_binding_value(binding: str) -> None:
  """A command-line value gin cannot read as a literal or reference is almost always a
  string without quotes (--gin.MODEL_DIR=runs/x); gin's own message for it is
  `malformed node or string ... <ast.Name ...>`."""
  name, eq, value = binding.partition("=")
  name, value = name.strip(), value.strip()
  if not eq or not value or value[0] in "@%[{(\"'" or "\n" in binding:
    return
  try:
    ast.literal_eval(value)
  except (ValueError, SyntaxError):
    raise UserError(f"--gin.{name}={value}: not a gin value; strings need quotes: write "
                    f"--gin.{name}=\\\"{value}\\\"") from None


_MACRO_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_macros_used(bindings: Sequence[str]) -> None:
  """Refuses a command-line macro (NAME=VALUE) that no binding refers to as %NAME: gin
  accepts it and changes nothing (--gin.TRAIN_STEPZ=10)."""
  defined = {scope for scope, selector, _ in gin_internals.bindings() if selector == "gin.macro"}
  referenced: set[str] = set()

  def walk(value: Any) -> None:
    if isinstance(value, gin_config.ConfigurableReference):
      if value.selector == "gin.macro" or value.selector.endswith(".macro"):
        referenced.add("/".join(value.scopes))
    elif isinstance(value, dict):
      for v in value.values():
        walk(v)
    elif isinstance(value, (list, tuple, set)):
      for v in value:
        walk(v)

  for _, _, params in gin_internals.bindings():
    walk(params)
  for b in bindings:
    name = b.partition("=")[0].strip()
    if _MACRO_NAME.match(name) and name in defined and name not in referenced:
      known = sorted(referenced | defined - {x.partition("=")[0].strip() for x in bindings})
      close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
      hint = (f"; did you mean --gin.{close[0]}?" if close else
              f"; the macros these gin files use: {', '.join(sorted(referenced)) or 'none'}")
      raise UserError(f"--gin.{name}: no gin file uses the macro {name}, so it would change "
                      f"nothing{hint}")


def _guard_package_reader() -> None:
  """gin's package reader (gin/resource_reader.py) reads `a/b/x.gin` as file x.gin of the
  Python package `a.b`; for a folder without `__init__.py` that Python still imports as a
  namespace package (a user's `runs/`, or `t5forge/configs/examples`) it raises TypeError
  instead of answering "not there", and the search stops. Answer "not there" instead, so
  the next search path is tried."""
  readers = gin_internals.file_readers()
  for i, (reader, exists) in enumerate(readers):
    if getattr(exists, "_t5forge_guarded", False):
      continue

    def guarded(path, _exists=exists):
      try:
        return _exists(path)
      except TypeError:  # a namespace package has no origin
        return False

    guarded._t5forge_guarded = True  # noqa: SLF001 (our marker on a function)
    readers[i] = (reader, guarded)


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
    return (f"a gin file imports a module that cannot be imported ({first}){_where(msg)}; "
            "put the directory that holds it on PYTHONPATH, or pass it with --gin_search_paths")
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


def apply_precision(platform: str | None = None,
                    flags: frozenset[str] | None = None) -> precision.Choice:
  """Chooses the run's dtype from the parsed (finalized) gin config and this machine
  (`precision.choose`), and binds it where the run set none, so that config.gin records it.
  Prints nothing."""
  platform, flags = precision.machine(platform, flags)
  selectors, requested = [], None
  for scope, selector, values in gin_internals.bindings():
    if selector.rsplit(".", 1)[-1] != "ModelConfig":
      continue
    selectors.append(selector)
    if "dtype" in values:
      value = values["dtype"]
      if requested is None or not scope:  # an unscoped binding is the one models get
        requested = value if isinstance(value, str) else "?"
  choice = precision.choose(requested, platform=platform, flags=flags,
                            configurable=bool(selectors))
  if choice.auto:
    with gin.unlock_config():
      gin.bind_parameter(f"{selectors[0]}.dtype", choice.dtype)
  return choice
