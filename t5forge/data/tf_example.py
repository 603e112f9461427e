"""`tf.train.Example` records without TensorFlow: the messages, TF's feature specs, decoding.

The messages are TensorFlow's `example.proto` / `feature.proto`, declared here to the
protobuf runtime (no generated code, no TensorFlow). The feature specs are stand-ins for
`tf.io.FixedLenFeature`, `tf.io.VarLenFeature` and `tf.io.FixedLenSequenceFeature` with
the same arguments, so a port of a SeqIO `TFExampleDataSource` renames `tf.io.` to
`t5forge.data.` and writes the dtype as a string:

    feature_description = {
        "inputs": seqio.FixedLenFeature([], "string"),
        "weight": seqio.FixedLenFeature([], "float32", default_value=1.0),
        "tags": seqio.VarLenFeature("int64"),
    }

Decoded as `tf.io.parse_single_example` does, as Python values: a scalar spec gives a
`str` / `int` / `float`; a shaped numeric spec a numpy array of that shape; a shaped
string spec a (nested) list of `str`; `VarLenFeature` a list. Strings are UTF-8 decoded
(`bytes` where they are not valid UTF-8, e.g. an encoded image).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from t5forge.errors import UserError

# ---------------------------------------------------------------------------------- messages


def _declare_messages():
  """TensorFlow's Example messages (`tensorflow/core/example/{example,feature}.proto`)."""
  f = descriptor_pb2.FileDescriptorProto(name="t5forge_tf_example.proto",
                                         package="t5forge.tf_example", syntax="proto3")
  label = descriptor_pb2.FieldDescriptorProto
  packed = descriptor_pb2.FieldOptions(packed=True)

  def message(name, fields, oneof=None):
    m = f.message_type.add(name=name)
    if oneof:
      m.oneof_decl.add(name=oneof)
    for number, (field, kind, type_name, repeated) in enumerate(fields, start=1):
      d = m.field.add(name=field, number=number, type=kind,
                      label=label.LABEL_REPEATED if repeated else label.LABEL_OPTIONAL)
      if type_name:
        d.type_name = f".t5forge.tf_example.{type_name}"
      if repeated and kind != label.TYPE_BYTES:
        d.options.CopyFrom(packed)
      if oneof:
        d.oneof_index = 0
    return m

  message("BytesList", [("value", label.TYPE_BYTES, None, True)])
  message("FloatList", [("value", label.TYPE_FLOAT, None, True)])
  message("Int64List", [("value", label.TYPE_INT64, None, True)])
  message("Feature", [("bytes_list", label.TYPE_MESSAGE, "BytesList", False),
                      ("float_list", label.TYPE_MESSAGE, "FloatList", False),
                      ("int64_list", label.TYPE_MESSAGE, "Int64List", False)], oneof="kind")
  features = message("Features", [("feature", label.TYPE_MESSAGE, "Features.FeatureEntry", True)])
  entry = features.nested_type.add(name="FeatureEntry")
  entry.options.map_entry = True
  entry.field.add(name="key", number=1, type=label.TYPE_STRING, label=label.LABEL_OPTIONAL)
  entry.field.add(name="value", number=2, type=label.TYPE_MESSAGE, label=label.LABEL_OPTIONAL,
                  type_name=".t5forge.tf_example.Feature")
  message("Example", [("features", label.TYPE_MESSAGE, "Features", False)])
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
      f"t5forge.tf_example.{name}")) for name in ("Example", "Feature", "Features")}


_MESSAGES = _declare_messages()
Example = _MESSAGES["Example"]

# The list each value kind lives in, and the kind a dtype is stored as.
_KINDS = {"bytes_list": "string", "float_list": "float32", "int64_list": "int64"}
_STORED = {"string": "bytes_list", "float32": "float_list", "float64": "float_list",
           "float16": "float_list", "bfloat16": "float_list", "int64": "int64_list",
           "int32": "int64_list", "int16": "int64_list", "int8": "int64_list",
           "uint8": "int64_list", "uint16": "int64_list", "uint32": "int64_list",
           "bool": "int64_list"}
_ALIASES = {"bytes": "string", "str": "string", "object": "string", "float": "float32",
            "int": "int64", "double": "float64", "half": "float16"}


