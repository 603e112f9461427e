"""`t5forge serve`: an OpenAI-compatible HTTP server for a checkpoint (docs/serving.md).

    t5forge serve --checkpoint MODEL_DIR                      # http://127.0.0.1:8000
    t5forge serve --checkpoint google/flan-t5-small --max_batch_size 16 --max_wait_ms 10
    t5forge serve --checkpoint ckpt --host 0.0.0.0 --api_key "$KEY"   # behind a TLS proxy
    t5forge serve --checkpoint base --adapter fr=lora-fr --adapter de=peft-de  # LoRA adapters

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
POST /v1/score, POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics,
GET / (a page to try the model). The buckets are compiled at start-up; /health answers
503 until they are, and the server prints one `ready at URL` line. SIGTERM stops taking
requests, finishes those in flight and exits 0.

Exit codes: 0 after SIGTERM; 1 the warm-up failed; 2 a bad flag or input (one
`t5forge: error:` line); 70 (EX_SOFTWARE) a worker thread died while serving: its
requests were answered with an error, /health said 503, and the server stopped so that
its supervisor (systemd Restart=on-failure, Kubernetes) starts a fresh one.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time

from t5forge.cli import decode_flags
from t5forge.errors import UserError


def _ints(flag: str, text: str) -> tuple[int, ...]:
  try:
    values = sorted({int(x) for x in text.split(",") if x.strip()})
  except ValueError:
    raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
  if not values or values[0] < 1:
    raise UserError(f"{flag} takes positive integers, got {text!r}")
  return tuple(values)


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _bind(host: str, port: int) -> socket.socket:
  """Binds the listening socket before anything slow, so a port in use is said at once;
  uvicorn then serves on this very socket (no window for another process to take it)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    if e.errno == errno.EADDRINUSE:
      raise UserError(f"port {port} on {host} is in use (another server?); stop it or pick "
                      "another with --port") from None
    raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
  sock.set_inheritable(True)
  return sock


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="t5forge serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="a t5forge checkpoint or MODEL_DIR (latest), "
                 "an HF directory or Hub name, or a T5X or Mesh TF checkpoint")
  p.add_argument("--vocabulary", default=None,
                 help="SentencePiece .model when the checkpoint carries none")
  p.add_argument("--model_name", default=None,
                 help="the name clients send as `model` (default: the checkpoint's base name)")
  p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                 help="serve a LoRA adapter of the checkpoint (t5forge's adapter directory or "
                 "training run, or HF peft's) as model NAME; repeatable: requests for any of "
                 "them and the base share batches (docs/serving.md)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
  p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
  p.add_argument("--chat_template", default=None,
                 help="a Jinja chat template file for /v1/chat/completions (default: the "
                 "checkpoint's chat_template.jinja or tokenizer_config.json chat_template)")
  p.add_argument("--api_key", default=None,
                 help="require `Authorization: Bearer KEY` on every route but /livez, /readyz, "
                 "/health and / (the key's name: default)")
  sec = p.add_argument_group("keys and rate limits (docs/serving.md)")
  sec.add_argument("--api_key_file", default=None,
                   help="named keys, one `name:key` a line (# comments); every route but "
                   "/livez, /readyz, /health and / then needs one of them")
  sec.add_argument("--requests_per_second", default=None,
                   help="per key: requests per second (a token bucket; bursts of up to one "
                   "second's worth); more get 429 + Retry-After")
  sec.add_argument("--tokens_per_minute", default=None,
                   help="per key: prompt + output tokens per minute; a key whose bucket is "
                   "empty gets 429 + Retry-After")
  sec.add_argument("--body_timeout_s", default="30",
                   help="a request body not received whole within this many seconds gets 408")
  sec.add_argument("--metrics_compat", choices=["none", "vllm"], default="none",
                   help="vllm: /metrics also shows vLLM's names (vllm:num_requests_waiting, "
                   "...), each labelled model_name")
  b = p.add_argument_group("batching (docs/serving.md says what each trades)")
  b.add_argument("--max_batch_size", type=int, default=16, help="rows per model call at most")
  b.add_argument("--max_wait_ms", type=float, default=10.0,
                 help="static: how long the oldest waiting request waits for others to "
                 "batch with; continuous: how long the loop after rows ended may wait for "
                 "their clients' next requests (at most a quarter of a step, and only while "
                 "clients come back that soon)")
  b.add_argument("--batch_buckets", default=None,
                 help="compiled batch sizes (default 1,4,16,... up to --max_batch_size)")
  b.add_argument("--length_buckets", "--input_buckets", dest="length_buckets",
                 default=None, help="compiled input lengths in tokens, EOS included (default "
                 "64,256; an exported directory: its input lengths)")
  b.add_argument("--decode_buckets", default=None,
                 help="compiled output lengths, new tokens; also the score targets' lengths "
                 "(default 32,128; an exported directory: its decode lengths)")
  b.add_argument("--chunk_tokens", type=int, default=4,
                 help="decode steps per compiled call (the engine's step; the static path's "
                 "streamed chunks)")
  b.add_argument("--warmup", default="greedy,embed",
                 help="what to compile for every bucket before ready: greedy, sample, score, "
                 "embed (the encoder of /v1/embeddings; encoder-decoder checkpoints) (others "
                 "compile once per shape on first use; the engine always compiles its greedy "
                 "and sampling functions)")
  e = p.add_argument_group("continuous batching (docs/serving.md)")
  e.add_argument("--scheduler", choices=["auto", "continuous", "static"], default="auto",
                 help="continuous: greedy and sampled requests decode in --slots slots that "
                 "free as rows finish; static: batches that run until their longest row is "
                 "done; auto: continuous for encoder-decoder checkpoints, else static")
  e.add_argument("--slots", type=int, default=None,
                 help="decodes in flight at most (default --max_batch_size)")
  e.add_argument("--encode_budget", type=int, default=None,
                 help="rows encoded per step while others decode (default half the slots)")
  e.add_argument("--max_queue_wait_s", type=float, default=None,
                 help="a request waiting longer for a slot gets 503 + Retry-After")
  e.add_argument("--shutdown_timeout", type=float, default=0.0,
                 help="SIGTERM: seconds to finish the requests in flight, then end them with "
                 "an error; a beam or static batch still running 5 s later is cut off "
                 "(0: finish everything)")
  e.add_argument("--request_timeout_s", type=float, default=0.0,
                 help="a request not answered within this many seconds gets 504 (a stream: "
                 "an error event) and its rows leave the queue and the slots (0, the "
                 "default as in vLLM and TGI: no limit; clients set their own)")
  lim = p.add_argument_group("limits")
  lim.add_argument("--max_queue", type=int, default=256,
                   help="rows that may wait; more get 503 + Retry-After")
  lim.add_argument("--max_prompt_tokens", type=int, default=None,
                   help="prompt length limit (default: the largest length bucket)")
  lim.add_argument("--max_tokens_limit", type=int, default=None,
                   help="max_tokens limit (default: the largest decode bucket)")
  lim.add_argument("--max_n", type=int, default=8, help="n and num_beams limit")
  lim.add_argument("--max_body_bytes", type=int, default=1 << 20, help="request size limit")
  lim.add_argument("--max_request_tokens", type=int, default=None,
                   help="refuse requests whose prompts + n x max_tokens are more tokens")
  r = p.add_argument_group("runtime")
  r.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="matmul compute dtype (default: the checkpoint's)")
  r.add_argument("--weight_dtype", choices=["float32", "int8"], default=None,
                 help="int8: weight-only int8 projection kernels, quantised on load")
  decode_flags.add_partitioning(p)
  return p


