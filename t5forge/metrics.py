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

One deliberate difference: with several references per example, `bleu` / `chrf`
read `targets[i]` as example i's list of references; T5's `bleu` reads `targets[i]` as reference stream i (one reference
for every example). Transpose T5-style stream lists before passing them here.

The GLUE / SuperGLUE metrics follow T5's `t5.evaluation.metrics` on T5's scale and
keys, computed with the same libraries: `pearson_corrcoef` / `spearman_corrcoef`
(scipy.stats), `matthews_corrcoef`, `mean_multiclass_f1(num_classes)` and
`f1_score_with_invalid` (scikit-learn), `edit_distance` (word-level) and
`mean_group_metric(metric_fn)` (MultiRC, ReCoRD-style per-group means).

An unknown name (`metrics.glue_f1_foo` in a ported tasks.py) raises an
AttributeError naming the closest known metrics.
"""
from __future__ import annotations

import collections
import difflib
import re
import string
from collections.abc import Callable, Sequence

import numpy as np

from t5forge.errors import UserError


def _check(targets: Sequence, predictions: Sequence) -> None:
  if len(targets) != len(predictions):
    raise UserError(f"metric got {len(targets)} targets but {len(predictions)} predictions")


def bleu(targets: Sequence, predictions: Sequence[str],
         tokenizer: str = "intl") -> dict[str, float]:
  """Corpus BLEU (sacrebleu, T5's settings).

  Args:
    targets: one reference per example, or per example a list of references
      (`targets[i]` = example i's references; T5 reads `targets[i]` as reference
      stream i instead, see the module docstring).
    predictions: one string per example.
  """
  import sacrebleu  # noqa: PLC0415 (slow import, on first use)

  _check(targets, predictions)
  score = sacrebleu.corpus_bleu(list(predictions), _reference_streams(targets), smooth_method="exp",
                                smooth_value=0.0, force=False, lowercase=False, tokenize=tokenizer,
                                use_effective_order=False)
  return {"bleu": score.score}


def chrf(targets: Sequence, predictions: Sequence[str]) -> dict[str, float]:
  """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2)."""
  import sacrebleu  # noqa: PLC0415 (slow import, on first use)

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
  from rouge_score import rouge_scorer, scoring  # noqa: PLC0415 (slow import, on first use)

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


# GLUE / SuperGLUE: T5's t5.evaluation.metrics, same libraries, keys and 0-100 scale.


def pearson_corrcoef(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
  """Pearson's r x100 (scipy.stats.pearsonr), as T5's STS-B metric."""
  import scipy.stats  # noqa: PLC0415 (slow import, on first use)

  _check(targets, predictions)
  return {"pearson_corrcoef": 100 * float(scipy.stats.pearsonr(targets, predictions)[0])}


def spearman_corrcoef(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
  """Spearman's rho x100 (scipy.stats.spearmanr), as T5's STS-B metric."""
  import scipy.stats  # noqa: PLC0415 (slow import, on first use)

  _check(targets, predictions)
  return {"spearman_corrcoef": 100 * float(scipy.stats.spearmanr(targets, predictions)[0])}


def matthews_corrcoef(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """Matthews correlation x100 (sklearn.metrics.matthews_corrcoef), T5's CoLA metric."""
  import sklearn.metrics  # noqa: PLC0415 (slow import, on first use)

  _check(targets, predictions)
  return {"matthews_corrcoef": 100 * float(sklearn.metrics.matthews_corrcoef(targets, predictions))}


