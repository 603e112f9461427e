"""Metric functions for tasks: `fn(targets, predictions) -> {name: value}` (SeqIO's convention).

Values are on T5's scale (0-100). BLEU and ROUGE are computed exactly as T5's
`t5.evaluation.metrics.bleu` / `rouge` do, so numbers compare with published T5
results:

* BLEU: `sacrebleu.corpus_bleu(predictions, [targets], smooth_method="exp",
  smooth_value=0.0, force=False, lowercase=False, tokenize="intl",
  use_effective_order=False)`.
* ROUGE: rouge-score's `RougeScorer(["rouge1", "rouge2", "rougeLsum"])` (no
  stemming), " . " replaced by " .\\n" so rougeLsum sees sentences, bootstrap
  aggregate, the mid F-measure. The bootstrap resampling is seeded (T5's is not)
  so a score is reproducible.
"""
from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np

from t5forge.errors import UserError


def _check(targets: Sequence, predictions: Sequence) -> None:
  if len(targets) != len(predictions):
    raise UserError(f"metric got {len(targets)} targets but {len(predictions)} predictions")


def bleu(targets: Sequence, predictions: Sequence[str],
         tokenizer: str = "intl") -> dict[str, float]:
  """Corpus BLEU (sacrebleu, T5's settings). Targets may be lists of references."""
  import sacrebleu

  _check(targets, predictions)
  score = sacrebleu.corpus_bleu(list(predictions), _reference_streams(targets), smooth_method="exp",
                                smooth_value=0.0, force=False, lowercase=False, tokenize=tokenizer,
                                use_effective_order=False)
  return {"bleu": score.score}


def chrf(targets: Sequence, predictions: Sequence[str]) -> dict[str, float]:
  """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2)."""
  import sacrebleu

  _check(targets, predictions)
  return {"chrf": sacrebleu.corpus_chrf(list(predictions), _reference_streams(targets)).score}


def _reference_streams(targets: Sequence) -> list[list[str]]:
  """sacrebleu wants one list per reference; targets may hold several per example."""
  if targets and isinstance(targets[0], (list, tuple)):
    return [list(r) for r in zip(*targets)]
  return [list(targets)]


def rouge(targets: Sequence[str], predictions: Sequence[str],
          score_keys: Sequence[str] = ("rouge1", "rouge2", "rougeLsum")) -> dict[str, float]:
  """ROUGE F-measures x100 as T5 computes them (see the module docstring)."""
  from rouge_score import rouge_scorer, scoring

  _check(targets, predictions)
  scorer = rouge_scorer.RougeScorer(list(score_keys))
  aggregator = scoring.BootstrapAggregator()

  def prepare(summary: str) -> str:
    return summary.replace(" . ", " .\n")  # sentence breaks for rougeLsum

  for target, prediction in zip(targets, predictions):
    aggregator.add_scores(scorer.score(target=prepare(target), prediction=prepare(prediction)))
  # rouge-score resamples with numpy's global RNG: seed it for a reproducible
  # "mid", and restore the caller's RNG state afterwards.
  saved = np.random.get_state()
  try:
    np.random.seed(0)
    result = aggregator.aggregate()
  finally:
    np.random.set_state(saved)
  return {k: result[k].mid.fmeasure * 100 for k in score_keys}


def rouge_l(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """rougeL (no sentence splitting) alongside rouge1/2/Lsum."""
  return rouge(targets, predictions, score_keys=("rouge1", "rouge2", "rougeL", "rougeLsum"))


def accuracy(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """Percentage of predictions equal to their target."""
  _check(targets, predictions)
  if not targets:
    return {"accuracy": 0.0}
  return {"accuracy": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def sequence_accuracy(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """T5's name for per-example exact match of whole sequences."""
  return {"sequence_accuracy": accuracy(targets, predictions)["accuracy"]}


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Percentage of predictions equal to the target after stripping whitespace."""
  _check(targets, predictions)
  if not targets:
    return {"exact_match": 0.0}
  same = [t.strip() == p.strip() for t, p in zip(targets, predictions)]
  return {"exact_match": 100.0 * float(np.mean(same))}


# SQuAD: T5's qa_utils.normalize_squad and qa_metrics.


def normalize_squad(answer: str) -> str:
  """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD v1.1)."""
  answer = answer.lower()
  answer = "".join(ch for ch in answer if ch not in set(string.punctuation))
  answer = re.sub(r"\b(a|an|the)\b", " ", answer)
  return " ".join(answer.split())


def _f1(target: str, prediction: str) -> float:
  target_tokens, prediction_tokens = target.split(), prediction.split()
  common = collections.Counter(prediction_tokens) & collections.Counter(target_tokens)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(prediction_tokens)
  recall = num_same / len(target_tokens)
  return 2 * precision * recall / (precision + recall)


def squad(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
  """SQuAD exact match and F1 (x100), maximised over each example's answers.

  Args:
    targets: per example, a list of acceptable answers (a string counts as one).
    predictions: one answer per example.
  """
  _check(targets, predictions)
  if not targets:
    return {"em": 0.0, "f1": 0.0}
  targets = [[t] if isinstance(t, str) else list(t) for t in targets]
  ems, f1s = [], []
  for answers, prediction in zip(targets, predictions):
    answers = [normalize_squad(a) for a in answers]
    prediction = normalize_squad(prediction)
    ems.append(max(float(a == prediction) for a in answers))
    f1s.append(max(_f1(a, prediction) for a in answers))
  return {"em": 100.0 * float(np.mean(ems)), "f1": 100.0 * float(np.mean(f1s))}
