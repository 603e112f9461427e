"""`serve.chat_template` without a server: a T5 tokenizer (the bundled SentencePiece model as
`write_t5` writes it for transformers) and a Gemma-made one with Gemma's chat template
render and tokenize 20 conversations exactly as transformers' `apply_chat_template` does;
the template's own refusals, `tojson` and where a template is found behave as in
transformers."""
import json
import os

import pytest

from t5forge.convert.hf import tokenizer as hf_tokenizer
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.errors import UserError
from t5forge.serve.chat_template import ChatTemplate, TemplateError
from t5forge.testing import bundled_vocabulary
from test_serve_chat import END_OF_TURN, GEMMA_TEMPLATE, _gemma_vocabulary, message_lists


def _with_template(d: str, template: str = GEMMA_TEMPLATE) -> str:
  path = os.path.join(d, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    cfg = json.load(f)
  cfg["chat_template"] = template
  with open(path, "w", encoding="utf-8") as f:
    json.dump(cfg, f)
  return d


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat_template")
  t5 = str(root / "t5")
  os.makedirs(t5)
  vocab = bundled_vocabulary()
  assert hf_tokenizer.write_t5(vocab, t5) == []
  gemma = str(root / "gemma")
  os.makedirs(gemma)
  gvocab = _gemma_vocabulary(os.path.join(root, "gemma.model"))
  assert hf_tokenizer.write_gemma(gvocab, gemma) == []
  return {"t5": (_with_template(t5), SentencePieceVocabulary(os.path.join(t5, "spiece.model"),
                                                               extra_ids=100)),
          "gemma": (_with_template(gemma), gvocab)}


@pytest.mark.parametrize("kind", ["t5", "gemma"])
def test_ids_equal_transformers_apply_chat_template(tokenizer_dirs, kind):
  from transformers import AutoTokenizer
  d, vocab = tokenizer_dirs[kind]
  tok = AutoTokenizer.from_pretrained(d)
  template = ChatTemplate.find(None, [d], vocab)
  for msgs in message_lists():
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert template.render(msgs) == want
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert template.encode(want) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  if kind == "gemma":
    assert template.special["bos_token"] == "<bos>"
    assert template.encode(template.render(msgs))[:2] == [vocab.bos_id, END_OF_TURN - 1]


def test_refusals_and_tojson_as_transformers(tokenizer_dirs, tmp_path):
  d, vocab = tokenizer_dirs["t5"]
  template = ChatTemplate.find(None, [d], vocab)
  with pytest.raises(TemplateError, match="System role not supported"):
    template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
  flag = tmp_path / "t.jinja"
  flag.write_text("{{ messages | tojson }}", encoding="utf-8")
  # Found first: the flag's file; tojson writes <, > and non-ASCII as they are.
  mine = ChatTemplate.find(str(flag), [d], vocab)
  assert mine.render([{"role": "user", "content": "<a> ¿é?"}]) == (
      '[{"role": "user", "content": "<a> ¿é?"}]')
  (tmp_path / "chat_template.jinja").write_text("jinja file", encoding="utf-8")
  assert ChatTemplate.find(None, [str(tmp_path), d], vocab).render([]) == "jinja file"
  assert ChatTemplate.find(None, [str(tmp_path / "none")], vocab) is None
  with pytest.raises(UserError, match="--chat_template"):
    ChatTemplate.find(str(tmp_path / "missing.jinja"), [d], vocab)
  flag.write_text("{% for %}", encoding="utf-8")
  with pytest.raises(UserError, match="does not parse"):
    ChatTemplate.find(str(flag), [d], vocab)
