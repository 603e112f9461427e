"""Checkpoint formats: Hugging Face, T5X native, and t5forge's own; one entry to read any.

`load_checkpoint(path)` decides the format from what is on disk:

- a t5forge checkpoint directory (`params/` + `config/`), or a MODEL_DIR holding
  `checkpoint_<step>/` directories (the latest complete one is read);
- a Hugging Face directory (`config.json` + `model.safetensors` / `pytorch_model.bin` /
  sharded index) of a family in `hf.FAMILIES` (T5, T5Gemma, T5Gemma 2: `hf/`);
- a T5X checkpoint (`checkpoint_<step>/` with a msgpack `checkpoint` file, or the file);
- a Mesh TensorFlow T5 checkpoint (TensorFlow V2 bundle): its prefix `model.ckpt-N`, its
  `.index` file or its directory (`mtf`: T5 1.0, T5.1.1, mT5, ByT5 releases);
- a Hugging Face Hub name such as `google/flan-t5-base`, downloaded when the machine is
  online (set HF_HUB_OFFLINE=1 to forbid it).

`from_checkpoint(path)` and `of_checkpoint(loaded)` give the vocabulary a checkpoint
stores, in any of these formats.

Each may be in a bucket (`gs://...`, `s3://...`): a t5forge checkpoint on gs:// is read in
place (Orbax's TensorStore GCS driver), anything else through a local copy of it, made once
per object version under the cache (`storage.local_copy`, `readable`).
"""
from __future__ import annotations

import dataclasses
import os

from t5forge import storage
from t5forge.convert import hf, mtf, native, paths, t5x
from t5forge.data import vocab_io
from t5forge.data.vocab import Vocabulary
from t5forge.errors import UserError
from t5forge.nn import adapters, quant
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import stack_layers, unstack_layers

HF, T5X, T5FORGE, MTF = "hf", "t5x", "t5forge", "mtf"


@dataclasses.dataclass
class LoadedCheckpoint:
  """What `load_checkpoint` found.

  Attributes:
    config: the model config.
    params: float32 parameter tree (numpy or jax arrays); with a `base_dtype`, kernels
      as that base keeps them (`nn.adapters.store_base`).
    format: 'hf', 't5x', 'mtf' or 't5forge'.
    path: the directory or file actually read (e.g. the latest checkpoint_<step>).
    step: training step, when the format records one (else 0).
    extras: format-specific leftovers, e.g. T5X's optimizer `param_states`, Mesh TF's
      count of Adafactor `slots`, or the t5forge config item (vocabulary spec ...).
  """

  config: ModelConfig
  params: dict
  format: str
  path: str
  step: int = 0
  extras: dict = dataclasses.field(default_factory=dict)

  def source_for(self, config: ModelConfig) -> str:
    """`path` for messages about fitting these parameters to a model of `config`, with
    both architectures when they differ (e.g. a T5 checkpoint given to a T5Gemma gin)."""
    if self.config.architecture == config.architecture:
      return self.path
    return (f"{self.path} (a {self.config.architecture} checkpoint, the model is "
            f"{config.architecture})")


def _describe(path: str) -> str:
  try:
    entries = sorted(os.listdir(path))[:8]
  except OSError:
    return "unreadable"
  return ", ".join(entries) if entries else "an empty directory"


def _looks_like_hub_name(path: str) -> bool:
  parts = path.split("/")
  return (not os.path.isabs(path) and not path.startswith(".") and len(parts) <= 2
          and all(p and not p.startswith(".") for p in parts))


def _download(name: str) -> str:
  try:
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (slow or optional import, on first use)
    return snapshot_download(repo_id=name, allow_patterns=[
        "config.json", "*.safetensors", "*.safetensors.index.json", "spiece.model",
        "tokenizer.model", "tokenizer*.json", "special_tokens_map.json", "generation_config.json"])
  except Exception as e:  # noqa: BLE001 (network, auth, missing repo: all mean "not loadable from here")
    reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    raise UserError(
        f"{name!r} is not a local path and could not be fetched from the Hugging Face Hub "
        f"({type(e).__name__}: {reason}). On an offline machine, download it elsewhere "
        f"(`hf download {name}`) and pass the local directory.") from None