def _buckets(args, manifest: dict | None = None) -> tuple:
  """Checks the bucket flags against each other and the limits; -> (Buckets, Limits).
  `manifest`: an exported directory's, whose shapes are the defaults and the bounds."""
  from t5forge.serve import api, batcher  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if args.max_batch_size < 1:
    raise UserError(f"--max_batch_size must be >= 1, got {args.max_batch_size}")
  if args.batch_buckets is None:
    sizes, s = [], 1
    while s < args.max_batch_size:
      sizes.append(s)
      s *= 4
    batch = tuple(sizes + [args.max_batch_size])
  else:
    batch = _ints("--batch_buckets", args.batch_buckets)
    if batch[-1] != args.max_batch_size:
      raise UserError(f"--batch_buckets {args.batch_buckets}: the largest must be "
                      f"--max_batch_size {args.max_batch_size} (larger is never filled, smaller "
                      "cannot hold a full batch)")
  fns = (manifest or {}).get("functions", [])
  exported_lengths = ",".join(str(f["input_length"]) for f in fns)
  exported_decode = ",".join(str(f["decode_length"]) for f in fns)
  length = _ints("--length_buckets", args.length_buckets or exported_lengths or "64,256")
  decode = _ints("--decode_buckets", args.decode_buckets or exported_decode or "32,128")
  if fns:
    for flag, got, have in (("--length_buckets", length[-1], max(f["input_length"] for f in fns)),
                            ("--decode_buckets", decode[-1], max(f["decode_length"] for f in fns))):
      if got > have:
        raise UserError(f"{flag} {got} is over the exported model's largest ({have}); "
                        "re-export with larger lengths or lower the bucket")
  max_prompt = args.max_prompt_tokens or length[-1]
  if max_prompt > length[-1]:
    raise UserError(f"--max_prompt_tokens {max_prompt} is over the largest --length_buckets "
                    f"{length[-1]}; raise the bucket or lower the limit")
  max_tokens = args.max_tokens_limit or decode[-1]
  if max_tokens > decode[-1]:
    raise UserError(f"--max_tokens_limit {max_tokens} is over the largest --decode_buckets "
                    f"{decode[-1]}; raise the bucket or lower the limit")
  for flag, v in (("--max_queue", args.max_queue), ("--max_n", args.max_n),
                  ("--chunk_tokens", args.chunk_tokens), ("--max_body_bytes", args.max_body_bytes)):
    if v < 1:
      raise UserError(f"{flag} must be >= 1, got {v}")
  if args.max_wait_ms < 0:
    raise UserError(f"--max_wait_ms must be >= 0, got {args.max_wait_ms}")
  for flag, v in (("--slots", args.slots), ("--encode_budget", args.encode_budget),
                  ("--max_request_tokens", args.max_request_tokens)):
    if v is not None and v < 1:
      raise UserError(f"{flag} must be >= 1, got {v}")
  for flag, v in (("--max_queue_wait_s", args.max_queue_wait_s),
                  ("--shutdown_timeout", args.shutdown_timeout),
                  ("--request_timeout_s", args.request_timeout_s)):
    if v is not None and v < 0:
      raise UserError(f"{flag} must be >= 0 seconds, got {v}")
  limits = api.Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=max_prompt,
                      max_tokens=max_tokens, max_n=args.max_n,
                      max_prompts=min(64, args.max_queue),
                      max_request_tokens=args.max_request_tokens)
  return batcher.Buckets(batch=batch, length=length, decode=decode), limits


