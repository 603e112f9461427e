"""Batch inference to JSONL as T5X writes it: resumable in chunks, sharded over hosts.

Inputs come from a registered task's split or from a file (TSV: inputs[<TAB>targets];
JSONL: {"inputs": ..., "targets": ...}; text: one input a line). Output, in output_dir:

    <name>-<step>.jsonl-00003-of-00010              a finished chunk
    <name>-<step>.jsonl-00003-of-00010.COMPLETED    written after the chunk is whole
    <name>-<step>.jsonl                             all chunks merged, in input order
    <name>-<step>.jsonl.fingerprint.json            what the output is made from

output_dir may be a `gs://` or `s3://` URL: each of these files is then one object,
written whole (`t5forge.files`), and the chunks are found by listing the prefix.

The fingerprint (written before any chunk, kept beside the merged file) records the
inputs (a digest of their tokens and text), mode, decoding options, lengths, model dtype
and checkpoint (path, step, format, a digest of its metadata files). A rerun of the same
work skips chunks whose COMPLETED marker names this fingerprint, so a killed job loses no
line and repeats none, and returns a merged file as it is. Output of this name made by
other work (or by an older t5forge, with no fingerprint) is refused with one line naming
what differs; `overwrite` (--overwrite) deletes it and starts afresh. With several
processes, chunk k belongs to process k % process_count; process 0 merges once every chunk
is complete. Lines (T5X's format):

    predict:          {"inputs": {"inputs_pretokenized": ...}, "prediction": ..., "prediction_tokens": [...]}
    predict_with_aux: the same plus "aux": {"scores": ...}
    score:            {"inputs": {...}, "targets": ..., "score": ...}
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import json
import os
import warnings
from typing import Any

import jax
import numpy as np

from t5forge import data, decoding, files, multihost, opener, provenance, storage
from t5forge.data import vocab_io
from t5forge.data.files import iter_lines
from t5forge.errors import UserError
from t5forge.engine import offline
from t5forge.generation import Generator
from t5forge.predict import SCHEDULERS, DecodeOptions, features_from_tokens, fit
from t5forge.sharding import Partitioner

MODES = ("predict", "predict_with_aux", "score")


@dataclasses.dataclass
class Example:
  """One input: its tokens, optional target tokens, and the text to echo back."""

  inputs: list[int]
  targets: list[int] | None
  pretokenized: dict[str, Any]
  where: str  # file:line or task:index, for messages


def read_file(path: str) -> list[dict[str, str]]:
  """Rows {'inputs': str, 'targets'?: str} of a TSV, JSONL or text file (optionally .gz)."""
  name = path[:-3] if path.endswith(".gz") else path
  if not storage.isfile(path):
    raise UserError(f"{path}: input file not found")
  rows = []
  for n, line in iter_lines(path):
    if not line.strip():
      continue
    if name.endswith(".jsonl") or name.endswith(".json"):
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not a JSON object ({e.msg}); one object per line") from None
      if not isinstance(obj, dict) or "inputs" not in obj:
        raise UserError(f"{path}:{n}: each line needs an \"inputs\" field")
      rows.append({k: str(v) for k, v in obj.items() if k in ("inputs", "targets")})
    elif name.endswith(".tsv"):
      fields = line.split("\t")
      if len(fields) > 2:
        raise UserError(f"{path}:{n}: {len(fields)} tab-separated fields; expected inputs or "
                        "inputs<TAB>targets")
      rows.append(dict(zip(("inputs", "targets"), fields)))
    else:
      rows.append({"inputs": line})
  if not rows:
    raise UserError(f"{path}: no inputs (the file is empty); give at least one line")
  return rows


def examples_from_file(path: str, vocabulary, *, need_targets: bool) -> list[Example]:
  rows = read_file(path)
  out = []
  for n, row in enumerate(rows):
    if need_targets and "targets" not in row:
      raise UserError(f"{path}: scoring needs targets: row {n + 1} has none (TSV: inputs<TAB>"
                      "targets; JSONL: a \"targets\" field)")
    targets = vocabulary.encode(row["targets"]) + [vocabulary.eos_id] if "targets" in row else None
    pre = {"inputs_pretokenized": row["inputs"]}
    if "targets" in row:
      pre["targets_pretokenized"] = row["targets"]
    out.append(Example(vocabulary.encode(row["inputs"]) + [vocabulary.eos_id], targets, pre,
                       f"{path}:{n + 1}"))
  return out


def examples_from_task(name: str, split: str,
                       use_cached: bool = False) -> tuple[list[Example], Any]:
  """A task's split as examples (preprocessed, untrimmed), and the task; `use_cached`:
  from its SeqIO cache."""
  task = data.get_mixture_or_task(name)
  if not hasattr(task, "output_features"):
    raise UserError(f"{name!r} is a mixture; infer one of its tasks")
  out = []
  for i, ex in enumerate(task.get_dataset(None, split, use_cached, shuffle=False,
                                          num_epochs=1)):
    pre = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in ex.items()
           if k.endswith("_pretokenized")}
    targets = [int(t) for t in ex["targets"]] if "targets" in ex else None
    out.append(Example([int(t) for t in ex["inputs"]], targets, pre, f"{name}:{split}:{i}"))
  if not out:
    raise UserError(f"task {name!r} split {split!r} has no examples")
  return out, task


@dataclasses.dataclass
class InferResult:
  path: str
  num_examples: int
  truncated: int
  chunks_done_now: int
  num_chunks: int = 0


def infer(*, model, params, examples: list[Example], output_dir: str, name: str, step: int,
          mode: str = "predict", batch_size: int = 32, chunk_size: int = 1024,
          input_length: int | None = None, target_length: int = 64, strict: bool = False,
          decode_options: DecodeOptions | None = None,
          partitioner: Partitioner | None = None, param_shardings=None,
          checkpoint: dict | None = None, overwrite: bool = False,
          scheduler: str = "continuous") -> InferResult:
  """Runs inference over `examples`, chunk by chunk, resumably (see the module doc).

  Args:
    input_length: inputs longer than this many tokens are truncated (EOS kept) with a
      counted warning, or refused when `strict`; default the longest input.
    target_length: tokens to decode (predict) or the longest target kept (score).
    partitioner, param_shardings: the mesh `params` are placed on and their shardings
      (`opener.Opened`); the prediction functions are compiled for them.
    checkpoint: where `params` came from, `provenance.checkpoint_identity(...)`; part of
      the fingerprint that decides whether earlier output may be reused.
    overwrite: delete earlier output of this name made by other work (other inputs,
      mode, decoding options or checkpoint) instead of refusing.
    scheduler: 'continuous': greedy and sampled decodes of an encoder-decoder model feed
      the engine's batch_size slots as they free up (`engine.OfflineDecoder`); 'static':
      padded batches of batch_size that each decode as long as their longest row (the
      only way for beams, decoder-only models and scoring). Greedy output is the same
      either way; sampled output is not (the engine keys each row by its place).
  """
  if mode not in MODES:
    raise UserError(f"--mode {mode!r}: choose one of {MODES}")
  if scheduler not in SCHEDULERS:
    raise UserError(f"--scheduler {scheduler!r}: choose one of {SCHEDULERS}")
  if mode == "score" and any(ex.targets is None for ex in examples):
    raise UserError("score mode needs targets for every input")
  vocab = model.vocabulary
  eos = vocab.eos_id if vocab is not None else 1
  stops = model.stop_ids  # the EOS id, or several (ModelConfig.eos_token_ids)
  longest = max(len(ex.inputs) for ex in examples)
  input_length = input_length or longest
  too_long = [ex for ex in examples if len(ex.inputs) > input_length]
  if too_long and strict:
    raise UserError(f"{too_long[0].where}: input has {len(too_long[0].inputs)} tokens, more than "
                    f"the input length {input_length} (--strict); raise --max_input_length or "
                    "drop --strict to truncate")
  partitioner = inference_partitioner(partitioner)
  partitioner.check_batch_size(batch_size)
  generator = Generator(model, partitioner=partitioner, param_shardings=param_shardings)
  opts = decode_options or DecodeOptions()
  continuous = (scheduler == "continuous" and mode != "score"
                and offline.supports(model, opts))
  if storage.is_remote(output_dir):
    output_dir = storage.normalize(output_dir)
  storage.makedirs(output_dir)  # a bucket: checks that it exists
  base = storage.join(output_dir, f"{name}-{step}.jsonl")
  n_chunks = max(1, -(-len(examples) // chunk_size))
  work = fingerprint(examples, mode=mode, options=opts, input_length=input_length,
                     target_length=target_length, chunk_size=chunk_size, model=model,
                     checkpoint=checkpoint, engine=continuous)
  _claim(base, work, overwrite=overwrite)
  if storage.exists(base) and not _matching(base, "-*.COMPLETED"):
    return InferResult(base, len(examples), 0, 0, n_chunks)  # merged by an earlier run
  marker = provenance.digest(work)  # a COMPLETED marker names the work its chunk belongs to
  done_now = 0
  # Greedy and sampled decodes of an encoder-decoder feed the engine's slots
  # continuously (a short row frees its slot for the next); beams, decoder-only models
  # and scoring run in static batches.
  engine = None
  if continuous:
    engine = offline.OfflineDecoder(model, params, num_slots=batch_size,
                                    decode_length=target_length, input_length=input_length,
                                    partitioner=partitioner)
  try:
    for k in range(jax.process_index(), n_chunks, jax.process_count()):
      chunk_path = f"{base}-{k:05d}-of-{n_chunks:05d}"
      if _read(chunk_path + ".COMPLETED") == marker:
        continue  # finished by an earlier run of the same work
      chunk = examples[k * chunk_size:(k + 1) * chunk_size]
      if engine is not None:
        tokens, scores = engine.decode([fit(ex.inputs, input_length, eos) for ex in chunk],
                                       opts)
        lines = _prediction_lines(chunk, tokens, scores, mode=mode, vocab=vocab, stops=stops)
      else:
        lines = []
        for start in range(0, len(chunk), batch_size):
          lines += _static_lines(model, params, generator, partitioner,
                                 chunk[start:start + batch_size], mode=mode, opts=opts,
                                 input_length=input_length, target_length=target_length,
                                 batch_size=batch_size, eos=eos, vocab=vocab, stops=stops)
      files.write_lines(chunk_path, lines)
      files.write_text(chunk_path + ".COMPLETED", marker)  # after the chunk is whole
      done_now += 1
  finally:
    if engine is not None:
      engine.close()
  multihost.sync("t5forge_infer_chunks")
  if multihost.is_chief():
    _merge(base, n_chunks)
  multihost.sync("t5forge_infer_merged")
  if too_long:
    warnings.warn(f"{len(too_long)} of {len(examples)} inputs were longer than {input_length} "
                  "tokens and were truncated (--strict refuses them)", stacklevel=2)
  return InferResult(base, len(examples), len(too_long), done_now, n_chunks)


def _static_lines(model, params, generator, partitioner, part: list[Example], *, mode: str,
                  opts: DecodeOptions, input_length: int, target_length: int,
                  batch_size: int, eos: int, vocab, stops) -> list[dict]:
  """One padded batch of `part` (at most batch_size examples) -> its output lines."""
  batch = features_from_tokens([ex.inputs for ex in part], [ex.targets for ex in part],
                               encoder_decoder=model.config.is_encoder_decoder,
                               input_length=input_length, target_length=target_length,
                               eos=eos, rows=batch_size)
  # One process: the batch is split over all devices. Several: each process infers its
  # own chunks on its own devices (the generator places the rows), with no collective in
  # the loop.
  gbatch = partitioner.shard_batch(batch) if jax.process_count() == 1 else batch
  if mode == "score":
    scores = generator.score_batch(gbatch, params=params)
    return [{"inputs": ex.pretokenized, "score": float(scores[r])} for r, ex in enumerate(part)]
  tokens, scores = generator.predict(gbatch, opts, params=params,
                                     max_decode_length=target_length)
  return _prediction_lines(part, tokens, scores, mode=mode, vocab=vocab, stops=stops)


def _prediction_lines(part: list[Example], tokens: np.ndarray, scores: np.ndarray, *,
                      mode: str, vocab, stops) -> list[dict]:
  """Decodes [>= len(part), l] and their scores -> one line per example: the text up to
  the first stop id, the tokens through it, and with predict_with_aux the score."""
  lines = []
  for r, ex in enumerate(part):
    toks = [int(t) for t in tokens[r]]
    ends = np.flatnonzero(np.isin(toks, stops))
    cut = toks[:ends[0] + 1] if len(ends) else toks
    row = {"inputs": ex.pretokenized,
           "prediction": (vocab.decode(decoding.text_ids(cut, stops)) if vocab is not None
                          else None),
           "prediction_tokens": cut}
    if mode == "predict_with_aux":
      row["aux"] = {"scores": float(scores[r])}
    lines.append(row)
  return lines


FINGERPRINT = ".fingerprint.json"
OVERWRITE_HINT = ("pass --overwrite to replace it (gin: "
                  "--gin.infer_script.infer_task.overwrite=True), or choose another "
                  "--output_dir or --name")


def fingerprint(examples: list[Example], *, mode: str, options: DecodeOptions,
                input_length: int, target_length: int, chunk_size: int, model,
                checkpoint: dict | None, engine: bool = False) -> dict[str, Any]:
  """What decides the output lines: inputs (a digest of every example's tokens, targets
  and text), mode, decoding options (predict modes), lengths, the model's numerics and
  the checkpoint; and the chunk size, which decides what the chunk files hold. Batch size
  is not part of it: it changes no line. Sampling on the engine draws other tokens
  than in static batches: it is recorded then."""
  h = hashlib.sha256()
  for ex in examples:
    h.update(json.dumps([ex.inputs, ex.targets, ex.pretokenized], sort_keys=True,
                        default=str).encode() + b"\n")
  decode = None if mode == "score" else provenance.decode_record(options)
  if decode is not None and engine and options.method == "sample":
    decode["scheduler"] = "continuous"
  return provenance.normalized({
      "mode": mode, "inputs": {"count": len(examples), "sha256": h.hexdigest()},
      "checkpoint": checkpoint,
      "decode": decode,
      "input_length": input_length, "target_length": target_length,
      "model": provenance.model_record(model.config), "chunk_size": chunk_size})


def _read(path: str) -> str | None:
  try:
    if storage.is_remote(path):
      return storage.read_text(path)
    with open(path, encoding="utf-8") as f:
      return f.read()
  except FileNotFoundError:
    return None


def _matching(base: str, pattern: str) -> list[str]:
  """The files whose names are `base`'s followed by `pattern` (a glob, e.g. '-*-of-*')."""
  if not storage.is_remote(base):
    return glob.glob(f"{glob.escape(base)}{pattern}")
  folder, name = storage.dirname(base), storage.basename(base)
  wanted = glob.escape(name) + pattern
  return [storage.join(folder, n) for n in storage.listdir(folder)
          if fnmatch.fnmatchcase(n, wanted)]