def normalize_dtype(dtype: Any, where: str = "dtype") -> str:
  """A dtype given as a string, a numpy dtype or a `tf.DType` -> its name here
  ('string', 'int64', 'float32', ... ); UserError for what a record cannot hold."""
  if isinstance(dtype, str):
    name = dtype
  elif getattr(dtype, "name", None) and not isinstance(dtype, np.dtype) and \
       not isinstance(dtype, type):
    name = dtype.name  # a tf.DType or a similar object
  else:
    try:
      d = np.dtype(dtype)
      name = "string" if d.kind in "OSU" else d.name
    except TypeError:
      name = repr(dtype)
  name = _ALIASES.get(name, name)
  if name not in _STORED:
    raise UserError(f"{where}={dtype!r}: a tf.train.Example holds 'string', 'int64' or "
                    "'float32' values (also 'int32', 'bool', 'float64', ... which are cast); "
                    "write the dtype as one of these strings")
  return name


# ---------------------------------------------------------------------------------------- specs


def _shape(shape: Any, where: str) -> tuple[int, ...]:
  if isinstance(shape, (int, np.integer)):
    shape = [shape]
  try:
    dims = tuple(int(d) for d in shape)
  except (TypeError, ValueError):
    raise UserError(f"{where}: shape must be a list of sizes, e.g. [] or [3], got "
                    f"{shape!r}") from None
  if any(d < 0 for d in dims):
    raise UserError(f"{where}: shape {list(dims)} has a negative size; use "
                    "FixedLenSequenceFeature or VarLenFeature for variable lengths")
  return dims


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
  """`tf.io.FixedLenFeature`: exactly prod(shape) values; `default_value` when absent."""
  shape: Sequence[int]
  dtype: Any
  default_value: Any = None


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
  """`tf.io.VarLenFeature`: any number of values, decoded to a list (empty when absent)."""
  dtype: Any


@dataclasses.dataclass(frozen=True)
class FixedLenSequenceFeature:
  """`tf.io.FixedLenSequenceFeature`: a multiple of prod(shape) values -> `[n, *shape]`;
  absent is allowed (n = 0) with `allow_missing=True`."""
  shape: Sequence[int]
  dtype: Any
  allow_missing: bool = False
  default_value: Any = None


FeatureSpec = FixedLenFeature | VarLenFeature | FixedLenSequenceFeature


@dataclasses.dataclass(frozen=True)
class _Plan:
  key: str
  mode: str  # 'fixed' | 'var' | 'seq'
  dtype: str
  shape: tuple[int, ...]
  size: int
  stored: str
  default: Any
  allow_missing: bool


def _plan(key: str, spec: Any) -> _Plan:
  where = f"feature_description[{key!r}]"
  if isinstance(spec, FixedLenFeature):
    shape = _shape(spec.shape, where)
    mode = "fixed"
  elif isinstance(spec, FixedLenSequenceFeature):
    shape = _shape(spec.shape, where)
    mode = "seq"
  elif isinstance(spec, VarLenFeature):
    shape, mode = (), "var"
  else:
    raise UserError(f"{where} is a {type(spec).__name__}; use t5forge.data.FixedLenFeature, "
                    "VarLenFeature or FixedLenSequenceFeature (tf.io's, renamed)")
  dtype = normalize_dtype(spec.dtype, f"{where}.dtype")
  plan = _Plan(key, mode, dtype, shape, math.prod(shape), _STORED[dtype], None,
               getattr(spec, "allow_missing", False))
  default = getattr(spec, "default_value", None)
  if default is not None:
    values = np.asarray(default).reshape(-1).tolist()
    if mode == "fixed" and len(values) == 1 and plan.size != 1:
      values = values * plan.size  # TF broadcasts a scalar default
    if mode == "fixed" and len(values) != plan.size:
      raise UserError(f"{where}: default_value has {len(values)} values, the shape "
                      f"{list(shape)} needs {plan.size}")
    plan = dataclasses.replace(plan, default=values)
  return plan


# ------------------------------------------------------------------------------------- decoding


def _text(value: bytes) -> str | bytes:
  try:
    return value.decode("utf-8")
  except UnicodeDecodeError:
    return value


