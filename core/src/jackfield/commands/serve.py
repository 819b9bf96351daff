"""`jackfield serve`: the OpenAI-compatible server on one engine, or with `--pd` on a prefill engine
(a child process) and a decode engine (this one) joined by the pd KV connector (docs/serving.md)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from jackfield.commands.run import add_config_flags

    parser = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)"
    )
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="a local Hugging Face model directory (overrides [model].path)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation: a second engine in a child process computes "
                             "the prompts and hands their KV to this one (jackfield-kv-offload; docs/pd.md)")
    add_config_flags(parser)  # run's: --speculative-method, --kv-cache-dtype, ..., --set
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jackfield.commands.pd import PDLLM
    from jackfield.commands.run import config_overrides
    from jackfield.config import resolve_config
    from jackfield.engine.async_engine import AsyncEngine
    from jackfield.engine.engine import Engine

    try:
        import uvicorn

        from jackfield.serving.app import create_app
    except ImportError as exc:
        raise ValueError(
            f"jackfield serve needs the server packages: pip install 'jackfield[serve]' ({exc})"
        ) from None
    overrides = config_overrides(args)
    config = resolve_config(args.config, args.model, overrides)
    if config.parallel.tensor_parallel_size > 1:
        # Every rank must run the same requests in the same order; a server's requests arrive at
        # one process only, and nothing hands them to the other ranks yet.
        raise ValueError("jackfield serve runs one process: parallel.tensor_parallel_size > 1 is not served "
                         "yet (use `torchrun ... -m jackfield.cli run` or LLM(...) under torchrun)")

    def say(message: str) -> None:
        print(message, file=sys.stderr)

    pair = PDLLM(args.model, args.config, progress=say, **overrides) if args.pd else None
    engine = pair.engine if pair is not None else Engine(config, say)
    name = args.served_model_name or (Path(args.model).name if args.model else Path(engine.model_dir).name)
    async_engine = AsyncEngine(engine, pair)
    try:
        uvicorn.run(create_app(async_engine, name), host=args.host, port=args.port, log_level="warning")
    finally:
        async_engine.shutdown()
        if pair is not None:
            pair.close()  # the prefill engine stops with the server
    return 0
