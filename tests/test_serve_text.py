"""Tokens to text for completions (`t5forge.serve.text`): each token's text is what it
adds to the decoded prefix before it, computed from a short window, so the cost is linear
in the completion's length; streamed and unstreamed log-probs agree."""
import os
import random

import pytest

from t5forge.data.vocab import ByteVocabulary, SentencePieceVocabulary
from t5forge.serve import text as text_lib

BUNDLED = os.path.join(os.path.dirname(__file__), "..", "t5forge", "data", "bundled")


@pytest.fixture(scope="module")
def sp():
  return SentencePieceVocabulary(os.path.join(BUNDLED, "bible_en_es_8k.model"), extra_ids=100)


def _prefix_texts(vocab, ids):
  """The definition: token k's text is decode(ids[:k+1]) minus decode(ids[:k])."""
  out = []
  for k in range(len(ids)):
    before, cur = vocab.decode(ids[:k]), vocab.decode(ids[:k + 1])
    assert cur.startswith(before)
    out.append(cur[len(before):])
  return out


class CountingVocab:
  """Counts the tokens every decode reads."""

  def __init__(self, vocab):
    self.vocab, self.decoded = vocab, 0
    self.eos_id = vocab.eos_id

  def decode(self, ids):
    self.decoded += len(ids)
    return self.vocab.decode(ids)


def test_token_texts_equal_the_prefix_definition(sp):
  rng = random.Random(0)
  for _ in range(150):
    ids = [rng.randrange(3, 8000) for _ in range(rng.randint(1, 40))]
    got = text_lib.logprobs(sp, ids, [0.0] * len(ids), None, None, 10**9)
    assert got["tokens"] == _prefix_texts(sp, ids), ids
    assert "".join(got["tokens"]) == sp.decode(ids)
    assert got["text_offset"] == [sum(map(len, got["tokens"][:k])) for k in range(len(ids))]


def test_a_whitespace_token_keeps_the_next_words_space(sp):
  # A window that began at the lone "▁" would decode " " + " Walk" as "Walk".
  ids = [5879, 6185, 22, 6742]  # " Immer Kedesh", "▁", "▁Walk" in this vocabulary
  got = text_lib.logprobs(sp, ids, [0.0] * 4, None, None, 10**9)["tokens"]
  assert got == _prefix_texts(sp, ids) and got[2:] == [" ", " Walk"]


def test_decoding_cost_is_linear_in_the_completion(sp):
  """The old form re-decoded every prefix (n^2/2 tokens, and k times that for the top
  tokens); the window reads a few tokens per token."""
  rng = random.Random(1)
  costs = {}
  for n in (500, 1000):
    ids = sp.encode(" ".join(rng.choice(["the", "earth", "Dios", "mío", "and", "heavens", ","])
                             for _ in range(n)))[:n]
    counting = CountingVocab(sp)
    top = [[rng.randrange(3, 8000) for _ in range(5)] for _ in ids]
    got = text_lib.logprobs(counting, ids, [0.0] * n, top, [[0.0] * 5] * n, 10**9)
    assert "".join(got["tokens"]) == sp.decode(ids)
    costs[n] = counting.decoded
  assert costs[1000] < 40 * 1000 * 6  # a few tokens per decode, 7 decodes per token
  assert costs[1000] / costs[500] < 2.3  # linear: the quadratic form gives 4


def test_an_incomplete_character_goes_to_the_token_that_completes_it():
  v = ByteVocabulary()
  ids = v.encode("hé日!")
  got = text_lib.logprobs(v, ids, [0.0] * len(ids), None, None, 10**9)
  assert got["tokens"] == ["h", "", "é", "", "", "日", "!"]
  assert got["text_offset"] == [0, 1, 1, 2, 2, 2, 3]
  # Cut short mid-character: the rest is rendered as the vocabulary renders it.
  choice = text_lib.ChoiceText(v, [], v.eos_id)
  assert choice.feed(ids[:4]) == "hé" and choice.finish() == v.decode(ids[:4])[2:]


def test_an_ignore_eos_rows_text_goes_on_after_eos(sp):
  ids = sp.encode("In the beginning") + [sp.eos_id] + sp.encode(" God created")
  choice = text_lib.ChoiceText(sp, [], sp.eos_id, skip_stop_ids=True)
  choice.feed(ids)
  choice.finish()
  got = text_lib.logprobs(sp, ids, [0.0] * len(ids), None, None, len(choice.final_text))
  assert "".join(got["tokens"]) == choice.final_text == "In the beginning God created"


@pytest.mark.parametrize("vocab_name", ["sp", "bytes"])
def test_streamed_pieces_join_to_the_whole(sp, vocab_name):
  vocab = sp if vocab_name == "sp" else ByteVocabulary()
  rng = random.Random(2)
  ids = vocab.encode("In the beginning, God created the heavens. Dios mío, ¡日本!")
  top = [[rng.randrange(3, 250) for _ in range(3)] for _ in ids]
  top_lp = [[-1.0, -2.0, -3.0]] * len(ids)
  lps = [-0.5] * len(ids)
  choice = text_lib.ChoiceText(vocab, ["heav"], vocab.eos_id)
  stream = text_lib.LogprobStream(vocab, 3)
  pieces, k = [], 0
  while k < len(ids) and not choice.stopped:
    step = rng.randint(1, 4)
    new = ids[k:k + step]
    stream.add(new, lps[k:k + step], top[k:k + step], top_lp[k:k + step])
    choice.feed(new)
    pieces.append(stream.release(choice.sent))
    k += step
  choice.finish()
  pieces.append(stream.finish(len(choice.final_text)))
  whole = text_lib.logprobs(vocab, ids[:k], lps[:k], top[:k], top_lp[:k], len(choice.final_text))
  for key in whole:
    assert [x for p in pieces for x in p[key]] == whole[key], key
  # The tokens kept are those whose text starts within the final text (the stop sequence
  # can cut the last one, as " heavens" in SentencePiece).
  assert choice.final_text == "In the beginning, God created the "
  joined = "".join(whole["tokens"])
  assert joined.startswith(choice.final_text) and whole["text_offset"][-1] < len(choice.final_text)
  assert len(joined) - len(whole["tokens"][-1]) < len(choice.final_text)
