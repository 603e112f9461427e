"""The Python API: `t5forge.load(path)` and the model object it returns.

    m = t5forge.load("path/to/flan-t5-base")      # HF dir, T5X checkpoint, or ours
    m.generate(["translate English to German: Hello"], method="beam", num_decodes=4)
    tokens, scores = m.predict(encoder_input_tokens, max_decode_length=64)
    m.score(["question ..."], ["answer ..."])      # summed log-likelihoods
    logits = m.logits(encoder_input_tokens, decoder_input_tokens)   # numpy [b, t, v]
    m.train_step([{"inputs": "...", "targets": "..."}])           # fine-tune a step
    m.save("out/")                                 # t5forge checkpoint
    m.save_hf("out-hf/")                           # loads in transformers

LoRA adapters (t5forge's or Hugging Face peft's format):

    m = t5forge.load("flan-t5-base", adapter="my-lora/")
    m.save_adapter("my-lora-peft/", format="peft")  # PeftModel.from_pretrained loads it
    m.merge_adapter()                              # now a plain model: W + scale * a @ b

Token conventions are T5's: id 0 is padding in the encoder input (masked there), and
the decoder input starts with 0 as BOS and attends causally.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import models, opener, presets
from t5forge import nn as t5nn
from t5forge.convert import LoadedCheckpoint, hf, native, peft
from t5forge.data import vocab_io
from t5forge.engine import offline
from t5forge.decoding import text_ids
from t5forge.errors import UserError
from t5forge.nn import adapters, lora
from t5forge.nn import prompt as prompt_lib
from t5forge.nn.config import ModelConfig
from t5forge.generation import Generator
from t5forge.predict import DecodeOptions, features_from_tokens
from t5forge.nn.stack import unstack_layers
from t5forge.sharding import Partitioner

# Text batches are padded to a multiple of this many tokens, so that a handful of
# compiled shapes serve any input.
_LENGTH_BUCKET = 32


def _as_tokens(x: Any, name: str, vocab_size: int) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
    raise UserError(f"{name} must be an integer array [batch, length], got "
                    f"{arr.dtype} with shape {arr.shape}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise UserError(f"{name} has ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}")
  return arr.astype(np.int32)


class Model:
  """A network, its parameters, and what was loaded with them.

  Attributes:
    config: the ModelConfig.
    params: parameter tree of jax arrays (float32).
    vocabulary: the text vocabulary (from the checkpoint), or None.
    source: where the parameters came from (path and format), for display.
  """

  def __init__(self, config: ModelConfig, params: dict, *, source: str = "",
               checkpoint: LoadedCheckpoint | None = None, vocabulary=None,
               partitioner: Partitioner | None = None, param_shardings=None):
    self.config = config
    self.source = source
    self.checkpoint = checkpoint
    self.network = t5nn.build(config)
    self.vocabulary = vocabulary
    self.model = models.model_for(config, vocabulary=vocabulary)
    self.partitioner = partitioner or Partitioner()
    if param_shardings is None:  # init(), or parameters handed in: place them by the rules
      params, param_shardings = opener.place_params(self.partitioner, self.model, params)
    self.params, self.param_shardings = params, param_shardings
    self.generator = Generator(self.model, partitioner=self.partitioner,
                               param_shardings=param_shardings)
    self._train = None  # (jitted step, state), made on the first train_step
    self._offline = None  # (key, engine.OfflineDecoder) of the last generate()

  def __repr__(self) -> str:
    c = self.config
    return (f"t5forge.Model({c.architecture}, {t5nn.count_params(self.params):,} params, "
            f"emb_dim={c.emb_dim}, layers={c.num_encoder_layers}/{c.num_decoder_layers}, "
            f"vocab={c.vocab_size}, from {self.source or 'random init'})")

  @functools.cached_property
  def _logits_fn(self):
    net = self.network
    if self.config.is_encoder_decoder:
      return jax.jit(lambda p, e, d: net.apply({"params": p}, e, d))
    return jax.jit(lambda p, d, c: net.apply({"params": p}, d, decoder_causal_attention=c))

  @functools.cached_property
  def _encode_fn(self):
    net = self.network
    return jax.jit(lambda p, e: net.apply({"params": p}, e, method=net.encode))

  def logits(self, *tokens, decoder_causal_attention=None) -> np.ndarray:
    """Teacher-forced logits.

    Encoder-decoder: `logits(encoder_input_tokens [b, i], decoder_input_tokens [b, t])`.
    Decoder-only: `logits(decoder_input_tokens [b, t], decoder_causal_attention=None)`,
    where decoder_causal_attention [b, t] marks a bidirectional prefix (prefix-LM).

    Returns:
      float32 numpy array [b, t, v].
    """
    v = self.config.vocab_size
    if self.config.is_encoder_decoder:
      if len(tokens) != 2:
        raise UserError("logits(encoder_input_tokens, decoder_input_tokens) takes two arrays "
                        "for an encoder-decoder model")
      enc = _as_tokens(tokens[0], "encoder_input_tokens", v)
      dec = _as_tokens(tokens[1], "decoder_input_tokens", v)
      if enc.shape[0] != dec.shape[0]:
        raise UserError(f"batch sizes differ: encoder {enc.shape[0]}, decoder {dec.shape[0]}")
      return np.asarray(self._logits_fn(self.params, enc, dec))
    if len(tokens) != 1:
      raise UserError("logits(decoder_input_tokens) takes one array for a decoder-only model")
    dec = _as_tokens(tokens[0], "decoder_input_tokens", v)
    causal = None if decoder_causal_attention is None else np.asarray(
        decoder_causal_attention, np.int32).reshape(dec.shape)
    return np.asarray(self._logits_fn(self.params, dec, causal))

  def encode(self, encoder_input_tokens) -> np.ndarray:
    """Encoder output [b, i, e] (float32 numpy)."""
    if not self.config.is_encoder_decoder:
      raise UserError("encode() needs an encoder-decoder model")
    enc = _as_tokens(encoder_input_tokens, "encoder_input_tokens", self.config.vocab_size)
    return np.asarray(self._encode_fn(self.params, enc), dtype=np.float32)

  # -- decoding, scoring, text -----------------------------------------------------------
  def predict(self, tokens, max_decode_length: int = 64, **decoding) -> tuple[np.ndarray, np.ndarray]:
    """Decodes from integer arrays (for checks against other implementations).

    Encoder-decoder: tokens are encoder_input_tokens [b, i] (0 = padding). Decoder-only:
    tokens are decoder prompts [b, t]: 0 as BOS, then the prompt, then 0 padding.

    Args:
      max_decode_length: new tokens to decode.
      **decoding: DecodeOptions fields: method ('greedy', 'sample', 'beam'),
        num_decodes (or beam_size), temperature, topk, topp, alpha, max_decode_steps,
        min_log_prob (beam only), seed, return_all_decodes.

    Returns:
      (tokens [b, max_decode_length] int32, 0 after EOS, scores [b]) as numpy; with
      return_all_decodes, [b, n, l] and [b, n] sorted by score (best last).
    """
    opts = DecodeOptions.from_kwargs(**decoding)
    arr = _as_tokens(tokens, "tokens", self.config.vocab_size)
    if self.config.is_encoder_decoder:
      batch = {"encoder_input_tokens": arr,
               "decoder_input_tokens": np.zeros((arr.shape[0], max_decode_length), np.int32)}
    else:
      batch = {"decoder_input_tokens": arr}
    return self.generator.predict(batch, opts, params=self.params,
                                  max_decode_length=max_decode_length)

  def _vocab(self):
    if self.vocabulary is None:
      raise UserError("this model has no vocabulary (none was saved with the checkpoint); "
                      "pass one: t5forge.load(path, vocabulary=t5forge.data."
                      "SentencePieceVocabulary('spiece.model', extra_ids=100))")
    return self.vocabulary

  def _token_rows(self, texts, max_length: int | None) -> tuple[list[list[int]], int]:
    """Texts (or token lists) -> token lists ending in EOS, cut to max_length (EOS
    kept); -> (rows, how many were cut)."""
    eos = self.vocabulary.eos_id if self.vocabulary is not None else 1  # T5's EOS
    rows, truncated = [], 0
    for t in texts:
      ids = list(t) if not isinstance(t, str) else self._vocab().encode(t)
      ids = ids + [eos]
      if max_length and len(ids) > max_length:
        ids, truncated = ids[:max_length - 1] + [eos], truncated + 1
      rows.append(ids)
    return rows, truncated

  def _encode_texts(self, texts, max_length: int | None) -> tuple[np.ndarray, int]:
    """Texts (or token lists) -> [b, bucketed length] with EOS; returns #truncated."""
    rows, truncated = self._token_rows(texts, max_length)
    width = -(-max(len(r) for r in rows) // _LENGTH_BUCKET) * _LENGTH_BUCKET
    arr = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
      arr[i, :len(r)] = r
    return arr, truncated

  def _engine(self, num_slots: int, decode_length: int, width: int):
    """The engine for inputs up to `width` tokens, kept for the next call
    (`decode(params=...)` takes the parameters a `train_step` or an assignment left).

    One engine at a time, reused by every call whose inputs fit it: its smaller encoder
    buckets (`offline.input_buckets`) serve shorter inputs with the shapes it compiled. A
    longer input replaces it with one at the next power of two (never narrower than the
    one it replaces), so a loop over texts of mixed lengths builds at most
    log2(longest / 32) + 1 engines in all, instead of one per call whose longest text
    changes its 32-token bucket.
    """
    if self._offline is not None:
      (slots, length, widest), dec = self._offline
      if (slots, length) == (num_slots, decode_length) and widest >= width:
        return dec
      dec.close()
      self._offline = None
      if (slots, length) == (num_slots, decode_length):
        width = max(width, widest)
    widest = max(_LENGTH_BUCKET, 1 << (width - 1).bit_length())
    dec = offline.OfflineDecoder(self.model, self.params, num_slots=num_slots,
                                 decode_length=decode_length, input_length=widest,
                                 partitioner=self.partitioner)
    self._offline = ((num_slots, decode_length, widest), dec)
    return dec

  def generate(self, texts, *, max_decode_length: int = 64, batch_size: int = 32,
               max_input_length: int | None = 512, **decoding) -> list:
    """Strings in, strings out.

    Greedy and sampled decodes of an encoder-decoder model run on the engine
    (`t5forge.engine.OfflineDecoder`): batch_size rows decode at once and a finished row's
    slot takes the next text at once; a sampled text depends on the seed and its place in
    `texts` only. Beam search and decoder-only models decode in padded batches of
    batch_size.

    Encoder-decoder: each text is an input. Decoder-only: each text is a prompt that is
    continued. Decoding stops at EOS or after max_decode_length tokens. Inputs longer
    than max_input_length tokens are truncated (a warning says how many).

    Returns:
      one string per text; with return_all_decodes, a list of strings per text (best
      last).
    """
    if isinstance(texts, str):
      raise UserError("generate() takes a list of strings; wrap a single text in a list")
    vocab, out, cut = self._vocab(), [], 0
    opts = DecodeOptions.from_kwargs(**decoding)
    # Several stop ids (ModelConfig.eos_token_ids): <end_of_turn> ends the text, not in it.
    text = lambda t: vocab.decode(text_ids(t, self.model.stop_ids))
    if offline.supports(self.model, opts) and len(texts):
      # Every text feeds the engine's batch_size slots as they free up.
      rows, cut = self._token_rows(texts, max_input_length)
      engine = self._engine(batch_size, max_decode_length, max(len(r) for r in rows))
      tokens, _ = engine.decode(rows, opts, params=self.params)
      chunks = [tokens]
    else:
      chunks = []
      for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        arr, n = self._encode_texts(chunk, max_input_length)
        if not self.config.is_encoder_decoder:
          arr = np.where(arr == vocab.eos_id, 0, arr)  # a prompt continues: no EOS
          arr = np.pad(arr, ((0, 0), (1, 0)))  # BOS
        cut += n
        chunks.append(self.predict(arr, max_decode_length, **dataclasses.asdict(opts))[0])
    for tokens in chunks:
      if tokens.ndim == 3:
        out += [[text(t) for t in row] for row in tokens.tolist()]
      else:
        out += [text(t) for t in tokens.tolist()]
    if cut:
      warnings.warn(f"{cut} of {len(texts)} inputs were longer than {max_input_length} tokens "
                    "and were truncated (raise max_input_length)", stacklevel=2)
    return out

  def _text_batch(self, inputs, targets, max_length):
    if len(inputs) != len(targets):
      raise UserError(f"{len(inputs)} inputs but {len(targets)} targets; pass one target each")
    x, _ = self._encode_texts(inputs, max_length)
    y, _ = self._encode_texts(targets, max_length)
    xs = [[t for t in row if t] for row in x]
    ys = [[t for t in row if t] for row in y]
    return features_from_tokens(xs, ys, encoder_decoder=self.config.is_encoder_decoder,
                                input_length=x.shape[1], target_length=y.shape[1],
                                eos=self.vocabulary.eos_id if self.vocabulary else 1,
                                rows=len(xs))

  def score(self, inputs, targets, *, batch_size: int = 32,
            max_length: int | None = None) -> np.ndarray:
    """Summed log-probability of each target (EOS included) given its input, [n].

    inputs / targets: strings (encoded with the model's vocabulary) or token lists.
    """
    out = []
    for start in range(0, len(inputs), batch_size):
      batch = self._text_batch(inputs[start:start + batch_size],
                               targets[start:start + batch_size], max_length)
      out.append(self.generator.score_batch(batch, params=self.params))
    return np.concatenate(out) if out else np.zeros((0,), np.float32)

  def train_step(self, examples, *, learning_rate: float = 1e-3, optimizer=None,
                 max_length: int | None = 512) -> dict[str, float]:
    """One optimizer step on [{'inputs': ..., 'targets': ...}, ...] (T5X's
    InteractiveModel.train_step, simpler). The optimizer (default Adafactor at a
    constant learning rate) is made on the first call and kept.

    Returns:
      {'loss': per-target-token loss, 'accuracy': ...} of this batch before the update.
    """
    from t5forge.train import optim  # noqa: PLC0415 (the trainer and optax load on first use)
    from t5forge.train.state import create  # noqa: PLC0415 (the trainer, on first use)
    from t5forge.train.step import make_train_step  # noqa: PLC0415 (the trainer, on first use)
    if not examples:
      raise UserError("train_step() needs at least one example")
    batch = self._text_batch([e["inputs"] for e in examples], [e["targets"] for e in examples],
                             max_length)
    if self._train is None:
      spec = optimizer or optim.Adafactor()
      tx = spec.build(lambda _: jnp.float32(learning_rate), self.model.logical_axes())
      step_fn = jax.jit(make_train_step(self.model, tx), donate_argnums=(0,))
      self._train = [step_fn, create(self.params, tx)]
    step_fn, state = self._train
    state, sums = step_fn(state, batch)
    self._train[1] = state
    # Back onto the placement the prediction functions are compiled for.
    self.params = jax.device_put(state.params, self.param_shardings)
    sums = jax.device_get(sums)
    return {"loss": float(sums["cross_ent_loss"] / max(sums["weight_sum"], 1e-9)),
            "accuracy": float(sums["accuracy_correct"] / max(sums["accuracy_count"], 1e-9)),
            "step": int(state.step)}

  # -- saving -------------------------------------------------------------------------------
  def _refuse_int8(self, what: str) -> None:
    if self.config.weight_dtype != "float32":
      raise UserError(f"{what}: this model was loaded with weight_dtype="
                      f"{self.config.weight_dtype!r}; load it without weight_dtype to save "
                      "full-precision weights")

  def save(self, path: str) -> None:
    """Writes a t5forge checkpoint directory (orbax), with the vocabulary."""
    self._refuse_int8("save")
    native.save(path, self.config, self.params,
                extra_config={"vocabulary": vocab_io.to_spec(self.vocabulary)})

  def save_hf(self, path: str) -> None:
    """Writes an HF directory that `T5ForConditionalGeneration.from_pretrained` (a T5Gemma
    model: `T5GemmaForConditionalGeneration`) loads, with the tokenizer of the model's
    vocabulary (`AutoTokenizer.from_pretrained`)."""
    self._refuse_int8("save_hf")
    if adapters.has_adapter(self.params):
      raise UserError("save_hf: this model has a LoRA adapter, which an HF checkpoint has no "
                      "place for; call merge_adapter() first, or save_adapter(DIR, "
                      "format='peft') for the adapter alone")
    tok_dir = self.checkpoint.path if self.checkpoint and self.checkpoint.format == "hf" else None
    for note in hf.save_hf(jax.tree.map(np.asarray, self.params), self.config, path,
                           vocabulary=self.vocabulary, tokenizer_dir=tok_dir):
      print(f"note: {note}")

  # -- adapters -----------------------------------------------------------------------------
  def _adapter_parts(self, what: str, *, prompt: bool = False) -> tuple[dict, dict]:
    adapter, base = adapters.split(self.params)
    has = self.config.lora is not None or (prompt and self.config.prompt is not None)
    if not adapters.has_adapter(self.params) or not has:
      kind = "LoRA or prompt" if prompt else "LoRA"
      raise UserError(f"{what}: this model has no {kind} adapter; load one with "
                      "t5forge.load(base, adapter=DIR)" + (
                          "" if prompt or self.config.prompt is None else
                          " (a tuned prompt stays a prompt: it is not merged into weights)"))
    return adapter, base

  def _base_name(self) -> str:
    return self.checkpoint.path if self.checkpoint is not None else self.source

  def save_adapter(self, path: str, *, format: str = "t5forge") -> None:
    """Writes the LoRA adapter (or tuned prompt) alone: `format='t5forge'` (ours, with the
    base's path and fingerprint, `nn.adapters.save`) or `'peft'` (`adapter_config.json` +
    `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` loads; a prompt as
    peft's PROMPT_TUNING)."""
    if format not in ("t5forge", "peft"):
      raise UserError(f"save_adapter(format={format!r}): choose 't5forge' or 'peft'")
    adapter, base = self._adapter_parts("save_adapter", prompt=True)
    adapter, base = jax.device_get(adapter), jax.device_get(base)
    if self.config.scan_layers:
      adapter, base = unstack_layers(adapter), unstack_layers(base)
    if self.config.lora is None:  # a tuned prompt
      plain = self.config.replace(scan_layers=False)
      if format == "peft":
        prompt_lib.to_peft(path, prompt_lib.get_prompt(adapter), plain,
                           base_model_name_or_path=self._base_name())
      else:
        adapters.save(path, adapter, model_config=plain.to_dict(),
                      record=peft.base_record(self._base_name(), base, plain))
      return
    # Unscanned, with the ranks and scales the model runs (a scan: layer 0's everywhere).
    plain = self.config.replace(scan_layers=False,
                                lora=peft.as_unscanned(self.config.lora, self.config))
    if format == "peft":
      peft.write_peft(path, plain.lora, adapter, plain, base_name=self._base_name())
    else:
      adapters.save(path, adapter, model_config=plain.to_dict(),
                    record=peft.base_record(self._base_name(), base, plain))

  def merge_adapter(self) -> "Model":
    """Merges the LoRA adapter into the kernels (W + scale * lora_a @ lora_b) and becomes
    the plain model of the base's config; returns self."""
    self._adapter_parts("merge_adapter")
    if self.config.weight_dtype != "float32":
      raise UserError(f"merge_adapter: the base is stored as {self.config.weight_dtype}; load "
                      "it in float32 to merge (a merged int8 kernel would be requantised)")
    merged = lora.merge(jax.device_get(self.params), self.config.lora)
    for cached in ("_logits_fn", "_encode_fn"):
      self.__dict__.pop(cached, None)
    if self._offline is not None:
      self._offline[1].close()
    self.__init__(self.config.replace(lora=None), merged, source=self.source,
                  checkpoint=self.checkpoint, vocabulary=self.vocabulary,
                  partitioner=self.partitioner)
    return self


def load(path: str, *, vocabulary=None, partitioner: Partitioner | None = None,
         adapter: str | None = None, base_dtype: str | None = None, **overrides) -> Model:
  """Loads a model from a t5forge checkpoint or MODEL_DIR, an HF directory (or Hub name),
  or a T5X checkpoint.

  Args:
    path: a t5forge checkpoint or MODEL_DIR (its newest intact checkpoint,
      `convert.paths.resolve`), an HF directory or Hub name, or a T5X checkpoint; a
      t5forge checkpoint is restored straight onto `partitioner`'s mesh (`opener`).
    vocabulary: the text vocabulary; default the one saved with a t5forge checkpoint or
      the spiece.model / ByT5 tokenizer of an HF directory.
    partitioner: mesh and rules to place the parameters on (`t5forge.sharding.
      Partitioner`, e.g. `Partitioner(num_partitions=2)`); default all devices, T5X's
      standard rules.
    adapter: a LoRA adapter directory to apply to the checkpoint: ours (`save_adapter`,
      a training run's adapter checkpoint) or Hugging Face peft's; ours is checked against
      the fingerprint of the base it was trained on.
    base_dtype: keep the weights as a frozen base for adapters: 'bfloat16' or 'int8'
      projection kernels, the rest float32 (`nn.adapters.store_base`); an HF checkpoint is cast
      tensor by tensor as it is read, so a model whose float32 copy does not fit in RAM
      loads. None: as stored.
    **overrides: runtime config fields, e.g. dtype='bfloat16', scan_layers=True.
  """
  opened = opener.open_checkpoint(path, vocabulary=vocabulary, overrides=overrides,
                                  partitioner=partitioner, base_dtype=base_dtype)
  if adapter is not None:
    opened = opener.with_adapter(opened, adapter)
  ckpt = opened.checkpoint
  return Model(opened.config, opened.params, source=f"{ckpt.format}:{ckpt.path}",
               checkpoint=ckpt, vocabulary=opened.vocabulary, partitioner=opened.partitioner,
               param_shardings=opened.param_shardings)


def init(config: ModelConfig | str, *, seed: int = 0, vocabulary=None, **overrides) -> Model:
  """A randomly initialised model from a config or a preset name (see `t5forge.presets`)."""
  if isinstance(config, str):
    config = presets.get(config, **overrides)
  elif overrides:
    config = config.replace(**overrides)
  return Model(config, t5nn.init_params(config, jax.random.key(seed)), vocabulary=vocabulary)
