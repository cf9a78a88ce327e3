"""``specdecode-worker``: one entry point with two jobs, ``plan`` (the init pod) and ``serve``."""

from __future__ import annotations

import sys

USAGE = """usage: specdecode-worker {plan,serve} [options]

  plan    dry-run GPU memory plan for a target + draft model pair (reads configs and
          checkpoint headers only; no torch, no weights)
  serve   load the models in three phases and serve an OpenAI-compatible API

Run 'specdecode-worker plan --help' or 'specdecode-worker serve --help' for options.
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "plan":
        from .plan_cli import main as plan_main

        return plan_main(rest)
    if command == "serve":
        from .serve_cli import main as serve_main

        return serve_main(rest)
    print(f"specdecode-worker: unknown command '{command}'\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
