"""The ``vramshard`` command: one module per subcommand, each with ``register``.

Each subcommand module defines ``register(subparsers)``, which adds its parser and
sets ``func`` to a callable taking the parsed namespace and returning an exit code.
"""

import argparse
import importlib
import logging
import sys

from ..errors import VramshardError

SUBCOMMANDS = ("demo", "run", "chat", "convert", "profile", "plan", "bench", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramshard",
        description="Run LLMs larger than your free VRAM, planned onto CPU and GPU.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"vramshard.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"vramshard.cli.{name}":
                raise
            continue  # subcommand not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except VramshardError as exc:
        print(f"vramshard {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
