"""The ``minillm`` command, shaped like vLLM's ``vllm``:

    minillm serve [MODEL] [options]     the OpenAI server (``python -m minillm.serve``); MODEL is a
                                        checkpoint directory (default: the shipped Shakespeare model)
    minillm chat [--url URL] [-q MSG]   chat in the terminal with a running server (as ``vllm chat``)
    minillm bench NAME [options]        a benchmark (``python -m minillm.bench``)

``minillm serve MODEL --port 8000`` is ``python -m minillm.serve --model MODEL --port 8000``; every option
of the server (``--block-size``, ``--gpu-memory-utilization``, ...) passes through as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence, TextIO

COMMANDS = {
    "serve": "start the OpenAI-compatible server (python -m minillm.serve)",
    "chat": "chat with a running server in the terminal",
    "bench": "run a benchmark (python -m minillm.bench)",
}


def serve_argv(argv: Sequence[str], has_model_option: bool) -> list[str]:
    """The arguments of ``python -m minillm.serve`` for ``minillm serve ARGV``: a first argument that is
    not an option is the model (vLLM's ``vllm serve MODEL``), given as ``--model MODEL`` when the server
    has that option, else left where it is (a positional model of the server's own)."""
    argv = list(argv)
    if argv and not argv[0].startswith("-") and has_model_option:
        if "--model" in argv or any(a.startswith("--model=") for a in argv):
            raise SystemExit(f"minillm serve: the model is given twice ({argv[0]!r} and --model); give one")
        return ["--model", argv[0], *argv[1:]]
    return argv


def serve(argv: Sequence[str]) -> None:
    from .serve import __main__ as server

    has_model_option = "--model" in server.make_parser()._option_string_actions
    server.main(serve_argv(argv, has_model_option))


def bench(argv: Sequence[str]) -> None:
    from .bench.__main__ import main

    main(list(argv))


def chat_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minillm chat",
        description="Chat with a running minillm (or any "
        "OpenAI-compatible) server; an empty line or Ctrl-D ends the session.",
    )
    p.add_argument("--url", default="http://localhost:8000/v1", help="the server's API (default: %(default)s)")
    p.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
    p.add_argument(
        "--api-key", default=None, help="API key (default: $MINILLM_API_KEY, else $OPENAI_API_KEY, else none)"
    )
    p.add_argument("--system-prompt", default=None, help="a system message that starts the conversation")
    p.add_argument("-q", "--quick", metavar="MESSAGE", default=None, help="send MESSAGE, print the reply and exit")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply (default: the server's)")
    return p


def chat(argv: Sequence[str], client=None, read: Callable[[str], str] = input, out: TextIO = None) -> list[dict]:
    """A conversation with the server at ``--url``: each line read is a user message, each reply is
    streamed to ``out`` as it comes. ``client`` (an ``openai.OpenAI``) and ``read`` can be given (tests);
    returns the messages of the conversation."""
    args = chat_parser().parse_args(list(argv))
    out = out or sys.stdout
    if client is None:
        import openai

        key = args.api_key or os.environ.get("MINILLM_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
        client = openai.OpenAI(base_url=args.url, api_key=key)
    model = args.model_name or client.models.list().data[0].id
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    while True:
        if args.quick is not None:
            text = args.quick
        else:
            try:
                text = read("> ")
            except (EOFError, KeyboardInterrupt):
                break
            if not text.strip():
                break
        messages.append({"role": "user", "content": text})
        reply = []
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **extra):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                reply.append(piece)
                out.write(piece)
                out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.quick is not None:
            break
    return messages


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minillm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument(
        "command", nargs="?", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items())
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments (minillm COMMAND -h)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``minillm COMMAND ARGS``: hands ARGS to the command, untouched but for serve's model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    if argv and argv[0] in COMMANDS:  # the command's own -h and options are its business
        command, rest = argv[0], argv[1:]
    else:
        args = parser.parse_args(argv)
        if args.version:
            from . import __version__

            print(f"minillm {__version__}")
            return
        if args.command is None:
            parser.print_help()
            raise SystemExit(2)
        command, rest = args.command, args.args
    if command == "chat":
        import openai

        try:
            chat(rest)
        except openai.OpenAIError as e:  # no server there, a refused request: one line, not a traceback
            raise SystemExit(f"minillm chat: {type(e).__name__}: {e}") from None
        return
    {"serve": serve, "bench": bench}[command](rest)


if __name__ == "__main__":
    main()
