"""``specdecode-worker``: one entry point for ``plan`` (the planner pod), ``serve`` (the workers) and
``fetch`` (the download pods of a hub model cache).

The subcommand's own parser (``plan_cli.parser``, ``serve_cli.parser``) reads the rest of the
command line, so each flag is defined in one place.
"""

from __future__ import annotations

import argparse
import sys

from .contract import ExitCode

COMMANDS = {
    "plan": "dry-run GPU memory plan for a target + draft model pair (reads configs and checkpoint "
            "headers only; no torch, no weights)",
    "serve": "load the models in three phases and serve an OpenAI-compatible API",
    "fetch": "download (a part of) a hub model at a pinned commit into a folder, skipping complete files",
}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise _UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specdecode-worker", epilog="Run 'specdecode-worker COMMAND --help' for a command's options.")
    commands = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", required=True)
    for name, text in COMMANDS.items():
        # The subcommand's flags, -h included, go through to its own parser.
        commands.add_parser(name, help=text, description=text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return ExitCode.OK if argv else ExitCode.BAD_INPUT
    try:
        args, rest = p.parse_known_args(argv)
    except _UsageError as exc:
        print(f"specdecode-worker: {exc}\n", file=sys.stderr)
        p.print_usage(sys.stderr)
        return ExitCode.BAD_INPUT
    if args.command == "plan":
        from .planner.plan_cli import main as plan_main

        return plan_main(rest)
    if args.command == "fetch":
        from .planner.fetch_cli import main as fetch_main

        return fetch_main(rest)
    from .serving.serve_cli import main as serve_main

    return serve_main(rest)


if __name__ == "__main__":
    sys.exit(main())
