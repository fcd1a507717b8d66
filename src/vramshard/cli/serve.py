"""``vramshard serve MODEL`` (or ``--shape NAME``): an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import logging

from ..errors import InvalidInputError
from .common import add_engine_args, engine_options, stderr_console

log = logging.getLogger(__name__)
DEFAULT_CONTEXT = 8192  # KV positions per sequence when the model allows more (the pool is max_seqs x this)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /v1/stats, /v1/budget and /health. "
                    "Requests from all clients are batched continuously.",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", help="Hugging Face model directory or .gguf file "
                        "(or use --shape)")
    parser.add_argument("--shape", metavar="NAME", default=None,
                        help="serve random weights of a named real shape (e.g. nemo-8b) for load tests; it has no "
                             "tokenizer, so prompts are token ids")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every request but /health")
    parser.add_argument("--max-seqs", type=int, default=8, metavar="N",
                        help="sequences generated at once; more requests wait in a queue (default 8)")
    parser.add_argument("--max-context", type=int, default=None, metavar="N",
                        help=f"longest prompt + answer per sequence (default: the model's, at most {DEFAULT_CONTEXT})")
    parser.add_argument("--max-step-tokens", type=int, default=2048, metavar="N",
                        help="most new tokens in one forward step (default 2048)")
    parser.add_argument("--budget-poll", type=float, default=1.0, metavar="S",
                        help="while idle, check the VRAM budget every S seconds (--vram auto follows the free "
                             "VRAM; POST /v1/budget changes it); 0: only at step boundaries (default 1)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients must send (default: the model directory or file name)")
    add_engine_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..serve.app import ServerState, create_app
    except ImportError as exc:
        raise InvalidInputError(f"vramshard serve needs FastAPI and uvicorn ({exc}); "
                                "install them with: pip install 'vramshard[serve]'") from None
    from ..engine import Engine
    from ..runtime.engine_loop import EngineLoop

    if args.max_seqs < 1 or not 0 < args.port < 65536 or args.max_step_tokens < 1:
        raise InvalidInputError("--max-seqs and --max-step-tokens must be >= 1 and --port in 1..65535")
    if not args.budget_poll >= 0:
        raise InvalidInputError(f"--budget-poll must be 0 or more seconds, got {args.budget_poll}")
    console = stderr_console()
    options = dict(vram=args.vram, device=args.device, placement=args.placement, max_context=args.max_context,
                   max_batch=args.max_seqs, max_step_tokens=args.max_step_tokens, **engine_options(args))
    if args.shape is not None or args.model is None:
        from .bench import load_weights_of

        with console.status(f"building random weights of {args.shape}"):
            model, weights, name = load_weights_of(args.model, args.shape, args.dtype)
        engine = Engine.from_weights(model, weights, None, name=name, **options)
    else:
        engine = Engine.load(args.model, dtype=args.dtype, **options)
    context = args.max_context or min(engine.max_context, DEFAULT_CONTEXT)
    loop = EngineLoop(engine.scheduler(max_seqs=args.max_seqs, max_context=context))
    name = args.served_model_name or engine.model_name
    app = create_app(ServerState(loop, engine.tokenizer, name, args.api_key, engine.executor, engine=engine))
    console.print(f"[bold]vramshard serve[/bold] {name} on http://{args.host}:{args.port}/v1 "
                  f"({args.max_seqs} sequences x {context} tokens; {engine.executor.placement.name})", soft_wrap=True)
    stop_polling = None
    if args.budget_poll > 0 and engine.device != "cpu":
        from ..runtime.budget import start_budget_thread

        stop_polling = start_budget_thread(engine.poll_budget, args.budget_poll)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        if stop_polling is not None:
            stop_polling.set()
        loop.close()
    return 0
