"""Tokens to text for completions: incremental detokenization, stop sequences, and
OpenAI's legacy logprobs object.

A `ChoiceText` follows one completion as its tokens arrive. It decodes only a short
window of recent tokens per call (SentencePiece joins pieces, so the text a token adds
is the difference between two decodes of the window: the window starts at the last
token whose text was already complete), cuts the text at the first stop sequence, and
holds back what could still become one (or an incomplete UTF-8 character).
"""
from __future__ import annotations

import dataclasses


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
  """Cuts text before the earliest stop sequence; -> (text, whether one was found)."""
  hits = [i for i in (text.find(s) for s in stops) if i >= 0]
  return (text[:min(hits)], True) if hits else (text, False)


class ChoiceText:
  """One completion's text as its tokens arrive.

  Args:
    vocab: has `decode(ids) -> str`.
    stops: stop sequences (cut before the first).
    stop_ids: the ids that end a decode: one id (the vocabulary's EOS, rendered as
      nothing), or a tuple whose first is EOS and whose others (T5Gemma's <end_of_turn>)
      end the text without being part of it.
    skip_stop_ids: the row ignores its stop ids (ignore_eos): they are left out of the
      text, as special tokens, instead of ending it.
  """

  def __init__(self, vocab, stops: list[str], stop_ids, skip_stop_ids: bool = False):
    self.vocab, self.stops = vocab, stops
    self.extra_stops = set(stop_ids[1:]) if isinstance(stop_ids, tuple) else set()
    self.skipped = set(stop_ids) if isinstance(stop_ids, tuple) else {stop_ids}
    if not skip_stop_ids:
      self.skipped = set()
    self.hold = max((len(s) for s in stops), default=1) - 1
    self.ids: list[int] = []
    self.text = ""  # decoded so far (before any stop cut)
    self.sent = 0  # characters handed out
    self.stopped = False  # a stop sequence was found
    self.closed = False  # a stop id ended the text
    self._prefix = 0  # the decode window starts here ...
    self._read = 0  # ... and its text up to here is in self.text

  def feed(self, new_ids: list[int], final: bool = False) -> str:
    """Adds tokens; -> the text to send now ("" while it is held back)."""
    for t in new_ids:
      if self.closed or self.stopped:
        break
      if t in self.skipped:
        continue
      if t in self.extra_stops:
        self.closed = True
        break
      self.ids.append(t)
    window = self.vocab.decode(self.ids[self._prefix:])
    before = self.vocab.decode(self.ids[self._prefix:self._read])
    if len(window) > len(before) and not window.endswith("\ufffd"):
      self.text += window[len(before):] if window.startswith(before) else window
      self._prefix, self._read = self._read, len(self.ids)
    text, found = cut_at_stop(self.text, self.stops)
    self.stopped = self.stopped or found
    if not (final or found):
      text = text[:max(self.sent, len(text) - self.hold)]
    if len(text) <= self.sent:
      return ""
    delta, self.sent = text[self.sent:], len(text)
    return delta

  def finish(self) -> str:
    """The rest of the text once the tokens have all arrived."""
    if self._read < len(self.ids):  # a trailing incomplete character: decode it as is
      whole = self.vocab.decode(self.ids[self._prefix:])
      before = self.vocab.decode(self.ids[self._prefix:self._read])
      self.text += whole[len(before):] if whole.startswith(before) else whole
      self._prefix = self._read = len(self.ids)
    return self.feed([], final=True)

  def finish_reason(self, ended_with_stop_id: bool) -> str:
    """OpenAI's: "stop" for a stop id or a stop sequence, else "length"."""
    return "stop" if self.stopped or self.closed or ended_with_stop_id else "length"

  @property
  def final_text(self) -> str:
    return cut_at_stop(self.text, self.stops)[0]


def _token_texts(vocab, ids: list[int]) -> tuple[list[str], list[int]]:
  """Each token's text as the difference of the decoded prefixes (SentencePiece joins
  pieces, so a piece alone decodes differently), and its offset in the completion."""
  texts, offsets, prev = [], [], ""
  for k in range(len(ids)):
    cur = vocab.decode(ids[:k + 1])
    texts.append(cur[len(prev):] if cur.startswith(prev) else cur)
    offsets.append(len(prev))
    prev = cur
  return texts, offsets


