"""What the benchmark measures: model shapes, run plans, batches and matmul FLOP counts.

Import-light on purpose (numpy only): the driver process reads this module and never
imports JAX or torch; the workers read it too, so that every framework gets the same
shapes and the same random tokens.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

PAD, EOS, UNK = 0, 1, 2  # T5's ids; also the three words of the benchmark tokenizer


@dataclasses.dataclass(frozen=True)
class Shape:
  """An HF T5 shape (T5Config field names); gated-GELU as in Flan-T5."""

  name: str
  vocab_size: int
  d_model: int
  d_kv: int
  num_heads: int
  d_ff: int
  num_layers: int
  num_decoder_layers: int
  dropout_rate: float = 0.1

  def hf_config(self) -> dict:
    """Fields for `transformers.T5Config` (untied output layer, like flan-t5)."""
    return {
        "vocab_size": self.vocab_size, "d_model": self.d_model, "d_kv": self.d_kv,
        "num_heads": self.num_heads, "d_ff": self.d_ff, "num_layers": self.num_layers,
        "num_decoder_layers": self.num_decoder_layers, "feed_forward_proj": "gated-gelu",
        "dropout_rate": self.dropout_rate, "tie_word_embeddings": False,
        "pad_token_id": PAD, "eos_token_id": EOS, "decoder_start_token_id": PAD,
    }

  def cache_key(self, seed: int) -> str:
    """Directory name under the cache: changes whenever the config or seed does."""
    digest = hashlib.sha1(json.dumps([self.hf_config(), seed, "v1"], sort_keys=True)
                          .encode()).hexdigest()[:10]
    return f"{self.name}-seed{seed}-{digest}"


SHAPES = {
    # --quick only: small enough that every worker compiles in seconds.
    "tiny": Shape("t5-tiny", vocab_size=1024, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                  num_layers=2, num_decoder_layers=2),
    "small": Shape("flan-t5-small", vocab_size=32128, d_model=512, d_kv=64, num_heads=6,
                   d_ff=1024, num_layers=8, num_decoder_layers=8),
    "base": Shape("flan-t5-base", vocab_size=32128, d_model=768, d_kv=64, num_heads=12,
                  d_ff=2048, num_layers=12, num_decoder_layers=12),
}


@dataclasses.dataclass(frozen=True)
class T5GemmaShape:
  """A T5Gemma encoder-decoder shape (HF T5GemmaModuleConfig field names), the same stack
  for encoder and decoder (the S-S, B-B, ... sizes). Everything else is the released
  configs' (Gemma 2's): soft-caps 50 / 30, sliding window 4096 on every other layer,
  query_pre_attn_scalar = head_dim, RoPE theta 10,000, tied decoder embedding, BOS 2,
  no dropout."""

  name: str
  preset: str  # the t5forge preset of this shape (checked against what t5forge.load reads)
  vocab_size: int
  hidden_size: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  num_hidden_layers: int
  sliding_window: int = 4096
  bos_id: int = 2  # the decoder's start token

  def hf_config(self) -> dict:
    """Fields for `transformers.T5GemmaConfig`; `model_type` selects the builder."""
    module = {
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "query_pre_attn_scalar": self.head_dim, "sliding_window": self.sliding_window,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "pad_token_id": PAD, "eos_token_id": EOS,
        "bos_token_id": self.bos_id}
    return {"model_type": "t5gemma", "encoder": dict(module), "decoder": dict(module),
            "vocab_size": self.vocab_size, "tie_word_embeddings": True, "dropout_rate": 0.0,
            "attention_dropout": 0.0, "pad_token_id": PAD, "eos_token_id": EOS,
            "bos_token_id": self.bos_id}

  def cache_key(self, seed: int) -> str:
    digest = hashlib.sha1(json.dumps([self.hf_config(), seed, "v1"], sort_keys=True)
                          .encode()).hexdigest()[:10]
    return f"{self.name}-seed{seed}-{digest}"

  def as_t5_shape(self) -> Shape:
    """The T5 `Shape` whose matmuls are the same (for forward_matmul_macs): MHA only."""
    if self.num_key_value_heads != self.num_attention_heads:
      raise ValueError(f"{self.name}: FLOP count written for kv heads == heads")
    return Shape(self.name, vocab_size=self.vocab_size, d_model=self.hidden_size,
                 d_kv=self.head_dim, num_heads=self.num_attention_heads,
                 d_ff=self.intermediate_size, num_layers=self.num_hidden_layers,
                 num_decoder_layers=self.num_hidden_layers, dropout_rate=0.0)


T5GEMMA_SHAPES = {
    # --quick only: a Gemma-shaped toy (window 8 < the quick lengths, so local and global
    # layers differ).
    "tiny": T5GemmaShape("t5gemma-tiny", preset="t5gemma.tiny", vocab_size=32128,
                         hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=16, intermediate_size=128, num_hidden_layers=2,
                         sliding_window=8),
    # google/t5gemma-s-s-{prefixlm,ul2}: the released shape, Gemma 2's 256k vocabulary.
    "s-s": T5GemmaShape("t5gemma-s-s", preset="t5gemma.s-s", vocab_size=256000,
                        hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                        head_dim=64, intermediate_size=1024, num_hidden_layers=8),
}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes of every case. `FULL` is the full benchmark; `QUICK` a smoke test."""

  rounds: int = 3  # timed runs per job, alternated round-robin between workers
  warmup_runs: int = 1  # untimed runs after the first (compiling) one, at least ...
  max_warmup_runs: int = 5  # ... and more until two in a row agree within 10%
  matmul_sizes: tuple[int, ...] = (2048, 4096)
  matmul_seconds: float = 0.4  # a timed matmul run repeats the product for about this long
  train_batch: int = 8
  train_lengths: tuple[int, int] = (512, 114)  # inputs, targets
  decode_input_length: int = 128
  new_tokens: int = 64
  decode_batches: tuple[int, ...] = (1, 16)  # greedy
  beam_size: int = 4  # beam rows decode batch 1
  scaling_batches: tuple[int, ...] = (4, 8, 16)  # at train_lengths
  scaling_lengths: tuple[tuple[int, int], ...] = ((256, 57), (512, 114), (1024, 228))
  scaling_batch: int = 8  # batch of the length series
  data_batches: int = 150
  data_batch_size: int = 32
  # T5Gemma (`python -m bench t5gemma`): its 256k vocabulary makes the output layer ~8x
  # flan-t5-small's, so the training batch is halved and decoding makes 32 tokens.
  t5gemma_size: str = "s-s"
  t5gemma_train_batch: int = 4
  t5gemma_train_lengths: tuple[int, int] = (512, 128)
  t5gemma_decode_input_length: int = 128
  t5gemma_new_tokens: int = 32
  t5gemma_decode_batches: tuple[int, ...] = (1, 16)


