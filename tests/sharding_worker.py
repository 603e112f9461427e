"""Runs in a subprocess with 8 host CPU devices (XLA_FLAGS set by the test): trains a
small model on several meshes and partitioning rules, compares against one device, and
checks the sharding of every parameter and optimizer leaf. Prints one JSON line.

  python tests/sharding_worker.py DIR            # T5 (CFG)
  python tests/sharding_worker.py DIR t5gemma    # T5Gemma with GQA (T5GEMMA_CFG)
"""
import json
import sys

import jax
import numpy as np

from t5forge.models import EncoderDecoderModel
from t5forge import presets
from t5forge.nn import ModelConfig
from t5forge.sharding import Partitioner, is_axes, standard_logical_axis_rules
from t5forge.train import checkpoint as ckpt_lib
from t5forge.train import loop, optim, settings
from t5forge.train.state import TrainState

# Every sharded dimension divides by 8 (data) and 4 (model), so the rules apply unaltered.
CFG = ModelConfig(vocab_size=8000, emb_dim=128, num_heads=4, head_dim=32, mlp_dim=256,
                  num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)
# T5Gemma: decoder 4 query heads over 2 kv heads, encoder 4 over 1 (multi-query), a sliding
# window (8) shorter than the sequences (32) so local and global layers differ.
T5GEMMA_CFG = presets.get("t5gemma.tiny", vocab_size=8000, emb_dim=128, num_heads=4,
                          num_kv_heads=2, head_dim=32, mlp_dim=256, encoder_num_kv_heads=1,
                          query_pre_attn_scalar=32, dropout_rate=0.0)


def run(out_dir, mesh, pdims, steps=3, devices=None, cfg=CFG):
  part = Partitioner(mesh_shape=mesh, devices=devices,
                     logical_axis_rules=standard_logical_axis_rules(1, pdims))
  result = loop.train(
      model=EncoderDecoderModel(cfg, optimizer=optim.Adafactor()), model_dir=out_dir,
      train_dataset_cfg=settings.DatasetConfig("bible_translate_en_es",
                                               {"inputs": 32, "targets": 32}, batch_size=8),
      total_steps=steps, partitioner=part,
      trainer_cls=settings.Trainer(learning_rate_fn=lambda s: 0.01),
      checkpoint_cfg=settings.CheckpointConfig(save=settings.SaveCheckpointConfig(period=steps)),
      stats_period=1, show_progress=False)
  return part, result


def check_shardings(part, state, cfg=CFG):
  """Every leaf's .sharding equals what the rules give for its logical axes."""
  model = EncoderDecoderModel(cfg)
  p_axes = model.logical_axes()
  spec = optim.Adafactor()
  o_axes = spec.state_axes(state.opt_state, model.abstract_params(), p_axes)
  n = 0
  for tree, axes in ((state.params, p_axes), (state.opt_state, o_axes)):
    leaves = jax.tree.leaves(tree)
    ax = jax.tree.leaves(axes, is_leaf=is_axes)
    assert len(leaves) == len(ax)
    for leaf, a in zip(leaves, ax):
      want = part.mesh_axes(a)
      got = leaf.sharding.spec
      assert tuple(got) + (None,) * (leaf.ndim - len(got)) == tuple(want) + (None,) * (
          leaf.ndim - len(want)), (a, got, want)
      n += 1
  return n


def compare_meshes(tmp, runs, cfg=CFG):
  """Trains on one device and on each (mesh, pdims) of runs -> {name: differences}."""
  report = {}
  _, ref = run(f"{tmp}/one", (1, 1), 1, devices=jax.devices()[:1], cfg=cfg)
  ref_params = jax.tree.map(np.asarray, ref.state.params)
  for mesh, pdims in runs:
    name = f"{mesh[0]}x{mesh[1]}_p{pdims}"
    part, res = run(f"{tmp}/{name}", mesh, pdims, cfg=cfg)
    n = check_shardings(part, res.state, cfg)
    params = jax.tree.map(np.asarray, res.state.params)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params),
                                                            jax.tree.leaves(ref_params)))
    loss_diff = abs(res.train_metrics["loss"] - ref.train_metrics["loss"])
    sharded = sum(1 for x in jax.tree.leaves(res.state.params)
                  if any(s is not None for s in x.sharding.spec))
    specs = {jax.tree_util.keystr(path): [s if s is None or isinstance(s, str) else list(s)
                                          for s in x.sharding.spec]
             for path, x in jax.tree_util.tree_leaves_with_path(res.state.params)}
    report[name] = {"max_param_diff": diff, "loss_diff": loss_diff, "leaves_checked": n,
                    "sharded_params": sharded, "loss": float(res.train_metrics["loss"]),
                    "specs": specs}
  report["one"] = {"loss": float(ref.train_metrics["loss"])}
  return report


def main_t5gemma(tmp):
  """T5Gemma with 2-D parameter rules over meshes (4, 2) and (2, 4)."""
  assert jax.device_count() == 8, jax.devices()
  print(json.dumps(compare_meshes(tmp, (((4, 2), 2), ((2, 4), 2)), cfg=T5GEMMA_CFG)))


def main(tmp):
  assert jax.device_count() == 8, jax.devices()
  # Each mesh shape once and each rule set on (4, 2), where 2-D rules shard more: (8, 1)
  # with 2-D rules and (2, 4) with 1-D ones add compiles, not code paths.
  report = compare_meshes(tmp, [((8, 1), 1), ((4, 2), 1), ((4, 2), 2), ((2, 4), 2)])
  # A (4, 2) checkpoint restores on (8, 1) and on one device with identical values.
  src = f"{tmp}/4x2_p2"
  saved = jax.tree.map(np.asarray, ckpt_lib.Checkpointer(src, settings.SaveCheckpointConfig())
                       .restore(3, _abstract(Partitioner(mesh_shape=(4, 2), logical_axis_rules=
                                                         standard_logical_axis_rules(1, 2))))[0])
  for mesh, devices in (((8, 1), None), ((1, 1), jax.devices()[:1])):
    part = Partitioner(mesh_shape=mesh, devices=devices)
    ck = ckpt_lib.Checkpointer(src, settings.SaveCheckpointConfig())
    params, opt_state, _ = ck.restore(3, _abstract(part))
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(saved)))
    leaf = params["token_embedder"]["embedding"]
    report[f"restore_{mesh[0]}x{mesh[1]}"] = {"devices": len(leaf.sharding.device_set)}
    ck.close()
  print(json.dumps(report))


def _abstract(part):
  model = EncoderDecoderModel(CFG)
  p_axes = model.logical_axes()
  params = model.abstract_params()
  spec = optim.Adafactor()
  tx = spec.build(lambda s: 0.01, p_axes)
  opt = jax.eval_shape(tx.init, params)
  o_axes = spec.state_axes(opt, params, p_axes)
  shard = lambda abstract, axes, prefix: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
      part.tree_shardings(axes, prefix=prefix, shapes=abstract))
  return TrainState(step=None, params=shard(params, p_axes, "p"), opt_state=shard(opt, o_axes, "o"))


if __name__ == "__main__":
  if sys.argv[2:] == ["t5gemma"]:
    main_t5gemma(sys.argv[1])
  else:
    main(sys.argv[1])
