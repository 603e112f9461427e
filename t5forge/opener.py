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

How they get there depends on the format. A t5forge checkpoint (the one training writes)
is restored as training restores it: the shardings are made from the model's abstract
parameters before anything is read, and Orbax reads each array straight into its shards
on the mesh, so no device or host holds a full copy of a parameter a mesh splits (a
model that fits only on the mesh opens). A change of layout on load (`scan_layers`) is
then made on the mesh. Hugging Face and T5X checkpoints, and int8 weights made on load,
are converted on the host and then placed.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import convert, models, provenance, storage
from t5forge import nn as t5nn
from t5forge.convert import LoadedCheckpoint, load_checkpoint, native, paths, peft
from t5forge.data import vocab_io
from t5forge.errors import UserError
from t5forge.nn import adapters, quant
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import stack_layers, unstack_layers
from t5forge.sharding import Partitioner, is_axes


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
  source: str | None = None

  @property
  def config(self):
    return self.model.config

  def identity(self) -> dict:
    """Where the parameters came from, as the provenance records of eval/infer hold it: for
    a bucket checkpoint read through a local copy, the bucket's URL (`source`)."""
    c = self.checkpoint
    return provenance.checkpoint_identity(self.source or c.path, c.step, c.format)


def _shardings(partitioner: Partitioner, axes: dict, params: dict) -> dict:
  """NamedShardings by the rules for `params` (arrays or ShapeDtypeStructs, float or int8
  kernels) whose logical axes are `axes`."""

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

  return jax.tree_util.tree_map_with_path(one, axes, params, is_leaf=is_axes)


def param_shardings(partitioner: Partitioner, model, params: dict) -> dict:
  """NamedShardings with the structure of `params` (arrays or ShapeDtypeStructs, float or
  int8 kernels) by the rules."""
  return _shardings(partitioner, model.logical_axes(), params)


def place_params(partitioner: Partitioner, model, params: dict) -> tuple[dict, dict]:
  """Host (or device) parameters -> (arrays on the mesh, their shardings)."""
  shardings = param_shardings(partitioner, model, params)
  host = jax.tree.map(np.asarray, params)
  return partitioner.place(host, shardings), shardings


def _place_owned(partitioner: Partitioner, model, ckpt: LoadedCheckpoint) -> tuple[dict, dict]:
  """`ckpt.params` (host arrays nothing else holds) placed on the mesh one leaf at a time,
  each host leaf dropped once its arrays are made: the peak is the model plus one
  parameter, not a host and a device copy of it (a frozen base that fills the RAM).
  `ckpt.params` is None after."""
  shardings = param_shardings(partitioner, model, ckpt.params)
  leaves, treedef = jax.tree_util.tree_flatten(ckpt.params)
  ckpt.params = None
  placed = []
  for i, sharding in enumerate(treedef.flatten_up_to(shardings)):
    placed.append(partitioner.place(np.asarray(leaves[i]), sharding))
    leaves[i] = None
  return jax.tree_util.tree_unflatten(treedef, placed), shardings


def _found(path: str) -> str:
  if not os.path.isdir(path):
    return "a file"
  names = sorted(os.listdir(path))
  return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "nothing"


