"""Decoding flags shared by `t5forge infer` and `t5forge eval`."""
from __future__ import annotations

import argparse

from t5forge.predict import DecodeOptions


def add(parser: argparse.ArgumentParser) -> None:
  g = parser.add_argument_group("decoding")
  g.add_argument("--method", choices=["greedy", "sample", "beam"], default=None,
                 help="default greedy; 'sample' if a sampling option is given")
  g.add_argument("--num_decodes", type=int, default=None, help="samples or beams per input")
  g.add_argument("--beam_size", type=int, default=None, help="beam search with this many beams")
  g.add_argument("--temperature", type=float, default=None)
  g.add_argument("--topk", type=int, default=None)
  g.add_argument("--topp", type=float, default=None)
  g.add_argument("--alpha", type=float, default=None, help="beam brevity penalty exponent")
  g.add_argument("--max_decode_steps", type=int, default=None,
                 help="decode at most this many new tokens (any method)")
  g.add_argument("--min_log_prob", type=float, default=None,
                 help="beam search: stop once the best live beam's log-prob is below this")
  g.add_argument("--seed", type=int, default=None)
  r = parser.add_argument_group("runtime (how the checkpoint is run, not what it holds)")
  r.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="matmul compute dtype; bfloat16: bf16 operands, float32 accumulation (default: the checkpoint's)")
  r.add_argument("--weight_dtype", choices=["float32", "int8"], default=None,
                 help="int8: weight-only int8 projection kernels, quantised on load")
  add_partitioning(parser)


def add_partitioning(parser: argparse.ArgumentParser) -> None:
  """--num_partitions / --parameter_partitioning_dims: the mesh the parameters are
  placed on (T5X's PjitPartitioner with its standard rules)."""
  g = parser.add_argument_group("partitioning (a model that needs several devices)")
  g.add_argument("--num_partitions", type=int, default=1,
                 help="size of the 'model' mesh axis; the 'data' axis gets the other devices")
  g.add_argument("--parameter_partitioning_dims", type=int, choices=[1, 2], default=1,
                 help="2: also shard parameters' embed axis over 'data' (2-D, FSDP-like)")


def partitioner(args: argparse.Namespace, *, per_process: bool = False):
  """The Partitioner of --num_partitions / --parameter_partitioning_dims over all devices;
  per_process: over this process's devices (infer: each process its own chunks)."""
  import jax  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.sharding import Partitioner, standard_logical_axis_rules  # noqa: PLC0415 (after the flags parse: --help stays fast)
  devices = jax.local_devices() if per_process and jax.process_count() > 1 else None
  return Partitioner(num_partitions=args.num_partitions, devices=devices,
                     logical_axis_rules=standard_logical_axis_rules(
                         parameter_partitioning_dims=args.parameter_partitioning_dims))


def runtime_overrides(args: argparse.Namespace) -> dict:
  """`load_checkpoint` overrides from --dtype / --weight_dtype."""
  return {k: getattr(args, k) for k in ("dtype", "weight_dtype")
          if getattr(args, k, None) is not None}


def options(args: argparse.Namespace) -> DecodeOptions:
  kw = {k: getattr(args, k) for k in ("method", "num_decodes", "beam_size", "temperature",
                                        "topk", "topp", "alpha", "max_decode_steps", "min_log_prob",
                                        "seed")}
  return DecodeOptions.from_kwargs(**{k: v for k, v in kw.items() if v is not None})
