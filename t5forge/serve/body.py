"""JSON request bodies that Python's `json` accepts but no route can use, found before
any model sees them; `api.parse` runs these for every route.

    loads(raw) -> data          NaN / Infinity / 1e999, nesting deeper than MAX_DEPTH and
                                strings with lone UTF-16 surrogates ("\\ud800") are a
                                `BadBody` naming the field (`temperature`, `prompt[1]`)

Python's `json` reads NaN and Infinity (not JSON), turns 1e999 into inf, recurses once
per nesting level (a body nested 100,000 deep is a RecursionError) and decodes "\\ud800"
into a str that cannot be encoded as UTF-8 (the tokenizer's C++ side then fails). All
walks here are iterative.
"""
from __future__ import annotations

import json
import math
import re

MAX_DEPTH = 32  # nesting levels; OpenAI's bodies use at most 4 (a list of token-id lists)


class BadBody(ValueError):
  """A body no route can use; `param` names the field ('body' for the whole)."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


class _NonFinite(str):
  """A number JSON cannot hold (NaN, Infinity, or a float that overflows to inf)."""


def _float(s: str):
  x = float(s)
  return x if math.isfinite(x) else _NonFinite(s)


def _join(path: str, part) -> str:
  if isinstance(part, int):
    return f"{path}[{part}]"
  return f"{path}.{part}" if path else str(part)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _top(path: str) -> str:
  """The top-level field of a path ('prompt' of 'prompt[0][0]'): what a client set."""
  return re.split(r"[.\[]", path, maxsplit=1)[0] or "body"


def _check(data) -> None:
  """Walks `data` (iteratively); BadBody at the first unusable value."""
  stack = [(data, "", 0)]
  while stack:
    x, path, depth = stack.pop()
    if isinstance(x, _NonFinite):
      raise BadBody(f"{path or 'body'} is {x}, which is not a finite number; send a JSON "
                    "number", path or "body")
    if isinstance(x, str):
      m = _SURROGATE.search(x)
      if m:
        raise BadBody(f"{path or 'body'} holds a lone UTF-16 surrogate "
                      f"(\\u{ord(m.group()):04x} at character {m.start()}); send valid "
                      "Unicode (pair the surrogate or drop it)", path or "body")
      continue
    if isinstance(x, (dict, list)):
      if depth >= MAX_DEPTH:
        top = _top(path)
        raise BadBody(f"{top} is nested more than {MAX_DEPTH} levels deep", top)
      items = x.items() if isinstance(x, dict) else enumerate(x)
      for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
          raise BadBody(f"a key in {path or 'the body'} holds a lone UTF-16 surrogate; "
                        "send valid Unicode", path or "body")
        stack.append((v, _join(path, k), depth + 1))


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"\s*(:?)|[\[\]{},]')


def _deep_path(text: str) -> str:
  """The top-level field in which `text` first nests deeper than MAX_DEPTH, read from
  its brackets, keys and commas (for a body Python's json could not even parse)."""
  stack: list[list] = []  # [container char, key or index]
  for m in _TOKEN.finditer(text):
    tok = m.group()
    if tok in "[{":
      if len(stack) >= MAX_DEPTH:
        break
      stack.append([tok, 0 if tok == "[" else None])
    elif tok in "]}":
      if stack:
        stack.pop()
    elif tok == ",":
      if stack and stack[-1][0] == "[":
        stack[-1][1] += 1
    elif m.group(1) and stack and stack[-1][0] == "{":
      try:
        stack[-1][1] = json.loads(tok[:tok.rindex('"') + 1])
      except ValueError:
        stack[-1][1] = "?"
  top = stack[0][1] if stack and stack[0][0] == "{" else None
  return str(top) if top is not None else "body"


def loads(raw: bytes):
  """Request bytes -> the parsed JSON; ValueError / UnicodeDecodeError as `json.loads`
  (malformed JSON), BadBody for what `_check` refuses."""
  try:
    data = json.loads(raw, parse_constant=_NonFinite, parse_float=_float)
  except RecursionError:
    text = raw.decode("utf-8", errors="replace")
    path = _deep_path(text)
    raise BadBody(f"{path} is nested more than {MAX_DEPTH} levels deep", path) from None
  _check(data)
  return data
