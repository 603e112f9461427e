"""TFDS features (`features.json`) -> a decoder of TFDS's serialized examples, without TF.

TFDS stores an example as one `tf.train.Example` whose keys are the flattened feature
names (`translation/en`, `words`, ...); `features.json` says what each one is. Decoded as
`tfds.as_numpy` gives them, as Python values:

| feature | value |
|---|---|
| `Text` | `str` (UTF-8; `bytes` where it is not valid UTF-8) |
| `ClassLabel` | `int` (the names: `label_names`, from `<feature>.labels.txt`) |
| `Tensor` / `Scalar` | a Python scalar for shape `()`, else a numpy array of its dtype and shape (string tensors: nested lists of `str`) |
| `Sequence(f)` | `f`'s values with a leading length dimension: a list of `str` for text, a numpy array for numbers, nested lists when ragged; `Sequence({...})` is a dict of sequences |
| `Translation` | a dict language -> `str` |
| `FeaturesDict` | a dict |

Images, audio, video and other media are refused by name: t5forge trains on text.
Both `features.json` layouts are read: TFDS 4's (`pythonClassName` + the feature's proto
as JSON) and the older `{"type": ..., "content": ...}`.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from t5forge import storage
from t5forge.data import tf_example
from t5forge.errors import UserError

# TFDS feature class (last part of its Python name) -> the proto-JSON key of its content.
_CONTENT_KEYS = {"FeaturesDict": "featuresDict", "Text": "text", "ClassLabel": "classLabel",
                 "Tensor": "tensor", "Scalar": "tensor", "Sequence": "sequence",
                 "Translation": "translation"}
_MEDIA = ("Image", "Audio", "Video", "BBoxFeature", "BBox", "LabeledImage", "Dataset",
          "TranslationVariableLanguages")


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One stored tensor: its key, dtype, inner shape, how many sequence levels wrap it."""
  key: str
  dtype: str  # 'string', 'int64', 'int32', 'float32', 'bool', ...
  shape: tuple  # the feature's own shape; None for an unknown dimension
  seq_rank: int = 0
  encoding: str = "none"  # Tensor(encoding=): 'none' | 'bytes' | 'zlib'


def _class_name(spec: Mapping[str, Any]) -> str:
  name = spec.get("pythonClassName") or spec.get("type") or ""
  return name.rsplit(".", 1)[-1]


def _content(spec: Mapping[str, Any], cls: str, where: str) -> Mapping[str, Any]:
  if "content" in spec and "type" in spec:  # the older layout
    content = spec["content"]
    if isinstance(content, str):
      content = json.loads(content)
    return _from_legacy(cls, content or {})
  key = _CONTENT_KEYS.get(cls)
  if key is None or key not in spec:
    raise UserError(f"{where}: feature of type {cls or '?'} has no {key or 'known'} content")
  return spec[key]


def _from_legacy(cls: str, content: Mapping[str, Any]) -> Mapping[str, Any]:
  """The older `content` -> the proto-JSON field names read below."""
  if cls == "FeaturesDict":
    return {"features": dict(content)}
  if cls == "ClassLabel":
    return {"numClasses": content.get("num_classes")}
  if cls in ("Tensor", "Scalar"):
    dims = content.get("shape") or []
    return {"shape": {"dimensions": [-1 if d is None else d for d in dims]},
            "dtype": content.get("dtype", "float32"), "encoding": content.get("encoding", "none")}
  if cls == "Sequence":
    length = content.get("length")
    return {"feature": content["feature"], "length": -1 if length is None else length}
  return dict(content)


def _dims(tensor: Mapping[str, Any]) -> tuple:
  shape = tensor.get("shape") or {}
  dims = shape.get("dimensions", []) if isinstance(shape, Mapping) else shape
  return tuple(None if int(d) < 0 else int(d) for d in dims)


