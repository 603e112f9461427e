"""A checkpoint's Hugging Face chat template: messages -> the text transformers renders ->
the encoder's ids, as `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` gives them.

    template = ChatTemplate.find(flag_file, [checkpoint_dir, ...], vocabulary)  # or None
    text = template.render(messages, add_generation_prompt=True)
    ids = template.encode(text)     # no EOS appended: the template writes the turn marks

Rendering is transformers' own set-up: Jinja2's `ImmutableSandboxedEnvironment` with
trim_blocks and lstrip_blocks and the loopcontrols extension, a `raise_exception(msg)`
global that raises `TemplateError`, `tojson` as `json.dumps` (not HTML-escaped, not
ASCII-escaped), and the special tokens of the tokenizer (`bos_token`, `eos_token`, ...)
as variables. The template is the --chat_template file, else a `chat_template.jinja`,
else the `chat_template` of a `tokenizer_config.json` in the checkpoint's directories.

Tokenizing is transformers' `tokenizer(text, add_special_tokens=False)` (the template
already writes BOS): the tokenizer's special and added tokens (`<bos>`,
`<start_of_turn>`, `<extra_id_0>`, ...) are cut out of the text first, longest match at
the leftmost place, each becoming its id; the text between them goes through the
vocabulary's own encode.
"""
from __future__ import annotations

import datetime
import json
import os
import re

from t5forge.convert.hf.config_files import read_json
from t5forge.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers hands to every template (its special_tokens_map).
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool", "developer")


class TemplateError(ValueError):
  """The template refused the messages (its raise_exception) or failed to render."""


def _token_text(value) -> str | None:
  """'<eos>' from "<eos>" or from {"content": "<eos>", ...} (an AddedToken)."""
  return value.get("content") if isinstance(value, dict) else value


def _environment():
  # Lazy: Jinja2 is needed only by servers that have a template.
  import jinja2  # noqa: PLC0415 (slow or optional import, on first use)
  from jinja2 import ext, sandbox  # noqa: PLC0415 (as above)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers: Jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _added_tokens(vocab) -> dict[str, int]:
  """The strings the tokenizer matches whole before the model sees the text -> their ids:
  SentencePiece's control, unknown and user-defined pieces and T5's sentinels, or the
  added tokens of a `tokenizers` tokenizer.json."""
  out: dict[str, int] = {}
  processor = getattr(vocab, "processor", None)
  tokenizer = getattr(vocab, "tokenizer", None)
  if processor is not None:
    # Lazy: the protobuf module costs ~80 ms, needed only once per server.
    from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: PLC0415 (slow or optional import, on first use)
    proto = model_pb2.ModelProto()
    proto.ParseFromString(processor.serialized_model_proto())
    kinds = model_pb2.ModelProto.SentencePiece
    for i, piece in enumerate(proto.pieces):
      if piece.type in (kinds.UNKNOWN, kinds.CONTROL, kinds.USER_DEFINED):
        out[piece.piece] = i
    for k in range(vocab.extra_ids):
      out[f"<extra_id_{k}>"] = vocab.vocab_size - 1 - k
  elif tokenizer is not None:
    for i, tok in tokenizer.get_added_tokens_decoder().items():
      out[tok.content] = int(i)
  return out


class ChatTemplate:
  """One chat template and the tokenizer it renders for.

  Args:
    source: the template's Jinja text.
    where: the file it came from (for messages).
    vocab: the served vocabulary (`encode`, and its special pieces).
    special: the named special tokens passed to the template ({"bos_token": "<bos>"...}).
  """

  def __init__(self, source: str, where: str, vocab, special: dict[str, str]):
    import jinja2  # noqa: PLC0415 (slow or optional import, on first use)
    self.where, self.vocab, self.special = where, vocab, special
    try:
      self._template = _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
      raise UserError(f"{where}: the chat template does not parse: {e}") from None
    added = _added_tokens(vocab)
    self._added = added
    self._split = (re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
                   if added else None)

  @classmethod
  def find(cls, flag_file: str | None, dirs: list[str], vocab) -> ChatTemplate | None:
    """The --chat_template file, else the first template in `dirs` (chat_template.jinja,
    then tokenizer_config.json's chat_template), else None."""
    special: dict[str, str] = {}
    for d in reversed(dirs):  # the first directory's say wins
      for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
        cfg = read_json(os.path.join(d, name), default={})
        for k in _SPECIAL_NAMES:
          if _token_text(cfg.get(k)) is not None:
            special[k] = _token_text(cfg[k])
    if not special:  # a t5forge checkpoint: the vocabulary's own pieces
      for k, i in (("bos_token", getattr(vocab, "bos_id", None)),
                   ("eos_token", getattr(vocab, "eos_id", None)),
                   ("unk_token", getattr(vocab, "unk_id", None)),
                   ("pad_token", getattr(vocab, "pad_id", None))):
        if i is not None and i >= 0:
          special[k] = _piece(vocab, i)
    if flag_file:
      if not os.path.isfile(flag_file):
        raise UserError(f"--chat_template {flag_file}: no such file; give a Jinja file such "
                        f"as a model's {TEMPLATE_FILE}")
      with open(flag_file, encoding="utf-8") as f:
        return cls(f.read(), flag_file, vocab, special)
    for d in dirs:
      path = os.path.join(d, TEMPLATE_FILE)
      if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
          return cls(f.read(), path, vocab, special)
      path = os.path.join(d, TOKENIZER_CONFIG)
      source = read_json(path, default={}).get("chat_template")
      if isinstance(source, list):  # named templates: transformers' default is "default"
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
      if isinstance(source, str):
        return cls(source, path, vocab, special)
    return None

  def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The template's text for `messages`; TemplateError with the template's message."""
    import jinja2  # noqa: PLC0415 (slow or optional import, on first use)
    try:
      return self._template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special)
    except jinja2.exceptions.TemplateError as e:
      raise TemplateError(" ".join(str(e).split())) from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
      raise TemplateError(f"{type(e).__name__}: {' '.join(str(e).split())}") from None

  def encode(self, text: str) -> list[int]:
    """`text`'s ids as transformers' tokenizer(text, add_special_tokens=False) gives them."""
    if self._split is None:
      return self.vocab.encode(text)
    ids, at = [], 0
    for m in self._split.finditer(text):
      if m.start() > at:
        ids += self.vocab.encode(text[at:m.start()])
      ids.append(self._added[m.group()])
      at = m.end()
    if at < len(text):
      ids += self.vocab.encode(text[at:])
    return ids


def _piece(vocab, i: int) -> str:
  processor = getattr(vocab, "processor", None)
  if processor is not None:
    return processor.id_to_piece(i)
  tokenizer = getattr(vocab, "tokenizer", None)
  return tokenizer.id_to_token(i) if tokenizer is not None else vocab.decode([i])