def _temporaries(base: str) -> list[str]:
  """What a killed write of `base` or of one of its chunks left: `files.atomic_file`'s
  temporaries (and an older t5forge's `<name>.tmp-<pid>`). A bucket has none: each of
  its files is one object, written whole."""
  if storage.is_remote(base):
    return []
  folder, name = os.path.split(base)
  return (glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}*.tmp-*"))
          + glob.glob(f"{glob.escape(base)}*.tmp-*"))


def _claim(base: str, work: dict, *, overwrite: bool) -> None:
  """Makes `base`'s files hold only `work`: refuses (one line naming what differs) output
  of this name made by other work, or deletes it when `overwrite`; then records `work`
  in <base>.fingerprint.json before any chunk is written."""
  record_path = base + FINGERPRINT
  text = _read(record_path)
  try:
    recorded = json.loads(text) if text is not None else None
  except json.JSONDecodeError:
    recorded = None  # torn by hand or by a disk fault: unknown work, like no record
  recorded = recorded if isinstance(recorded, dict) else None
  chunks = _matching(base, "-*-of-*")
  merged = storage.exists(base)
  if (chunks or merged) and not overwrite:
    if recorded is None:
      raise UserError(f"{base} has no record of the inputs, mode, decoding options and "
                      f"checkpoint it was made with ({record_path} is missing or "
                      f"unreadable: an older t5forge, or another program); {OVERWRITE_HINT}")
    old, new = recorded, work
    if old.get("mode") != new.get("mode"):  # then the decoding options say nothing more
      old, new = ({k: v for k, v in r.items() if k != "decode"} for r in (old, new))
    if not chunks:  # merged: how it was chunked no longer matters
      old, new = ({k: v for k, v in r.items() if k != "chunk_size"} for r in (old, new))
    diffs = provenance.differences(old, new)
    if diffs:
      raise UserError(f"{base} was made with {'; '.join(diffs)}; {OVERWRITE_HINT}")
  if multihost.is_chief():
    if overwrite:
      # The record goes first: a run killed while deleting leaves files that a rerun
      # without --overwrite refuses, never a marker whose chunk is gone.
      markers = [p for p in chunks if p.endswith(".COMPLETED")]
      for path in ([record_path] + markers + sorted(set(chunks) - set(markers)) + [base]
                   + _temporaries(base)):
        if storage.exists(path):
          storage.remove(path)
    if overwrite or (recorded != work and not (chunks or merged)):
      files.write_json(record_path, work, indent=1)
  multihost.sync("t5forge_infer_fingerprint")


