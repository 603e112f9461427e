"""The one place t5forge touches gin-config's private names (gin 0.5.0, pinned).

gin has no public API for: the search paths it keeps across `clear_config()`, every parsed
binding with its scope (to find `ModelConfig.dtype` and the macros), and its file readers
(to patch the package reader's TypeError). tests/test_gin_internals.py pins these to the
locked gin version, so an upgrade that moves them fails there, not in a user's run.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gin import config as gin_config

GIN_VERSION = "0.5.0"


def reset_search_paths() -> None:
  """gin's search paths back to its default ([''] = file names as given)."""
  gin_config._LOCATION_PREFIXES[:] = [""]  # noqa: SLF001


def search_paths() -> list[str]:
  """The search paths gin tries, in order (a copy)."""
  return list(gin_config._LOCATION_PREFIXES)  # noqa: SLF001


def bindings() -> Iterator[tuple[str, str, dict[str, Any]]]:
  """(scope, selector, {parameter: value}) for every configurable the parsed files bind;
  a macro NAME is (NAME, 'gin.macro', {'value': ...})."""
  for (scope, selector), values in gin_config._CONFIG.items():  # noqa: SLF001
    yield scope, selector, values


def file_readers() -> list:
  """gin's list of (reader, exists) pairs, which gin reads on every include (mutable)."""
  return gin_config._FILE_READERS  # noqa: SLF001
