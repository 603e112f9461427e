"""Vocabularies: T5's id layout, sentinels, decode rules, the `vocab` CLI."""
import pickle
import subprocess
import sys

import numpy as np
import pytest

from t5forge.data import vocab as vocab_lib
from t5forge.data.bundled_tasks import VOCAB_PATH
from t5forge.errors import UserError


@pytest.fixture(scope="module")
def spm_vocab():
  return vocab_lib.SentencePieceVocabulary(VOCAB_PATH, extra_ids=100)


def test_t5_layout(spm_vocab):
  p = spm_vocab.processor
  assert (spm_vocab.pad_id, spm_vocab.eos_id, spm_vocab.unk_id) == (0, 1, 2)
  assert (p.id_to_piece(0), p.id_to_piece(1), p.id_to_piece(2)) == ("<pad>", "</s>", "<unk>")
  assert p.bos_id() == -1
  assert spm_vocab.vocab_size == 8000
  assert spm_vocab.base_vocab_size == 7900
  assert spm_vocab.extra_ids == 100


def test_sentinels_at_the_top(spm_vocab):
  assert spm_vocab.sentinel_id(0) == 7999 == spm_vocab.vocab_size - 1
  assert spm_vocab.sentinel_id(99) == 7900
  assert spm_vocab.processor.id_to_piece(7999) == "▁<extra_id_0>"
  assert spm_vocab.encode("a <extra_id_0> b <extra_id_1>")[1:4:2] == [7999, 7998] or \
      7999 in spm_vocab.encode("a <extra_id_0> b")
  assert spm_vocab.decode([7999]).strip() == "<extra_id_0>"
  with pytest.raises(UserError, match="out of range"):
    spm_vocab.sentinel_id(100)


def test_encode_decode_round_trip(spm_vocab):
  text = "In the beginning was the Word. En el principio era el Verbo."
  ids = spm_vocab.encode(text)
  assert all(3 <= i < 7900 for i in ids)
  assert spm_vocab.decode(ids) == text
  # Printable ASCII is always representable (--require_ascii): no unknowns in code.
  code = "def f(x_1={}): return x_1|{'a': [1, 2]} # ~^`@$%&*\\"
  assert spm_vocab.unk_id not in spm_vocab.encode(code)
  assert spm_vocab.decode(spm_vocab.encode(code)) == code


def test_decode_stops_at_eos_and_drops_pad(spm_vocab):
  ids = spm_vocab.encode("Jesus wept.")
  assert spm_vocab.decode(ids + [1] + spm_vocab.encode("garbage after eos")) == "Jesus wept."
  assert spm_vocab.decode([0, 0] + ids + [1, 0, 0]) == "Jesus wept."
  assert spm_vocab.decode(np.array(ids + [1, 5, 6], np.int32)) == "Jesus wept."
  assert spm_vocab.decode_batch([ids + [1, 9], ids]) == ["Jesus wept."] * 2
  assert spm_vocab.encode_batch(["Jesus wept."]) == [ids]


def test_vocab_is_picklable(spm_vocab):
  clone = pickle.loads(pickle.dumps(spm_vocab))
  assert clone == spm_vocab
  assert clone.encode("Amen") == spm_vocab.encode("Amen")
  assert len(pickle.dumps(spm_vocab)) < 500  # (path, extra_ids), not the model


def test_missing_model_file():
  with pytest.raises(UserError, match="not found: /no/such.model"):
    vocab_lib.SentencePieceVocabulary("/no/such.model")


def test_byte_vocabulary():
  v = vocab_lib.ByteVocabulary(extra_ids=125)
  assert v.vocab_size == 259 + 125
  assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  assert v.sentinel_id(0) == 259 + 125 - 1
  text = "Señor, ¿adónde vas? 主"
  ids = v.encode(text)
  assert ids == [b + 3 for b in text.encode("utf-8")]
  assert v.decode(ids) == text
  assert v.decode(ids[:2] + [1] + ids[2:]) == "Se"  # stops at EOS
  # Invalid bytes (half of "ñ") and sentinels are dropped, as ByT5 does.
  half = [0xC3 + 3]
  assert v.decode([ord("a") + 3] + half + [ord("b") + 3, v.sentinel_id(0)]) == "ab"
  assert pickle.loads(pickle.dumps(v)) == v


def test_pass_through_vocabulary():
  v = vocab_lib.PassThroughVocabulary(size=50)
  assert v.encode([5, 6, 7]) == [5, 6, 7]
  assert v.decode([5, 6, 1, 9]) == [5, 6, 1]
  assert v.vocab_size == 50 and v.eos_id == 1


def _run_cli(*args, cwd=None):
  return subprocess.run([sys.executable, "-m", "t5forge", "vocab", *args], capture_output=True,
                        text=True, cwd=cwd, timeout=120)


def test_vocab_train_cli_end_to_end(tmp_path):
  words = ("word light life way land sea good great small river mountain shepherd kingdom bread "
           "water wine house temple city desert garden morning evening heaven earth people").split()
  lines = [f"the {a} of the {b} was {c}"
           for a in words[:9] for b in words[9:18] for c in words[18:]]
  (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
  import gzip
  with gzip.open(tmp_path / "b.tsv.gz", "wt") as f:
    f.write("hello world\thola mundo\nthe light\tla luz\n")
  out = tmp_path / "out" / "tiny"
  res = _run_cli("train", "--input", str(tmp_path / "*.txt"), str(tmp_path / "b.tsv.gz"),
                 "--vocab_size", "60", "--extra_ids", "5", "--output", str(out))
  assert res.returncode == 0, res.stderr
  assert "60 ids (55 pieces + 5 extra ids)" in res.stdout
  model = tmp_path / "out" / "tiny.model"
  v = vocab_lib.SentencePieceVocabulary(model, extra_ids=5)
  assert v.vocab_size == 60 and (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  assert v.processor.bos_id() == -1
  assert v.decode(v.encode("the light of the sea")) == "the light of the sea"
  # Deterministic: the same input gives the same bytes.
  res2 = _run_cli("train", "--input", str(tmp_path / "*.txt"), str(tmp_path / "b.tsv.gz"),
                  "--vocab_size", "60", "--extra_ids", "5", "--output", str(tmp_path / "again"))
  assert res2.returncode == 0, res2.stderr
  assert (tmp_path / "again.model").read_bytes() == model.read_bytes()
  info = _run_cli("info", str(model), "--extra_ids", "5", "--text", "the way")
  assert info.returncode == 0, info.stderr
  assert "vocab_size: 60" in info.stdout and "<extra_id_0>=59" in info.stdout


def test_vocab_train_cli_bad_input(tmp_path):
  res = _run_cli("train", "--input", str(tmp_path / "*.txt"), "--vocab_size", "60",
                 "--output", str(tmp_path / "x"))
  assert res.returncode == 2
  assert res.stderr.strip().count("\n") == 0  # one line, no traceback
  assert "matched no files" in res.stderr
  (tmp_path / "small.txt").write_text("a b c\n")
  res = _run_cli("train", "--input", str(tmp_path / "small.txt"), "--vocab_size", "5000",
                 "--extra_ids", "0", "--output", str(tmp_path / "x"))
  assert res.returncode == 2 and "--vocab_size" in res.stderr and "Traceback" not in res.stderr
