"""Metric functions: T5's BLEU/ROUGE settings, SQuAD, accuracy."""
import numpy as np
import pytest
import sacrebleu

from t5forge import metrics
from t5forge.errors import UserError


def test_bleu_uses_t5_settings():
  targets = ["El que da testimonio de estas cosas, dice: Ciertamente, vengo en breve.",
             "Amén, sea así."]
  predictions = ["El que da testimonio de estas cosas dice: vengo pronto.", "Amén, así sea."]
  expected = sacrebleu.corpus_bleu(predictions, [targets], smooth_method="exp", smooth_value=0.0,
                                   force=False, lowercase=False, tokenize="intl",
                                   use_effective_order=False).score
  assert metrics.bleu(targets, predictions) == {"bleu": pytest.approx(expected)}
  assert metrics.bleu(targets, targets)["bleu"] == pytest.approx(100.0)
  two_refs = metrics.bleu([["a b c d", "x"], ["e f g h", "y"]], ["a b c d", "e f g h"])
  assert two_refs["bleu"] == pytest.approx(100.0)
  assert 0 < metrics.chrf(targets, predictions)["chrf"] < 100
  with pytest.raises(UserError, match="2 targets but 1 predictions"):
    metrics.bleu(targets, predictions[:1])


def test_rouge_like_t5_and_reproducible():
  targets = ["Return the mode of the normal distribution . It is the peak .",
             "Clear the option database."]
  predictions = ["Return the mode of the distribution .", "Clear the database."]
  state = np.random.get_state()
  a = metrics.rouge(targets, predictions)
  assert set(a) == {"rouge1", "rouge2", "rougeLsum"}
  assert a == metrics.rouge(targets, predictions)  # seeded bootstrap
  assert np.random.get_state()[1].tolist() == state[1].tolist()  # caller's RNG untouched
  assert metrics.rouge(targets, targets)["rouge1"] == pytest.approx(100.0)
  assert 0 < a["rouge2"] < a["rouge1"] < 100
  assert "rougeL" in metrics.rouge_l(targets, predictions)


def test_squad_accuracy_exact_match():
  result = metrics.squad([["The Cat", "a dog"], ["blue"]], ["cat", "light blue"])
  assert result["em"] == pytest.approx(50.0)
  assert result["f1"] == pytest.approx(100 * (1.0 + 2 / 3) / 2)
  normalized = metrics.normalize_squad("`Needs\tA_LOT of the 'normalization'.")
  assert normalized == "needs alot of normalization"
  assert metrics.accuracy([1, 2, 3, 4], [1, 2, 0, 0]) == {"accuracy": 50.0}
  assert metrics.sequence_accuracy(["a b"], ["a b"]) == {"sequence_accuracy": 100.0}
  assert metrics.exact_match(["yes ", "no"], ["yes", "yes"]) == {"exact_match": 50.0}
