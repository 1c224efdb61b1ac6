"""``leapdecode serve``: its arguments, loading the model, and running the app under uvicorn.

This module is imported by every ``leapdecode`` invocation (to list the sub-command), so the heavy imports
(FastAPI, uvicorn, torch's engine) happen when the command runs, keeping ``leapdecode --help`` fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leapdecode.cli_args import EPILOG, add_model_args
from leapdecode.server.defaults import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI



def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
) -> uvicorn.Server:
    """A ``uvicorn.Server`` for ``app``; ``on_ready(base_url)`` runs once the socket is listening (``port=0``
    picks a free port, reported in the URL)."""
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
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5
    )
    return _Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    """``leapdecode serve``: load the model, then serve until Ctrl-C."""
    from leapdecode import LLM
    from leapdecode.server.api_server import build_app

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    kwargs: dict[str, Any] = {}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=args.speculative_config,
        kv_cache_blocks=args.kv_cache_blocks,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
        **kwargs,
    )
    app = build_app(
        llm, model_name=args.served_model_name, max_queue=args.max_queue, max_request_bytes=args.max_request_bytes
    )
    name = app.state.model_name

    def ready(url: str) -> None:
        print(f"leapdecode: serving {name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)

    server = make_server(app, args.host, args.port, args.log_level, on_ready=ready)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the Ctrl-C it caught
        pass
    return 0


def add_cli(sub: Any) -> None:
    """Add ``serve`` to the ``leapdecode`` sub-commands."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat/completions, SSE streaming, /metrics)",
        description=(
            "Serve the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, /v1/completions "
            "(streaming and not), GET /v1/models, /health and /metrics (Prometheus). All requests share one "
            "continuously batched engine. The model answers to its own name and to 'default'. Per request, "
            '"speculative": false opts out of speculative decoding.'
        ),
        epilog=EPILOG,
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 picks a free one)")
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
        "--served-model-name", default=None, help="name in /v1/models (default: the model folder's name)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests batched together (default: 64)")
    p.add_argument(
        "--kv-cache-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


if __name__ == "__main__":  # python -m leapdecode.server.serve ...
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))
