"""Mesh TensorFlow T5 checkpoints: the original T5, T5.1.1, mT5 and ByT5 releases.

They are TensorFlow V2 bundles (`model.ckpt-N.index` + `.data-*`, read by `tf_bundle`)
with an `operative_config.gin` and a `checkpoint` state file beside them. A user names one
by its prefix (`.../model.ckpt-1000000`), its `.index` file, or its directory (the step
the `checkpoint` state file names, else the highest `model.ckpt-N`).

Names map one to one onto ours, in the same layouts (no transposes): q/k/v are
`[d_model, heads*d_kv]` and o its transpose's shape, as our attention kernels;
`relative_attention_bias` `[heads, buckets]` is in block 0 of each stack only (shared by
the stack's layers, as ours); `DenseReluDense/wi` (T5 1.0, ReLU) or `wi_0`/`wi_1` (T5.1.1,
mT5, ByT5, gated GELU); `decoder/logits/kernel` `[d_model, vocab]` where the output is not
tied (T5 1.0 ties it to `shared/embedding`, scaling the decoder output by d_model**-0.5,
which our config's `logits_via_embedding` does too).

The architecture comes from the shapes, checked against `operative_config.gin` when it is
there: only the bindings listed in `_GIN` are read, by `gin_bindings` (a small parser of
`name = literal` lines; the file is never executed). The activation is the gin's
`DenseReluDense.activation`; without a gin, 'relu' for one `wi` and ('gelu', 'linear') for
`wi_0`/`wi_1`, as every released T5 checkpoint has.

Adafactor's slots (`<name>_slot_vr` / `_slot_vc` / `_slot_v`) are counted by `load_mtf`
and read by `read_slots` (training from the checkpoint seeds its Adafactor state with
them where it factors alike: `train.checkpoint.initial_second_moments`);
`global_step` is the checkpoint's step.
"""
from __future__ import annotations

import ast
import os
import re

import numpy as np

from t5forge import storage
from t5forge.convert import tf_bundle
from t5forge.errors import UserError
from t5forge.nn import abstract_params
from t5forge.nn.config import ModelConfig

GIN_FILE = "operative_config.gin"
STATE_FILE = "checkpoint"  # TensorFlow's text CheckpointState, beside the bundles
SLOT_MARK = "_slot_"
STEP_TENSOR = "global_step"
_PREFIX = re.compile(r"^(?P<name>.+)-(?P<step>\d+)$")
_STATE_LINE = re.compile(r'^model_checkpoint_path:\s*"(?P<path>[^"]+)"\s*$', re.M)
# Mesh TF activation names -> ours (mtf's gelu is the tanh approximation, as our 'gelu').
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "linear": "linear", "swish": "silu",
                "silu": "silu", "gelu_new": "gelu"}


# -------------------------------------------------------------------------- where it is


def _state_prefix(directory: str) -> str | None:
  """The prefix a `checkpoint` state file in `directory` names, if it is one (a T5X
  `checkpoint` file of the same name is msgpack, not this text)."""
  state = storage.join(directory, STATE_FILE)
  if not storage.isfile(state):
    return None
  # The head only: a T5X msgpack `checkpoint` may hold gigabytes of arrays (its bytes
  # decode to text the pattern does not match).
  head = storage.read_range(state, 0, 4096).decode("utf-8", "replace")
  match = _STATE_LINE.search(head)
  if not match:
    return None
  # Its file's name, in this directory: a path recorded absolute names where the run wrote
  # it (another machine, another bucket), not where the copy in hand is.
  return storage.join(directory, os.path.basename(match["path"].rstrip("/")))


def find_prefix(path: str) -> str | None:
  """The bundle prefix `path` names (see the module doc), local or in a bucket; None when
  `path` is not a TensorFlow checkpoint."""
  if not path:
    return None
  if path.endswith(tf_bundle.INDEX_SUFFIX) and storage.isfile(path):
    return tf_bundle.prefix_of(path)
  if storage.isfile(path + tf_bundle.INDEX_SUFFIX):
    return path
  if not storage.isdir(path):
    return None
  named = _state_prefix(path)
  if named and storage.isfile(named + tf_bundle.INDEX_SUFFIX):
    return named
  steps = []
  for name in storage.listdir(path):
    match = _PREFIX.match(name[:-len(tf_bundle.INDEX_SUFFIX)]) if name.endswith(
        tf_bundle.INDEX_SUFFIX) else None
    if match:
      steps.append((int(match["step"]), name[:-len(tf_bundle.INDEX_SUFFIX)]))
  return storage.join(path, max(steps)[1]) if steps else None


