"""Many prompts decoded at once on the engine: the Python API (`Model.generate`) and
`t5forge infer` feed their rows to the slots as slots free up, instead of padded static
batches that run as long as their longest row.

    dec = OfflineDecoder(model, params, num_slots=32, decode_length=64, input_length=512)
    tokens, scores = dec.decode(inputs, DecodeOptions(method="sample", seed=3))
    dec.close()

Greedy and sampled decodes of encoder-decoder models run here (`supports`); beam search
and decoder-only models stay on `generation.Generator.predict`, whose results' shapes
these are. Row r's sample j draws with key `fold_in(fold_in(key(seed), r * n + j), position)`:
its text depends on the seed and its place in the input list, never on the number of
slots or on which rows share a step.
"""
from __future__ import annotations

import jax
import numpy as np

from t5forge.engine.scheduler import Engine, Row
from t5forge.engine.slots import Slots, check_fits

_SMALLEST_BUCKET = 32  # shorter encoder buckets save little and cost a compile each


def supports(model, opts) -> bool:
  """Whether `OfflineDecoder` runs these options (`predict.DecodeOptions`) on `model`."""
  return (model.config.is_encoder_decoder and opts.method in ("greedy", "sample")
          and jax.process_count() == 1)


def input_buckets(length: int) -> tuple[int, ...]:
  """Encoder buckets for inputs of at most `length` tokens: `length`, then a quarter of
  it, and so on while >= 32 (a short prompt is not encoded at the longest width)."""
  out = [int(length)]
  while out[-1] // 4 >= _SMALLEST_BUCKET:
    out.append(-(-out[-1] // 4 // 8) * 8)
  return tuple(sorted(out))


class _Lazy(Engine):
  """An engine that compiles each insert shape on first use: an offline run meets only
  the few (row count, bucket) pairs its inputs need."""

  def _warmup(self) -> int:
    self.slots.reset()
    return 0


class OfflineDecoder:
  """The engine for one (decode length, input length, slot count), started on creation.

  Args:
    model, params: an encoder-decoder `EncoderDecoderModel` and its placed parameters.
    num_slots: rows decoding at once (the CLI's --batch_size).
    decode_length: l, tokens decoded at most per row.
    input_length: the longest encoder input (EOS included); longer inputs are an error
      here (callers truncate them first, as `predict.features_from_tokens` does).
    partitioner: the mesh the parameters are on.
  """

  def __init__(self, model, params, *, num_slots: int, decode_length: int, input_length: int,
               partitioner=None, steps: int = 4):
    # On a CPU an encoder row costs about the same alone as in a batch of 32, and each
    # (row count, bucket) pair is one more compile: rows are encoded 1 or 4 at a time.
    # An accelerator encodes a full batch for little more than one row.
    platform = (partitioner.mesh.devices.flat[0].platform if partitioner is not None
                else jax.devices()[0].platform)
    sizes = sorted({1, min(4, num_slots)} | ({num_slots} if platform != "cpu" else set()))
    self.slots = Slots(model, params, num_slots=num_slots, decode_length=decode_length,
                       input_buckets=input_buckets(input_length), encode_sizes=tuple(sizes),
                       steps=steps, partitioner=partitioner)
    check_fits(self.slots, flags="the batch size (--batch_size) or the decode length")
    # Every row of a call waits in the queue at once: the slots never drain between
    # parts of the input.
    self.engine = _Lazy(self.slots, max_queue=2 ** 31)
    self.engine.start()
    self.engine.ready.wait()

  def decode(self, inputs: list[list[int]], opts, *, params=None) -> tuple[np.ndarray, np.ndarray]:
    """Encoder inputs (each ending in EOS) -> (tokens [b, l] int32 with 0 after the stop
    id, scores [b]) as `Generator.predict`; [b, n, l] and [b, n] sorted by increasing
    score (best last) with `opts.return_all_decodes`.

    Args:
      opts: `predict.DecodeOptions` with method 'greedy' or 'sample'.
      params: parameters to decode with from now on (after a training step or for
        another checkpoint); the same shapes and placement compile nothing new.
    """
    if params is not None:
      self.slots.params = params
    length = self.slots.decode_length
    n = opts.num_decodes
    new_tokens = min(opts.max_decode_steps or length, length)
    temperature = 0.0 if opts.method == "greedy" else float(opts.temperature)
    rows = [Row(ids=list(ids), max_new_tokens=new_tokens, temperature=temperature,
                top_k=int(opts.topk), top_p=float(opts.topp) or 1.0, seed=int(opts.seed),
                sample=r * n + j)
            for r, ids in enumerate(inputs) for j in range(n)]
    # Longest first: rows admitted together mostly share an input bucket, so their
    # encoder batches are full; a result belongs to its row whatever the order.
    order = sorted(range(len(rows)), key=lambda k: -len(rows[k].ids))
    outs = [None] * len(rows)
    for k, out in zip(order, self.engine.generate([rows[k] for k in order])):
      outs[k] = out
    tokens = np.zeros((len(inputs), n, length), np.int32)
    scores = np.zeros((len(inputs), n), np.float32)
    for k, out in enumerate(outs):
      r, j = divmod(k, n)
      tokens[r, j, :len(out.tokens)] = out.tokens
      scores[r, j] = np.sum(np.asarray(out.logprobs, np.float32))
    order = np.argsort(scores, axis=1, kind="stable")  # best last
    tokens = np.take_along_axis(tokens, order[:, :, None], axis=1)
    scores = np.take_along_axis(scores, order, axis=1)
    if opts.return_all_decodes:
      return tokens, scores
    return tokens[:, -1], scores[:, -1]

  def close(self) -> None:
    self.engine.close()
