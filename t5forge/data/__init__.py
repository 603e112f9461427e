"""The data layer: vocabularies, sources, preprocessors, tasks, converters, Grain pipeline.

Importing this package registers the bundled tasks (`bundled_tasks`). The
SeqIO-shaped names are re-exported here, so `from t5forge import data as seqio`
keeps a ported `tasks.py` close to the original.

Training batches:  `get_batches(name, task_feature_lengths, batch_size, ...)`
Evaluation:        `get_eval_dataset(task, task_feature_lengths, batch_size, ...)`
Task examples:     `get_dataset(name, split, task_feature_lengths, ...)`
"""
from t5forge.data import preprocessors
from t5forge.data.converters import (EncDecFeatureConverter, FeatureConverter, LMFeatureConverter,
                                     PrefixLMFeatureConverter, get_converter)
from t5forge.data.preprocessors import CacheDatasetPlaceholder, map_over_dataset
from t5forge.data.hf_datasets import HfDataSource
from t5forge.data.records import TFExampleDataSource, TFRecordDataSource
from t5forge.data.seqio_cache import (add_global_cache_dirs, get_global_cache_dirs,
                                      set_global_cache_dirs)
from t5forge.data.sources import (ArrayRecordDataSource, DataSource, FunctionDataSource,
                                  InMemoryDataSource, JsonlDataSource, TextLineDataSource,
                                  TsvDataSource)
from t5forge.data.tabular import (ArrowDataSource, CsvDataSource, JsonTableDataSource,
                                  ParquetDataSource)
from t5forge.data.tf_example import FixedLenFeature, FixedLenSequenceFeature, VarLenFeature
from t5forge.data.tfds import TfdsDataSource, TfdsSplit, set_tfds_data_dir_override
from t5forge.data.tasks import (Feature, Mixture, MixtureRegistry, ShardInfo, Task, TaskRegistry,
                                get_dataset, get_mixture_or_task, get_vocabulary,
                                import_task_module, mixing_rate_num_examples,
                                with_vocabulary)
from t5forge.data.vocab import (ByteVocabulary, PassThroughVocabulary, SentencePieceVocabulary,
                                Vocabulary)
from t5forge.data import ul2
from t5forge.data.ul2 import ul2_objective
from t5forge.data import bundled_tasks  # registers the bundled tasks

# The pipeline imports Grain (~1 s); load it on first use so that e.g.
# `t5forge vocab` stays fast.
_PIPELINE_NAMES = ("get_batches", "get_eval_dataset", "get_eval_datasets", "DataIterator",
                   "EvalDataset")


def __getattr__(name):
  if name in _PIPELINE_NAMES:
    from t5forge.data import pipeline  # noqa: PLC0415 (grain and the pipeline load on first use)
    return getattr(pipeline, name)
  raise AttributeError(f"module 't5forge.data' has no attribute {name!r}")


__all__ = [
    "ArrayRecordDataSource", "ArrowDataSource", "ByteVocabulary", "CacheDatasetPlaceholder",
    "CsvDataSource", "DataSource", "EncDecFeatureConverter", "Feature", "FeatureConverter",
    "FixedLenFeature", "FixedLenSequenceFeature", "FunctionDataSource", "HfDataSource",
    "InMemoryDataSource", "JsonTableDataSource", "JsonlDataSource", "LMFeatureConverter",
    "Mixture", "MixtureRegistry", "ParquetDataSource", "PassThroughVocabulary",
    "PrefixLMFeatureConverter", "SentencePieceVocabulary", "ShardInfo", "TFExampleDataSource",
    "TFRecordDataSource", "Task", "TaskRegistry", "TextLineDataSource", "TfdsDataSource",
    "TfdsSplit", "TsvDataSource", "VarLenFeature", "Vocabulary", "add_global_cache_dirs",
    "bundled_tasks", "get_converter", "get_dataset", "get_global_cache_dirs",
    "get_mixture_or_task", "get_vocabulary", "import_task_module", "map_over_dataset",
    "mixing_rate_num_examples", "preprocessors", "set_global_cache_dirs",
    "set_tfds_data_dir_override", "ul2", "ul2_objective", "with_vocabulary",
    *_PIPELINE_NAMES,
]