def _check_model_limits(config, buckets) -> None:
  """Bucket sizes the model cannot take: an input holds at least one token and EOS (a
  decoder-only prompt BOS and one token)."""
  if buckets.length[0] < 2:
    raise UserError(f"--length_buckets {buckets.length[0]}: an input needs at least 2 tokens "
                    f"(a token and {'EOS' if config.is_encoder_decoder else 'BOS'})")


@dataclasses.dataclass
class _Flags:
  """What the flags say once checked (before anything slow)."""
  buckets: object
  limits: object
  warm: list
  keys: object
  rates: tuple
  body_timeout_s: float
  name: str
  specs: list


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  flags = _check_flags(args)
  sock = _bind(args.host, args.port)
  t0 = time.monotonic()
  service, devices = _build(args, flags)
  from t5forge.serve import app as app_lib  # noqa: PLC0415 (after the flags parse: --help stays fast)
  return _run(app_lib.create_app(service), service, sock, args.host, t0, devices)


def build_service(argv: list[str]):
  """The `t5forge.serve.Service` that `t5forge serve ARGV` serves: the model loaded, its
  workers not started, nothing listening (--host and --port unused). For running the
  application in-process: `app.create_app(service)`, then start and close
  `service.workers()` (the application's lifespan does both under uvicorn)."""
  args = _parser().parse_args(argv)
  return _build(args, _check_flags(args))[0]


