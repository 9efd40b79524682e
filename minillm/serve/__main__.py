"""``python -m minillm.serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]``

Loads the model (default: the shipped Shakespeare checkpoint) in an engine process of its own
(``--no-engine-process``: on a thread of the server's; ``--engine-cores 0-1`` binds the engine
process to cores), then serves the OpenAI API with uvicorn. Every ``EngineConfig`` field is an
option: ``--block-size 16 --num-kv-blocks 512 --max-num-seqs 32 --max-queue-len 64 --policy fcfs``
(``--help`` lists them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Optional, Sequence

from ..config import EngineConfig

# Fields with no command-line form (objects or dicts): set them from Python.
_NOT_ON_THE_COMMAND_LINE = {"random_model"}


def default_model_name(model_path: str) -> str:
    """The name clients send as ``model``: the checkpoint's directory name ("shakespeare")."""
    return Path(model_path).name if model_path not in ("random", "") else model_path


def _none_or(kind):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else kind(s)

    parse.__name__ = kind.__name__
    return parse


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field, typed from its annotation; the default is EngineConfig's."""
    g = p.add_argument_group("engine options (EngineConfig fields)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_ON_THE_COMMAND_LINE:
            continue
        flag = "--" + f.name.replace("_", "-")
        ann = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if ann == "bool":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default {default})")
            continue
        kind = int if "int" in ann else float if "float" in ann else str
        if "Optional" in ann or default is None:
            kind = _none_or(kind)
        g.add_argument(flag, type=kind, default=None, metavar=kind.__name__.upper(), help=f"(default {default})")


def engine_config_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (the rest keep their defaults)."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minillm.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped Shakespeare model)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as 'model' (default: the checkpoint's directory name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("MINILLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $MINILLM_API_KEY, else none)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="refuse a request body over this many bytes with 413 (default: 4 MiB)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own, as vLLM's EngineCore (default); "
        "--no-engine-process steps it on a thread of the server's process",
    )
    p.add_argument(
        "--engine-cores",
        default=None,
        metavar="LIST",
        help="bind the engine process (and its torch threads) to these cores, e.g. '0-1' or '0,2' "
        "(vLLM's VLLM_CPU_OMP_THREADS_BIND); the HTTP server runs on any (default: unbound)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_options(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = make_parser().parse_args(argv)
    import uvicorn

    from ..async_llm import AsyncLLM
    from .api_server import DEFAULT_MAX_REQUEST_BYTES, build_app

    try:
        if args.engine_process:
            from .engine_process import EngineProcessLLM, parse_cores

            llm = EngineProcessLLM(
                args.model, engine_cores=parse_cores(args.engine_cores), **engine_config_fields(args)
            )
        elif args.engine_cores:
            raise ValueError("--engine-cores binds the engine process: it needs --engine-process")
        else:
            llm = AsyncLLM.from_config(args.model, **engine_config_fields(args))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"minillm.serve: {e}")
    name = args.served_model_name or default_model_name(llm.engine.model_path)
    app = build_app(
        llm,
        name,
        llm.engine.model_path,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
    )
    cfg = llm.engine.config
    print(
        f"minillm: serving '{name}' ({llm.engine.model_path}) on http://{args.host}:{args.port}/v1 "
        f"(device {llm.engine.device}, {llm.engine.num_kv_blocks} KV blocks of {cfg.block_size}, "
        f"max_num_seqs {cfg.max_num_seqs}, policy {cfg.policy}"
        f"{f', engine process {llm.engine.pid}' if args.engine_process else ''}"
        f"{', API key required' if args.api_key else ''})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