def _merge(base: str, n_chunks: int) -> None:
  parts = [f"{base}-{k:05d}-of-{n_chunks:05d}" for k in range(n_chunks)]
  missing = [p for p in parts if not storage.exists(p + ".COMPLETED")]
  if missing:
    raise UserError(f"cannot merge {base}: chunk {missing[0]} is not complete; rerun to finish it")
  with files.atomic_file(base) as out:
    for p in parts:
      out.write(_read(p))
  for p in parts:  # the marker first: a chunk without its marker is simply redone
    storage.remove(p + ".COMPLETED")
    storage.remove(p)
  for stale in _temporaries(base):
    os.remove(stale)


def infer_task(*, restore_checkpoint_cfg, output_dir: str, dataset_cfg=None,
               input_path: str | None = None, model=None, mode: str = "predict",
               partitioner: Partitioner | None = None,
               decode_options: DecodeOptions | None = None, chunk_size: int = 1024,
               strict: bool = False, overwrite: bool = False, name: str | None = None,
               vocabulary_path: str | None = None, use_checkpoint_vocabulary: bool = False,
               load_overrides: dict | None = None,
               scheduler: str = "continuous") -> InferResult:
  """Inference from a checkpoint to JSONL in `output_dir`: the one library entry point of
  `t5forge infer` (as `evaluate.evaluate` is of `t5forge eval`), and T5X's infer.py
  through gin (runs/infer.gin binds it).

  Args:
    restore_checkpoint_cfg: its `path`: a checkpoint, a MODEL_DIR (its newest intact
      checkpoint, mode 'latest' or not), an HF directory or Hub name, or a T5X checkpoint.
    output_dir: where `<name>-<step>.jsonl` goes (see `infer`).
    dataset_cfg: the task (mixture_or_task_name, split, use_cached, module), the global
      batch size and task_feature_lengths: 'inputs' (longer inputs are truncated; None:
      the longest) and 'targets' (tokens decoded, or the longest target kept in score
      mode; default 64). With `input_path`, only the batch size, lengths and module apply.
      Default: batch 32, the default lengths.
    input_path: a TSV, JSONL or text file of inputs instead of a task (`read_file`).
    model: a model (gin MODEL); its layout and weight type apply to the checkpoint as it
      is read. Default: built from the checkpoint's config.
    name: output name; default the task, or the file's name up to its first dot.
    vocabulary_path: a SentencePiece model when the checkpoint carries no vocabulary.
    use_checkpoint_vocabulary: tokenize the task with the checkpoint's vocabulary (or
      `vocabulary_path`'s) instead of its own.
    load_overrides: runtime ModelConfig fields applied as the checkpoint is read
      (--dtype, --weight_dtype).
    mode, partitioner, decode_options, chunk_size, strict, overwrite, scheduler: as
      `infer`; `overwrite` replaces earlier output of other work.
  """
  task = dataset_cfg.mixture_or_task_name if dataset_cfg is not None else None
  if not restore_checkpoint_cfg.path:
    raise UserError("no checkpoint to infer with; set CHECKPOINT_PATH (--checkpoint)")
  if input_path is None and not task:
    raise UserError("nothing to infer: set MIXTURE_OR_TASK_NAME (--task) or give --input")
  if dataset_cfg is not None and dataset_cfg.module:
    data.import_task_module(dataset_cfg.module, flag="--module / MIXTURE_OR_TASK_MODULE")
  _check_paths(restore_checkpoint_cfg.path, input_path, output_dir)
  opened = opener.open_checkpoint(
      restore_checkpoint_cfg.path, model=model, vocabulary_path=vocabulary_path,
      overrides=load_overrides, partitioner=inference_partitioner(partitioner),
      require_vocabulary=input_path is not None and (model is None or model.vocabulary is None),
      vocabulary_hint="--vocabulary path/to/spiece.model")
  model, vocab = opened.model, opened.vocabulary
  if input_path is None:
    task_name = data.with_vocabulary(task, vocab) if use_checkpoint_vocabulary else task
    item = data.get_mixture_or_task(task_name)
    fix = ("Tokenize the task with the checkpoint's vocabulary: t5forge infer "
           "--use_checkpoint_vocabulary (gin: MIXTURE_OR_TASK_NAME = @data.with_vocabulary(), "
           "see t5forge/data/README.md)")
    vocab_io.check_task(item, vocab, against=(
        f"--vocabulary {vocabulary_path}" if vocabulary_path
        else f"checkpoint {opened.checkpoint.path}"), fix=fix)
    if model.vocabulary is not None and model.vocabulary is not vocab:
      vocab_io.check_task(item, model.vocabulary, against="the model (its VOCABULARY)",
                          fix=fix + ", or set VOCABULARY = None")
    examples, item = examples_from_task(task_name, dataset_cfg.split, dataset_cfg.use_cached)
    if model.vocabulary is None:  # neither checkpoint nor model gin has one: the task's
      model.vocabulary = item.output_features["targets"].vocabulary
    name = name or task
  else:
    examples = examples_from_file(input_path, model.vocabulary, need_targets=mode == "score")
    name = name or storage.basename(input_path).split(".")[0]
  lengths = dict((dataset_cfg.task_feature_lengths if dataset_cfg is not None else None) or {})
  return infer(model=model, params=opened.params, examples=examples, output_dir=output_dir,
               name=name, step=opened.checkpoint.step, mode=mode,
               batch_size=int(dataset_cfg.batch_size) if dataset_cfg is not None else 32,
               chunk_size=chunk_size, input_length=lengths.get("inputs"),
               target_length=lengths.get("targets") or 64, strict=strict,
               decode_options=decode_options, partitioner=opened.partitioner,
               param_shardings=opened.param_shardings, checkpoint=opened.identity(),
               overwrite=overwrite, scheduler=scheduler)


def _check_paths(checkpoint: str, input_path: str | None, output_dir: str) -> None:
  """Before the checkpoint is read: an unknown scheme in any path, or an output bucket
  that does not exist (or cannot be reached), is one line naming it."""
  for path in (checkpoint, input_path):
    if path:
      storage.is_remote(path)
  if storage.is_remote(output_dir):
    storage.check_bucket(output_dir)


def inference_partitioner(partitioner: Partitioner | None = None) -> Partitioner:
  """The mesh `infer` runs on: `partitioner` (default all devices, standard rules) with
  one process; with several, the same rules and model axis over this process's own
  devices, as each process infers its own chunks with no collective."""
  if jax.process_count() == 1:
    return partitioner or Partitioner()
  if partitioner is not None and all(d.process_index == jax.process_index()
                                     for d in partitioner.mesh.devices.flat):
    return partitioner  # already this process's own
  if partitioner is None:
    return Partitioner(devices=jax.local_devices())
  return Partitioner(num_partitions=partitioner.mesh.shape.get("model", 1),
                     logical_axis_rules=partitioner.rules, devices=jax.local_devices())