def _check_flags(args) -> _Flags:
  """Checks everything the flags alone can say, so that a bad flag is one line at once."""
  buckets, limits = _buckets(args)
  warm = [w.strip() for w in args.warmup.split(",") if w.strip()]
  unknown = sorted(set(warm) - {"greedy", "sample", "score", "embed"})
  if unknown:
    raise UserError(f"--warmup {unknown}: choose from greedy, sample, score, embed")
  given = args.checkpoint
  _bucket_paths(args)
  from t5forge.serve import auth  # noqa: PLC0415 (after the flags parse: --help stays fast)
  # Before anything slow: a bad key file or limit is said at once.
  keys = auth.load_keys(args.api_key, args.api_key_file)
  rates = (auth.positive("--requests_per_second", args.requests_per_second),
           auth.positive("--tokens_per_minute", args.tokens_per_minute))
  body_timeout_s = auth.positive("--body_timeout_s", args.body_timeout_s)
  if keys is not None and not _is_loopback(args.host):
    print(f"warning: API keys on {args.host}: the keys and the prompts travel unencrypted "
          "(this server has no TLS); put a TLS proxy in front (docs/serving.md)",
          file=sys.stderr, flush=True)
  if args.chat_template is not None and not os.path.isfile(args.chat_template):
    # Said before the model loads (the template itself is read once it has).
    raise UserError(f"--chat_template {args.chat_template}: no such file; give a Jinja chat "
                    "template file such as a model's chat_template.jinja")
  from t5forge.serve import adapters as adapter_lib  # noqa: PLC0415 (after the flags parse: --help stays fast)
  name = args.model_name or os.path.basename(os.path.normpath(given))
  specs = adapter_lib.parse(args.adapter, base_name=name)
  return _Flags(buckets=buckets, limits=limits, warm=warm, keys=keys, rates=rates,
                body_timeout_s=body_timeout_s, name=name, specs=specs)


def _build(args, flags: _Flags) -> tuple:
  """Loads the model and makes its workers; -> (Service, "N platform device(s)")."""
  from t5forge.serve import auth  # noqa: PLC0415 (after the flags parse: --help stays fast)
  buckets, limits, warm, name = flags.buckets, flags.limits, flags.warm, flags.name
  from t5forge.export import loader as exported  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if exported.is_exported_dir(args.checkpoint):
    # Checked again now that the manifest's shapes are known.
    with open(os.path.join(args.checkpoint, "manifest.json"), encoding="utf-8") as f:
      buckets, limits = _buckets(args, json.load(f))
  import jax  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.serve import batcher  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.serve.service import Service  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.serve.metrics import Metrics  # noqa: PLC0415 (after the flags parse: --help stays fast)
  gen, vocab, kind_cls, check_kind, adapter_names = _open(args, buckets, exported, flags.specs)
  metrics = Metrics(model_name=name, compat=args.metrics_compat)
  engine = _engine(args, gen, buckets, exported_dir=check_kind is not None, metrics=metrics)
  # The engine compiles greedy and sampling itself; the batcher then runs beam search only.
  kinds = [] if engine is not None else [kind_cls(method=m) for m in ("greedy", "sample")
                                         if m in warm]
  if check_kind is not None:
    kinds = [k for k in kinds if _allowed(check_kind, k)]
  batch = batcher.Batcher(gen, buckets, max_batch_size=args.max_batch_size,
                          max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                          metrics=metrics, warmup_kinds=kinds,
                          warmup_score="score" in warm and check_kind is None,
                          warmup_embed=("embed" in warm and check_kind is None
                                        and gen.is_encoder_decoder))
  if engine is not None:
    # The engine counts compilations from its ready on: the batcher's come first.
    engine.warm_after = batch.ready
  metrics.watch_compiles(engine if engine is not None else batch)  # the last to be ready
  if hasattr(gen, "compiled"):  # a Generator; an exported backend's functions are fixed
    metrics.watch_compile_cache(gen.compiled)
  chat_template = _chat_template(args, vocab)
  rates = flags.rates
  service = Service(batcher=batch, vocabulary=vocab, kind_cls=kind_cls, model_name=name,
                    limits=limits, metrics=metrics, is_encoder_decoder=gen.is_encoder_decoder,
                    eos_id=gen.eos_id, stop_ids=getattr(gen, "stop_ids", None),
                    check_kind=check_kind, can_score=check_kind is None,
                    can_embed=check_kind is None,
                    engine=engine, shutdown_timeout=args.shutdown_timeout, keys=flags.keys,
                    limiter=None if rates == (None, None) else auth.Limiter(*rates,
                                                                            metrics=metrics),
                    body_timeout_s=flags.body_timeout_s, chat_template=chat_template,
                    adapters=adapter_names, request_timeout_s=args.request_timeout_s)
  return service, f"{len(jax.devices())} {jax.devices()[0].platform} device(s)"