def build(spec: Mapping[str, Any], name: str, where: str, seq_rank: int = 0) -> Any:
  """A features.json node -> a tree of dicts whose leaves are `_Leaf`s.

  Args:
    spec: the node.
    name: its flattened key (`translation/en`); '' at the top.
    where: the features.json path, for messages.
    seq_rank: how many `Sequence`s enclose it.
  """
  cls = _class_name(spec)
  if cls in _MEDIA:
    raise UserError(f"{where}: feature {name!r} is a TFDS {cls}; t5forge reads text, class "
                    "labels and tensors (drop the feature from the dataset, or read it with a "
                    "TFRecordDataSource and your own decode function)")
  content = _content(spec, cls, where)

  def join(child: str) -> str:
    return f"{name}/{child}" if name else child

  if cls == "FeaturesDict":
    return {k: build(v, join(k), where, seq_rank) for k, v in content["features"].items()}
  if cls == "Translation":
    return {lang: _Leaf(join(lang), "string", (), seq_rank) for lang in content["languages"]}
  if cls == "Text":
    return _Leaf(name, "string", (), seq_rank)
  if cls == "ClassLabel":
    return _Leaf(name, "int64", (), seq_rank)
  if cls in ("Tensor", "Scalar"):
    dtype = tf_example.normalize_dtype(content.get("dtype", "float32"), f"{where}: {name}.dtype")
    encoding = (content.get("encoding") or "none").lower()
    if encoding not in ("none", "bytes", "zlib"):
      raise UserError(f"{where}: feature {name!r} has encoding {encoding!r}; t5forge reads "
                      "'none', 'bytes' and 'zlib'")
    return _Leaf(name, dtype, _dims(content), seq_rank, encoding)
  if cls == "Sequence":
    return build(content["feature"], name, where, seq_rank + 1)
  raise UserError(f"{where}: feature {name!r} is a TFDS {cls or 'feature of unknown type'}; "
                  "t5forge reads FeaturesDict, Text, ClassLabel, Tensor, Scalar, Sequence and "
                  "Translation")


def leaves(tree: Any) -> list[_Leaf]:
  if isinstance(tree, _Leaf):
    return [tree]
  return [leaf for child in tree.values() for leaf in leaves(child)]


def class_labels(spec: Mapping[str, Any], directory: str, name: str = "") -> dict[str, list[str]]:
  """ClassLabel feature name -> its names (`<feature>.labels.txt` beside features.json,
  nested names joined with '-'), for those that have a names file."""
  cls = _class_name(spec)
  if cls in _MEDIA or cls not in _CONTENT_KEYS:
    return {}
  content = _content(spec, cls, directory)
  out = {}
  if cls == "FeaturesDict":
    for k, v in content["features"].items():
      out.update(class_labels(v, directory, f"{name}/{k}" if name else k))
  elif cls == "Sequence":
    out.update(class_labels(content["feature"], directory, name))
  elif cls == "ClassLabel":
    path = storage.join(directory, name.replace("/", "-") + ".labels.txt")
    if storage.exists(path):
      out[name] = [line.strip() for line in storage.read_text(path).split("\n") if line.strip()]
  return out


# -------------------------------------------------------------------------------------- decoding


def _values(feature_map, key: str, where: Any, kind: str):
  feature = feature_map.get(key)
  if feature is None:
    return None
  which = feature.WhichOneof("kind")
  if which is None:
    return []
  if which != kind:
    raise UserError(f"{where}: feature {key!r} is stored as {which} where features.json says "
                    f"{kind}; the files and features.json do not belong together")
  return getattr(feature, which).value


def _text(v: bytes) -> str | bytes:
  try:
    return v.decode("utf-8")
  except UnicodeDecodeError:
    return v


def _split_rows(items: list, lengths) -> list:
  out, pos = [], 0
  for n in lengths:
    out.append(items[pos:pos + n])
    pos += n
  return out


