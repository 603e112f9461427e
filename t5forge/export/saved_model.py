"""Writes and runs a TensorFlow SavedModel (`t5forge export --format saved_model`, extra `[tf]`).

The generate functions are `writer.generate_fn`, the ones `--format jax` exports, converted
with `jax.experimental.jax2tf.convert` (native serialization: each signature holds the
StableHLO of the whole decode loop in one XlaCallModule op) with a symbolic batch
(`polymorphic_shapes`), so one signature serves every batch size. The directory:

- `saved_model.pb`, `variables/`: the SavedModel; the parameters are `tf.Variable`s shared
  by every signature (one copy of the weights, as `params.safetensors` in the jax format);
- `assets/spiece.model`: the vocabulary, as `--format jax` writes it (sentinels appended),
  tracked as a `tf.saved_model.Asset` so it moves with the model;
- `assets.extra/tf_serving_warmup_requests`: TF Serving's warm-up file (a TFRecord of
  `tensorflow.serving.PredictionLog`), one request per signature and `--batch_sizes`
  entry, so TF Serving compiles those shapes when it loads the model, not on first use;
- `assets.extra/t5forge.json`: format version, model summary, eos / pad ids, vocabulary,
  the signatures and the warm-up batch sizes.

Signatures, one per (method, input length i, decode length l), named `<method>_i<i>_l<l>`;
`serving_default` is greedy (else the first method) at the largest i and l:

    greedy: inputs [b, i] int32, max_new_tokens [b] int32 -> tokens [b, l] int32, scores [b] float32
    sample: + temperature [b] float32, topp [b] float32, seed [] uint32
    beam:   + alpha [] float32 (the best of `num_beams` beams, as writer.generate_fn's)

b is symbolic. `inputs` are token ids laid out as `loader.encode_rows` writes them
(encoder tokens ending in EOS, 0-padded; decoder-only: [0 (BOS), prompt..., 0...]).

Why ids, not strings: T5X tokenises in the graph with tf-text's SentencePiece op, which
is a custom-op package t5forge does not depend on, and SentencePiece's segmentation
(unigram Viterbi or BPE merges over a normalizer) has no expression in core TF ops. A
`tf.py_function` would not survive saving. So text is tokenised beside the graph:
`SavedModelRunner` (below) reads `assets/spiece.model` with the sentencepiece package and
calls a signature; a TF Serving client does the same with any SentencePiece library.

TensorFlow is imported only here, on first use (`import_tensorflow`).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import numpy as np

from t5forge import files
from t5forge.data import records
from t5forge.errors import UserError
from t5forge.export import loader, writer

FORMAT = "t5forge-saved-model"
FORMAT_VERSION = 1
MANIFEST_FILE = "assets.extra/t5forge.json"
WARMUP_FILE = "assets.extra/tf_serving_warmup_requests"
VOCAB_FILE = "assets/spiece.model"
DEFAULT_SIGNATURE = "serving_default"
# TF Serving's warm-up guide (tfx/serving/saved_model_warmup): "Number of warmup records
# <= 1000".
MAX_WARMUP_RECORDS = 1000


def import_tensorflow():
  """The tensorflow module, or a one-line UserError naming the extra to install."""
  try:
    import tensorflow as tf  # noqa: PLC0415 (the [tf] extra: imported by this format only)
  except ImportError:
    raise UserError("--format saved_model needs TensorFlow: pip install 't5forge[tf]' "
                    "(or tensorflow==2.21.0), or export --format jax") from None
  return tf


def signature_name(method: str, input_length: int, decode_length: int) -> str:
  return f"{method}_i{input_length}_l{decode_length}"


# -- warm-up requests -----------------------------------------------------------------------
# tensorflow_serving's protos are not a dependency; the three small messages a warm-up
# record needs are written in protobuf's wire format with the field numbers of
# tensorflow_serving/apis/{prediction_log,predict,model}.proto:
#   PredictionLog.predict_log = 6; PredictLog.request = 1;
#   PredictRequest.model_spec = 1, .inputs = 2 (map<string, TensorProto>: key 1, value 2);
#   ModelSpec.signature_name = 3.
def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _message_field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2): a string, bytes or a sub-message."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def prediction_log(signature: str, inputs: dict[str, bytes]) -> bytes:
  """A serialized PredictionLog holding one PredictRequest for `signature`.

  Args:
    signature: the signature name (ModelSpec.signature_name); the model name is left empty:
      TF Serving runs warm-up records against the model whose directory holds them.
    inputs: {input name: serialized tensorflow.TensorProto}.
  """
  spec = _message_field(3, signature.encode())
  entries = b"".join(_message_field(2, _message_field(1, k.encode()) + _message_field(2, v))
                     for k, v in sorted(inputs.items()))
  request = _message_field(1, spec) + entries
  return _message_field(6, _message_field(1, request))


def _warmup_arrays(method: str, batch: int, input_length: int, decode_length: int,
                   eos_id: int, is_encoder_decoder: bool) -> dict[str, np.ndarray]:
  """A request of the given shape: each row an empty prompt, decoding all l steps."""
  inputs = np.zeros((batch, input_length), np.int32)
  # Encoder input: just EOS; decoder-only: BOS 0 then EOS as a one-token prompt.
  inputs[:, 0 if is_encoder_decoder else 1] = eos_id
  arrays = {"inputs": inputs, "max_new_tokens": np.full((batch,), decode_length, np.int32)}
  if method == "sample":
    arrays.update(temperature=np.ones((batch,), np.float32),
                  topp=np.zeros((batch,), np.float32), seed=np.uint32(0))
  if method == "beam":
    arrays.update(alpha=np.float32(0.6))
  return arrays


# -- export -----------------------------------------------------------------------------------
def _tensor_specs(tf, method: str, input_length: int) -> list:
  """The signature's inputs, as `writer.arg_specs` lists them with the batch left None."""
  specs = []
  for a in writer.arg_specs(method, writer.Shape(1, input_length, 1)):
    shape = [None if k == 0 else d for k, d in enumerate(a["shape"])] if a["shape"] else []
    specs.append(tf.TensorSpec(shape, tf.as_dtype(a["dtype"]), name=a["name"]))
  return specs


