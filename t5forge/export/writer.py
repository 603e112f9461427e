"""Writes a checkpoint as a self-contained `jax.export` artifact (`t5forge export --format jax`).

The artifact directory holds:

- `functions/<method>_b<B>_i<I>_l<L>.jaxexp`: the whole generate function (encoder, cache
  set-up and the compiled decode loop of `t5forge.decoding`) serialized with `jax.export`
  for one batch size B, input length I and decode length L; the parameters are its
  ARGUMENTS, not constants, so one weights file serves every shape;
- `params.safetensors`: the parameters, named by their tree path joined with '/';
- `spiece.model`: the SentencePiece vocabulary with T5's sentinels appended, as
  `t5forge.data.vocab.SentencePieceVocabulary` loads it (so ids and text agree exactly);
- `load_exported.py`: a copy of `t5forge/export/loader.py`, the loader, which imports
  only jax, numpy, safetensors, sentencepiece and the standard library;
- `requirements.txt`: the packages the loader needs (`pip install -r requirements.txt`),
  pinned as t5forge pins them: jax, jaxlib, numpy, safetensors, sentencepiece, and
  flatbuffers, which jax.export imports to deserialize but jax does not install;
- `manifest.json`: format version, model summary, eos / pad ids, the beam size `num_beams`
  (null without beam), the functions with their
  shapes, argument and output specs and files, the parameter names / shapes / dtypes, the
  jax version, and the sha256 of every other file.

Function signatures (shape letters as in docs/shapes.md; every argument positional):

    greedy(params, inputs [b, i] int32, max_new_tokens [b] int32)
        -> tokens [b, l] int32, scores [b] float32
    sample(params, inputs, max_new_tokens, temperature [b] float32, topp [b] float32,
           seed [] uint32) -> tokens [b, l] int32, scores [b] float32
    beam(params, inputs, max_new_tokens, alpha [] float32)
        -> tokens [b, l] int32, scores [b] float32

`beam` is T5X's beam search with `num_beams` beams (fixed at export: the manifest's
`num_beams`) and brevity-penalty exponent `alpha`; it returns the best beam only, with its
penalised score, as `interactive.Model.predict(..., method="beam")` does without
return_all_decodes. One output contract for every method keeps the loader and the
SavedModel signatures alike; the other beams would serve only n > 1, which an export does
not serve.

`params` is the flat dict {name: array} of params.safetensors. `inputs` are as
`interactive.Model.predict` takes them: encoder tokens ending in EOS, 0-padded
(encoder-decoder), or [0 (BOS), prompt..., 0 padding] (decoder-only). `tokens` are the new
tokens only, 0 after EOS or after max_new_tokens.

The directory is written under a temporary sibling and renamed into place at the end, so
it exists complete or not at all. A `gs://` / `s3://` output is written locally and
uploaded, manifest.json last: a reader takes a prefix without it as no export.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import decoding, files, storage
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.errors import UserError
from t5forge.export import loader

FORMAT = "t5forge-jax-export"
FORMAT_VERSION = 1
METHODS = ("greedy", "sample", "beam")
DEFAULT_NUM_BEAMS = 4
PARAMS_FILE = "params.safetensors"
VOCAB_FILE = "spiece.model"
LOADER_FILE = "load_exported.py"
REQUIREMENTS_FILE = "requirements.txt"
MANIFEST_FILE = "manifest.json"
# The distributions the loader imports at run time. jaxlib: jax's compiled half, pinned
# with it; flatbuffers: jax.export's serialization imports it, but jax leaves it optional.
LOADER_DISTRIBUTIONS = ("jax", "jaxlib", "numpy", "safetensors", "sentencepiece",
                        "flatbuffers")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One compiled shape: batch b, input length i, decode length l (new tokens)."""
  batch: int
  input_length: int
  decode_length: int


