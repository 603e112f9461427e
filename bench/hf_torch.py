"""Hugging Face transformers' side of the benchmark (PyTorch, eager, CPU); runs in an
`hf` worker (see bench/worker.py).

It also builds the shared weights (`op_prepare`): a random-init T5 from a config with
a fixed seed and a distinct output layer, saved as an HF directory that t5forge reads
with its HF reader and CTranslate2 converts. Conversion runs here, not in the ct2
worker, so that the ct2 worker never loads torch.

Threads: `torch.set_num_threads(2)` (this machine's cores). bf16 means
`torch.autocast("cpu", dtype=torch.bfloat16)` around the forward pass (training) or
`generate` (decoding); the weights stay float32, as in HF's own mixed-precision recipe.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import time

import numpy as np
import torch
import transformers

from bench import shapes

NUM_THREADS = 2
LEARNING_RATE = 1e-3
COMPLETE = "BENCH_COMPLETE"  # written last into a finished cache directory


def _autocast(dtype: str):
  if dtype == "bfloat16":
    return torch.autocast("cpu", dtype=torch.bfloat16)
  return contextlib.nullcontext()


def _model_class(model_dir: str):
  """T5ForConditionalGeneration, or T5GemmaForConditionalGeneration for a T5Gemma dir."""
  with open(os.path.join(model_dir, "config.json")) as f:
    model_type = json.load(f).get("model_type")
  return (transformers.T5GemmaForConditionalGeneration if model_type == "t5gemma"
          else transformers.T5ForConditionalGeneration)


def _load(model_dir: str):
  # eager attention: T5's relative bias and T5Gemma's attention-logit soft-cap are both
  # computed there (transformers' sdpa path has no soft-cap).
  return _model_class(model_dir).from_pretrained(
      model_dir, attn_implementation="eager", dtype=torch.float32)


def is_complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, COMPLETE))


def _write_tokenizer(out_dir: str) -> None:
  """A three-word WordLevel tokenizer: CTranslate2's T5 loader needs one, and pads the
  vocabulary with `<extra_id_N>` up to config.vocab_size (ids 3.. map to those)."""
  from tokenizers import Tokenizer
  from tokenizers.models import WordLevel
  vocab = {"<pad>": shapes.PAD, "</s>": shapes.EOS, "<unk>": shapes.UNK}
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
      pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
  tok.save_pretrained(out_dir)
  path = os.path.join(out_dir, "tokenizer_config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
  with open(path, "w") as f:
    json.dump(cfg, f, indent=2)


def build_hf_dir(out_dir: str, hf_config: dict, seed: int) -> None:
  """Random-init T5 (seeded) with a distinct lm_head, saved like a flan-t5 directory.

  transformers 5 ties the output layer to the embedding by default; as the real
  flan-t5 files do, the config says tie_word_embeddings false and model.safetensors
  holds its own `lm_head.weight` (normal, std 1: HF's init of an untied T5 output layer).
  """
  from safetensors.torch import load_file, save_file
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf_config))
  model.save_pretrained(out_dir)
  del model
  weights = os.path.join(out_dir, "model.safetensors")
  state = load_file(weights)
  gen = torch.Generator().manual_seed(seed + 1)
  state["lm_head.weight"] = torch.randn(hf_config["vocab_size"], hf_config["d_model"],
                                        generator=gen)
  save_file(state, weights, metadata={"format": "pt"})
  cfg_path = os.path.join(out_dir, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  cfg["tie_word_embeddings"] = False
  cfg.pop("scale_decoder_outputs", None)  # 4.x semantics: untied, logits not rescaled
  with open(cfg_path, "w") as f:
    json.dump(cfg, f, indent=2)
  _write_tokenizer(out_dir)
  # Check that transformers reads back a distinct, unscaled output layer (transformers 5
  # always sets config.tie_word_embeddings; it unties when the weights differ and records
  # the 4.x "false" as scale_decoder_outputs=False).
  model = _load(out_dir)
  if (getattr(model.config, "scale_decoder_outputs", False)
      or torch.equal(model.lm_head.weight, model.shared.weight)):
    raise RuntimeError(f"{out_dir}: transformers reads back a tied or rescaled output layer")


def build_t5gemma_dir(out_dir: str, hf_config: dict, seed: int) -> None:
  """Random-init T5GemmaForConditionalGeneration (transformers' own init, seeded), saved
  as a T5Gemma directory (nested encoder/decoder configs, tied decoder embedding). No
  tokenizer: the benchmark feeds token ids."""
  torch.manual_seed(seed)
  model = transformers.T5GemmaForConditionalGeneration(t5gemma_config(hf_config))
  model.save_pretrained(out_dir)


def t5gemma_config(hf_config: dict) -> "transformers.T5GemmaConfig":
  """`shapes.T5GemmaShape.hf_config()` as a transformers config."""
  cfg = {k: v for k, v in hf_config.items() if k != "model_type"}
  encoder = transformers.T5GemmaModuleConfig(**cfg.pop("encoder"))
  decoder = transformers.T5GemmaModuleConfig(**cfg.pop("decoder"))
  return transformers.T5GemmaConfig(encoder=encoder, decoder=decoder, **cfg)


def convert_ct2(hf_dir: str, out_dir: str, quantization: str | None) -> None:
  """CTranslate2 conversion of hf_dir.

  CTranslate2 4.8.5's T5 loader scales the decoder output by d_model**-0.5 whenever
  `config.tie_word_embeddings` is true, which transformers 5 now always reports; the
  loaded config is corrected to what the files say (untied, unscaled), or CTranslate2
  would compute logits d_model**0.5 times smaller than HF's (same greedy tokens,
  different beam scores).
  """
  import ctranslate2

  class Converter(ctranslate2.converters.TransformersConverter):
    def load_model(self, model_class, model_name_or_path, **kwargs):
      model = super().load_model(model_class, model_name_or_path, **kwargs)
      if getattr(model.config, "scale_decoder_outputs", None) is False:
        model.config.tie_word_embeddings = False
      return model

  Converter(hf_dir).convert(out_dir, quantization=quantization, force=True)


def _fresh(path: str) -> str:
  tmp = path + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.rmtree(path, ignore_errors=True)
  return tmp


def _finish(tmp: str, path: str) -> None:
  with open(os.path.join(tmp, COMPLETE), "w") as f:
    f.write("ok\n")
  os.replace(tmp, path)


class Backend:
  """Jobs of the `hf` worker."""

  def __init__(self):
    torch.set_num_threads(NUM_THREADS)
    transformers.logging.set_verbosity_error()
    self._models: dict[str, torch.nn.Module] = {}
    self._last_tokens: dict[str, np.ndarray] = {}

  # -- information and preparation ---------------------------------------------------
  def op_versions(self) -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "mkldnn_bf16": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported",
                                        lambda: False)()),
            "ctranslate2": importlib.metadata.version("ctranslate2")}

  def op_prepare(self, hf_dir: str, hf_config: dict, seed: int,
                 ct2_dirs: dict[str, str] | None = None) -> dict:
    """Builds the HF directory and CTranslate2 conversions that are not cached yet.

    Args:
      ct2_dirs: {quantization ('float32' or 'int8'): output directory}.
    """
    built = []
    if not is_complete(hf_dir):
      tmp = _fresh(hf_dir)
      if hf_config.get("model_type") == "t5gemma":
        build_t5gemma_dir(tmp, hf_config, seed)
      else:
        build_hf_dir(tmp, hf_config, seed)
      _finish(tmp, hf_dir)
      built.append(hf_dir)
    for quant, out in (ct2_dirs or {}).items():
      if is_complete(out):
        continue
      tmp = _fresh(out)
      convert_ct2(hf_dir, tmp, None if quant == "float32" else quant)
      _finish(tmp, out)
      built.append(out)
    return {"built": built}

  def op_tokens(self, tag: str) -> list:
    return self._last_tokens[tag].tolist()

  # -- matmul ------------------------------------------------------------------------
  def setup_matmul(self, n: int, dtype: str, seconds: float):
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dt)
    b = torch.randn(n, n, generator=gen).to(dt)
    torch.matmul(a, b)
    start = time.perf_counter()
    torch.matmul(a, b)
    reps = max(1, int(round(seconds / max(time.perf_counter() - start, 1e-6))))

    def run():
      for _ in range(reps):
        torch.matmul(a, b)

    return run, {"reps": reps, "flops_per_run": reps * 2 * n ** 3}

  # -- training ----------------------------------------------------------------------
  def setup_train(self, model_dir: str, dtype: str, optimizer: str, batch: int,
                  input_length: int, target_length: int, seed: int = 0):
    """forward (labels -> mean cross entropy) + backward + optimizer step, train mode
    (dropout on, as ours). Each run returns the loss (the first run's is reported)."""
    model = _load(model_dir).train()
    if optimizer == "adamw":
      opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    else:  # T5X's Adafactor settings: parameter scale, update clipping 1, decay 0.8
      opt = transformers.optimization.Adafactor(
          model.parameters(), lr=LEARNING_RATE, scale_parameter=True, relative_step=False,
          warmup_init=False, clip_threshold=1.0, decay_rate=-0.8, beta1=None)
    feats = shapes.train_batch(model.config.vocab_size, batch, input_length, target_length, seed)
    input_ids = torch.from_numpy(feats["encoder_input_tokens"]).long()
    labels = torch.from_numpy(feats["decoder_target_tokens"]).long()
    mask = torch.ones_like(input_ids)

    def run():
      with _autocast(dtype):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels,
                     use_cache=False).loss
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
      return {"loss": loss.item()}

    params = sum(p.numel() for p in model.parameters())
    return run, {"params": int(params)}

  # -- decoding ----------------------------------------------------------------------
  def setup_decode(self, tag: str, model_dir: str, dtype: str, method: str, batch: int,
                   beams: int, input_length: int, new_tokens: int, seed: int = 0,
                   decoder_start: int = shapes.PAD):
    """`generate` with min_new_tokens = max_new_tokens: exactly new_tokens tokens.

    Args:
      decoder_start: the decoder's first input (T5: pad 0; T5Gemma: BOS 2).
    """
    if model_dir not in self._models:
      self._models[model_dir] = _load(model_dir).eval()
    model = self._models[model_dir]
    tokens = shapes.random_tokens(seed, batch, input_length, model.config.vocab_size,
                                  end_with_eos=True)
    input_ids = torch.from_numpy(tokens).long()
    mask = torch.ones_like(input_ids)
    kwargs = dict(do_sample=False, num_beams=beams if method == "beam" else 1,
                  num_return_sequences=1, min_new_tokens=new_tokens,
                  max_new_tokens=new_tokens, pad_token_id=shapes.PAD,
                  eos_token_id=shapes.EOS, decoder_start_token_id=decoder_start,
                  use_cache=True)

    def run():
      with torch.inference_mode(), _autocast(dtype):
        out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
      if tuple(out.shape) != (batch, new_tokens + 1):  # + the decoder start token
        raise AssertionError(f"generated shape {tuple(out.shape)}, expected "
                             f"{(batch, new_tokens + 1)}")
      self._last_tokens[tag] = out[:, 1:].numpy()

    return run, {}
