"""Serving: `t5forge serve`, an OpenAI-compatible HTTP server with dynamic batching.

    app.py          `create_app`: wires a `Service` to the routes, errors, auth and metrics
    routes.py       the routes (an APIRouter): health, metrics, models, page, score, completions,
                    embeddings
    completions.py  a completion request -> decode plan -> batched rows -> JSON or SSE stream
    chat.py         chat completions: messages -> the chat template -> completions.run
    chat_template.py  a checkpoint's HF chat template: render (Jinja) and tokenize
    tokens.py       /tokenize and /detokenize
    embeddings.py   an embeddings request -> padded ids -> encoder rows -> pooled vectors
    service.py      `Service` (what the routes share) and the request steps they share
    api.py          request bodies, their checks, OpenAI's error objects
    auth.py         named API keys, the open routes, per-key rate limits (token buckets)
    batcher.py      the queue and the worker thread that batches requests into model calls
    metrics.py      Prometheus metrics (+ vLLM's names with --metrics_compat vllm)

An exported model (`t5forge export --format jax`) is served through `t5forge.export.loader`.
"""
