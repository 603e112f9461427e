"""One way to open a checkpoint for inference: model, vocabulary and parameters sharded by
the partitioner's rules. `t5forge.load`, `t5forge eval`, `t5forge infer` and
`t5forge serve` all open checkpoints here, so a model that needs a mesh to fit can be
evaluated, inferred and served, not only trained.

    opened = open_checkpoint("MODEL_DIR", partitioner=Partitioner(num_partitions=2))
    opened.model, opened.vocabulary, opened.params   # params: jax arrays on the mesh

The parameters are placed with the same logical-axis rules the trainer uses
(`Partitioner.tree_shardings(model.logical_axes())`); a dimension a mesh axis does not
divide is replicated. int8 kernels (`nn.quant.QArray`) shard `q` as the float kernel and
`scale` [..., out] as the kernel without its input axis.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from t5forge import models, provenance
from t5forge.convert import LoadedCheckpoint, load_checkpoint, of_checkpoint
from t5forge.errors import UserError
from t5forge.sharding import Partitioner


@dataclasses.dataclass
class Opened:
  """What `open_checkpoint` returns.

  Attributes:
    model: the model (`models.BaseModel`); its `vocabulary` is set when one was found.
    vocabulary: the text vocabulary, or None (none saved and none given).
    params: parameter tree of jax arrays placed with `param_shardings`.
    partitioner: the mesh and rules the parameters are placed on.
    param_shardings: NamedSharding tree with the structure of `params`.
    checkpoint: what was read (config, path, step, format, extras); its `params` is None
      (the host copy is dropped once placed).
  """

  model: Any
  vocabulary: Any
  params: dict
  partitioner: Partitioner
  param_shardings: dict
  checkpoint: LoadedCheckpoint

  @property
  def config(self):
    return self.model.config

  def identity(self) -> dict:
    """Where the parameters came from, as the provenance records of eval/infer hold it."""
    c = self.checkpoint
    return provenance.checkpoint_identity(c.path, c.step, c.format)


def param_shardings(partitioner: Partitioner, model, params: dict) -> dict:
  """NamedShardings with the structure of `params` (float or int8 kernels) by the rules."""
  from t5forge.nn import quant  # pylint: disable=import-outside-toplevel
  axes = model.logical_axes()

  def one(path, spec, leaf):
    what = "params" + jax.tree_util.keystr(path)
    mesh_spec = partitioner.mesh_axes(spec, what=what)
    if isinstance(leaf, quant.QArray):
      q_spec = partitioner.divisible(mesh_spec, tuple(leaf.q.shape))
      entries = tuple(q_spec) + (None,) * (leaf.q.ndim - len(q_spec))
      scale_spec = jax.sharding.PartitionSpec(*(entries[:-2] + entries[-1:]))
      return quant.QArray(q=jax.sharding.NamedSharding(partitioner.mesh, q_spec),
                          scale=jax.sharding.NamedSharding(partitioner.mesh, scale_spec))
    return jax.sharding.NamedSharding(
        partitioner.mesh, partitioner.divisible(mesh_spec, tuple(np.shape(leaf))))

  from t5forge.sharding import is_axes  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_map_with_path(one, axes, params, is_leaf=is_axes)


def place_params(partitioner: Partitioner, model, params: dict) -> tuple[dict, dict]:
  """Host (or device) parameters -> (arrays on the mesh, their shardings)."""
  shardings = param_shardings(partitioner, model, params)
  host = jax.tree.map(np.asarray, params)
  return partitioner.place(host, shardings), shardings


def _found(path: str) -> str:
  if not os.path.isdir(path):
    return "a file"
  names = sorted(os.listdir(path))
  return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "nothing"


def open_checkpoint(path: str, *, vocabulary=None, model=None, overrides: dict | None = None,
                    partitioner: Partitioner | None = None, require_vocabulary: bool = False,
                    vocabulary_hint: str = "--vocabulary path/to/spiece.model",
                    vocabulary_path: str | None = None) -> Opened:
  """Opens any checkpoint the project reads for inference.

  Args:
    path: a t5forge checkpoint or MODEL_DIR (its latest intact checkpoint), an HF
      directory or Hub name, or a T5X checkpoint (see `convert.load_checkpoint`).
    vocabulary: the text vocabulary; default the one saved with the checkpoint.
    model: a model to use (a gin MODEL); its layout (scan_layers) and weight type apply
      to the checkpoint as it is read, and its vocabulary, when it has none, becomes the
      checkpoint's. Default: built from the checkpoint's config.
    overrides: runtime ModelConfig fields (`convert.RUNTIME_FIELDS`, e.g. dtype,
      weight_dtype) applied on load when `model` is None.
    partitioner: mesh + rules to place the parameters on (default: all devices, T5X's
      standard rules, i.e. replicated on one device).
    require_vocabulary: a checkpoint without a vocabulary (and none given) is a
      UserError that names what was found and `vocabulary_hint`.
    vocabulary_path: a SentencePiece .model to use instead of `vocabulary` (--vocabulary),
      read as the checkpoint's family needs it (`vocab_io.from_model_file`).

  A vocabulary with more ids than the model's embedding rows is a UserError.
  """
  load_overrides = dict(overrides or {})
  if model is not None:
    load_overrides.update(scan_layers=model.config.scan_layers,
                          weight_dtype=model.config.weight_dtype)
  ckpt = load_checkpoint(path, **load_overrides)
  from t5forge.data import vocab_io  # pylint: disable=import-outside-toplevel
  if vocabulary_path:
    vocabulary = vocab_io.from_model_file(vocabulary_path, ckpt.config)
  if vocabulary is None:
    vocabulary = of_checkpoint(ckpt)
  if vocabulary is not None and vocabulary.vocab_size > ckpt.config.vocab_size:
    raise UserError(f"{vocabulary_path or vocab_io.describe(vocabulary)}: {vocabulary.vocab_size} "
                    f"ids, more than the {ckpt.config.vocab_size} embedding rows (vocab_size) of "
                    f"{ckpt.path}; use the tokenizer this model was trained with")
  if vocabulary is None and require_vocabulary:
    raise UserError(f"{ckpt.path}: no vocabulary saved with this {ckpt.format} checkpoint "
                    f"(found {_found(ckpt.path)}); pass {vocabulary_hint}")
  if model is None:
    model = models.model_for(ckpt.config, vocabulary=vocabulary)
  elif model.vocabulary is None:
    model.vocabulary = vocabulary
  models.check_params_fit(model, ckpt.params, source=ckpt.source_for(model.config))
  partitioner = partitioner or Partitioner()
  params, shardings = place_params(partitioner, model, ckpt.params)
  ckpt.params = None  # the host copy: freed once the arrays are placed
  return Opened(model=model, vocabulary=vocabulary, params=params, partitioner=partitioner,
                param_shardings=shardings, checkpoint=ckpt)
