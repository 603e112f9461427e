"""Tokens to text for completions: incremental detokenization, stop sequences, and
OpenAI's legacy logprobs object.

`TokenTexts` turns tokens into text one at a time, decoding only a short window of
recent tokens per token (linear in the completion's length, see its docstring). A
`ChoiceText` follows one completion's text with it, cuts the text at the first stop
sequence and holds back what could still become one; `logprobs` and `LogprobStream`
read each token's text, offset and top tokens' texts from it.
"""
from __future__ import annotations

import dataclasses


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
  """Cuts text before the earliest stop sequence; -> (text, whether one was found)."""
  hits = [i for i in (text.find(s) for s in stops) if i >= 0]
  return (text[:min(hits)], True) if hits else (text, False)


class TokenTexts:
  """Each token's text and its offset in the completion, as the tokens arrive.

  Decoding costs O(1) tokens per token, not the whole prefix (a 4,000-token completion
  would re-decode 8 million tokens): SentencePiece joins pieces (the leading space of a
  text's first piece is dropped, byte pieces merge into one character), so a token's text
  is the difference between two decodes of a short window that starts at an earlier token
  whose text is complete. A token that leaves an incomplete character (a byte piece) gets
  "" and the token that completes it gets the character; offsets always add up:
  `offsets[k] == len("".join(texts[:k]))`.

  Args:
    vocab: has `decode(ids) -> str` (which stops at its EOS).
    hidden: ids rendered as "" and kept out of the window: the vocabulary's EOS, because
      `decode` stops at it (an ignore_eos row's text goes on after one).
  """

  def __init__(self, vocab, hidden=()):
    self.vocab, self.hidden = vocab, set(hidden)
    self.ids: list[int] = []
    self.texts: list[str] = []
    self.offsets: list[int] = []
    self.text = ""  # "".join(self.texts)
    self._contexts: list[tuple[int, int]] = []  # token k's window before it: _win[a:b]
    self._win: list[int] = []  # the rendered ids (hidden ones left out)
    self._prefix = 0  # the window starts here in _win ...
    self._read = 0  # ... and its text up to here is in self.text
    self._before = ""  # decode(_win[_prefix:_read])

  def add(self, t: int) -> str:
    """Adds one token; -> the text it adds ("" while a character is incomplete)."""
    t = int(t)
    self.ids.append(t)
    self.offsets.append(len(self.text))
    self._contexts.append((self._prefix, len(self._win)))
    if t in self.hidden:
      self.texts.append("")
      return ""
    self._win.append(t)
    window = self.vocab.decode(self._win[self._prefix:])
    new = ""
    if len(window) > len(self._before) and not window.endswith("\ufffd"):
      new = window[len(self._before):] if window.startswith(self._before) else window
      if new.strip():
        # The next window starts at this text. Not at whitespace alone: a window's
        # leading whitespace is dropped, so " " + " Walk" would decode as "Walk".
        self._prefix = self._read
      self._read = len(self._win)
      self._before = self.vocab.decode(self._win[self._prefix:self._read])
    self.texts.append(new)
    self.text += new
    return new

  def finish(self) -> str:
    """Renders a trailing incomplete character as it is (onto the last token)."""
    if self._read == len(self._win):
      return ""
    whole = self.vocab.decode(self._win[self._prefix:])
    new = whole[len(self._before):] if whole.startswith(self._before) else whole
    self._prefix = self._read = len(self._win)
    self._before = ""
    self.texts[-1] += new
    self.text += new
    return new

  def candidates(self, k: int, top_ids) -> dict[int, str]:
    """The text each of top_ids would have added at position k (in place of token k),
    read against the same window before it."""
    a, b = self._contexts[k]
    context = self._win[a:b]
    base = self.vocab.decode(context)
    out = {}
    for t in top_ids:
      s = self.vocab.decode(context + [int(t)])
      out[int(t)] = s[len(base):] if s.startswith(base) else s
    return out


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
    self.stops = stops
    self.extra_stops = set(stop_ids[1:]) if isinstance(stop_ids, tuple) else set()
    self.skipped = set(stop_ids) if isinstance(stop_ids, tuple) else {stop_ids}
    if not skip_stop_ids:
      self.skipped = set()
    self.hold = max((len(s) for s in stops), default=1) - 1
    self.tokens = TokenTexts(vocab)  # the tokens of the text (skipped ids left out)
    self.sent = 0  # characters handed out
    self.stopped = False  # a stop sequence was found
    self.closed = False  # a stop id ended the text

  @property
  def ids(self) -> list[int]:
    return self.tokens.ids

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
      self.tokens.add(t)
    text, found = cut_at_stop(self.tokens.text, self.stops)
    self.stopped = self.stopped or found
    if not (final or found):
      text = text[:max(self.sent, len(text) - self.hold)]
    if len(text) <= self.sent:
      return ""
    delta, self.sent = text[self.sent:], len(text)
    return delta

  def finish(self) -> str:
    """The rest of the text once the tokens have all arrived."""
    self.tokens.finish()  # a trailing incomplete character: rendered as it is
    return self.feed([], final=True)

  def finish_reason(self, ended_with_stop_id: bool) -> str:
    """OpenAI's: "stop" for a stop id or a stop sequence, else "length"."""
    return "stop" if self.stopped or self.closed or ended_with_stop_id else "length"

  @property
  def final_text(self) -> str:
    return cut_at_stop(self.tokens.text, self.stops)[0]


