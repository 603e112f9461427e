"""Every export carries the vocabulary: `convert --to hf` writes the
tokenizer files transformers' AutoTokenizer loads, tokenizing and detokenizing text as our
vocabulary does; `convert --to t5forge` and `t5forge.load(...).save/.save_hf` keep it."""
import gzip
import json
import os
import shutil

import jax
import pytest

import t5forge
from t5forge.cli import convert as convert_cli
from t5forge.convert import native
from t5forge.data import bundled_tasks, vocab_io
from t5forge.data.vocab import ByteVocabulary, SentencePieceVocabulary
from t5forge.nn import init_params

BUNDLED = os.path.join(os.path.dirname(bundled_tasks.__file__), "bundled")


def _sentences(n=12):
  """Real English and Spanish verses (Spanish accents and ñ) from the bundled data."""
  out = []
  with gzip.open(os.path.join(BUNDLED, "en_es_bible.validation.tsv.gz"), "rt",
                 encoding="utf-8") as f:
    for line in f:
      en, es = line.rstrip("\n").split("\t")
      out += [en, es]
      if len(out) >= n:
        break
  out.append("¿Quién es? El niño dijo: «Señor, aquí estoy», y el corazón de Jesús se conmovió.")
  return out


def _checkpoint(path, preset, vocab):
  """A t5forge checkpoint of a tiny random model that stores `vocab`."""
  config = t5forge.presets.get(preset, vocab_size=vocab.vocab_size)
  params = init_params(config, jax.random.key(0))
  native.save(str(path), config, params, extra_config={"vocabulary": vocab_io.to_spec(vocab)})
  return str(path)


def _convert(src, out, to, capsys):
  assert convert_cli.main(["--input", src, "--output", str(out), "--to", to]) == 0
  return capsys.readouterr().out


@pytest.fixture(scope="module")
def spm_vocab():
  return SentencePieceVocabulary(os.path.join(BUNDLED, "bible_en_es_8k.model"), extra_ids=100)


def _assert_same_tokenizer(tok, vocab):
  assert len(tok) == vocab.vocab_size == 8000
  texts = _sentences()
  for text in texts:
    ids = vocab.encode(text) + [vocab.eos_id]
    assert tok(text).input_ids == ids, text
    if vocab.unk_id not in ids:  # transformers renders unk as '<unk>', SentencePiece as ' ⁇ '
      assert tok.decode(ids, skip_special_tokens=True) == vocab.decode(ids), text
  assert sum(vocab.unk_id not in vocab.encode(t) for t in texts) >= 10  # most decode too
  for i in (0, 1, 99):
    assert tok.convert_tokens_to_ids(f"<extra_id_{i}>") == vocab.sentinel_id(i)
  assert tok.eos_token_id == vocab.eos_id and tok.pad_token_id == 0 and tok.unk_token_id == 2


def test_convert_to_hf_writes_a_tokenizer_autotokenizer_loads(tmp_path, spm_vocab, capsys):
  from transformers import AutoTokenizer, T5Tokenizer
  ckpt = _checkpoint(tmp_path / "ckpt", "t5_1_1.tiny", spm_vocab)
  out = _convert(ckpt, tmp_path / "hf", "hf", capsys)
  assert "sentencepiece 8000 ids (bible_en_es_8k)" in out
  tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert isinstance(tok, T5Tokenizer)
  _assert_same_tokenizer(tok, spm_vocab)
  # tokenizer.json is the fast tokenizer transformers itself builds from spiece.model ...
  with open(tmp_path / "hf" / "tokenizer.json", encoding="utf-8") as f:
    ours = json.load(f)
  (tmp_path / "spm_only").mkdir()
  shutil.copy(tmp_path / "hf" / "spiece.model", tmp_path / "spm_only" / "spiece.model")
  theirs = json.loads(T5Tokenizer.from_pretrained(str(tmp_path / "spm_only"), extra_ids=100)
                      .backend_tokenizer.to_str())
  for key in ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
    assert ours[key] == theirs[key], key
  # ... and is enough alone (tokenizers-only readers, no sentencepiece needed).
  os.remove(tmp_path / "hf" / "spiece.model")
  _assert_same_tokenizer(AutoTokenizer.from_pretrained(str(tmp_path / "hf")), spm_vocab)


def test_convert_to_t5forge_keeps_the_vocabulary(tmp_path, spm_vocab, capsys):
  ckpt = _checkpoint(tmp_path / "ckpt", "t5_1_1.tiny", spm_vocab)
  _convert(ckpt, tmp_path / "again", "t5forge", capsys)
  back = vocab_io.from_spec(native.read_config(str(tmp_path / "again"))["vocabulary"])
  assert vocab_io.difference(back, spm_vocab) is None and back.vocab_size == 8000
  # Through HF and back: the vocabulary comes from the exported spiece.model.
  _convert(ckpt, tmp_path / "hf", "hf", capsys)
  _convert(str(tmp_path / "hf"), tmp_path / "from_hf", "t5forge", capsys)
  back = t5forge.load(str(tmp_path / "from_hf")).vocabulary
  assert vocab_io.difference(back, spm_vocab) is None
  text = _sentences()[1]
  assert back.encode(text) == spm_vocab.encode(text)


def test_load_save_and_save_hf_carry_the_vocabulary(tmp_path, spm_vocab):
  from transformers import AutoTokenizer
  m = t5forge.load(_checkpoint(tmp_path / "ckpt", "t5_1_1.tiny", spm_vocab))
  m.save_hf(str(tmp_path / "hf"))
  _assert_same_tokenizer(AutoTokenizer.from_pretrained(str(tmp_path / "hf")), spm_vocab)
  m.save(str(tmp_path / "native"))
  assert vocab_io.difference(t5forge.load(str(tmp_path / "native")).vocabulary, spm_vocab) is None


def test_byt5_export_loads_as_byt5_tokenizer(tmp_path, capsys):
  from transformers import AutoTokenizer
  vocab = ByteVocabulary(extra_ids=125)
  ckpt = _checkpoint(tmp_path / "ckpt", "byt5.tiny", vocab)
  _convert(ckpt, tmp_path / "hf", "hf", capsys)
  tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert type(tok).__name__ == "ByT5Tokenizer" and len(tok) == vocab.vocab_size == 384
  for text in _sentences() + ["日本語 — ½ €"]:
    ids = vocab.encode(text) + [vocab.eos_id]
    assert tok(text).input_ids == ids, text
    assert tok.decode(ids, skip_special_tokens=True) == vocab.decode(ids) == text
  # Sentinels count down from the top, as in T5X (transformers' default counts up).
  for i in (0, 1, 124):
    assert tok.convert_tokens_to_ids(f"<extra_id_{i}>") == vocab.sentinel_id(i)
  _convert(str(tmp_path / "hf"), tmp_path / "back", "t5forge", capsys)
  assert t5forge.load(str(tmp_path / "back")).vocabulary == vocab
