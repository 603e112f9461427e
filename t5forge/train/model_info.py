"""`MODEL_DIR/model-info.txt`: every parameter and optimizer leaf with its shape, logical
axes and partition spec, and the totals (what T5X writes, plus the logical axes)."""
from __future__ import annotations

import jax
import numpy as np

from t5forge import files, storage
from t5forge.sharding import is_axes


def _rows(prefix: str, shapes, axes, shardings):
  flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
  flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
  flat_shard = jax.tree.leaves(shardings)
  for (path, leaf), a, s in zip(flat_shapes, flat_axes, flat_shard):
    name = prefix + "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                             for k in path)
    yield name, tuple(leaf.shape), tuple(a), tuple(s.spec), int(np.prod(leaf.shape))


def render(param_shapes, param_axes, param_shardings, opt_shapes, opt_axes, opt_shardings,
           mesh_shape: dict) -> str:
  """The text of model-info.txt."""
  lines = [f"Mesh: {dict(mesh_shape)}", ""]
  total = 0
  header = f"{'Variable':<70} {'size':>12}  {'shape':<28} {'logical axes':<36} partition spec"
  lines.append(header)
  for name, shape, a, spec, size in _rows("", param_shapes, param_axes, param_shardings):
    lines.append(f"{name:<70} {size:>12,}  {str(shape):<28} {str(a):<36} {spec}")
    total += size
  lines += ["", f"Total number of parameters: {total:,}", "", header]
  opt_total = 0
  for name, shape, a, spec, size in _rows("opt_state/", opt_shapes, opt_axes, opt_shardings):
    lines.append(f"{name:<70} {size:>12,}  {str(shape):<28} {str(a):<36} {spec}")
    opt_total += size
  lines += ["", f"Total number of optimizer state values: {opt_total:,}", ""]
  return "\n".join(lines)


def write(model_dir: str, text: str) -> None:
  files.write_text(storage.join(model_dir, "model-info.txt"), text)