def _polymorphic_shapes(method: str) -> list:
  """One entry per argument of `writer.generate_fn`: params fixed, every [b, ...] array
  with the symbolic batch b, the sampling seed and beam alpha scalars."""
  extra = {"sample": ["(b,)", "(b,)", None], "beam": [None]}.get(method, [])
  return [None, "(b, _)", "(b,)", *extra]


def _serving_fn(method: str, converted, variables: dict):
  """The Python function a signature traces: TF arrays -> {'tokens', 'scores'}. Its
  parameters are named (no *args, no defaults): a signature's input keys are their names."""
  if method == "greedy":
    def greedy(inputs, max_new_tokens):
      tokens, scores = converted(dict(variables), inputs, max_new_tokens)
      return {"tokens": tokens, "scores": scores}
    return greedy

  if method == "beam":
    def beam(inputs, max_new_tokens, alpha):
      tokens, scores = converted(dict(variables), inputs, max_new_tokens, alpha)
      return {"tokens": tokens, "scores": scores}
    return beam

  def sample(inputs, max_new_tokens, temperature, topp, seed):
    tokens, scores = converted(dict(variables), inputs, max_new_tokens, temperature, topp,
                               seed)
    return {"tokens": tokens, "scores": scores}
  return sample


def export_saved_model(model, params: dict, vocab, out_dir: str, *,
                       input_lengths: list[int], decode_lengths: list[int],
                       warmup_batch_sizes: list[int], methods: tuple[str, ...] = ("greedy",),
                       num_beams: int | None = None, platforms: tuple[str, ...] | None = None,
                       source: dict | None = None, log=print) -> dict:
  """Exports `model`'s generate functions with `params` and `vocab` as a SavedModel.

  Args:
    model: a `t5forge.models.BaseModel`.
    params: its parameter tree (copied to host, then into tf.Variables).
    vocab: its SentencePiece vocabulary, or None (the model then takes token ids only).
    out_dir: a directory to create (must not exist or be empty).
    input_lengths, decode_lengths: one signature per (method, i, l).
    warmup_batch_sizes: the batch sizes of the warm-up requests (the batch is symbolic).
    methods: any of 'greedy', 'sample', 'beam'.
    num_beams: beam search's beam size (with 'beam' only; default 4).
    platforms: where the serialized StableHLO may run, e.g. ('cpu', 'cuda'); default this
      machine's backend.
    source: provenance to record (checkpoint path, format, step).

  Returns:
    The manifest (also written as assets.extra/t5forge.json).
  """
  tf = import_tensorflow()
  from jax.experimental import jax2tf  # noqa: PLC0415 (imports tensorflow)
  num_beams = writer.check_methods(methods, num_beams)
  config = model.config
  writer.check_shapes([writer.Shape(b, i, l) for b in warmup_batch_sizes for i in input_lengths
                       for l in decode_lengths], config, vocab)
  keys = [(m, i, l) for m in methods for i in input_lengths for l in decode_lengths]
  n_warmup = len(keys) * len(warmup_batch_sizes)
  if n_warmup > MAX_WARMUP_RECORDS:
    raise UserError(f"{n_warmup} warm-up requests ({len(keys)} signatures x "
                    f"{len(warmup_batch_sizes)} --batch_sizes); TF Serving reads at most "
                    f"{MAX_WARMUP_RECORDS}: give fewer lengths or batch sizes")
  out_dir = writer.check_output(out_dir)
  flat = writer.flatten_params(jax.device_get(params))
  eos = int(vocab.eos_id) if vocab is not None else int(model.eos_id)
  stops = [int(i) for i in np.reshape(model.stop_ids, -1)]

  module = tf.Module()
  # '/' would read as a name scope; the dict key keeps the parameter's own name.
  module.params = {k: tf.Variable(v, trainable=False, name=k.replace("/", "."))
                   for k, v in flat.items()}
  signatures, entries = {}, []
  for method, i, l in keys:
    start = time.perf_counter()
    # Native serialization is jax2tf's only mode in jax 0.10 (its `native_serialization`
    # argument is deprecated and ignored), so it is not passed.
    converted = jax2tf.convert(
        writer.generate_fn(model, method, l, num_beams or writer.DEFAULT_NUM_BEAMS,
                           for_tensorflow=True),
        polymorphic_shapes=_polymorphic_shapes(method),
        with_gradient=False, native_serialization_platforms=platforms)
    fn = tf.function(_serving_fn(method, converted, module.params),
                     input_signature=_tensor_specs(tf, method, i), autograph=False)
    name = signature_name(method, i, l)
    signatures[name] = fn.get_concrete_function()
    setattr(module, name, fn)
    entries.append({"name": name, "method": method, "input_length": i, "decode_length": l,
                    "inputs": [{**a, "shape": [None, *a["shape"][1:]] if a["shape"] else []}
                               for a in writer.arg_specs(method, writer.Shape(1, i, 1))],
                    "outputs": [{"name": "tokens", "shape": [None, l], "dtype": "int32"},
                                {"name": "scores", "shape": [None], "dtype": "float32"}]})
    log(f"converted {name} in {time.perf_counter() - start:.1f}s")
  default = min(entries, key=lambda e: (e["method"] != "greedy", -e["input_length"],
                                        -e["decode_length"]))
  signatures[DEFAULT_SIGNATURE] = signatures[default["name"]]

  with files.staged_dir(out_dir, last=(MANIFEST_FILE,)) as tmp, \
       tempfile.TemporaryDirectory() as scratch:
    vocab_entry = writer.write_vocabulary(vocab, scratch)
    if vocab_entry:
      # Saved as assets/spiece.model: TF copies a tracked Asset there by its base name.
      module.vocabulary = tf.saved_model.Asset(os.path.join(scratch, writer.VOCAB_FILE))
      vocab_entry["file"] = VOCAB_FILE
    start = time.perf_counter()
    tf.saved_model.save(module, tmp, signatures=signatures)
    log(f"saved the SavedModel in {time.perf_counter() - start:.1f}s")
    warmup = []
    for e in entries:
      for b in warmup_batch_sizes:
        arrays = _warmup_arrays(e["method"], b, e["input_length"], e["decode_length"], eos,
                                bool(config.is_encoder_decoder))
        warmup.append(prediction_log(e["name"], {
            k: tf.make_tensor_proto(v).SerializeToString() for k, v in arrays.items()}))
    os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)
    records.write(os.path.join(tmp, WARMUP_FILE), warmup)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "jax_version": jax.__version__, "tensorflow_version": tf.__version__,
        "model": {"architecture": config.architecture,
                  "is_encoder_decoder": bool(config.is_encoder_decoder),
                  "vocab_size": config.vocab_size, "dtype": config.dtype,
                  "num_parameters": int(sum(v.size for v in flat.values()))},
        "source": source or {},
        "eos_id": eos, "eos_ids": list(dict.fromkeys([eos] + stops)), "pad_id": 0,
        "num_beams": num_beams,  # the beam signatures' beam size; None without beam
        "vocabulary": vocab_entry,
        "platforms": list(platforms) if platforms else [jax.default_backend()],
        "signatures": entries, "default_signature": default["name"],
        "warmup": {"file": WARMUP_FILE, "batch_sizes": list(warmup_batch_sizes),
                   "requests": len(warmup)},
    }
    files.write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
  return manifest


