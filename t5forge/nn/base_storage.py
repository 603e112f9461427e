"""How a frozen base is kept in memory for adapter training and serving: `base_dtype`.

    float32   every parameter as trained (4 bytes a weight);
    bfloat16  projection kernels (`kernel` leaves: attention, MLP, an untied output layer)
              rounded to bfloat16 (2 bytes), round-to-nearest-even as `jnp.astype`;
    int8      projection kernels as `quant.QArray` int8 with per-output-channel scales
              (1 byte a weight, plus out scales).

Embeddings, norms and relative-position tables stay float32 in every case: they are a
small part of a large model and the lookup and the norm are where rounding costs most.

`store_leaf` is the rule for one leaf, applied as each tensor is read (`convert.hf.load_hf`'s
`store`, so a 44 GB float32 file is never in memory whole); `store_params` applies it to a
tree already in memory.
"""
from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from t5forge.errors import UserError
from t5forge.nn import quant

BASE_DTYPES = ("float32", "bfloat16", "int8")


def check_base_dtype(dtype: str) -> str:
  """`dtype`, or a UserError naming the field and the choices."""
  if dtype not in BASE_DTYPES:
    raise UserError(f"base_dtype {dtype!r} is not one of {', '.join(BASE_DTYPES)}")
  return dtype


def store_leaf(path: tuple[str, ...], value: np.ndarray, dtype: str) -> Any:
  """One parameter as a base of `dtype` keeps it.

  Args:
    path: its path in the parameter tree (the last name decides: `kernel` leaves are
      the projection kernels).
    value: float32 [..., in, out] for a kernel, any shape otherwise.
    dtype: one of BASE_DTYPES.

  Returns:
    A numpy array (float32, or bfloat16 for a kernel), or for an int8 kernel a
    `quant.QArray` of numpy arrays (q int8 [..., in, out], scale float32 [..., out]).
  """
  if path[-1] != "kernel" or dtype == "float32" or isinstance(value, quant.QArray):
    return value
  if dtype == "bfloat16":
    return np.asarray(value, np.float32).astype(ml_dtypes.bfloat16)
  k = quant.quantize_kernel(value)
  return quant.QArray(q=np.asarray(k.q), scale=np.asarray(k.scale))


def storer(dtype: str) -> Callable[[tuple[str, ...], np.ndarray], Any]:
  """`store_leaf` for `dtype`, as `convert.hf.load_hf(store=...)` takes it."""
  check_base_dtype(dtype)
  return lambda path, value: store_leaf(path, value, dtype)


def store_params(params: dict, dtype: str, path: tuple[str, ...] = ()) -> dict:
  """A parameter tree (either layout) with every leaf as `store_leaf` keeps it."""
  check_base_dtype(dtype)
  return {name: store_params(v, dtype, path + (name,)) if isinstance(v, dict)
          else store_leaf(path + (name,), v if isinstance(v, quant.QArray) else np.asarray(v), dtype)
          for name, v in params.items()}
