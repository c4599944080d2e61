"""The `warmstart` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from warmstart.handlers.cli import demo, prepare_model, serve, snapshots, templates
from warmstart.handlers.errors import CliError, check_environment


class Parser(argparse.ArgumentParser):
    """No abbreviations: argparse would read ``--api-key`` as ``--api-key-env`` (a prefix of it) and so on. The
    subcommands' parsers are of this class too (add_subparsers makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def _version() -> str:
    # the installed distribution's, without importing the runtime (torch)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("warmstart")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="warmstart", description="Cold-start-optimized LLM runtime.")
    parser.add_argument("--version", action="version", version=f"warmstart {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_command(sub)
    snapshots.add_commands(sub)
    prepare_model.add_command(sub)
    serve.add_command(sub)
    templates.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        check_environment()
        return int(args.func(args))
    except CliError as e:
        print(f"warmstart: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
