"""Logical axis names shared by the networks and the partitioner.

Every parameter is created with logical axis names (T5X's vocabulary), so that a
rules table alone decides how it is sharded. Activations are constrained at block
boundaries with the activation names below.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np

from t5forge.errors import UserError

# Parameter axes (T5X's names).
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV = "kv"
JOINED_KV = "joined_kv"
# The [num_kv_heads * head_dim] output of grouped-query key/value projections (T5Gemma);
# also the kv-head axis of their activations and decoding caches.
KV_HEADS = "kv_heads"
RELPOS_BUCKETS = "relpos_buckets"
LAYERS = "layers"  # the stacked axis of scanned layers
LORA_RANK = "lora_rank"  # the rank axis of LoRA updates (`t5forge.nn.lora`): replicated
PROMPT = "prompt"  # the positions of a tuned prompt (nn/prompt.py): never sharded
LORA_ADAPTERS = "lora_adapters"  # stacked adapters' axis (`lora.LoraConfig.stacked`): replicated

# Activation axes.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "embed"
ACT_MLP = "mlp"
ACT_HEADS = "heads"
ACT_KV = "kv"
ACT_VOCAB = "vocab"

PARAM_AXES = (VOCAB, EMBED, MLP, HEADS, KV, JOINED_KV, KV_HEADS, RELPOS_BUCKETS, LAYERS,
              LORA_RANK, PROMPT, LORA_ADAPTERS)

ACTIVATION_AXES = (BATCH, LENGTH, ACT_EMBED, ACT_MLP, ACT_HEADS, ACT_KV, ACT_VOCAB)
KNOWN_AXES = tuple(dict.fromkeys(PARAM_AXES + ACTIVATION_AXES))
DATA, MODEL = "data", "model"


def standard_logical_axis_rules(activation_partitioning_dims: int = 1,
                                parameter_partitioning_dims: int = 1,
                                additional_rules=()) -> list[tuple[str, str | None]]:
  """T5X's `standard_logical_axis_rules`: logical axis -> mesh axis, in priority order.

  parameter_partitioning_dims=1 shards parameters over 'model' only (Megatron-like
  when the model axis is > 1); =2 also shards `embed` over 'data' (2D / FSDP-like).
  activation_partitioning_dims=2 also shards activations' `embed` over 'model'.
  A logical axis may appear twice: the first rule whose mesh axis is still free in the
  array wins (so `mlp` takes 'model' before `embed` does).
  """
  a, p = activation_partitioning_dims, parameter_partitioning_dims
  if a not in (1, 2) or p not in (1, 2):
    raise UserError(f"activation_partitioning_dims={a} and parameter_partitioning_dims={p} "
                    "must each be 1 or 2")
  # kv_heads: sharded like the query heads. The kernels' [kv_heads * head_dim] axis splits
  # wherever the model axis divides it (Partitioner.tree_shardings); the activations'
  # kv-head axis only where it divides the number of kv heads, replicated otherwise, e.g.
  # 4 kv heads on 8 devices (attention._head_axis).
  rules = [(BATCH, DATA), (VOCAB, MODEL), (MLP, MODEL), (HEADS, MODEL), (KV, None),
           (JOINED_KV, MODEL), (KV_HEADS, MODEL)]
  if a == 1 and p == 1:
    rules.append((EMBED, None))
  elif a == 2 and p == 1:
    rules.append((EMBED, MODEL))
  elif a == 1 and p == 2:
    rules.append((EMBED, DATA))
  else:
    rules += [(EMBED, MODEL), (EMBED, DATA)]
  rules += [(RELPOS_BUCKETS, None), (LENGTH, None), (LAYERS, None), (LORA_RANK, None),
            (PROMPT, None), (LORA_ADAPTERS, None)]
  rules += list(additional_rules)
  return rules


def is_axes(x) -> bool:
  """A leaf of a logical-axes tree: a PartitionSpec, or a plain tuple of axis names / None
  (not a namedtuple such as an optax state, which is also a tuple)."""
  if isinstance(x, jax.sharding.PartitionSpec):
    return True
  return (isinstance(x, tuple) and not hasattr(x, "_fields")
          and all(isinstance(e, (str, type(None))) for e in x))


class Partitioner:
  """A device mesh plus a logical-axis rules table -> shardings for state and batches.

  Args:
    num_partitions: size of the 'model' axis; the 'data' axis gets the rest of the
      devices. Ignored when mesh_shape is given.
    mesh_shape: explicit mesh shape, e.g. (4, 2), one entry per mesh_axis_names.
    mesh_axis_names: mesh axis names; ('data', 'model') unless more axes are wanted.
    logical_axis_rules: [(logical axis, mesh axis or None)], default T5X's standard rules.
    devices: devices to use (default: all).
  """

  def __init__(self, *, num_partitions: int | None = None, mesh_shape=None,
               mesh_axis_names=(DATA, MODEL), logical_axis_rules=None, devices=None):
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    names = tuple(mesh_axis_names)
    if mesh_shape is None:
      mp = int(num_partitions or 1)
      if mp < 1 or n % mp:
        raise UserError(f"num_partitions={mp} does not divide the {n} available devices; "
                        f"use a divisor of {n}")
      mesh_shape = (n // mp, mp) + (1,) * (len(names) - 2)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if len(mesh_shape) != len(names):
      raise UserError(f"mesh_shape {mesh_shape} needs one size per mesh axis {names}")
    if int(_prod(mesh_shape)) != n:
      raise UserError(f"mesh_shape {mesh_shape} has {_prod(mesh_shape)} devices but {n} are "
                      f"available; make the product of the mesh shape {n}")
    self.mesh = jax.make_mesh(mesh_shape, names, devices=devices,
                              axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    rules = list(logical_axis_rules if logical_axis_rules is not None
                 else standard_logical_axis_rules())
    for logical, mesh_axis in rules:
      if logical not in KNOWN_AXES:
        raise UserError(f"logical axis rule ({logical!r}, {mesh_axis!r}) names an unknown "
                        f"logical axis; known axes: {', '.join(KNOWN_AXES)}")
      if mesh_axis is not None and mesh_axis not in names:
        raise UserError(f"logical axis rule ({logical!r}, {mesh_axis!r}) names a mesh axis "
                        f"that is not in the mesh {names}")
    self.rules = tuple(rules)
    self._covered = {logical for logical, _ in rules}

  # -- logical -> physical --------------------------------------------------------------
  def mesh_axes(self, logical_axes, *, what: str = "array"):
    """Logical axis names (tuple or PartitionSpec) -> PartitionSpec of mesh axes."""
    logical_axes = tuple(logical_axes)
    for name in logical_axes:
      if name is not None and name not in self._covered:
        raise UserError(f"{what} has logical axis {name!r} that no partitioning rule covers; "
                        f"add a rule such as ({name!r}, None) to logical_axis_rules")
    return nn.logical_to_mesh_axes(logical_axes, self.rules)

  def sharding(self, logical_axes, *, what: str = "array"):
    return jax.sharding.NamedSharding(self.mesh, self.mesh_axes(logical_axes, what=what))

  def tree_shardings(self, axes_tree, *, prefix: str = "", shapes=None):
    """A tree of logical axes (tuples / PartitionSpecs) -> a tree of NamedShardings.

    Args:
      shapes: optional tree of arrays / ShapeDtypeStructs like axes_tree. A dimension
        that its mesh axes do not divide (e.g. 6 heads on a model axis of 4) is then
        replicated instead: JAX cannot place uneven shards, and a run should not fail
        for one small parameter.
    """
    def one(path, spec, shape=None):
      what = prefix + jax.tree_util.keystr(path)
      mesh_spec = self.mesh_axes(spec, what=what)
      if shape is not None:
        mesh_spec = self.divisible(mesh_spec, tuple(shape.shape))
      return jax.sharding.NamedSharding(self.mesh, mesh_spec)

    if shapes is None:
      return jax.tree_util.tree_map_with_path(one, axes_tree, is_leaf=is_axes)
    return jax.tree_util.tree_map_with_path(one, axes_tree, shapes, is_leaf=is_axes)

  def divisible(self, spec, shape: tuple[int, ...]):
    """Drops mesh axes from dims they do not divide (those dims are replicated)."""
    out = []
    for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
      axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      size = _prod(self.mesh.shape[a] for a in axes)
      out.append(entry if size <= 1 or shape[i] % size == 0 else None)
    return jax.sharding.PartitionSpec(*out)

  def place(self, tree, shardings=None):
    """Host (numpy) arrays present on every process -> global arrays with the given
    shardings (default: replicated). Works with one or several processes."""
    if shardings is None:
      shardings = jax.tree.map(lambda _: self.replicated(), tree)

    def one(x, sharding):
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)

  def replicated(self):
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  # -- data -------------------------------------------------------------------------------
  @property
  def data_axes(self) -> tuple[str, ...]:
    """Mesh axes the batch dimension is split over."""
    spec = self.mesh_axes((BATCH,))
    axes = spec[0]
    if axes is None:
      return ()
    return tuple(axes) if isinstance(axes, tuple) else (axes,)

  @property
  def num_data_shards(self) -> int:
    return int(_prod([self.mesh.shape[a] for a in self.data_axes]))

  def batch_sharding(self, ndim: int = 2):
    spec = self.mesh_axes((BATCH,) + (None,) * (ndim - 1))
    return jax.sharding.NamedSharding(self.mesh, spec)

  def check_batch_size(self, global_batch_size: int) -> None:
    shards = self.num_data_shards
    if global_batch_size % shards:
      raise UserError(f"BATCH_SIZE {global_batch_size} is not divisible by the data axis "
                      f"({shards} shards on mesh {dict(self.mesh.shape)}); use a multiple of "
                      f"{shards}")
    if global_batch_size % jax.process_count():
      raise UserError(f"BATCH_SIZE {global_batch_size} is not divisible by the "
                      f"{jax.process_count()} processes")

  def host_batch_slice(self, global_batch_size: int) -> tuple[int, int]:
    """(shard_index, num_shards) of this process's part of every global batch."""
    self.check_batch_size(global_batch_size)
    return jax.process_index(), jax.process_count()

  def shard_batch(self, local_batch: dict) -> dict:
    """This process's rows {name: [b_local, ...]} -> global arrays sharded on 'batch'."""
    out = {}
    for name, x in local_batch.items():
      if x is None:
        continue
      global_shape = (x.shape[0] * jax.process_count(),) + tuple(x.shape[1:])
      out[name] = jax.make_array_from_process_local_data(self.batch_sharding(x.ndim), x,
                                                         global_shape)
    return out

  def activation_context(self):
    """Context for tracing / running: the mesh and the rules that constrain activations."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= int(x)
  return out


# T5X's class name, so run gins read `partitioning.PjitPartitioner.num_partitions = 1`.
PjitPartitioner = Partitioner