def readable(path: str) -> str:
  """What readers open for the checkpoint at `path` (as `paths.resolve` gives it): a local
  path, or a t5forge checkpoint on gs://, as it is (Orbax reads it in place); any other
  bucket checkpoint, a local copy of it (`storage.local_copy`, cached per object version)."""
  if not storage.is_remote(path):
    return path
  if storage.scheme(path) == "gs" and native.is_native_checkpoint(path):
    return path
  prefix = mtf.find_prefix(path)
  if prefix is not None:  # a prefix, not an object: copy the bundle's files only
    return mtf.local_prefix(prefix)
  try:
    return storage.local_copy(path)
  except FileNotFoundError:
    raise UserError(f"{path}: no such object or prefix in the bucket; pass a checkpoint "
                    "or the MODEL_DIR a run wrote") from None


def locate(path: str) -> tuple[str, int | None]:
  """(`local_path(path)`, the step of the `checkpoint_<step>` it names or None): the step
  of a bucket checkpoint read through a local copy is not in the copy's name."""
  if path and not storage.is_remote(path) and not os.path.exists(path) and (
      _looks_like_hub_name(path)):
    return _download(path), None
  resolved = paths.resolve(path)
  return readable(resolved.path), resolved.step


def local_path(path: str) -> str:
  """The local checkpoint `path` names, absolute: where a Hugging Face Hub name such as
  `google/flan-t5-small` was downloaded to (when it is not a local path), else the
  checkpoint `paths.resolve` finds (a MODEL_DIR's newest intact checkpoint). For a bucket
  URL, what `readable` opens: the URL of a t5forge checkpoint on gs://, else a local copy."""
  return locate(path)[0]


def detect_format(path: str) -> str:
  """'t5forge', 'hf', 't5x' or 'mtf' for an existing local path (a Mesh TF prefix
  included) or bucket URL; UserError otherwise."""
  if storage.is_remote(path):
    if native.is_native_checkpoint(path) or paths.is_model_dir(path):
      return T5FORGE
    return detect_format(readable(path))
  if not os.path.isdir(path) and mtf.find_prefix(path) is not None:
    return MTF
  if os.path.isdir(path):
    if native.is_native_checkpoint(path) or paths.is_model_dir(path):
      return T5FORGE
    if hf.is_hf_dir(path):
      return HF
    if os.path.isfile(os.path.join(path, hf.CONFIG_FILE)):
      raise UserError(f"{path}: has config.json but no weights; expected "
                      f"{hf.SAFETENSORS}, {hf.TORCH_BIN} or a sharded *.index.json beside it")
    if t5x.is_t5x_checkpoint(path):
      return T5X
    if mtf.find_prefix(path) is not None:
      return MTF
    raise UserError(f"{path}: not a checkpoint; found {_describe(path)}. Expected a "
                    "t5forge checkpoint or MODEL_DIR, an HF directory (config.json + "
                    "model.safetensors), a T5X checkpoint_<step> directory or a Mesh TF "
                    "model.ckpt-N prefix")
  if os.path.isfile(path):
    if t5x.is_t5x_checkpoint(path):
      return T5X
    raise UserError(f"{path}: a file that is not a T5X msgpack checkpoint; pass the "
                    "directory that holds the checkpoint instead")
  raise UserError(f"{path}: no such file or directory")


# Fields a caller may change on load: they alter computation, not parameter shapes
# (scan_layers changes only the layout, which `relayout` converts).
RUNTIME_FIELDS = ("dtype", "scan_layers", "remat_policy", "dropout_rate",
                  "float32_attention_logits", "weight_dtype", "attention_kernel")


def relayout(params: dict, *, scanned: bool, to_scanned: bool) -> dict:
  """Converts parameters between the per-layer and the scanned (stacked) layout."""
  if scanned == to_scanned:
    return params
  return stack_layers(params) if to_scanned else unstack_layers(params)


def _storer(base_dtype: str) -> hf.Store:
  """`adapters.store_base`'s rule for one leaf, as an HF load applies it to each tensor
  as it is read."""
  adapters.store_base({}, base_dtype)  # an unknown dtype: its one-line error, before reading

  def store(path: tuple[str, ...], value):
    return adapters.store_base({path[-1]: value}, base_dtype)[path[-1]]

  return store