def flatten_params(params: dict) -> dict[str, np.ndarray]:
  """{'encoder': {'layers_0': {...}}} -> {'encoder/layers_0/...': numpy array}."""
  flat = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for key in sorted(node):
        if "/" in str(key):
          raise UserError(f"parameter name {prefix + str(key)!r} contains '/'; cannot export")
        walk(f"{prefix}{key}/", node[key])
    else:
      flat[prefix[:-1]] = np.asarray(node)

  walk("", params)
  return flat


def unflatten_params(flat: dict) -> dict:
  """Inverse of `flatten_params` (works on traced values too)."""
  tree: dict = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def generate_fn(model, method: str, decode_length: int, num_beams: int = DEFAULT_NUM_BEAMS,
                *, for_tensorflow: bool = False):
  """The function that is exported: params (flat dict) + arrays -> (tokens [b, l] int32,
  scores [b] float32); its arguments after params are `arg_specs(method, ...)`.

  for_tensorflow: beam search takes its top-k with `decoding.portable_top_k` (the same
  result), as TensorFlow's XlaCallModule cannot read what `lax.top_k` serializes to."""

  def features(inputs):
    if model.config.is_encoder_decoder:
      return {"encoder_input_tokens": inputs,
              "decoder_input_tokens": jnp.zeros((inputs.shape[0], decode_length), jnp.int32)}
    return {"decoder_input_tokens": inputs}

  def run(flat_params, inputs, max_new_tokens, temperature, topp, seed):
    options = {"temperature": temperature, "topk": 0, "topp": topp,
               "max_decode_steps": max_new_tokens}
    tokens, aux = model.predict_batch_with_aux(
        unflatten_params(flat_params), features(inputs), jax.random.key(seed),
        decoder_params=options, num_decodes=1, max_decode_length=decode_length,
        decode_fn=decoding.temperature_sample)
    return tokens.astype(jnp.int32), aux["scores"].astype(jnp.float32)

  def beam(flat_params, inputs, max_new_tokens, alpha):
    # The live model's beam call (generation.Generator._make_beam_fn) without its
    # min_log_prob stop (None: never, as the live default -inf) and per-token log-probs.
    tokens, aux = model.predict_batch_with_aux(
        unflatten_params(flat_params), features(inputs), None,
        decoder_params={"alpha": alpha, "max_decode_steps": max_new_tokens,
                        "top_k": decoding.portable_top_k if for_tensorflow else jax.lax.top_k},
        num_decodes=num_beams, max_decode_length=decode_length,
        decode_fn=decoding.beam_search)
    return tokens.astype(jnp.int32), aux["scores"].astype(jnp.float32)

  if method == "greedy":
    # A Python 0 temperature compiles the greedy-only loop (no sampling, no sort).
    return lambda p, x, m: run(p, x, m, 0.0, 0.0, 0)
  if method == "beam":
    return beam
  return run


def arg_specs(method: str, shape: Shape) -> list[dict]:
  b, i = shape.batch, shape.input_length
  specs = [{"name": "inputs", "shape": [b, i], "dtype": "int32"},
           {"name": "max_new_tokens", "shape": [b], "dtype": "int32"}]
  if method == "sample":
    specs += [{"name": "temperature", "shape": [b], "dtype": "float32"},
              {"name": "topp", "shape": [b], "dtype": "float32"},
              {"name": "seed", "shape": [], "dtype": "uint32"}]
  if method == "beam":
    specs += [{"name": "alpha", "shape": [], "dtype": "float32"}]
  return specs


