"""``leapdecode serve``: its arguments, loading the model, and running the app under uvicorn.

This module is imported by every ``leapdecode`` invocation (to list the sub-command), so the heavy imports
(FastAPI, uvicorn, torch's engine) happen when the command runs, keeping ``leapdecode --help`` fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leapdecode.cli_args import EPILOG, add_model_args, read_chat_template
from leapdecode.config import KV_CACHE_DTYPES, LINEAR_KERNELS, engine_default
from leapdecode.gc_heap import startup_heap_frozen
from leapdecode.models.loader import resolve_model
from leapdecode.server.defaults import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
)
from leapdecode.server.request_ids import RequestIdFilter
from leapdecode.server.serve_args import add_user_args, apply_config_file, engine_kwargs, resolve_model_arg

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from leapdecode.llm import LLM

API_KEY_ENV = "LEAPDECODE_API_KEY"



def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
) -> uvicorn.Server:
    """A ``uvicorn.Server`` for ``app``; ``on_ready(base_url)`` runs once the socket is listening (``port=0``
    picks a free port, reported in the URL). Past ``limit_concurrency`` connections and running requests,
    uvicorn answers 503."""
    import uvicorn

    class _Server(uvicorn.Server):
        base_url: str | None = None

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.started:
                return
            bound = port
            for server in getattr(self, "servers", []):
                for sock in server.sockets or []:
                    bound = sock.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            self.base_url = f"http://{shown}:{bound}"
            if on_ready is not None:
                on_ready(self.base_url)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
        limit_concurrency=limit_concurrency,
    )
    return _Server(config)


def parse_origins(value: str) -> list[str]:
    """``--allowed-origins``: a JSON list (vLLM's form, e.g. ``'["http://localhost:3000"]'``) or comma-separated."""
    text = value.strip()
    if text.startswith("["):
        origins = json.loads(text)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError(f"--allowed-origins must be a JSON list of strings, got {value!r}")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]


def resolve_dtype(dtype: str, device: str, model: str | None) -> str:
    """``auto``: float32 on CPU (the packed CPU kernels are float32); on other devices the checkpoint's
    float16/bfloat16 when its config.json names one, else bfloat16 (a GGUF file, a float32 checkpoint)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cpu"):
        return "float32"
    config = resolve_model(model) / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text(encoding="utf-8"))
        named = cfg.get("torch_dtype") or cfg.get("dtype")
        if named in ("float16", "bfloat16"):
            return named
    return "bfloat16"


def load_llm(args: argparse.Namespace) -> LLM:
    """The engine ``serve`` runs, with every engine option of the command line."""
    from leapdecode import LLM

    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    kwargs: dict[str, Any] = {}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        **engine_kwargs(args),
        model=args.model,
        dtype=resolve_dtype(args.dtype, args.device, args.model),
        device=args.device,
        speculative_config=args.speculative_config,
        kv_cache_blocks=args.kv_cache_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        linear_kernel=args.linear_kernel,
        enable_prefix_caching=args.enable_prefix_caching,
        **kwargs,
    )
    if chat_template is not None:
        llm.get_tokenizer().chat_template = chat_template
    return llm


def configure_logging(level: str) -> None:
    """The server's own records (access lines, errors) on stderr, each with its request id."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    log = logging.getLogger("leapdecode.server")
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def cmd_serve(args: argparse.Namespace) -> int:
    """``leapdecode serve``: load the model, then serve until Ctrl-C."""
    from leapdecode.server.api_server import build_app
    from leapdecode.server.chat_output import ChatOutputConfig
    from leapdecode.server.stats_log import startup_summary

    apply_config_file(args, args.config_parser)
    resolve_model_arg(args)
    if not args.log_interval > 0:
        raise ValueError(f"--log-interval must be > 0 seconds, got {args.log_interval}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
    for flag, value in (("--body-read-timeout", args.body_read_timeout), ("--request-timeout", args.request_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    if args.api_key is not None and not args.api_key:
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) must not be empty")
    configure_logging(args.log_level)
    llm = load_llm(args)
    app = build_app(
        llm,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        chat_output=ChatOutputConfig(args.tool_call_parser, args.reasoning_parser),
        log_stats_interval=None if args.disable_log_stats else args.log_interval,
        embedding_pooling=args.embedding_pooling,
        body_read_timeout_s=args.body_read_timeout,
        request_timeout_s=args.request_timeout,
        share_output=not args.no_share_output,
    )
    name = app.state.model_name
    logging.getLogger("leapdecode.server").info(startup_summary(llm.engine, name))

    def ready(url: str) -> None:
        print(f"leapdecode: serving {name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)

    server = make_server(
        app, args.host, args.port, args.log_level, on_ready=ready, limit_concurrency=args.limit_concurrency
    )
    try:
        with startup_heap_frozen():  # no full collection of the start-up heap while serving (gc_heap.py)
            server.run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the Ctrl-C it caught
        pass
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options ``serve`` exposes (vLLM's names)."""
    p.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"),
                   help="requests batched together (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine_default("max_num_batched_tokens"),
                   help="tokens one engine step may process (default: %(default)s)")
    p.add_argument(
        "--kv-cache-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV-cache storage: auto (the model dtype, default), float32, float16 or bfloat16 (half the bytes of "
             "float32, rounded on write), or int8 (quantized on write, ~3.6x smaller than float32)",
    )
    p.add_argument(
        "--linear-kernel",
        default="auto",
        choices=LINEAR_KERNELS,
        help="CPU float32 projections: auto (default), packed, packed-float32, packed-int8act (int8 activations: "
        "faster, lossy against float32), torch",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes (default: on)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--chat-template", default=None, help="a Jinja chat template (file or text) replacing the model's own"
    )


def add_cli(sub: Any) -> None:
    """Add ``serve`` to the ``leapdecode`` sub-commands."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat/completions, SSE streaming, /metrics)",
        description=(
            "Serve the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, /v1/completions "
            "(streaming and not), /tokenize, /detokenize, GET /v1/models, /tokenizer_info, /version, /health and "
            "/metrics (Prometheus). All requests share one continuously batched engine. The model answers to its own "
            "name and to 'default'. Per request, \"speculative\": false opts out of speculative decoding."
        ),
        epilog=EPILOG,
    )
    add_model_args(p, auto_dtype=True)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every path but /health and /metrics (default: ${API_KEY_ENV} "
        "if set, else no key)",
    )
    p.add_argument(
        "--allowed-origins",
        type=parse_origins,
        default=None,
        help='browser origins allowed by CORS, a JSON list or comma-separated (\'["*"]\' for any; default: none)',
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests allowed to wait for their first token before new ones get 503 + Retry-After "
        f"(default: {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_REQUEST_BYTES}, 8 MiB)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        help="open connections plus running HTTP requests allowed at once (uvicorn's limit); past it new ones get "
        f"503 (default: {DEFAULT_LIMIT_CONCURRENCY})",
    )
    p.add_argument(
        "--body-read-timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a request body may take to arrive before the request gets 408, so slow uploads cannot each "
        f"hold a connection and a body buffer (default: {DEFAULT_BODY_READ_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a completion may run after the engine accepted it; then it is stopped, its KV cache freed, "
        "and it gets 408 (streamed: an error event, then [DONE]) (default: no limit)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: the model folder's name)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_user_args(p)
    p.set_defaults(func=cmd_serve, config_parser=p)


if __name__ == "__main__":  # python -m leapdecode.server.serve ...
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))