FULL = Plan()
QUICK = Plan(rounds=1, warmup_runs=1, max_warmup_runs=3, matmul_sizes=(256, 512),
             matmul_seconds=0.05,
             train_batch=2, train_lengths=(64, 16), decode_input_length=32, new_tokens=16,
             decode_batches=(1, 4), scaling_batches=(2, 4), scaling_lengths=((32, 8), (64, 16)),
             scaling_batch=4, data_batches=10, t5gemma_size="tiny", t5gemma_train_batch=2,
             t5gemma_train_lengths=(24, 12), t5gemma_decode_input_length=16,
             t5gemma_new_tokens=8, t5gemma_decode_batches=(1, 4))


def random_tokens(seed: int, batch: int, length: int, vocab_size: int, *,
                  end_with_eos: bool) -> np.ndarray:
  """[batch, length] int32 ids in [3, vocab): no padding, EOS, or unknown token inside;
  the last position is EOS when end_with_eos (an encoder input as T5 sees it)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab_size, size=(batch, length)).astype(np.int32)
  if end_with_eos:
    tokens[:, -1] = EOS
  return tokens


def train_batch(vocab_size: int, batch: int, input_length: int, target_length: int,
                seed: int = 0) -> dict[str, np.ndarray]:
  """Unpadded random features: encoder inputs [b, i], targets [b, t] and the decoder
  inputs (targets shifted right behind BOS 0, as HF does with `labels`)."""
  enc = random_tokens(seed, batch, input_length, vocab_size, end_with_eos=True)
  targets = random_tokens(seed + 1, batch, target_length, vocab_size, end_with_eos=True)
  dec_in = np.zeros_like(targets)
  dec_in[:, 1:] = targets[:, :-1]
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in,
          "decoder_target_tokens": targets,
          "decoder_loss_weights": np.ones(targets.shape, np.float32)}


def forward_matmul_macs(shape: Shape, batch: int, input_length: int,
                        target_length: int) -> int:
  """Multiply-accumulates of the matmuls of one teacher-forced forward pass.

  Counted: every dense projection (q, k, v, o; the two gated-MLP inputs and its
  output), attention scores Q K^T and the weighted sum A V (dense over the full key
  length, as every implementation here computes them), cross-attention keys and values
  of the encoder output, and the output layer. Not counted: embeddings (gathers),
  norms, softmax, relative position bias, the loss.
  """
  d, f, v = shape.d_model, shape.d_ff, shape.vocab_size
  inner = shape.num_heads * shape.d_kv
  i, t = input_length, target_length
  mlp = 3 * d * f  # wi_0, wi_1, wo per token
  enc_layer = i * (4 * d * inner + mlp) + 2 * i * i * inner
  dec_layer = (t * (4 * d * inner) + 2 * t * t * inner  # self-attention
               + t * 2 * d * inner + i * 2 * d * inner  # cross q, o; k, v of the encoder
               + 2 * t * i * inner  # cross scores and values
               + t * mlp)
  output = t * d * v
  return batch * (shape.num_layers * enc_layer + shape.num_decoder_layers * dec_layer + output)


def train_matmul_flops(shape: Shape, batch: int, input_length: int, target_length: int) -> int:
  """Matmul FLOPs of one training step: 2 FLOPs per MAC, x3 for forward + backward
  (the backward pass computes two products of the forward's size per matmul)."""
  return 3 * 2 * forward_matmul_macs(shape, batch, input_length, target_length)