class Decoder:
  """A serialized TFDS example -> the nested dict `tfds.as_numpy` gives (see module doc)."""

  def __init__(self, tree: Mapping[str, Any]):
    self.tree = tree
    self._leaves = leaves(tree)

  def __call__(self, data: bytes, where: Any) -> dict[str, Any]:
    feature_map = tf_example.parse(data, where).features.feature
    return self._fill(self.tree, feature_map, where)

  def _fill(self, node, feature_map, where):
    if isinstance(node, _Leaf):
      if not node.seq_rank and not node.shape and node.encoding == "none":
        # The common case, one text or number, without the general path below.
        feature = feature_map.get(node.key)
        if feature is not None:
          values = getattr(feature, _stored(node)).value
          if len(values) == 1:
            v = values[0]
            if node.dtype == "string":
              return _text(v)
            return v if node.dtype not in ("bool",) else bool(v)
      return self._leaf(node, feature_map, where)
    return {k: self._fill(v, feature_map, where) for k, v in node.items()}

  def _leaf(self, leaf: _Leaf, feature_map, where: Any) -> Any:
    stored = _stored(leaf)
    if leaf.seq_rank > 1:
      return self._ragged(leaf, feature_map, where, stored)
    dynamic = sum(d is None for d in leaf.shape) > 1
    key = f"{leaf.key}/value" if dynamic else leaf.key
    values = _values(feature_map, key, where, stored)
    if values is None:
      raise UserError(f"{where}: feature {key!r} of features.json is missing from the example; "
                      "the files and features.json do not belong together")
    if leaf.encoding != "none":
      return self._encoded(leaf, values, where)
    if dynamic:
      shape = tuple(int(d) for d in _values(feature_map, f"{leaf.key}/shape", where,
                                            "int64_list") or ())
    else:
      shape = leaf.shape
    if leaf.seq_rank == 1:
      shape = (-1, *shape)
    if not shape:
      if len(values) != 1:
        raise UserError(f"{where}: feature {leaf.key!r} holds {len(values)} values where "
                        "features.json says one")
      v = values[0]
      if leaf.dtype == "string":
        return _text(v)
      return bool(v) if leaf.dtype == "bool" else (float(v) if stored == "float_list" else int(v))
    if leaf.dtype == "string":
      items = [_text(v) for v in values]
      inner = [d for d in shape[1:]]
      for d in reversed(inner):
        items = [items[i:i + d] for i in range(0, len(items), d)] if d else []
      return items
    return np.asarray(values, _np_dtype(leaf.dtype)).reshape(
        [-1 if d is None else d for d in shape])

  def _encoded(self, leaf: _Leaf, values, where: Any) -> Any:
    def one(raw: bytes) -> np.ndarray:
      if leaf.encoding == "zlib":
        raw = zlib.decompress(raw)
      return np.frombuffer(raw, _np_dtype(leaf.dtype)).reshape(
          [-1 if d is None else d for d in leaf.shape])
    if leaf.seq_rank == 0:
      if len(values) != 1:
        raise UserError(f"{where}: feature {leaf.key!r} holds {len(values)} encoded tensors "
                        "where features.json says one")
      return one(values[0])
    return [one(v) for v in values]

  def _ragged(self, leaf: _Leaf, feature_map, where: Any, stored: str) -> Any:
    flat = _values(feature_map, f"{leaf.key}/ragged_flat_values", where, stored)
    if flat is None:
      raise UserError(f"{where}: feature {leaf.key!r} (a nested Sequence) has no "
                      "ragged_flat_values; the files and features.json do not belong together")
    items = ([_text(v) for v in flat] if leaf.dtype == "string"
             else np.asarray(flat, _np_dtype(leaf.dtype)).tolist())
    inner = [d for d in leaf.shape]
    for d in reversed(inner):
      items = [items[i:i + d] for i in range(0, len(items), d)] if d else []
    lengths = []
    k = 0
    while (row := _values(feature_map, f"{leaf.key}/ragged_row_lengths_{k}", where,
                          "int64_list")) is not None:
      lengths.append(list(row))
      k += 1
    for row in reversed(lengths):
      items = _split_rows(items, row)
    return items


def _stored(leaf: _Leaf) -> str:
  """The Feature list a leaf's values are stored in."""
  if leaf.dtype == "string" or leaf.encoding != "none":
    return "bytes_list"
  return "float_list" if leaf.dtype.startswith(("float", "bfloat")) else "int64_list"


def _np_dtype(dtype: str):
  return np.float32 if dtype == "bfloat16" else np.dtype(dtype)
