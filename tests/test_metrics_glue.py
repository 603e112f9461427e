"""GLUE / SuperGLUE metrics: T5's values, keys and scale; scipy and
scikit-learn called directly as the outside reference."""
import nltk
import numpy as np
import pytest
import sacrebleu
import scipy.stats
import sklearn.metrics

from t5forge import metrics
from t5forge.errors import UserError

RNG = np.random.default_rng(16)


def test_t5_metrics_test_values():
  """The values in T5's t5/evaluation/metrics_test.py."""
  assert metrics.mean_multiclass_f1(3)([0, 1, 1, 2], [0, 0, 2, 2]) == {
      "mean_3class_f1": pytest.approx(44.44444444444444)}
  assert metrics.pearson_corrcoef([0, 2], [0, 1]) == {"pearson_corrcoef": pytest.approx(100.0)}
  assert metrics.spearman_corrcoef([0, 2, 1], [0, 1, 2]) == {
      "spearman_corrcoef": pytest.approx(50.0)}
  assert metrics.f1_score_with_invalid([0, 1, 1, 0], [0, 1, 2, 2]) == {"f1": pytest.approx(50.0)}
  groups = [{"group": "a", "value": 0}, {"group": "a", "value": 1}, {"group": "b", "value": 0}]
  preds = [{"value": 0}, {"value": 0}, {"value": 1}]
  assert metrics.mean_group_metric(metrics.accuracy)(groups, preds) == {"accuracy": 25.0}
  assert metrics.mean_group_metric(metrics.accuracy, return_subgroup_scores=True)(
      groups, preds) == {"accuracy": 25.0, "a-accuracy": 50.0, "b-accuracy": 0.0}
  # Lowercased, "sentence" matches "SENTENCE": one insertion ("different").
  edits = lambda d: {"min_edit": d, "max_edit": d, "mean_edit": d, "median_edit": d,
                     "sum_edit": d}
  target, prediction = ["This is a sentence."], ["This is a different SENTENCE."]
  assert metrics.edit_distance(target, prediction) == edits(1)
  assert metrics.edit_distance(target, prediction, lower=False) == edits(2)
  # CoLA's MCC by hand: TP=1 FN=1 TN=2 FP=0 -> (1*2 - 0*1) / sqrt(1 * 2 * 2 * 3).
  assert metrics.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 0]) == {
      "matthews_corrcoef": pytest.approx(100 * 2 / np.sqrt(12))}


def test_against_scipy_and_sklearn():
  x = RNG.normal(size=50)
  y = x + RNG.normal(size=50)
  assert metrics.pearson_corrcoef(x, y)["pearson_corrcoef"] == pytest.approx(
      100 * scipy.stats.pearsonr(x, y).statistic)
  assert metrics.spearman_corrcoef(x, y)["spearman_corrcoef"] == pytest.approx(
      100 * scipy.stats.spearmanr(x, y).statistic)
  t, p = RNG.integers(0, 3, size=40), RNG.integers(0, 3, size=40)
  assert metrics.matthews_corrcoef(t, p)["matthews_corrcoef"] == pytest.approx(
      100 * sklearn.metrics.matthews_corrcoef(t, p))
  assert metrics.mean_multiclass_f1(3)(t, p)["mean_3class_f1"] == pytest.approx(
      100 * sklearn.metrics.f1_score(t, p, average="macro"))
  # Label 3 never occurs: it still counts (as F1 0) in the mean over num_classes labels.
  assert metrics.mean_multiclass_f1(4)(t, p) == {"mean_4class_f1": pytest.approx(
      100 * sklearn.metrics.f1_score(t, p, labels=[0, 1, 2, 3], average="macro",
                                     zero_division=0))}
  w = RNG.uniform(size=40)
  assert metrics.mean_multiclass_f1(3, sample_weight=w)(t, p)["mean_3class_f1"] == pytest.approx(
      100 * sklearn.metrics.f1_score(t, p, average="macro", sample_weight=w))
  # Invalid predictions (2, 7) become the wrong label; the caller's array is left alone.
  t2 = RNG.integers(0, 2, size=40)
  p2 = RNG.integers(0, 3, size=40)
  p2[0] = 7
  kept = p2.copy()
  wrong = np.where((p2 == 0) | (p2 == 1), p2, 1 - t2)
  assert metrics.f1_score_with_invalid(t2, p2) == {"f1": pytest.approx(
      100 * sklearn.metrics.f1_score(t2, wrong))}
  np.testing.assert_array_equal(p2, kept)


def test_edit_distance_words_against_nltk():
  words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
  targets, predictions = [], []
  for _ in range(20):
    targets.append(" ".join(RNG.choice(words, size=RNG.integers(1, 9))))
    predictions.append(" ".join(RNG.choice(words, size=RNG.integers(1, 9))))
  got = metrics.edit_distance(targets, predictions)
  want = [nltk.edit_distance(p.split(), t.split()) for t, p in zip(targets, predictions)]
  assert got == {"min_edit": min(want), "max_edit": max(want), "mean_edit": pytest.approx(np.mean(want)),
                 "median_edit": pytest.approx(np.median(want)), "sum_edit": sum(want)}
  # T5 splits on every non-word character, so ", " leaves an empty word behind.
  assert metrics.edit_distance(["hello world"], ["hello, world"])["sum_edit"] == 1
  with pytest.raises(UserError, match="1 targets but 2 predictions"):
    metrics.edit_distance(["a"], ["a", "b"])


def test_unknown_metric_name_says_what_exists():
  with pytest.raises(AttributeError) as info:
    metrics.glue_f1_foo
  message = str(info.value)
  assert "'glue_f1_foo'" in message and "\n" not in message
  for name in ("mean_multiclass_f1", "f1_score_with_invalid", "matthews_corrcoef", "bleu"):
    assert name in message
  with pytest.raises(AttributeError, match=r"'matthews'; did you mean matthews_corrcoef\?"):
    getattr(metrics, "matthews")
  assert not hasattr(metrics, "pearson") and hasattr(metrics, "pearson_corrcoef")
  # dir() (what an error message may list) holds the metrics, not the imported helpers.
  assert "mean_group_metric" in dir(metrics) and "np" not in dir(metrics)


def test_multi_reference_bleu_reads_references_per_example():
  """Ours: targets[i] = example i's references. T5's bleu reads targets[i] as reference
  stream i, which here would leave example 1 with only "" and "x" to match."""
  refs = [["a b c d e", ""], ["f g h i j", "x"]]
  assert metrics.bleu(refs, ["a b c d e", "f g h i j"])["bleu"] == pytest.approx(100.0)
  t5_reading = sacrebleu.corpus_bleu(["a b c d e", "f g h i j"], refs, tokenize="intl").score
  assert t5_reading < 100.0
  assert "targets[i]` as example i's list of references" in metrics.__doc__
  assert "reference stream i" in " ".join(metrics.bleu.__doc__.split())