_INTS = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32")


def _scalar_fn(dtype: str) -> Callable[[Any], Any]:
  """One stored value -> its Python value (float lists hold float32 values already)."""
  if dtype == "string":
    return lambda v: _text(v) if isinstance(v, bytes) else v
  if dtype == "bool":
    return bool
  return int if dtype in _INTS else float


def _as_python(values: Sequence[Any], dtype: str) -> list:
  if dtype == "string":
    return [_text(v) if isinstance(v, bytes) else v for v in values]
  return [_scalar_fn(dtype)(v) for v in values]


def _shaped(values: Sequence[Any], dtype: str, shape: Sequence[int]) -> Any:
  if dtype == "string":
    items = _as_python(values, dtype)
    for d in reversed(shape[1:]):
      items = [items[i:i + d] for i in range(0, len(items), d)] if d else []
    return items
  np_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
  return np.asarray(values, np_dtype).reshape(shape)


class ExampleDecoder:
  """Serialized `tf.train.Example` -> dict of Python/numpy values, as TF's
  `parse_single_example` with `description`.

  Args:
    description: feature name -> FixedLenFeature / VarLenFeature / FixedLenSequenceFeature.
      None: every feature, a value when it holds exactly one and a list otherwise (the
      shape is not recorded in a record; give a description where it matters).
  """

  def __init__(self, description: Mapping[str, FeatureSpec] | None = None):
    if description is not None and not isinstance(description, Mapping):
      raise UserError(f"feature_description must be a dict of feature name -> "
                      f"FixedLenFeature / VarLenFeature, got {type(description).__name__}")
    self.description = dict(description) if description is not None else None
    self._plans = ([_plan(k, v) for k, v in self.description.items()]
                   if self.description is not None else None)
    # The common case, a scalar of the stored kind, is decoded without the general path.
    self._fast = ([(p.key, p.stored, _scalar_fn(p.dtype))
                   if p.mode == "fixed" and not p.shape else None for p in self._plans]
                  if self._plans is not None else None)

  def __reduce__(self):
    return (ExampleDecoder, (self.description,))

  def __call__(self, data: bytes, where: Any = "a record") -> dict[str, Any]:
    """Decodes one record; `where` names it in messages (any object with a str)."""
    feature_map = parse(data, where).features.feature
    if self._plans is None:
      out = {}
      for key, feature in feature_map.items():
        kind = feature.WhichOneof("kind")
        values = _as_python(getattr(feature, kind).value, _KINDS[kind]) if kind else []
        out[key] = values[0] if len(values) == 1 else values
      return out
    out = {}
    for p, fast in zip(self._plans, self._fast):
      if fast is not None:
        key, stored, convert = fast
        feature = feature_map.get(key)
        if feature is not None and feature.WhichOneof("kind") == stored:
          values = getattr(feature, stored).value
          if len(values) == 1:
            out[key] = convert(values[0])
            continue
      out[p.key] = self._decode(p, feature_map, where)
    return out

  def _decode(self, p: _Plan, feature_map, where: Any) -> Any:
    feature = feature_map.get(p.key)
    kind = feature.WhichOneof("kind") if feature is not None else None
    if kind is None:  # absent (or present without values: TF treats it as absent)
      if p.mode == "var" or (p.mode == "seq" and p.allow_missing):
        values = []
      elif p.default is not None:
        values = p.default
      else:
        present = ", ".join(sorted(feature_map)) or "none"
        fix = ("allow_missing=True" if p.mode == "seq" else "a default_value")
        raise UserError(f"{where}: feature {p.key!r} is missing (the record has: {present}); "
                        f"fix the description or give it {fix}")
    else:
      if kind != p.stored:
        raise UserError(f"{where}: feature {p.key!r} holds {_KINDS[kind]} values "
                        f"({kind}) but the description says {p.dtype!r}; describe it as "
                        f"{_KINDS[kind]!r}")
      values = getattr(feature, kind).value
    if p.mode == "var":
      return _as_python(values, p.dtype)
    if p.mode == "fixed":
      if len(values) != p.size:
        raise UserError(f"{where}: feature {p.key!r} has {len(values)} values, its "
                        f"FixedLenFeature shape {list(p.shape)} needs {p.size}; use "
                        "VarLenFeature for a variable number")
      if not p.shape:
        return _as_python(values, p.dtype)[0]
      return _shaped(values, p.dtype, p.shape)
    if p.size == 0 or len(values) % p.size:
      raise UserError(f"{where}: feature {p.key!r} has {len(values)} values, not a multiple "
                      f"of its FixedLenSequenceFeature shape {list(p.shape)}")
    return _shaped(values, p.dtype, (len(values) // p.size, *p.shape))


def parse(data: bytes, where: Any = "a record"):
  """Serialized bytes -> the `Example` message; UserError when they are not one."""
  try:
    return Example.FromString(data)
  except Exception as e:  # noqa: BLE001 (the runtime's DecodeError, whichever implementation)
    raise UserError(f"{where}: not a tf.train.Example ({type(e).__name__}); is the file "
                    "of another kind (JSON records: decode='json')?") from None


def looks_like_example(data: bytes) -> bool:
  """A serialized Example starts with field 1 (`features`, a length-delimited message) or
  is empty; a JSON object starts with `{`."""
  return not data or data[:1] == b"\x0a"


def ragged_length_key(key: str, dim: int) -> str:
  """SeqIO's `tfexample_ragged_length_key`: the feature that holds the row lengths of
  ragged dimension `dim` (0: the outermost) of feature `key`."""
  return f"_rl:{dim}:{key}"


def nested_rows(value: Any) -> tuple[list, list[list[int]]] | None:
  """A ragged value -> (its flat values, the row lengths of each nesting level, outermost
  first), as a `tf.RaggedTensor`'s `flat_values` and `nested_row_lengths()`; None for a
  value that is not ragged.

  A Python list (or tuple) of lists / tuples / 1-D arrays is ragged whatever its rows'
  lengths, so that a feature is ragged in every example or in none; a numpy array of
  rank > 1 is dense. E.g. [[1, 2], [3]] -> ([1, 2, 3], [[2, 1]]); [[[1], [2, 3]], [[4]]] ->
  ([1, 2, 3, 4], [[2, 1], [1, 2, 1]]).
  """
  if isinstance(value, np.ndarray) and value.dtype == object:
    value = list(value)
  if not isinstance(value, (list, tuple)) or not value:
    return None
  rows, lengths = list(value), []
  while rows and all(isinstance(r, (list, tuple)) or (isinstance(r, np.ndarray) and r.ndim == 1)
                     for r in rows):
    lengths.append([len(r) for r in rows])
    rows = [x for r in rows for x in r]
  return (rows, lengths) if lengths else None


def _set_values(feature: Any, values: Sequence[Any]) -> None:
  values = [v.item() if isinstance(v, np.generic) else v for v in values]
  if all(isinstance(v, (str, bytes)) for v in values) and values:
    feature.bytes_list.value.extend(v.encode() if isinstance(v, str) else v for v in values)
  elif all(isinstance(v, (bool, int)) for v in values):
    feature.int64_list.value.extend(int(v) for v in values)
  else:
    feature.float_list.value.extend(float(v) for v in values)


def encode(example: Mapping[str, Any]) -> bytes:
  """A dict of str/bytes/int/float (or lists / numpy arrays of them) -> a serialized Example,
  as SeqIO's `dict_to_tfexample` writes it (ints as int64, floats as float32; an array of
  rank > 1 flattened; a ragged value as its flat values plus one row-length feature per
  ragged dimension, `ragged_length_key`)."""
  msg = Example()
  fmap = msg.features.feature
  for key, value in example.items():
    ragged = nested_rows(value)
    if ragged is not None:
      flat, lengths = ragged
      _set_values(fmap[key], flat)
      for dim, row_lengths in enumerate(lengths):
        fmap[ragged_length_key(key, dim)].int64_list.value.extend(row_lengths)
      continue
    values = np.asarray(value).reshape(-1) if isinstance(value, np.ndarray) else (
        list(np.asarray(value).reshape(-1)) if isinstance(value, (list, tuple)) else [value])
    _set_values(fmap[key], values)
  return msg.SerializeToString()