def mean_multiclass_f1(num_classes: int, **fbeta_kwargs) -> Callable[..., dict[str, float]]:
  """The unweighted mean of per-class F1 over labels 0..num_classes-1, x100 (T5's MNLI/CB).

  Returns a metric fn giving {"mean_<num_classes>class_f1": ...}; fbeta_kwargs (e.g.
  sample_weight) go to sklearn.metrics.fbeta_score. A label absent from both targets
  and predictions counts as F1 0, as scikit-learn scores it (with a warning silenced).
  """
  def metric(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
    import sklearn.metrics  # noqa: PLC0415 (slow import, on first use)

    _check(targets, predictions)
    kwargs = {"zero_division": 0.0, **fbeta_kwargs}
    score = sklearn.metrics.fbeta_score(targets, predictions, beta=1, labels=range(num_classes),
                                        average="macro", **kwargs)
    return {f"mean_{num_classes}class_f1": 100 * float(score)}

  return metric


def f1_score_with_invalid(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """Binary F1 x100 where a prediction other than 0 or 1 counts as wrong (T5's MRPC/QQP).

  An invalid prediction is replaced by the opposite of its target before
  sklearn.metrics.f1_score; the caller's predictions are not modified.
  """
  import sklearn.metrics  # noqa: PLC0415 (slow import, on first use)

  _check(targets, predictions)
  targets = np.asarray(targets)
  predictions = np.array(predictions)  # a copy: T5 rewrites its argument in place
  invalid = (predictions != 0) & (predictions != 1)
  predictions[invalid] = 1 - targets[invalid]
  return {"f1": 100 * float(sklearn.metrics.f1_score(targets, predictions))}


def _levenshtein(a: Sequence[str], b: Sequence[str]) -> int:
  """Insertions + deletions + substitutions turning token list a into b."""
  previous = list(range(len(b) + 1))
  for i, x in enumerate(a, 1):
    current = [i]
    for j, y in enumerate(b, 1):
      current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
    previous = current
  return previous[-1]


def edit_distance(targets: Sequence[str], predictions: Sequence[str],
                  lower: bool = True) -> dict[str, float]:
  """Word-level Levenshtein distance per example: min, max, mean, median and sum (T5's).

  Words are T5's `re.split(r"[^\\w]", text)` pieces (empty pieces between adjacent
  non-word characters count as words too, as in T5); `lower` lowercases first.
  """
  _check(targets, predictions)
  if not targets:
    raise UserError("edit_distance got no examples")
  distances = []
  for target, prediction in zip(targets, predictions):
    if lower:
      target, prediction = target.lower(), prediction.lower()
    distances.append(_levenshtein(re.split(r"[^\w]", prediction), re.split(r"[^\w]", target)))
  return {"min_edit": min(distances), "max_edit": max(distances),
          "mean_edit": float(np.mean(distances)), "median_edit": float(np.median(distances)),
          "sum_edit": sum(distances)}


def mean_group_metric(metric_fn: Callable[..., dict[str, float]], group_key: str = "group",
                      value_key: str = "value",
                      return_subgroup_scores: bool = False) -> Callable[..., dict[str, float]]:
  """A metric fn averaging `metric_fn` over groups of examples (T5's MultiRC / ReCoRD).

  Targets are dicts holding `group_key` and `value_key`; predictions dicts holding
  `value_key`. metric_fn runs on each group's values; every key of its result is
  averaged over groups. With return_subgroup_scores, "<group>-<key>" per group too.
  Pass whole groups: a group cut short by a subsampled eval set changes the mean.
  """
  def metric(targets: Sequence[dict], predictions: Sequence[dict]) -> dict[str, float]:
    _check(targets, predictions)
    grouped = collections.defaultdict(lambda: ([], []))
    for target, prediction in zip(targets, predictions):
      values = grouped[target[group_key]]
      values[0].append(target[value_key])
      values[1].append(prediction[value_key])
    scores = collections.defaultdict(list)
    for group, (group_targets, group_predictions) in grouped.items():
      for name, score in metric_fn(group_targets, group_predictions).items():
        scores[name].append(score)
        if return_subgroup_scores:
          scores[f"{group}-{name}"].append(score)
    return {name: float(np.mean(values)) for name, values in scores.items()}

  return metric


_NOT_METRICS = frozenset({"normalize_squad"})


def _metric_names() -> list[str]:
  return sorted(name for name, value in globals().items()
                if callable(value) and not name.startswith("_") and name not in _NOT_METRICS
                and getattr(value, "__module__", None) == __name__)


def __getattr__(name: str):
  """`metrics.<unknown>` (a typo in a ported tasks.py): say which names exist."""
  if name.startswith("__"):  # Python's own probes (__path__, __wrapped__, ...)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  known = _metric_names()
  close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
  hint = f"; did you mean {', '.join(close)}?" if close else ""
  raise AttributeError(f"t5forge.metrics has no metric {name!r}{hint} "
                       f"(known metrics: {', '.join(known)})")


def __dir__() -> list[str]:
  """The public names only (not the imported helpers), for dir() and error messages."""
  return sorted(_metric_names() + list(_NOT_METRICS))