def step_of(prefix: str) -> int | None:
  """N of a `model.ckpt-N` prefix."""
  match = _PREFIX.match(storage.basename(prefix))
  return int(match["step"]) if match else None


def local_prefix(prefix: str) -> str:
  """A local path of the bundle at `prefix`: itself, or for a bucket URL the prefix in a
  local copy of the bundle's files and its gin (`storage.local_copy`, cached per object
  version; a directory's other checkpoints are not copied)."""
  if not storage.is_remote(prefix):
    return prefix
  base = storage.basename(prefix)
  directory = storage.local_copy(storage.dirname(prefix), keep=lambda name: (
      name.startswith(base + ".") or name == GIN_FILE))
  return os.path.join(directory, base)


# ------------------------------------------------------------------------------ the gin


def _strip_comment(line: str) -> str:
  """`line` without a `#` comment (one outside quotes), right-stripped."""
  quote = None
  for i, c in enumerate(line):
    if quote:
      quote = None if c == quote else quote
    elif c in "'\"":
      quote = c
    elif c == "#":
      return line[:i].rstrip()
  return line.rstrip()


def gin_bindings(path: str) -> dict[str, object]:
  """`name = value` bindings of a gin file, values parsed as Python literals (`%macro`
  references resolved, `@configurable` references kept as their text). Imports, includes
  and comments are skipped; nothing is executed.

  Raises:
    UserError: a statement whose value does not parse.
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  statements, current, depth = [], "", 0
  for line in lines:
    text = _strip_comment(line)
    if not current and (not text.strip() or text.lstrip().startswith(("import ", "include ",
                                                                         "from "))):
      continue
    continued = text.endswith("\\")
    current += " " + (text[:-1] if continued else text).strip()
    depth = sum(current.count(c) for c in "([{") - sum(current.count(c) for c in ")]}")
    if not continued and depth <= 0:
      statements.append(current.strip())
      current = ""
  raw = {}
  for statement in statements:
    name, sep, value = statement.partition("=")
    if sep:
      raw[name.strip()] = value.strip()
  out: dict[str, object] = {}

  def value_of(name: str, seen=()):
    text = raw[name]
    if text.startswith("%"):
      macro = text[1:].strip()
      if macro not in raw or macro in seen:
        raise UserError(f"{path}: {name} = {text} refers to macro {macro!r}, which the file "
                        "does not bind")
      return value_of(macro, seen + (macro,))
    if text.startswith("@"):
      return text
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text  # a value we do not read (a list of @references ...)

  for name in raw:
    out[name] = value_of(name)
  return out


# The bindings read, per stack: (our field, [gin names, most specific first]).
_GIN = {
    "emb_dim": ["{s}/Unitransformer.d_model", "Unitransformer.d_model", "d_model"],
    "num_heads": ["{s}/SelfAttention.num_heads", "SelfAttention.num_heads", "num_heads"],
    "head_dim": ["{s}/SelfAttention.key_value_size", "SelfAttention.key_value_size", "d_kv"],
    "mlp_dim": ["{s}/DenseReluDense.hidden_size", "DenseReluDense.hidden_size", "d_ff"],
    "num_layers": ["{s}/make_layer_stack.num_layers", "make_layer_stack.num_layers",
                   "num_layers"],
    "activation": ["{s}/DenseReluDense.activation", "DenseReluDense.activation"],
    "buckets": ["{s}/SelfAttention.relative_attention_num_buckets",
                "SelfAttention.relative_attention_num_buckets"],
    "tied": ["{s}/Unitransformer.shared_embedding_and_softmax_weights",
             "Unitransformer.shared_embedding_and_softmax_weights"],
    "epsilon": ["sublayer_rms_norm.epsilon"],
}


def _gin_value(bindings: dict, field: str, stack: str):
  for name in _GIN[field]:
    name = name.format(s=stack)
    if name in bindings:
      return name, bindings[name]
  return None, None


# ------------------------------------------------------------------------------ the names


def _attention(ours: tuple, theirs: str) -> list[tuple[tuple, str]]:
  return [(ours + (o, "kernel"), f"{theirs}/{t}")
          for o, t in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))]


def _mlp(ours: tuple, theirs: str, gated: bool) -> list[tuple[tuple, str]]:
  names = ["wi_0", "wi_1", "wo"] if gated else ["wi", "wo"]
  return [(ours + ("mlp", n, "kernel"), f"{theirs}/DenseReluDense/{n}/kernel") for n in names]


def name_table(config: ModelConfig) -> list[tuple[tuple, str]]:
  """(our parameter path, Mesh TF tensor name) of every parameter of an unscanned T5."""
  gated = len(config.mlp_activations) == 2
  t = [(("token_embedder", "embedding"), "shared/embedding")]
  for stack, n, layers in (("encoder", config.num_encoder_layers,
                            ("attention", None, "mlp")),
                           ("decoder", config.num_decoder_layers,
                            ("self_attention", "encoder_decoder_attention", "mlp"))):
    t.append(((stack, "relpos_bias", "rel_embedding"),
              f"{stack}/block_000/layer_000/SelfAttention/relative_attention_bias"))
    norms = (["pre_attention_layer_norm", "pre_mlp_layer_norm"] if stack == "encoder" else
             ["pre_self_attention_layer_norm", "pre_cross_attention_layer_norm",
              "pre_mlp_layer_norm"])
    kinds = [k for k in layers if k]
    for i in range(n):
      ours, block = (stack, f"layers_{i}"), f"{stack}/block_{i:03d}"
      for j, (kind, norm) in enumerate(zip(kinds, norms)):
        theirs = f"{block}/layer_{j:03d}"
        t.append((ours + (norm, "scale"), f"{theirs}/rms_norm/scale"))
        if kind == "mlp":
          t += _mlp(ours, theirs, gated)
        else:
          cls = "EncDecAttention" if kind == "encoder_decoder_attention" else "SelfAttention"
          t += _attention(ours + (kind,), f"{theirs}/{cls}")
    t.append(((stack, f"{stack}_norm", "scale"), f"{stack}/rms_norm/scale"))
  if not config.logits_via_embedding:
    t.append((("decoder", "logits_dense", "kernel"), "decoder/logits/kernel"))
  return t


def _count_layers(names: list[str], stack: str) -> int:
  blocks = {m[1] for n in names for m in [re.match(rf"^{stack}/block_(\d+)/", n)] if m}
  return len(blocks)


def infer_config(bundle: tf_bundle.Bundle, gin_path: str | None) -> ModelConfig:
  """The architecture from the tensors' shapes, checked against the operative gin's
  bindings when there is one (see the module doc)."""
  where = bundle.index_path

  def shape(name: str) -> tuple[int, ...]:
    if name not in bundle:
      raise UserError(f"{where}: no tensor {name!r}; not a Mesh TensorFlow T5 checkpoint "
                      "(T5 1.0, T5.1.1, mT5 or ByT5)")
    return bundle.entry(name).shape

  names = bundle.names()
  vocab, emb = shape("shared/embedding")
  heads, buckets = shape("encoder/block_000/layer_000/SelfAttention/relative_attention_bias")
  joined = shape("encoder/block_000/layer_000/SelfAttention/q")[1]
  gated = "encoder/block_000/layer_001/DenseReluDense/wi_0/kernel" in bundle
  mlp = shape("encoder/block_000/layer_001/DenseReluDense/"
              + ("wi_0" if gated else "wi") + "/kernel")[1]
  tied = "decoder/logits/kernel" not in bundle
  found = {"emb_dim": emb, "num_heads": heads, "head_dim": joined // heads, "mlp_dim": mlp,
           "buckets": buckets, "tied": tied}
  activations = ("gelu", "linear") if gated else ("relu",)
  epsilon = 1e-6
  layers = {s: _count_layers(names, s) for s in ("encoder", "decoder")}
  if gin_path:
    bindings = gin_bindings(gin_path)
    for stack in ("encoder", "decoder"):
      for field, value in [*found.items(), ("num_layers", layers[stack])]:
        name, want = _gin_value(bindings, field, stack)
        if name is not None and want is not None and want != value:
          raise UserError(f"{gin_path}: {name} = {want!r}, but the checkpoint {bundle.prefix} "
                          f"has {field} {value!r} (from its tensors' shapes); the gin beside "
                          "it is not this checkpoint's, remove or fix it")
      name, act = _gin_value(bindings, "activation", stack)
      if name is not None:
        acts = (act,) if isinstance(act, str) else tuple(act)
        if any(a not in _ACTIVATIONS for a in acts) or len(acts) != (2 if gated else 1):
          raise UserError(f"{gin_path}: {name} = {act!r} does not fit the checkpoint "
                          f"({'wi_0/wi_1' if gated else 'one wi'}); t5forge reads "
                          f"{sorted(_ACTIVATIONS)}")
        activations = tuple(_ACTIVATIONS[a] for a in acts)
    name, eps = _gin_value(bindings, "epsilon", "")
    if isinstance(eps, (int, float)):
      epsilon = float(eps)
  return ModelConfig(
      vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=joined // heads, mlp_dim=mlp,
      num_encoder_layers=layers["encoder"], num_decoder_layers=layers["decoder"],
      mlp_activations=activations, logits_via_embedding=tied,
      relative_attention_num_buckets=buckets, layer_norm_epsilon=epsilon, dropout_rate=0.0)


def load_mtf(path: str) -> tuple[ModelConfig, dict, dict]:
  """Reads a Mesh TensorFlow T5 checkpoint.

  Args:
    path: a local bundle prefix, its .index, or its directory (`find_prefix`).

  Returns:
    (config, float32 parameter tree (unscanned), extras): extras holds `step`
    (global_step, else the prefix's N), `prefix`, `slots` (the number of Adafactor slot
    tensors, not read) and `gin` (the operative gin read, or None).
  """
  prefix = find_prefix(path)
  if prefix is None:
    raise UserError(f"{path}: not a TensorFlow checkpoint (no .index file); pass the prefix "
                    "(.../model.ckpt-N), its .index or its directory")
  bundle = tf_bundle.Bundle(prefix)
  bundle.check_shards()
  gin = os.path.join(os.path.dirname(prefix), GIN_FILE)
  gin = gin if os.path.isfile(gin) else None
  config = infer_config(bundle, gin)
  table = name_table(config)
  known = {theirs for _, theirs in table}
  slots = [n for n in bundle.names() if SLOT_MARK in n]
  extra = sorted(set(bundle.names()) - known - set(slots) - {STEP_TENSOR})
  if extra:
    raise UserError(f"{bundle.index_path}: tensor {extra[0]!r} ({len(extra)} unexpected in "
                    "all) is not part of a T5 1.0 / T5.1.1 / mT5 / ByT5 model; other Mesh TF "
                    "architectures are not supported")
  expected = abstract_params(config.replace(scan_layers=False))
  params: dict = {}
  for ours, theirs in table:
    want = expected
    for key in ours:
      want = want[key]
    got = bundle.entry(theirs).shape
    if got != tuple(want.shape):
      raise UserError(f"{bundle.index_path}: tensor {theirs!r} has shape {got}, the model its "
                      f"other tensors describe needs {tuple(want.shape)}; the checkpoint is "
                      "damaged or not a standard T5")
    array = np.asarray(bundle.read(theirs), dtype=np.float32)
    node = params
    for key in ours[:-1]:
      node = node.setdefault(key, {})
    node[ours[-1]] = array
  step = step_of(prefix) or 0
  if STEP_TENSOR in bundle:
    step = int(bundle.read(STEP_TENSOR))
  return config, params, {"step": step, "prefix": prefix, "slots": len(slots), "gin": gin}


def read_slots(path: str) -> dict[tuple, dict]:
  """Adafactor's second moments in a Mesh TF checkpoint, under our parameter paths.

  Mesh TF factors a matrix over its two largest dims d0 >= d1 (the first on ties):
  `_slot_vr` is the statistic with d0 reduced away, `_slot_vc` with d1 reduced away; an
  unfactored parameter has `_slot_v`, its own shape.

  Args:
    path: the checkpoint (`find_prefix`), local.

  Returns:
    {our parameter path: {"v": array}} or {path: {"kept": {dim: array}}}, where `dim` is
    the one parameter dim a factored statistic of a matrix keeps (0 or 1); parameters
    without slots are left out.
  """
  prefix = find_prefix(path)
  if prefix is None:
    raise UserError(f"{path}: not a TensorFlow checkpoint (no .index file)")
  bundle = tf_bundle.Bundle(prefix)
  out: dict[tuple, dict] = {}
  # The names depend only on the shapes (gated or not, tied or not, layer counts).
  for ours, theirs in name_table(infer_config(bundle, None)):
    shape = bundle.entry(theirs).shape
    if theirs + "_slot_v" in bundle:
      out[ours] = {"v": np.asarray(bundle.read(theirs + "_slot_v"), np.float32)}
    elif theirs + "_slot_vr" in bundle and theirs + "_slot_vc" in bundle and len(shape) == 2:
      d0 = int(np.argmax(shape))  # the first of the largest, as Python's stable sort
      vr, vc = (np.asarray(bundle.read(theirs + s), np.float32) for s in ("_slot_vr", "_slot_vc"))
      if vr.shape != (shape[1 - d0],) or vc.shape != (shape[d0],):
        raise UserError(f"{bundle.index_path}: slots of {theirs!r} have shapes {vr.shape} "
                        f"and {vc.shape}, which do not factor its shape {shape}")
      out[ours] = {"kept": {1 - d0: vr, d0: vc}}
  return out
