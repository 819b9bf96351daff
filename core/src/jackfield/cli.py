"""`jackfield` command: subcommands live in jackfield.commands, one module each.

User errors (bad config, unavailable backend) print a message and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from jackfield import __version__

SUBCOMMANDS = ("run", "serve", "bench", "plugins", "doctor")
USER_ERROR_EXIT = 2
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, as a shell reports a command killed by it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jackfield", description="Plugin-based LLM inference.")
    parser.add_argument("--version", action="version", version=f"jackfield {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log selection details to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"jackfield.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.environ.get("RANK", "0") != "0":
        # Under torchrun every rank runs the command and computes the same outputs: rank 0
        # prints them; the others' stdout goes nowhere (their errors still reach stderr).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    from jackfield.plugins import PluginConflictError

    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at exit
        return code
    # User errors: every entry point validates its input with a ValueError (ConfigError,
    # SelectionError and ModelFileError included: bad config, unreadable model files, unavailable
    # backend, bad prompt or sampling params). Anything else is a bug and keeps its traceback.
    except (PluginConflictError, FileNotFoundError, ValueError) as exc:
        print(f"jackfield {args.command}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except BrokenPipeError:  # `jackfield plugins | head`: the reader has what it wanted
        # Python flushes stdout again at exit; pointing it at /dev/null keeps that flush quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
