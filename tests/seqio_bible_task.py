"""Registers `bible_cached`, the task of the SeqIO cache fixture
(../shared/testdata/formats/seqio, written by SeqIO 0.0.20's cache_tasks_main), for tests
and for `--module_import seqio_bible_task` in cache_tasks' Beam workers."""
import os

from t5forge import data as seqio
from t5forge.data import preprocessors as pre

# As conftest.SHARED; not imported from there, so that a Beam worker need not load conftest.
FORMATS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                       "testdata", "formats"))
VOCAB_PATH = os.path.join(FORMATS, "seqio", "spiece.model")


def to_pair(ex):
  return {"inputs": "translate English to Spanish: " + ex["translation"]["en"],
          "targets": ex["translation"]["es"]}


def register(name="bible_cached", vocab=None, placeholder=True, required=False):
  vocab = vocab or seqio.SentencePieceVocabulary(VOCAB_PATH)
  steps = [to_pair, pre.tokenize]
  if placeholder:
    steps.append(seqio.CacheDatasetPlaceholder(required=required))
  steps.append(pre.append_eos_after_trim)
  return seqio.TaskRegistry.add(
      name, seqio.TfdsDataSource("bible_verses/en_es:1.0.0",
                                 tfds_data_dir=os.path.join(FORMATS, "tfds_tfrecord")),
      preprocessors=steps, output_features={"inputs": seqio.Feature(vocab),
                                            "targets": seqio.Feature(vocab)}, overwrite=True)


if "bible_cached" not in seqio.TaskRegistry.names():
  register()