def _top_entries(vocab, ids, top_ids, top_lp, start: int, end: int) -> list[dict]:
  """Positions start..end-1's {token text: log-prob} of their top tokens, each text
  read against the decoded prefix before it (so a position's entry depends only on the
  tokens before it: streamed and unstreamed agree)."""
  tops = []
  for k in range(start, end):
    prefix = vocab.decode(ids[:k])
    entry = {}
    for t, lp in zip(list(top_ids[k]), list(top_lp[k])):
      s = vocab.decode(ids[:k] + [int(t)])
      entry.setdefault(s[len(prefix):] if s.startswith(prefix) else s, float(lp))
    tops.append(entry)
  return tops


def _kept(offsets: list[int], texts: list[str], keep_chars: int) -> int:
  """How many tokens a choice of keep_chars characters keeps (all unless a stop
  sequence cut its text)."""
  if keep_chars < sum(map(len, texts)):
    return sum(1 for o in offsets if o < keep_chars)
  return len(offsets)


def logprobs(vocab, ids, token_lp, top_ids, top_lp, keep_chars: int) -> dict:
  """OpenAI's legacy logprobs object for one choice (tokens up to keep_chars of text).

  Args:
    ids: the choice's l tokens; token_lp [l]: their log-probs.
    top_ids, top_lp: [l, k] the most likely tokens and their log-probs, or None.
    keep_chars: the length of the choice's text (after a stop sequence cut it).
  """
  texts, offsets = _token_texts(vocab, ids)
  n = _kept(offsets, texts, keep_chars)
  tops = None if top_ids is None else _top_entries(vocab, ids, top_ids, top_lp, 0, n)
  return {"tokens": texts[:n], "token_logprobs": [float(x) for x in token_lp[:n]],
          "top_logprobs": tops, "text_offset": offsets[:n]}


class LogprobStream:
  """One choice's logprobs object in the pieces a stream sends: tokens are added as
  they arrive, and handed out once the text before them was sent (a stop sequence can
  no longer drop them), the rest at the end; joined, the pieces are `logprobs(...)` of
  the whole choice.

  Args:
    vocab: has `decode(ids) -> str`.
    k: top log-probs per token (0: top_logprobs is None).
  """

  def __init__(self, vocab, k: int):
    self.vocab, self.k = vocab, k
    self.ids: list[int] = []
    self.lps: list[float] = []
    self.top_ids: list = []
    self.top_lps: list = []
    self.texts: list[str] = []
    self.offsets: list[int] = []
    self._prev = ""  # the decode of all ids so far
    self._given = 0  # tokens handed out

  def add(self, ids, lps, top_ids, top_lps) -> None:
    """A step's new tokens [n], their log-probs [n] and top tokens / log-probs [n, K]."""
    for t in ids:
      self.ids.append(int(t))
      cur = self.vocab.decode(self.ids)
      self.texts.append(cur[len(self._prev):] if cur.startswith(self._prev) else cur)
      self.offsets.append(len(self._prev))
      self._prev = cur
    self.lps += [float(x) for x in lps]
    self.top_ids += [list(x)[:self.k] for x in top_ids]
    self.top_lps += [list(x)[:self.k] for x in top_lps]

  def _piece(self, end: int) -> dict:
    a, self._given = self._given, max(self._given, end)
    b = self._given
    tops = None if not self.k else _top_entries(self.vocab, self.ids, self.top_ids,
                                                self.top_lps, a, b)
    return {"tokens": self.texts[a:b], "token_logprobs": self.lps[a:b],
            "top_logprobs": tops, "text_offset": self.offsets[a:b]}

  def release(self, sent_chars: int) -> dict:
    """The tokens whose text starts within the sent_chars already sent."""
    return self._piece(sum(1 for o in self.offsets if o < sent_chars))

  def finish(self, keep_chars: int) -> dict:
    """The tokens left, once the choice's final text (keep_chars long) is known."""
    return self._piece(_kept(self.offsets, self.texts, keep_chars))


@dataclasses.dataclass
class Choice:
  """One finished completion, whichever path decoded it."""
  ids: list[int]  # new tokens (stop id included)
  token_logprobs: list[float] | None
  top_ids: list | None  # [l][k]
  top_logprobs: list | None
  finished: bool  # ended with a stop id