def open_checkpoint(path: str, *, vocabulary=None, model=None, overrides: dict | None = None,
                    partitioner: Partitioner | None = None, require_vocabulary: bool = False,
                    vocabulary_hint: str = "--vocabulary path/to/spiece.model",
                    vocabulary_path: str | None = None, base_dtype: str | None = None) -> Opened:
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
    base_dtype: keep the parameters as a frozen base of 'float32', 'bfloat16' or 'int8'
      projection kernels (`nn.adapters.store_base`); an HF checkpoint is cast tensor by tensor as
      it is read (`convert.load_checkpoint`). None: as stored.

  A vocabulary with more ids than the model's embedding rows is a UserError.
  """
  load_overrides = dict(overrides or {})
  if model is not None:
    load_overrides.update(scan_layers=model.config.scan_layers,
                          weight_dtype=model.config.weight_dtype)
  ckpt, stored_config = _read(path, load_overrides, base_dtype)
  if vocabulary_path:
    vocabulary = vocab_io.from_model_file(vocabulary_path, ckpt.config)
  if vocabulary is None:
    vocabulary = convert.of_checkpoint(ckpt)
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
  partitioner = partitioner or Partitioner()
  if stored_config is not None:
    params, shardings = _restore_on_mesh(partitioner, model, ckpt, stored_config)
  else:
    models.check_params_fit(model, ckpt.params, source=ckpt.source_for(model.config))
    params, shardings = _place_owned(partitioner, model, ckpt)
  return Opened(model=model, vocabulary=vocabulary, params=params, partitioner=partitioner,
                param_shardings=shardings, checkpoint=ckpt,
                source=_source(path, ckpt))


def with_adapter(opened: Opened, adapter: str) -> Opened:
  """`opened` with a LoRA or prompt-tuning adapter directory (ours or Hugging Face peft's,
  `convert.peft.read_any`) added to its parameters: the model's config gains the
  adapter's `lora` or `prompt`, and only the adapter's arrays are placed (the base stays
  where it is).

  An adapter that records its base's fingerprint (ours) is checked against this base's;
  a mismatch is a UserError naming both.
  """
  if adapters.has_adapter(opened.params):
    raise UserError(f"--adapter {adapter}: {opened.checkpoint.path} already holds adapter "
                    "parameters; merge them first (`t5forge convert --merge`)")
  config = opened.config
  changes, params = peft.read_any(adapter, config.replace(scan_layers=False),
                                  fingerprint=adapters.fingerprint(opened.params),
                                  base_name=opened.checkpoint.path)
  lora_config = changes.get("lora")
  if config.scan_layers and lora_config is not None:
    odd = peft.scan_mismatch(lora_config, config)
    if odd:
      raise UserError(f"adapter {adapter}: {odd} is adapted unlike layer 0 of its stack (rank "
                      f"{lora_config.rank_for(odd)}, scale {lora_config.scale_for(odd):g}); a "
                      "scanned model holds one update per stack: load with scan_layers=False")
    params = stack_layers(params)
  model = models.model_for(config.replace(**changes), vocabulary=opened.vocabulary)
  joined = adapters.join(params, opened.params)
  models.check_params_fit(model, joined, source=adapter)
  shardings = param_shardings(opened.partitioner, model, joined)
  placed = opened.partitioner.place(params, adapters.split(shardings)[0])
  return dataclasses.replace(opened, model=model, params=adapters.join(placed, opened.params),
                             param_shardings=shardings)


def _source(path: str, ckpt: LoadedCheckpoint) -> str | None:
  """The bucket URL of the checkpoint `path` names when `ckpt` was read from a local copy
  of it (s3://, or an HF / T5X checkpoint on either bucket); None otherwise."""
  if path and storage.is_remote(path) and not storage.is_remote(ckpt.path):
    return paths.resolve(path).path
  return None


def _read(path: str, overrides: dict,
          base_dtype: str | None = None) -> tuple[LoadedCheckpoint, ModelConfig | None]:
  """What `path` names, read as far as deciding where its parameters go needs.

  Returns:
    A t5forge checkpoint: its config (with `overrides`) and no parameters yet, and the
    config it was stored with (`_restore_on_mesh` reads them). Any other format, or int8
    weights made on load: the checkpoint read and converted on the host
    (`convert.load_checkpoint`), and None.
  """
  bad = sorted(set(overrides) - set(convert.RUNTIME_FIELDS))
  if bad:
    raise UserError(f"cannot override {bad} when loading a checkpoint; only "
                    f"{list(convert.RUNTIME_FIELDS)} may change")
  # A bucket checkpoint: `local` is its gs:// URL (Orbax reads it there) or a local copy,
  # whose name does not carry the step.
  local, step = convert.locate(path)
  if convert.detect_format(local) != convert.T5FORGE or base_dtype is not None:
    ckpt = load_checkpoint(local, base_dtype=base_dtype, **overrides)
    ckpt.step = ckpt.step or step or 0
    return ckpt, None
  stored, meta = native.read_header(local)
  config = stored.replace(**overrides) if overrides else stored
  if config.weight_dtype == "int8" and stored.weight_dtype != "int8":
    # nn.quant quantizes numpy kernels: a conversion on the host, as HF's.
    ckpt = load_checkpoint(local, **overrides)
    ckpt.step = ckpt.step or step or 0
    return ckpt, None
  return LoadedCheckpoint(config, None, convert.T5FORGE, local,
                          step=native.step_of(local) or step or 0, extras=meta), stored


def _targets(abstract: dict, shardings: dict) -> dict:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def _restore_on_mesh(partitioner: Partitioner, model, ckpt: LoadedCheckpoint,
                     stored_config: ModelConfig) -> tuple[dict, dict]:
  """A t5forge checkpoint's parameters, read by Orbax straight into their shards on the
  mesh (no full copy on one device or the host first), and their shardings.

  The model is checked against the checkpoint's shapes before anything is read. With the
  stored layout the model's (the usual case) each array is restored with its final
  sharding; with another (`scan_layers` changed on load) it is restored with the stored
  layout's sharding by the same rules and relaid out by one jitted function on the mesh.
  """
  models.check_params_fit(model, t5nn.abstract_params(ckpt.config),
                          source=ckpt.source_for(model.config))
  stored = t5nn.abstract_params(stored_config)
  to_scanned = ckpt.config.scan_layers
  if stored_config.scan_layers == to_scanned:
    shardings = param_shardings(partitioner, model, stored)
    return native.restore_params(ckpt.path, _targets(stored, shardings)), shardings
  params = native.restore_params(ckpt.path, _targets(
      stored, _shardings(partitioner, t5nn.logical_axes(stored_config), stored)))

  def relayout(tree):
    return stack_layers(tree, stack=jnp.stack) if to_scanned else unstack_layers(tree)

  shardings = param_shardings(partitioner, model, jax.eval_shape(relayout, stored))
  return jax.jit(relayout, out_shardings=shardings, donate_argnums=0)(params), shardings