def _bucket_paths(args) -> None:
  """Bucket URLs among the flags, read through local copies (one per object version,
  under T5FORGE_CACHE): an exported directory (its standalone loader reads local files),
  --chat_template and --api_key_file. A checkpoint of any other kind stays a URL: the
  opener reads it. A missing bucket or object is one line naming it."""
  from t5forge import storage  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if storage.is_remote(args.checkpoint):
    from t5forge.export import loader as exported  # noqa: PLC0415 (as above)
    storage.check_bucket(args.checkpoint)
    try:
      found = json.loads(storage.read_text(storage.join(args.checkpoint, "manifest.json")))
    except (FileNotFoundError, ValueError):
      found = None
    if isinstance(found, dict) and found.get("format") == exported.FORMAT:
      args.checkpoint = storage.local_copy(args.checkpoint)
  for flag in ("chat_template", "api_key_file"):
    path = getattr(args, flag)
    if path and storage.is_remote(path):
      try:
        setattr(args, flag, storage.local_copy(path))
      except FileNotFoundError:
        raise UserError(f"--{flag} {path}: no such object; check the URL") from None


def _chat_template(args, vocab):
  """The chat template for /v1/chat/completions: --chat_template, else the one the
  checkpoint's directories hold (the directory given, and the checkpoint it resolves to:
  an HF directory or Hub download, a MODEL_DIR's latest checkpoint), else None."""
  from t5forge import convert  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.serve.chat_template import ChatTemplate  # noqa: PLC0415 (as above)
  dirs = [args.checkpoint] if os.path.isdir(args.checkpoint) else []
  try:
    resolved = convert.local_path(args.checkpoint)
  except UserError:
    resolved = None
  if resolved and os.path.isdir(resolved) and resolved not in dirs:
    dirs.append(resolved)
  return ChatTemplate.find(args.chat_template, dirs, vocab)


def _engine(args, gen, buckets, *, exported_dir: bool, metrics):
  """The continuous-batching engine, or None (--scheduler static, or auto for an export or
  a decoder-only model); refuses --scheduler continuous where it cannot run and --slots
  that do not fit in memory."""
  what = ("an exported directory" if exported_dir else
          None if gen.is_encoder_decoder else "a decoder-only model")
  if args.scheduler == "static" or (args.scheduler == "auto" and what):
    for flag in ("slots", "encode_budget", "max_queue_wait_s"):
      if getattr(args, flag) is not None:
        raise UserError(f"--{flag} applies to the continuous scheduler, which is off here "
                        f"({'--scheduler static' if args.scheduler == 'static' else what}); "
                        f"drop --{flag}")
    return None
  if what:
    raise UserError(f"--scheduler continuous runs encoder-decoder checkpoints, not {what}; use "
                    "--scheduler static (or auto)")
  from t5forge import engine as engine_lib  # noqa: PLC0415 (after the flags parse: --help stays fast)
  num = args.slots or args.max_batch_size
  slots = engine_lib.Slots(gen.model, gen.params, num_slots=num,
                           decode_length=buckets.decode[-1], input_buckets=buckets.length,
                           encode_sizes=tuple(b for b in buckets.batch if b < num) + (num,),
                           steps=args.chunk_tokens, partitioner=gen.partitioner)
  engine_lib.check_fits(slots, flags="--slots, --decode_buckets or --length_buckets")
  engine = engine_lib.Engine(slots, max_queue=args.max_queue,
                             max_queue_wait_s=args.max_queue_wait_s,
                             encode_budget=args.encode_budget,
                             max_wait_ms=args.max_wait_ms, metrics=metrics)
  return engine


def _allowed(check_kind, kind) -> bool:
  try:
    check_kind(kind)
    return True
  except ValueError:
    return False


