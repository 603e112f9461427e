"""Runs in a subprocess with 8 host CPU devices (the test sets XLA_FLAGS): opens one small
t5forge checkpoint on a (data, model) mesh through `t5forge.load`, `evaluate.evaluate` and
the opener as `t5forge serve` calls it, recording how each parameter got onto the mesh;
prints one JSON line with what the test asserts.

    python mesh_restore_worker.py CKPT NUM_PARTITIONS OUTPUT_DIR

Recorded: every Orbax restore target of the parameters (must be a NamedSharding on the
mesh), and every array of a parameter's full shape made on a single device or placed from
the host (`jax.device_put`, `jax.make_array_from_callback`, `Partitioner.place`,
`convert.native.load`): there must be none.
"""
import json
import sys

import jax
import numpy as np

import t5forge
from t5forge import evaluate, nn as t5nn, opener
from t5forge.convert import native
from t5forge.sharding import Partitioner
from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig

TASK = "bible_translate_en_es"


def _named(tree) -> dict:
  return {"/".join(str(getattr(k, "key", k)) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _inside_orbax() -> bool:
  frame = sys._getframe(2)
  while frame is not None:
    if "orbax" in frame.f_code.co_filename:
      return True
    frame = frame.f_back
  return False


class Recorder:
  """Wraps the ways an array can reach a device and notes the suspicious ones."""

  def __init__(self, shapes: set):
    self.shapes = shapes  # full shapes of the parameters that a mesh axis splits
    self.full_copies = []  # ('how', shape) of an array of such a shape on one device / host
    self.restore_targets = []  # [{name: sharding}] per Orbax restore of parameters
    self.native_loads = 0

  def _note(self, how, shape, sharding=None):
    shape = tuple(shape)
    single = sharding is None or len(getattr(sharding, "device_set", ())) == 1
    # Orbax places the shards it read, each on its device: a shard may have the shape of
    # another, unsplit parameter; where Orbax puts them is checked by its targets.
    if shape in self.shapes and single and not _inside_orbax():
      self.full_copies.append((how, list(shape)))

  def install(self):
    rec = self
    device_put, from_callback = jax.device_put, jax.make_array_from_callback
    place, restore, load = Partitioner.place, native.restore_params, native.load

    def put(x, device=None, *a, **k):
      for leaf in jax.tree.leaves(x):
        rec._note("device_put", np.shape(leaf), device if hasattr(device, "device_set")
                  else None)
      return device_put(x, device, *a, **k)

    def callback(shape, sharding, *a, **k):
      rec._note("make_array_from_callback", shape, sharding)
      return from_callback(shape, sharding, *a, **k)

    def placed(self, tree, shardings=None):
      for leaf in jax.tree.leaves(tree):  # from the host: a full copy there first
        rec._note("Partitioner.place", np.shape(leaf))
      return place(self, tree, shardings)

    def restored(path, abstract_params):
      rec.restore_targets.append({k: v.sharding for k, v in _named(abstract_params).items()})
      return restore(path, abstract_params)

    def loaded(*a, **k):
      rec.native_loads += 1
      return load(*a, **k)

    jax.device_put, jax.make_array_from_callback = put, callback
    Partitioner.place, native.restore_params, native.load = placed, restored, loaded


def _check(name, params, expected, rec, report):
  """Each restored array's sharding is the rules' NamedSharding; one restore, onto it."""
  got, want = _named(params), _named(expected)
  assert got.keys() == want.keys(), name
  wrong = [k for k in want if got[k].sharding != want[k]]
  assert not wrong, (name, wrong[:3])
  assert len(rec.restore_targets) == 1, (name, len(rec.restore_targets))
  targets = rec.restore_targets.pop()
  assert all(targets[k] == want[k] for k in want), name
  report[name] = {"params": len(got), "split": sum(
      any(a is not None for a in s.spec) for s in want.values()),
                  "specs": {k: str(v.spec) for k, v in want.items()}}


def main():
  path, mp, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  part = Partitioner(num_partitions=mp)
  config = native.read_header(path)[0]
  abstract = t5nn.abstract_params(config)
  # The rules' shardings, from the partitioner alone (not the opener).
  expected = part.tree_shardings(t5nn.logical_axes(config), prefix="params", shapes=abstract)
  split = {tuple(abstract_leaf.shape) for abstract_leaf, s in
           zip(jax.tree.leaves(abstract), jax.tree.leaves(expected))
           if any(a is not None for a in s.spec)}
  rec = Recorder(split)
  rec.install()
  report = {"devices": jax.device_count(), "mesh": dict(part.mesh.shape)}

  model = t5forge.load(path, partitioner=part)
  _check("load", model.params, expected, rec, report)

  opened = opener.open_checkpoint(path, partitioner=part, require_vocabulary=True,
                                  vocabulary_hint="--vocabulary path/to/spiece.model")
  _check("serve", opened.params, expected, rec, report)

  # scan_layers changed on load: restored onto the mesh in the stored layout, relaid out
  # there.
  scanned = config.replace(scan_layers=True)
  want = _named(part.tree_shardings(t5nn.logical_axes(scanned), prefix="params",
                                    shapes=t5nn.abstract_params(scanned)))
  got = _named(t5forge.load(path, partitioner=part, scan_layers=True).params)
  assert got.keys() == want.keys() and all(got[k].sharding == want[k] for k in want)
  targets = rec.restore_targets.pop()
  assert all(isinstance(s, jax.sharding.NamedSharding) and s.mesh == part.mesh
             for s in targets.values())
  report["scanned"] = len(got)

  seen = {}
  original = evaluate.InferenceEvaluator.__call__

  def evaluated(self, params, step, checkpoint=None):
    seen["params"] = params
    return original(self, params, step, checkpoint=checkpoint)

  evaluate.InferenceEvaluator.__call__ = evaluated
  results = evaluate.evaluate(
      dataset_cfg=DatasetConfig(TASK, {"inputs": 16, "targets": 4}, split="validation",
                                batch_size=8, shuffle=False, pack=False),
      restore_checkpoint_cfg=RestoreCheckpointConfig(path=path, mode="specific"),
      output_dir=out_dir, num_examples=8, partitioner=part)
  _check("eval", seen["params"], expected, rec, report)
  report["eval_steps"] = sorted(results)
  report["full_copies"] = rec.full_copies
  report["native_loads"] = rec.native_loads
  print(json.dumps(report))


if __name__ == "__main__":
  main()