def _logprob_tokens(vocab) -> TokenTexts:
  """A choice's tokens for its logprobs object: EOS renders as nothing (and, for an
  ignore_eos row, the text goes on after it, as the choice's text does)."""
  return TokenTexts(vocab, hidden=() if vocab.eos_id is None else (vocab.eos_id,))


def _top_entries(tokens: TokenTexts, top_ids, top_lp, start: int, end: int) -> list[dict]:
  """Positions start..end-1's {token text: log-prob} of their top tokens, each text
  read against the tokens before its position (so a position's entry depends only on
  the tokens before it: streamed and unstreamed agree)."""
  tops = []
  for k in range(start, end):
    ids = [int(t) for t in top_ids[k]]
    texts = tokens.candidates(k, ids)
    entry = {}
    for t, lp in zip(ids, list(top_lp[k])):
      entry.setdefault(texts[t], float(lp))
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
  tokens = _logprob_tokens(vocab)
  for t in ids:
    tokens.add(t)
  tokens.finish()
  n = _kept(tokens.offsets, tokens.texts, keep_chars)
  tops = None if top_ids is None else _top_entries(tokens, top_ids, top_lp, 0, n)
  return {"tokens": tokens.texts[:n], "token_logprobs": [float(x) for x in token_lp[:n]],
          "top_logprobs": tops, "text_offset": tokens.offsets[:n]}


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
    self.k = k
    self.tokens = _logprob_tokens(vocab)
    self.lps: list[float] = []
    self.top_ids: list = []
    self.top_lps: list = []
    self._given = 0  # tokens handed out

  def add(self, ids, lps, top_ids, top_lps) -> None:
    """A step's new tokens [n], their log-probs [n] and top tokens / log-probs [n, K]."""
    for t in ids:
      self.tokens.add(t)
    self.lps += [float(x) for x in lps]
    self.top_ids += [list(x)[:self.k] for x in top_ids]
    self.top_lps += [list(x)[:self.k] for x in top_lps]

  def _piece(self, end: int) -> dict:
    a, self._given = self._given, max(self._given, end)
    b = self._given
    tops = None if not self.k else _top_entries(self.tokens, self.top_ids, self.top_lps, a, b)
    return {"tokens": self.tokens.texts[a:b], "token_logprobs": self.lps[a:b],
            "top_logprobs": tops, "text_offset": self.tokens.offsets[a:b]}

  def release(self, sent_chars: int) -> dict:
    """The tokens whose text starts within the sent_chars already sent."""
    return self._piece(sum(1 for o in self.tokens.offsets if o < sent_chars))

  def finish(self, keep_chars: int) -> dict:
    """The tokens left, once the choice's final text (keep_chars long) is known."""
    self.tokens.finish()
    return self._piece(_kept(self.tokens.offsets, self.tokens.texts, keep_chars))


@dataclasses.dataclass
class Choice:
  """One finished completion, whichever path decoded it."""
  ids: list[int]  # new tokens (stop id included)
  token_logprobs: list[float] | None
  top_ids: list | None  # [l][k]
  top_logprobs: list | None
  finished: bool  # ended with a stop id