def _open(args, buckets, exported, specs) -> tuple:
  """-> (generator, vocabulary, Kind class, kind check or None, {adapter name: index})
  for a checkpoint (with the --adapter `specs` stacked on it) or an exported directory
  (`t5forge export --format jax`, run by its standalone loader)."""
  if exported.is_exported_dir(args.checkpoint):
    for flag in ("dtype", "weight_dtype", "adapter"):
      if getattr(args, flag):
        raise UserError(f"--{flag} does not apply to an exported directory (its weights and "
                        "dtype were fixed at export)")
    try:
      gen = exported.ExportedGenerator(args.checkpoint)
    except exported.ExportError as e:
      raise UserError(str(e)) from None
    vocab = gen.vocabulary
    if args.vocabulary:
      from t5forge.data.vocab import SentencePieceVocabulary  # noqa: PLC0415 (after the flags parse: --help stays fast)
      vocab = SentencePieceVocabulary(args.vocabulary, extra_ids=100)
    if vocab is None:
      raise UserError(f"{args.checkpoint}: this export holds no vocabulary (found "
                      f"{', '.join(sorted(os.listdir(args.checkpoint)))}); pass --vocabulary "
                      "path/to/spiece.model")
    # What the export cannot run is a 400 naming the option, not a failed batch.
    return gen, vocab, exported.Kind, gen.check_kind, {}
  from t5forge import generation, opener  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.serve import adapters as adapter_lib  # noqa: PLC0415 (as above)
  opened = opener.open_checkpoint(args.checkpoint, vocabulary_path=args.vocabulary,
                                  overrides=decode_flags.runtime_overrides(args),
                                  partitioner=decode_flags.partitioner(args),
                                  require_vocabulary=True,
                                  vocabulary_hint="--vocabulary path/to/spiece.model")
  _check_model_limits(opened.config, buckets)
  model, params, names = adapter_lib.attach(opened, specs)
  gen = generation.Generator(model, params, partitioner=opened.partitioner,
                             chunk_tokens=args.chunk_tokens)
  return gen, opened.vocabulary, generation.Kind, None, names


_SHUTDOWN_GRACE_S = 5.0  # after --shutdown_timeout, for the last error events to go out


def _run(app, service, sock, host: str, t0: float, devices: str) -> int:
  import uvicorn  # noqa: PLC0415 (after the flags parse: --help stays fast)

  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      # New requests get 503 at once; uvicorn stops listening and waits for the ones in
      # flight; the lifespan's shutdown then drains the batcher.
      service.draining = True
      for w in service.workers():
        # uvicorn waits for the open streams before the lifespan's shutdown: the
        # deadline must start now.
        w.drain(service.shutdown_timeout or None)
      super().handle_exit(sig, frame)

  # --shutdown_timeout bounds uvicorn's wait for the requests in flight too: the workers
  # end their rows at the deadline, whose error events then get a few seconds to go out;
  # whatever still runs after that (a beam or static batch inside its one compiled call)
  # is cancelled and its connection closed.
  grace = service.shutdown_timeout + _SHUTDOWN_GRACE_S if service.shutdown_timeout else None
  config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          timeout_keep_alive=5, timeout_graceful_shutdown=grace)
  server = Server(config)
  port = sock.getsockname()[1]
  url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

  died = []  # the worker that died while serving, if one did

  def announce():
    # One line once the socket listens and the buckets are compiled.
    workers = service.workers()
    while not (server.started and all(w.ready.is_set() for w in workers)):
      if server.should_exit:
        return
      time.sleep(0.05)
    failed = next((w.failed for w in workers if w.failed is not None), None)
    if failed is not None:
      print(f"t5forge: error: warm-up failed: {failed}", file=sys.stderr, flush=True)
      server.should_exit = True
      return
    engine = "" if service.engine is None else f", {service.engine.slots.num_slots} slots"
    print(f"t5forge serve: ready at {url} (model {service.model_name!r}, "
          f"{sum(w.compiled_shapes for w in workers)} shapes compiled{engine}, {devices}, "
          f"{time.monotonic() - t0:.1f} s)", flush=True)
    watch(workers)

  def watch(workers):
    # A worker that died has answered its rows and /health says 503; nothing can serve
    # them again in this process, so it exits for its supervisor to start a fresh one.
    # (Polled: a thread that ends without `died` set is caught too.)
    while not (server.should_exit or service.draining):
      dead = next((w for w in workers if w.died is not None or not w.alive()), None)
      if dead is not None and not service.draining:
        died.append(dead)
        service.draining = True
        why = (f" on internal error {dead.died.error_id} (its traceback is above)"
               if dead.died is not None else "")
        print(f"t5forge: error: {dead.name} stopped{why}; exiting with status 70 for a "
              "supervisor to restart the server", file=sys.stderr, flush=True)
        server.should_exit = True
        return
      time.sleep(0.1)

  threading.Thread(target=announce, daemon=True).start()
  # uvicorn re-raises the signal it caught once it has shut down; with a Python handler
  # in place of the default one that is a no-op and the process exits 0.
  previous = signal.signal(signal.SIGTERM, lambda *_: None)
  try:
    server.run(sockets=[sock])
  finally:
    signal.signal(signal.SIGTERM, previous)
  if any(w.failed is not None for w in service.workers()):
    return 1
  return 70 if died else 0