def check_methods(methods: tuple[str, ...], num_beams: int | None) -> int | None:
  """The beam size to export (None without beam); a one-line UserError for an unknown
  method, a --num_beams without beam, or a beam size below 2."""
  for m in methods:
    if m not in METHODS:
      raise UserError(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
  if "beam" not in methods:
    if num_beams is not None:
      raise UserError(f"--num_beams {num_beams} applies to beam search only; add beam to "
                      "--methods or drop --num_beams")
    return None
  n = DEFAULT_NUM_BEAMS if num_beams is None else num_beams
  if n < 2:
    raise UserError(f"--num_beams {n}: beam search needs >= 2 beams (one beam is greedy: "
                    "export --methods greedy)")
  return n


def _distribution(requirement: str) -> str:
  """'jax==0.10.2' -> 'jax'; 'prometheus_client>=1' -> 'prometheus-client' (PEP 503)."""
  return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def loader_requirements() -> list[str]:
  """The lines of an artifact's requirements.txt: each of `LOADER_DISTRIBUTIONS` as this
  t5forge's metadata pins it (pyproject.toml's dependencies), else at the version
  installed here (t5forge run from a source tree without being installed)."""
  try:
    declared = importlib.metadata.requires("t5forge") or []
  except importlib.metadata.PackageNotFoundError:
    declared = []
  # Requirements with a marker belong to extras (tests, bench), not to running t5forge.
  pins = {_distribution(r): r.strip() for r in declared if ";" not in r}
  lines = []
  for name in LOADER_DISTRIBUTIONS:
    if name in pins:
      lines.append(pins[name])
      continue
    try:
      lines.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      lines.append(name)
  return lines


def write_vocabulary(vocab, out_dir: str) -> dict | None:
  """Writes the SentencePiece model as the vocabulary loads it (sentinels appended)."""
  if vocab is None:
    return None
  if not isinstance(vocab, SentencePieceVocabulary):
    raise UserError(f"cannot export vocabulary {type(vocab).__name__}: the exported loader "
                    "reads SentencePiece models only")
  files.write_bytes(os.path.join(out_dir, VOCAB_FILE), vocab.processor.serialized_model_proto())
  return {"type": "sentencepiece", "file": VOCAB_FILE, "extra_ids": vocab.extra_ids,
          "vocab_size": vocab.vocab_size, "eos_id": vocab.eos_id, "unk_id": vocab.unk_id,
          "pad_id": vocab.pad_id}


def check_shapes(shapes: list[Shape], config, vocab) -> None:
  """One-line errors for shapes the model cannot run."""
  if not shapes:
    raise UserError("no shapes to export: give --batch_sizes, --input_lengths and "
                    "--decode_lengths")
  for s in shapes:
    for name, v in (("batch size", s.batch), ("input length", s.input_length),
                    ("decode length", s.decode_length)):
      if v < 1:
        raise UserError(f"{name} {v} must be >= 1")
    if not config.is_encoder_decoder and s.input_length < 2:
      raise UserError(f"input length {s.input_length}: a decoder-only input needs >= 2 "
                      "positions (BOS and a prompt token)")
  if vocab is not None and vocab.vocab_size > config.vocab_size:
    raise UserError(f"the vocabulary has {vocab.vocab_size} ids but the model only "
                    f"{config.vocab_size}; export with the checkpoint's own vocabulary")


def check_output(out_dir: str) -> str:
  """The absolute output path (a bucket URL normalized); a UserError if it exists and is
  not an empty directory, or names a bucket that does not exist."""
  if storage.is_remote(out_dir):
    return storage.check_new_output(out_dir)
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise UserError(f"{out_dir}: exists and is not empty; choose a new output directory")
  return out_dir


def export_jax(model, params: dict, vocab, out_dir: str, *, shapes: list[Shape],
               methods: tuple[str, ...] = ("greedy",), num_beams: int | None = None,
               platforms: tuple[str, ...] | None = None, source: dict | None = None,
               log=print) -> dict:
  """Exports `model`'s generate functions with `params` and `vocab` into `out_dir`.

  Args:
    model: a `t5forge.models.BaseModel`.
    params: its parameter tree (arrays of any placement; copied to host).
    vocab: its vocabulary (SentencePiece), or None (the artifact then takes token ids).
    out_dir: a directory to create (must not exist or be empty).
    shapes: the (batch, input length, decode length) shapes to export.
    methods: any of 'greedy', 'sample', 'beam'.
    num_beams: beam search's beam size (with 'beam' only; default 4).
    platforms: jax.export platforms (default: this machine's backend), e.g. ('cpu', 'cuda').
    source: provenance to record (checkpoint path, format, step).

  Returns:
    The manifest (also written as manifest.json).
  """
  num_beams = check_methods(methods, num_beams)
  config = model.config
  check_shapes(shapes, config, vocab)
  out_dir = check_output(out_dir)
  # Written into a temporary sibling renamed into place: complete or absent.
  with files.staged_dir(out_dir, last=(MANIFEST_FILE,)) as tmp:
    os.makedirs(os.path.join(tmp, "functions"))
    flat = flatten_params(jax.device_get(params))
    from safetensors.numpy import save_file  # noqa: PLC0415 (slow or optional import, on first use)
    save_file(flat, os.path.join(tmp, PARAMS_FILE), metadata={"format": FORMAT})
    vocab_entry = write_vocabulary(vocab, tmp)
    with open(loader.__file__, "rb") as f:
      files.write_bytes(os.path.join(tmp, LOADER_FILE), f.read())
    files.write_text(os.path.join(tmp, REQUIREMENTS_FILE),
                     "".join(line + "\n" for line in loader_requirements()))
    param_avals = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}
    functions = []
    for method in methods:
      for shape in shapes:
        start = time.perf_counter()
        specs = arg_specs(method, shape)
        avals = [jax.ShapeDtypeStruct(tuple(a["shape"]), np.dtype(a["dtype"])) for a in specs]
        fn = jax.jit(generate_fn(model, method, shape.decode_length,
                                 num_beams or DEFAULT_NUM_BEAMS))
        exported = jax.export.export(fn, platforms=platforms)(param_avals, *avals)
        name = (f"functions/{method}_b{shape.batch}_i{shape.input_length}"
                f"_l{shape.decode_length}.jaxexp")
        files.write_bytes(os.path.join(tmp, name), exported.serialize())
        functions.append({
            "method": method, **dataclasses.asdict(shape), "file": name, "args": specs,
            "outputs": [{"name": "tokens", "shape": [shape.batch, shape.decode_length],
                         "dtype": "int32"},
                        {"name": "scores", "shape": [shape.batch], "dtype": "float32"}],
            "platforms": list(exported.platforms)})
        log(f"exported {method} b={shape.batch} i={shape.input_length} "
            f"l={shape.decode_length} in {time.perf_counter() - start:.1f}s")
    eos = int(vocab.eos_id) if vocab is not None else int(model.eos_id)
    # Every id that ends a row (the exported loops stop on all of them: `model.stop_ids`,
    # e.g. T5Gemma's <end_of_turn> 107 beside EOS); the loader cuts rows at any of them.
    stops = [int(i) for i in np.reshape(model.stop_ids, -1)]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "jax_version": jax.__version__,
        "model": {"architecture": config.architecture,
                  "is_encoder_decoder": bool(config.is_encoder_decoder),
                  "vocab_size": config.vocab_size, "emb_dim": config.emb_dim,
                  "num_heads": config.num_heads, "num_encoder_layers": config.num_encoder_layers,
                  "num_decoder_layers": config.num_decoder_layers, "dtype": config.dtype,
                  "num_parameters": int(sum(v.size for v in flat.values()))},
        "source": source or {},
        "eos_id": eos, "eos_ids": list(dict.fromkeys([eos] + stops)), "pad_id": 0,
        "num_beams": num_beams,  # the beam functions' beam size; None without beam
        "vocabulary": vocab_entry,
        "parameters": {"file": PARAMS_FILE,
                       "tree": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                                for k, v in flat.items()}},
        "functions": functions,
        "loader": LOADER_FILE,
        "requirements": REQUIREMENTS_FILE,
    }
    names = [PARAMS_FILE, LOADER_FILE, REQUIREMENTS_FILE] + (
        [VOCAB_FILE] if vocab_entry else []) + [f["file"] for f in functions]
    # The loader's own digest, so writer and reader cannot disagree on it.
    manifest["sha256"] = {n: loader.sha256_file(os.path.join(tmp, n)) for n in names}
    files.write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
    # safetensors writes its file private (0600); an artifact is for others to deploy.
    umask = os.umask(0)
    os.umask(umask)
    for n in names + [MANIFEST_FILE]:
      os.chmod(os.path.join(tmp, n), 0o666 & ~umask)
  return manifest