# -- running ----------------------------------------------------------------------------------
class SavedModelRunner:
  """A directory written by `export_saved_model`, loaded with `tf.saved_model.load`; text is
  tokenised beside the graph with `assets/spiece.model` (see the module docstring).

  Attributes:
    model: the loaded SavedModel (`model.signatures[name]` as TF Serving runs them).
    manifest: the parsed assets.extra/t5forge.json.
    vocabulary: a `loader.Vocabulary`, or None (token ids only).
  """

  def __init__(self, path: str):
    tf = import_tensorflow()
    self.path = os.path.abspath(path)
    manifest_path = os.path.join(self.path, MANIFEST_FILE)
    try:
      with open(manifest_path, encoding="utf-8") as f:
        self.manifest = json.load(f)
    except FileNotFoundError:
      raise UserError(f"{self.path}: no {MANIFEST_FILE}; not a directory written by "
                      "`t5forge export --format saved_model`") from None
    m = self.manifest
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
      raise UserError(f"{manifest_path}: format {m.get('format')!r} version "
                      f"{m.get('format_version')!r}; this reader reads {FORMAT} version "
                      f"{FORMAT_VERSION}")
    self.model = tf.saved_model.load(self.path)
    self.vocabulary = (loader.Vocabulary(os.path.join(self.path, m["vocabulary"]["file"]),
                                         m["vocabulary"]) if m.get("vocabulary") else None)
    self.eos_id = int(m["eos_id"])
    self.stop_ids = tuple(int(i) for i in m["eos_ids"])
    self.is_encoder_decoder = bool(m["model"]["is_encoder_decoder"])
    self._tf = tf

  def pick(self, method: str, input_length: int, decode_length: int) -> dict:
    """The signature of `method` with the smallest input, then decode, length that fit."""
    own = [s for s in self.manifest["signatures"] if s["method"] == method]
    if not own:
      have = sorted({s["method"] for s in self.manifest["signatures"]})
      fix = (f"re-export with --methods {method}" if method in writer.METHODS else
             f"choose from {', '.join(writer.METHODS)}")
      raise UserError(f"method {method!r} was not exported (this SavedModel has "
                      f"{', '.join(have)}); {fix}")
    fits = [s for s in own if s["input_length"] >= input_length
            and s["decode_length"] >= decode_length]
    if not fits:
      have = sorted({(s["input_length"], s["decode_length"]) for s in own})
      raise UserError(f"no {method} signature fits input length {input_length} and decode "
                      f"length {decode_length}; exported (input, decode) lengths: {have}; "
                      "re-export with larger --input_lengths / --decode_lengths")
    return min(fits, key=lambda s: (s["input_length"], s["decode_length"]))

  def run(self, inputs: np.ndarray, max_new_tokens: int, *, method: str = "greedy",
          temperature: float = 1.0, topp: float = 0.0, seed: int = 0,
          alpha: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """Model-ready tokens [b, i] -> new tokens [b, max_new_tokens] int32, scores [b]
    (temperature, topp, seed: method 'sample'; alpha: 'beam', the best beam's)."""
    x = np.asarray(inputs)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
      raise UserError(f"inputs must be integer tokens [batch, length], got {x.dtype} with "
                      f"shape {list(x.shape)}")
    v = self.manifest["model"]["vocab_size"]
    if x.size and (x.min() < 0 or x.max() >= v):
      # The compiled embedding lookup would clamp such ids silently.
      raise UserError(f"inputs have ids outside [0, {v}): min {x.min()}, max {x.max()}")
    if max_new_tokens < 1:
      raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b = x.shape[0]
    used = int(np.max(np.nonzero(x.any(axis=0))[0], initial=-1)) + 1
    entry = self.pick(method, max(used, 1 if self.is_encoder_decoder else 2), max_new_tokens)
    padded = np.zeros((b, entry["input_length"]), np.int32)
    padded[:, :used] = x[:, :used]
    tf = self._tf
    args = {"inputs": tf.constant(padded),
            "max_new_tokens": tf.constant(np.full((b,), max_new_tokens, np.int32))}
    if method == "sample":
      args.update(temperature=tf.constant(np.full((b,), temperature, np.float32)),
                  topp=tf.constant(np.full((b,), topp, np.float32)),
                  seed=tf.constant(np.uint32(seed)))
    if method == "beam":
      args.update(alpha=tf.constant(np.float32(alpha)))
    try:
      out = self.model.signatures[entry["name"]](**args)
    except tf.errors.NotFoundError as e:
      if "is not among the platforms required by the module" not in str(e):
        raise
      raise UserError(f"{self.path}: exported for {', '.join(self.manifest['platforms'])}, "
                      "not this machine's; re-export with --platforms naming it") from None
    return (out["tokens"].numpy()[:, :max_new_tokens].astype(np.int32),
            out["scores"].numpy().astype(np.float32))

  def generate(self, texts: list[str], max_new_tokens: int, **options) -> list[str]:
    """Strings in, strings out (one signature call for the whole batch)."""
    if isinstance(texts, str):
      raise UserError("generate() takes a list of strings; wrap a single text in a list")
    tokens, _ = self.run(loader.encode_rows(texts, self.vocabulary, self.eos_id,
                                            self.is_encoder_decoder), max_new_tokens, **options)
    return [self.vocabulary.decode(loader.text_ids(row, self.stop_ids, self.eos_id))
            for row in tokens]