def load_checkpoint(path: str, *, base_dtype: str | None = None,
                    **overrides) -> LoadedCheckpoint:
  """Reads parameters and config from any supported checkpoint (see module doc).

  Args:
    path: local path, or a Hugging Face Hub name.
    base_dtype: keep the parameters as a frozen base of this storage dtype
      (`nn.adapters.store_base`: 'bfloat16' or 'int8' projection kernels, the rest
      float32).
      An HF checkpoint is cast tensor by tensor as it is read and laid out (scanned or
      not) as it is made, so no float32 copy of the model is held; other formats are
      read as float32 and then cast. None: float32, as read.
    **overrides: ModelConfig fields to change on load, from RUNTIME_FIELDS (e.g.
      dtype='bfloat16', scan_layers=True, dropout_rate=0.0).
  """
  bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
  if bad:
    raise UserError(f"cannot override {bad} when loading a checkpoint; only "
                    f"{list(RUNTIME_FIELDS)} may change")
  store = None if base_dtype is None else _storer(base_dtype)
  path, known_step = locate(path)
  fmt = detect_format(path)
  step, extras = 0, {}
  if fmt == T5FORGE:
    ckpt_dir = path if native.is_native_checkpoint(path) else native.latest_checkpoint(path)
    if ckpt_dir is None:
      raise UserError(f"{path}: no complete checkpoint_<step> directory inside")
    config, params, extras = native.load(ckpt_dir)
    step, path = native.step_of(ckpt_dir) or known_step or 0, ckpt_dir
  elif fmt == HF:
    config, params = hf.load_hf(path, store=store,
                                scan_layers=overrides.get("scan_layers", False))
  elif fmt == MTF:
    config, params, extras = mtf.load_mtf(path)
    step = extras["step"]
  else:
    config, params, extras = t5x.load_t5x(path)
    step = extras["step"]
  new_config = config.replace(**overrides) if overrides else config
  params = relayout(params, scanned=config.scan_layers, to_scanned=new_config.scan_layers)
  if new_config.weight_dtype == "int8" and config.weight_dtype != "int8":
    params = quant.quantize_params(params)
  if base_dtype is not None and fmt != HF:
    params = adapters.store_base(params, base_dtype)
  return LoadedCheckpoint(new_config, params, fmt, path, step=step, extras=extras)


def of_checkpoint(ckpt: LoadedCheckpoint) -> Vocabulary | None:
  """The vocabulary stored with a loaded checkpoint (None: T5X, Mesh TF, or HF without a
  tokenizer)."""
  if ckpt.format == T5FORGE:
    return vocab_io.from_spec(ckpt.extras.get("vocabulary"))
  if ckpt.format == HF:
    return hf.from_hf_dir(ckpt.path)
  return None


def from_checkpoint(path: str) -> Vocabulary | None:
  """The vocabulary of the checkpoint at `path`, without reading its weights.

  For gin: `VOCABULARY = @vocab_io.from_checkpoint()` with
  `vocab_io.from_checkpoint.path = %INITIAL_CHECKPOINT_PATH` (the data layer's gin name for
  this function, installed below).

  Args:
    path: a t5forge checkpoint or MODEL_DIR (its latest checkpoint's spec), an HF
      directory (spiece.model / ByT5's tokenizer_config.json; weights are not needed),
      a Hugging Face Hub name (fetched as `load_checkpoint` does), or a T5X or Mesh TF
      checkpoint (which store none).

  Returns:
    The vocabulary, or None where the checkpoint stores none.
  """
  if not path:
    raise UserError("vocab_io.from_checkpoint: no path; bind vocab_io.from_checkpoint.path "
                    "(e.g. = %INITIAL_CHECKPOINT_PATH)")
  path = local_path(path)  # a MODEL_DIR: its newest intact checkpoint (`paths.resolve`)
  if native.is_native_checkpoint(path):
    return vocab_io.from_spec(native.read_config(path).get("vocabulary"))
  if os.path.isdir(path):
    vocab = hf.from_hf_dir(path)
    if vocab is not None:
      return vocab
  detect_format(path)  # not a checkpoint at all: its one-line error
  return None


vocab_io.set_checkpoint_reader(from_checkpoint)
